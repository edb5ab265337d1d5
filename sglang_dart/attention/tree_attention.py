"""Batched masked attention over SGLang's paged KV pool, in plain torch: extend, decode and speculative
target-verify with a per-request tree mask, all through one code path, on any device.

Every request r contributes q_len[r] query tokens that follow prefix_len[r] tokens already in the KV pool.
Keys are laid out per request as [prefix (padded to P) | new tokens (padded to Q)], and one boolean mask
[bs, Q, P + Q] says which key each query may see. Decode, extend and verify all run this one computation,
in the model's dtype (float16 upcast to float32).

Device contract: a plan is laid out on the host from host lengths (the callers have them: SGLang's
seq_lens_cpu, the draft runner's lists), then lives on the KV pool's device; the pool is only indexed on
its device. Nothing in `attend` reads a device value back, and no score block exceeds
`SCORE_BLOCK_BYTES` (queries are taken in blocks), so a long prefill chunk cannot take gigabytes of
temporary memory whatever kernel SDPA picks.

On SGLang's CPU engine every forward whose new keys are in the pool (decode, verify, prefill) goes to one
Rust call a layer instead (`sglang_dart.cpu.rust_attention`, once the plugin installed it); GPUs never do.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_dart.cpu import rust_attention

# Largest float32 score block [bs, H, q_block, P + Q] one attention call materializes (the math kernel's
# worst case): 256 MiB.
SCORE_BLOCK_BYTES = 256 << 20
# From this many requests on, a CPU attends with the query heads that share a KV head folded into the
# query rows (`_fold_heads`). torch's CPU SDPA runs a task per (request, query head) and with GQA reads
# each KV head once per query head; folded, a task per (request, KV head) reads it once for all of its
# heads. SmolLM2's shape (9 query heads, 3 KV heads, bf16, 2 threads, 300 cached tokens): 16 requests x
# 4 verify tokens 0.58 -> 0.32 ms a layer, 8 x 4 0.28 -> 0.16, 16 decode tokens 0.26 -> 0.23; with one
# or two requests level or slower as measured then (one request, one token: 0.024 -> 0.046 ms), which
# float32 still measures and bf16 no longer does (below).
FOLD_HEADS_MIN_REQUESTS = 4
# In bf16, folding pays from one request on while it has few queries: torch's bf16 CPU SDPA costs about
# 20 us per (request, query head) task whatever its size. SDPA alone, one query, 300 cached tokens, 2
# threads, an AVX512-BF16 EPYC (session 84): with GQA 0.18 ms, folded 0.04 (float32: 0.030 and 0.039).
# `attend` whole, one request: one token 0.24-0.33 -> 0.11-0.18 ms a layer; 3 / 5 / 9 queries 0.88x /
# 0.95x / 1.00x. Served (throughput run 111, paired), folding up to 8 queries made plain decoding
# 1.05-1.13x as fast and DART, with its batch-1 verify of 8 folded, 0.92-1.01x: so only up to 4.
# On the CPU engine most of these forwards (up to 8 queries a request, new keys in the pool) now go to the
# Rust attention instead (`sglang_dart/cpu/rust_attention.py`, throughput run 113); the fold serves the rest.
FOLD_HEADS_MAX_BF16_QUERIES = 4


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host-built tensor on `device`. On CUDA through pinned memory, without waiting: a copy from
    pageable memory (what `.to(device)` does) waits for the stream, a host sync."""
    device = torch.device(device)
    if host.device == device:
        return host
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors for one forward pass, shared by all layers."""

    prefix_loc: torch.Tensor  # [bs, P] KV pool slot of each cached prefix token (padding: slot 0)
    query_row: torch.Tensor  # [bs, Q] row of the flat q/k/v tensors for each query slot (padding: 0)
    query_valid: torch.Tensor  # [bs, Q] bool
    mask: torch.Tensor  # [bs, Q, P + Q] bool: query i of request r may attend to key j
    query_pos: torch.Tensor  # [bs, Q] absolute position of each query token
    key_pos: torch.Tensor  # [bs, P + Q] absolute position of each key
    sdpa_mask: torch.Tensor  # [bs, 1, Q, P + Q]: mask, with padding rows seeing key 0 (finite softmax)
    dense: bool  # every request has Q queries: the flat rows are [bs, Q] as they are, no gather needed
    # [bs, P + Q] KV pool slot of every key, new tokens included (padding: slot 0); None when the plan was
    # made without the new tokens' slots. Lets a layer whose new K/V are already in the pool read all keys
    # with one gather instead of a gather and a concat.
    key_loc: torch.Tensor | None = None
    # The flat positions in [bs * Q] of the valid query slots and their rows in q (used when the plan is
    # not dense): laid out on the host, so scattering the output back needs no boolean mask on the device.
    valid_slots: torch.Tensor | None = None
    valid_rows: torch.Tensor | None = None
    num_rows: int = 0

    @cached_property
    def _folded_masks(self) -> dict[int, torch.Tensor]:
        return {}

    @cached_property
    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """key_loc, mask, query_row and query_valid as C-contiguous numpy arrays (CPU plans made with
        new_token_loc): what the Rust CPU attention reads, made once per plan and shared by its layers."""
        assert self.key_loc is not None, "a plan made without new_token_loc"
        parts = (self.key_loc, self.mask, self.query_row, self.query_valid)
        return tuple(np.ascontiguousarray(t.numpy()) for t in parts)  # type: ignore[return-value]

    def windowed_mask(self, sliding_window: int) -> torch.Tensor:
        """mask with each query seeing only the keys at most `sliding_window` positions back."""
        window = self.key_pos.unsqueeze(1) >= self.query_pos.unsqueeze(2) - sliding_window
        return self.mask & window

    def folded_mask(self, group: int) -> torch.Tensor:
        """sdpa_mask for `group` query heads folded into the query rows (`_fold_heads`), made once per plan
        and shared by its layers."""
        if group not in self._folded_masks:
            self._folded_masks[group] = self.sdpa_mask.repeat(1, 1, group, 1)
        return self._folded_masks[group]

    def to(self, device: torch.device | str) -> AttentionPlan:
        """Move the plan next to the activations (a no-op where it already is)."""
        if self.mask.device == torch.device(device):
            return self
        moved = (getattr(self, f.name) for f in fields(self))
        return AttentionPlan(*(upload(x, device) if isinstance(x, torch.Tensor) else x for x in moved))


def _padded(lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[bs, width] column indices and a validity mask for per-request lengths."""
    cols = torch.arange(width, dtype=torch.int64).unsqueeze(0)
    return cols.expand(lengths.numel(), width), cols < lengths.unsqueeze(1)


def make_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    query_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    new_token_loc: torch.Tensor | None = None,
) -> AttentionPlan:
    """Plan a forward pass.

    new_token_loc: the KV pool slot of each new token, in flat row order (SGLang's out_cache_loc), if the
    layers write the new K/V to the pool before attending; then `attend` may be given k_new = v_new = None.

    prefix_lens and query_lens are read on the host (pass host tensors to avoid a device round trip);
    req_pool_indices and new_token_loc may live on the pool's device, where the plan is returned.

    tree_mask: None for causal attention among the new tokens (extend, decode, chain verify). Otherwise a
    flat mask as SGLang's speculative workers build it, for each request in turn a row-major block of
    either [q_len, prefix_len + q_len] booleans (prefix columns first; the GPU layout) or
    [q_len, q_len] (new tokens only, prefix fully visible; what NGRAM builds on CPU). The two layouts
    have different sizes whenever some prefix is non-empty, which tells them apart.
    """
    device = req_to_token.device
    prefix_lens = prefix_lens.to(torch.int64).cpu()
    query_lens = query_lens.to(torch.int64).cpu()
    bs = prefix_lens.numel()
    width_p = int(prefix_lens.max()) if bs else 0
    width_q = int(query_lens.max()) if bs else 0

    p_cols, p_valid = _padded(prefix_lens, width_p)
    q_cols, q_valid = _padded(query_lens, width_q)
    rows = upload(req_pool_indices.to(torch.int64), device).unsqueeze(1)
    prefix_loc = req_to_token[rows, upload(p_cols, device)].to(torch.int64)
    prefix_loc = torch.where(upload(p_valid, device), prefix_loc, 0)
    query_start = torch.cumsum(query_lens, 0) - query_lens
    query_row = torch.where(q_valid, query_start.unsqueeze(1) + q_cols, 0)

    if tree_mask is None:
        new_part = q_cols.unsqueeze(2) >= q_cols.unsqueeze(1)  # causal among new tokens
        prefix_part = p_valid.unsqueeze(1).expand(bs, width_q, width_p)
    else:
        flat = tree_mask.reshape(-1).to(torch.bool).cpu()
        new_tokens_only = flat.numel() == int((query_lens * query_lens).sum()) and int(prefix_lens.sum()) > 0
        row_len = query_lens if new_tokens_only else prefix_lens + query_lens  # columns per block row
        skip = torch.zeros_like(prefix_lens) if new_tokens_only else prefix_lens
        block_start = torch.cumsum(query_lens * row_len, 0) - query_lens * row_len
        row_base = (block_start.unsqueeze(1) + q_cols * row_len.unsqueeze(1)).unsqueeze(2)  # [bs, Q, 1]
        limit = flat.numel() - 1
        new_idx = (row_base + skip.view(bs, 1, 1) + q_cols.unsqueeze(1)).clamp(max=limit)
        if new_tokens_only:
            prefix_part = p_valid.unsqueeze(1).expand(bs, width_q, width_p)
        else:
            prefix_idx = (row_base + p_cols.unsqueeze(1)).clamp(max=limit)
            prefix_part = flat[prefix_idx] & p_valid.unsqueeze(1)
        new_part = flat[new_idx]
    new_part = new_part & q_valid.unsqueeze(1) & q_valid.unsqueeze(2)
    prefix_part = prefix_part & q_valid.unsqueeze(2)
    mask = torch.cat([prefix_part, new_part], dim=2)

    query_pos = prefix_lens.unsqueeze(1) + q_cols
    key_pos = torch.cat([p_cols, prefix_lens.unsqueeze(1) + q_cols], dim=1)
    dense = bool((query_lens == width_q).all())
    key_loc = None
    if new_token_loc is not None:
        new_loc = upload(new_token_loc.to(torch.int64), device)[upload(query_row, device)]
        key_loc = torch.cat([prefix_loc, torch.where(upload(q_valid, device), new_loc, 0)], dim=1)
    valid_slots = q_valid.reshape(-1).nonzero().squeeze(1)
    host_plan = AttentionPlan(
        prefix_loc,
        query_row,
        q_valid,
        mask,
        query_pos,
        key_pos,
        _sdpa_mask(mask),
        dense,
        key_loc,
        valid_slots,
        query_row.reshape(-1)[valid_slots],
        int(query_lens.sum()),
    )
    return host_plan.to(device)


def _sdpa_mask(mask: torch.Tensor) -> torch.Tensor:
    # Padding rows see nothing; give them key 0 so the softmax stays finite (their output is dropped).
    key0 = torch.arange(mask.shape[2], device=mask.device) == 0
    return (mask | ~mask.any(dim=2, keepdim=True) & key0).unsqueeze(1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16 runs SDPA in bf16 (its CPU flash kernel accumulates scores and the softmax in float32 itself):
    upcasting every layer's gathered K/V to float32 cost more than the attention (a fresh float32 copy of
    bs x prefix rows per layer; run 21 in benchmarks/results/throughput.md). float16 is upcast."""
    return torch.float32 if dtype == torch.float16 else dtype


def _gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src[index] for a 2-D index into src's first dimension, as one index_select over the flat index:
    advanced indexing with the 2-D index was up to 4x slower on CPU (16 x 300 slots of [3, 64] float32,
    with the cat that follows: 1.62 vs 0.40 ms)."""
    return src.index_select(0, index.reshape(-1)).view(*index.shape, *src.shape[1:])


def attend(
    plan: AttentionPlan,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float,
    logit_cap: float = 0.0,
    sliding_window: int = -1,
) -> torch.Tensor:
    """q: [T, H, D]; k_new/v_new: [T, Hkv, D/Dv] (the new tokens, in q's row order), or both None when
    they are already in the pool at the plan's key_loc; k_cache/v_cache: [slots, Hkv, D/Dv].
    Returns [T, H, Dv] in q's dtype."""
    out_shape = (q.shape[0], q.shape[1], v_cache.shape[-1])
    if plan.query_row.numel() == 0:
        return q.new_zeros(out_shape)
    plan = plan.to(q.device)
    if k_new is None and v_new is None and rust_attention.applies(plan, q, k_cache, v_cache, logit_cap):
        return rust_attention.attend(plan, q, k_cache, v_cache, scaling, sliding_window)
    bs, width_q = plan.query_row.shape
    dense = plan.dense and q.shape[0] == bs * width_q

    def per_request(x: torch.Tensor) -> torch.Tensor:  # flat rows -> [bs, Q, heads, dim]
        return x.view(bs, width_q, *x.shape[1:]) if dense else _gather_rows(x, plan.query_row)

    compute = _compute_dtype(q.dtype)
    queries = per_request(q).to(compute)  # [bs, Q, H, D]
    if k_new is None or v_new is None:
        if plan.key_loc is None or (k_new is None) != (v_new is None):
            raise ValueError("attend: k_new and v_new are both None only with a plan made with new_token_loc")
        k_all, v_all = _gather_rows(k_cache, plan.key_loc), _gather_rows(v_cache, plan.key_loc)
    else:
        k_prefix, v_prefix = _gather_rows(k_cache, plan.prefix_loc), _gather_rows(v_cache, plan.prefix_loc)
        k_all = torch.cat([k_prefix, per_request(k_new)], dim=1)
        v_all = torch.cat([v_prefix, per_request(v_new)], dim=1)
    kp, vp = k_all.to(compute).transpose(1, 2), v_all.to(compute).transpose(1, 2)
    windowed = sliding_window is not None and sliding_window > -1
    mask = plan.sdpa_mask
    if windowed:
        mask = _sdpa_mask(plan.windowed_mask(sliding_window))
    capped = bool(logit_cap and logit_cap > 0)
    group = queries.shape[2] // kp.shape[1]
    block = query_block(bs, queries.shape[2], width_q, kp.shape[2])
    if block >= width_q and group > 1 and not capped and q.is_cpu and _folds(bs, width_q, compute):
        folded_mask = mask.repeat(1, 1, group, 1) if windowed else plan.folded_mask(group)
        res = _fold_heads(queries, kp, vp, folded_mask, scaling)
    else:
        qp = queries.transpose(1, 2)  # [bs, H, Q, D]
        if capped:
            kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        if block >= width_q:  # decode and small extends: one block, no slicing (a per-layer cost)
            res = _attend_block(qp, kp, vp, mask, scaling, logit_cap)
        else:
            parts = [
                _attend_block(qp[:, :, i : i + block], kp, vp, mask[:, :, i : i + block], scaling, logit_cap)
                for i in range(0, width_q, block)
            ]
            res = torch.cat(parts, dim=2)
        res = res.transpose(1, 2)  # [bs, Q, H, Dv]
    if dense:
        return res.reshape(out_shape).to(q.dtype)
    out = q.new_zeros(out_shape)
    out[plan.valid_rows] = res.reshape(bs * width_q, *res.shape[2:])[plan.valid_slots].to(out.dtype)
    return out


def query_block(bs: int, heads: int, width_q: int, width_k: int) -> int:
    """Queries per block such that a float32 score block [bs, heads, block, width_k] stays within
    SCORE_BLOCK_BYTES (at least one query)."""
    per_query = max(1, bs * heads * width_k * 4)
    return max(1, min(width_q, SCORE_BLOCK_BYTES // per_query))


def _folds(bs: int, width_q: int, compute: torch.dtype) -> bool:
    """Whether a CPU attends with the heads folded (`_fold_heads`): measured faster for these shapes."""
    few_bf16_queries = compute == torch.bfloat16 and width_q <= FOLD_HEADS_MAX_BF16_QUERIES
    return bs >= FOLD_HEADS_MIN_REQUESTS or few_bf16_queries


def _fold_heads(
    queries: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, folded_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of queries [bs, Q, H, D] with the `group` = H / Hkv query heads of each KV head taken as
    more query rows of that head: q [bs, Hkv, group * Q, D] (query head h = kv * group + j is row
    j * Q + i), so SDPA sees no GQA; folded_mask [bs, 1, group * Q, K] is the mask repeated per head.
    Returns [bs, Q, H, Dv]; the same softmax(q k^T) v per query and head as the unfolded call."""
    bs, width_q, heads, dim = queries.shape
    kv_heads = kp.shape[1]
    group = heads // kv_heads
    qf = queries.view(bs, width_q, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, -1, dim)
    out = scaled_dot_product_attention(qf, kp, vp, attn_mask=folded_mask, scale=scaling)
    dv = out.shape[-1]
    return out.view(bs, kv_heads, group, width_q, dv).permute(0, 3, 1, 2, 4).reshape(bs, width_q, heads, dv)


def _attend_block(
    qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor, scaling: float, logit_cap: float
) -> torch.Tensor:
    if logit_cap and logit_cap > 0:
        scores = torch.matmul(qp, kp.transpose(-1, -2)) * scaling
        scores = logit_cap * torch.tanh(scores / logit_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), vp)
    return scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask, scale=scaling, enable_gqa=qp.shape[1] != kp.shape[1]
    )
