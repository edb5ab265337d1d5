"""DART's draft forward for a whole batch, through SGLang's draft model runner: its one-layer KV pool
(sized from SGLang's memory plan) and its attention backend (FlashInfer/triton on CUDA, the tree-mask
backend on CPU).

What the draft keeps per target KV slot (slot lifetimes, radix-cache sharing and freeing all follow the
target's own bookkeeping):
- the fused residual fc(taps) of the token in that slot (it depends on the prefix up to that token only):
  `residual`, beside the pool, counted in SGLang's per-slot budget (`gpu_contracts`);
- the draft K/V of draft entry t, which pairs token t's residual with the embedding of token t+1, in the
  draft pool at the slot of token t+1: it depends on tokens 0..t+1 only, so a shared radix prefix shares
  it correctly.

So the draft's sequence is the target's shifted by one: draft index j lives in the slot of target token
j + 1. The draft model runner reads its own request table (`draft_table`, an SGLang `ReqToTokenPool`),
whose rows each step copies from the target's, shifted. The newest entry (its next token has no slot yet)
and the mask slots are written to scratch slots past the end of the target's slot range (the draft pool is
made larger by that much; the shared allocator never hands them out) and are never kept: each step
recomputes them.

A step that drafts nothing (a root-only step) stores its tokens' residuals, which need the step's taps,
but defers their entries' K/V (`pending`): the next step that drafts recomputes them along with its own,
in the same batched forward, or a flush stores them once some request has `FLUSH_GAP` of them. So a long
run of root-only steps costs one small projection per `FLUSH_GAP` steps instead of one per step: py-spy
put the per-step store at 1% of a batch-16 float32 step on a 2-core EPYC, 0.2% deferred. A request can
finish with entries still pending, leaving stale K/V in slots the radix cache keeps; so a prefill
recomputes the `FLUSH_GAP` entries before its cached prefix too, from the residuals that are always
stored. Stale K/V can only make drafts worse, never change what the target accepts.

Device contract: row layouts are computed on the host from the callers' Python lists and uploaded in one
tensor (non-blocking where the memory allows); nothing is read back from the device.

`Drafting` is the step's drafting phase: after a prefill or a verify, it stores the draft state of the
tokens the step committed and drafts from them (`DraftForward`), and keeps the candidates (`Trees`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from sglang_dart.attention.tree_attention import upload
from sglang_dart.dart.phase_timer import PhaseTimer
from sglang_dart.dart.progress import KEPT_TOKENS, RequestProgress
from sglang_dart.dart.trees import Trees
from sglang_dart.drafter.sglang_model import LlamaForCausalLMDart


class DraftForward:
    def __init__(
        self,
        model: LlamaForCausalLMDart,
        draft_runner: Any,
        target_req_to_token: torch.Tensor,
        scratch_base: int,
        num_slots: int,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.drafter = model.drafter
        self.draft_runner = draft_runner
        self.req_to_token = target_req_to_token
        self.draft_table = draft_runner.req_to_token_pool.req_to_token
        self.device = target_req_to_token.device
        dtype = self.drafter.fc.weight.dtype
        self.residual = torch.zeros(num_slots, cfg.hidden_size, dtype=dtype, device=self.device)
        self.num_masks = cfg.draft_length
        self.scratch_base = scratch_base

    @staticmethod
    def scratch_slots(max_batch: int, draft_length: int) -> int:
        """Scratch slots the draft pool needs past the target's: the newest entry and the mask slots of
        every request of the largest batch."""
        return max_batch * (draft_length + 1)

    @torch.no_grad()
    def store_residuals(self, slots: torch.Tensor, aux_hidden: torch.Tensor) -> None:
        """Fuse the target taps of freshly computed tokens into their slots."""
        if slots.numel():
            self.residual[slots] = self.drafter.fuse(aux_hidden.to(self.residual.dtype))

    def slots_of(self, rows: list[int], first: list[int], last: list[int]) -> torch.Tensor:
        """Target slots of positions first[r]..last[r] of each request r (req_to_token row rows[r]), grouped
        per request (one gather on the device)."""
        count_list = [b - a + 1 for a, b in zip(first, last, strict=True)]
        counts, total = torch.tensor(count_list, dtype=torch.int64), sum(count_list)
        index = torch.stack(
            [
                torch.tensor(rows, dtype=torch.int64).repeat_interleave(counts, output_size=total),
                _ranges(torch.tensor(first, dtype=torch.int64), counts, total),
            ]
        )
        rows_d, cols_d = upload(index, self.req_to_token.device)
        return self.req_to_token[rows_d, cols_d].to(torch.int64)

    @torch.no_grad()
    def store_entries(
        self, rows: list[int], first: list[int], last: list[int], next_tokens: list[int]
    ) -> None:
        """Store the K/V of entries first[r]..last[r]-1 of each request, as `step` would, with no attention,
        head or mask slots (next_tokens as for `step`: grouped per request, the token after each entry)."""
        positions: list[int] = []
        tokens: list[int] = []
        offset = 0
        for a, b in zip(first, last, strict=True):  # the newest entry (b) has no slot yet
            positions.extend(range(a, b))
            tokens.extend(next_tokens[offset : offset + b - a])
            offset += b - a + 1
        if not positions:
            return
        positions_d, tokens_d = upload(torch.tensor([positions, tokens], dtype=torch.int64), self.device)
        residual = self.residual[self.slots_of(rows, first, [b - 1 for b in last])]
        k, v = self.drafter.project_kv(self.drafter.real_inputs(residual, tokens_d), positions_d)
        slots = self.slots_of(rows, [a + 1 for a in first], last)  # entry t lives in the slot of t + 1
        pool = self.draft_runner.token_to_kv_pool
        pool.set_kv_buffer(self.model.attn, KVWriteLoc(slots, None), k, v)

    @torch.no_grad()
    def step(
        self,
        rows: list[int],
        first: list[int],
        last: list[int],
        next_tokens: list[int],
        depths: int | None = None,
    ) -> torch.Tensor:
        """Draft entries first[r]..last[r] of each request r (req_to_token row rows[r]; their tokens must
        have stored residuals; next_tokens holds, grouped per request, the token after each), then the mask
        slots. Stores the K/V of every entry but the last one, returns logits [bs, D, draft_vocab]:
        D = d + 1, or the first `depths` of those rows (mask slots attend causally, so a later slot never
        changes an earlier row: the slots beyond them are not computed at all)."""
        drafter, d = self.drafter, self.num_masks
        if depths is not None:
            d = max(0, min(d, depths - 1))
        bs = len(first)
        real_list = [b - a + 1 for a, b in zip(first, last, strict=True)]
        num_real, total = sum(real_list), sum(real_list) + bs * d
        extend_list = [m + d for m in real_list]
        real_counts = torch.tensor(real_list, dtype=torch.int64)
        counts = real_counts + d  # flat row layout: request r owns [real rows | d mask rows]
        starts = torch.cumsum(counts, 0) - counts
        first_t = torch.tensor(first, dtype=torch.int64)
        last_t = torch.tensor(last, dtype=torch.int64)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        heads = (starts + real_counts - 1).unsqueeze(1) + torch.arange(d + 1).unsqueeze(0)
        width = max(last)  # columns before the newest entry's: stored entries, copied from the target
        # Scratch columns last[r]..last[r]+d of each row: the newest entry and the mask slots.
        scratch_cols = (last_t.unsqueeze(1) + torch.arange(d + 1).unsqueeze(0)).reshape(-1)
        scratch_slots = self.scratch_base + torch.arange(bs * (d + 1), dtype=torch.int64)
        layout = upload(
            torch.cat(
                [
                    torch.tensor(next_tokens, dtype=torch.int64),
                    _ranges(starts, real_counts, num_real),
                    _ranges(first_t, counts, total),
                    heads.reshape(-1),
                    rows_t,
                    rows_t.repeat_interleave(counts, output_size=total),
                    _ranges(first_t, counts, total),
                    rows_t.repeat_interleave(d + 1),
                    scratch_cols,
                    scratch_slots,
                    first_t,
                    counts,
                ]
            ),
            self.device,
        )
        (
            tokens_d,
            real_rows,
            positions,
            head_rows,
            rows_d,
            loc_rows,
            loc_cols,
            scratch_rows,
            scratch_cols_d,
            scratch_slots_d,
            prefix_d,
            extend_d,
        ) = layout.split(
            [len(next_tokens), num_real, total, bs * (d + 1), bs, total, total]
            + [bs * (d + 1)] * 3
            + [bs, bs]
        )

        # The draft's request table: the target's rows shifted by one (entry t in the slot of t + 1),
        # then scratch slots for the columns the step writes but never keeps.
        table = self.draft_table
        table[rows_d, :width] = self.req_to_token[rows_d, 1 : width + 1]
        table[scratch_rows, scratch_cols_d] = scratch_slots_d.to(table.dtype)
        out_cache_loc = table[loc_rows, loc_cols].to(torch.int64)

        residual_real = self.residual[self.slots_of(rows, first, last)]
        real_in = drafter.real_inputs(residual_real, tokens_d)
        mask_in, mask_residual = drafter.mask_row(residual_real.dtype)
        attn_in = mask_in.expand(total, -1).clone()
        residual = mask_residual.expand(total, -1).clone()
        attn_in[real_rows] = real_in
        residual[real_rows] = residual_real
        q, k, v = drafter.project_qkv(attn_in, positions)

        batch = self._extend_batch(rows_d, prefix_d, extend_d, first, extend_list, out_cache_loc, positions)
        backend = self.draft_runner.attn_backend
        backend.init_forward_metadata(batch)
        with forward_context(ForwardContext(attn_backend=backend)):
            context = self.model.attend(q, k, v, batch)
        logits = drafter.head(residual[head_rows], context[head_rows])
        return logits.view(bs, d + 1, -1)

    def _extend_batch(
        self,
        rows: torch.Tensor,
        prefix: torch.Tensor,
        extend: torch.Tensor,
        prefix_list: list[int],
        extend_list: list[int],
        out_cache_loc: torch.Tensor,
        positions: torch.Tensor,
    ) -> ForwardBatch:
        """An EXTEND batch over the draft table: each request's new rows follow its cached entries."""
        seq_list = [p + e for p, e in zip(prefix_list, extend_list, strict=True)]
        total = sum(extend_list)
        seq_lens = prefix + extend
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(prefix_list),
            input_ids=torch.zeros(total, dtype=torch.int64, device=self.device),
            req_pool_indices=rows,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=sum(seq_list),
            seq_lens_cpu=torch.tensor(seq_list, dtype=torch.int64),
            positions=positions,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
        batch.extend_prefix_lens = prefix.to(torch.int32)
        batch.extend_seq_lens = extend.to(torch.int32)
        batch.extend_prefix_lens_cpu = list(prefix_list)
        batch.extend_seq_lens_cpu = list(extend_list)
        batch.extend_num_tokens = total
        batch.extend_start_loc = (torch.cumsum(extend, 0) - extend).to(torch.int32)
        return batch


def request_rows(batch: Any) -> list[int]:
    """The batch's request-table rows, from the host copy SGLang keeps with the batch. Not from the
    requests: with overlap scheduling a request that finished in the step before may still ride in this
    batch after SGLang has released it (its `req_pool_idx` is then None), as every speculative worker's
    batch does; its row stays intact until the next allocation."""
    rows = batch.req_pool_indices_cpu
    if rows is None:
        return [req.req_pool_idx for req in batch.reqs]
    return rows.numpy().tolist()  # a host tensor: no device read


# Entries a request may defer before they are stored. Their next tokens come from the tokens
# `RequestProgress` keeps (KEPT_TOKENS) when they are computed. A prefill recomputes as many before its cached
# prefix: at 32, py-spy (batch 16) saw prefill drafting about double, so the gap is kept small.
FLUSH_GAP = 16
assert FLUSH_GAP <= KEPT_TOKENS


class Drafting:
    def __init__(
        self, forward: DraftForward, trees: Trees, progress: RequestProgress, timer: PhaseTimer
    ) -> None:
        self.forward = forward
        self.trees = trees
        self.progress = progress
        self.timer = timer
        self.pending: dict[str, int] = {}  # rid -> its first entry whose K/V is not stored

    def after_extend(self, batch: Any, taps: torch.Tensor, sampled: torch.Tensor) -> None:
        """Draft from a prefill: every extended token's residual is stored, then one draft step per request
        over its new entries (the entry before the chunk too: its next token was not known before)."""
        runner = self.forward
        rows = request_rows(batch)
        firsts, lasts, nexts, prefixes, ends = [], [], [], [], []
        sampled_ids = sampled.tolist()  # the one read of a prefill before its candidates
        for i, req in enumerate(batch.reqs):
            prefix, extend = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
            end = prefix + extend
            prefixes.append(prefix)
            ends.append(end - 1)
            seq = list(req.origin_input_ids) + list(req.output_ids)
            after = seq[end] if end < len(seq) else sampled_ids[i]  # next prompt token, or the first output
            tail = seq[:end] + [after]
            # From FLUSH_GAP entries before the cached prefix: ones a finished request left pending there.
            first = max(prefix - 1 - FLUSH_GAP, 0)
            self.pending.pop(req.rid, None)
            firsts.append(first)
            lasts.append(end - 1)
            nexts.extend(tail[first + 1 : end + 1])
            self.progress.start(req, end, tail)
        # The taps rows are the extend tokens of every request, in batch order: one fused write for all.
        with self.timer.phase("draft"):
            runner.store_residuals(runner.slots_of(rows, prefixes, ends), taps[: sum(batch.extend_lens)])
            logits = runner.step(rows, firsts, lasts, nexts)
        self.trees.keep(batch.reqs, logits, [self.progress.of(req) for req in batch.reqs])

    def after_verify(
        self,
        batch: Any,
        taps: torch.Tensor,
        drafts: list[int],
        accept_rows: list[list[int]],
        lens: list[int],
        predicted: list[int],
        depths: int | None,
    ) -> float:
        """Store the draft state of the tokens a step committed and, when the next step builds trees
        (`depths`: how deep they can reach), draft from them, along with any entries earlier root-only
        steps deferred; returns the seconds drafting took. Each request's progress advances past the step.
        drafts: the verified tokens (flat); accept_rows[i][: lens[i]]: request i's accepted rows of them,
        root first; predicted: the target's token after each row. The per-request walk runs on host
        lists (a tensor op per request would cost more than a root-only step saves at large batches)."""
        runner = self.forward
        rows = request_rows(batch)
        firsts, lasts, nexts, paths, slot_rows, slot_cols = [], [], [], [], [], []
        pending: dict[str, int] = {}  # requests that left the batch have nothing left to store
        for i, (req, row) in enumerate(zip(batch.reqs, rows, strict=True)):
            now = self.progress.of(req)
            committed = now.committed  # the root's position
            path = accept_rows[i][: lens[i]]  # root, then the accepted drafts
            paths.extend(path)
            slot_rows.extend([row] * len(path))
            slot_cols.extend(range(committed, committed + len(path)))
            new_tokens = [drafts[j] for j in path]
            bonus = predicted[path[-1]]
            first = self.pending.get(req.rid, committed - 1)
            pending[req.rid] = first
            firsts.append(first)
            lasts.append(committed + len(path) - 1)
            # The next token of each deferred entry: positions first + 1 .. committed - 1, held in `recent`
            # (the root, at `committed`, is its last token).
            deferred = now.recent[len(now.recent) - (committed - first) : -1] if committed - first > 1 else ()
            nexts.extend([*deferred, *new_tokens, bonus])
            self.progress.advance(req, new_tokens[1:] + [bonus])
        index = upload(torch.tensor([slot_rows, slot_cols, paths], dtype=torch.int64), taps.device)
        slots = runner.req_to_token[index[0], index[1]].to(torch.int64)
        gaps = [b - a for a, b in zip(firsts, lasts, strict=True)]
        flush = depths is None and max(gaps, default=0) >= FLUSH_GAP
        with self.timer.phase("draft"):
            runner.store_residuals(slots, taps[index[2]])  # one write
            drafting_from = time.perf_counter()
            if depths is not None:
                logits = runner.step(rows, firsts, lasts, nexts, depths)
            elif flush:
                runner.store_entries(rows, firsts, lasts, nexts)
        # After a draft or a flush every entry but the newest is stored; else the step's are deferred too.
        self.pending = pending if depths is None and not flush else {}
        if depths is None:
            self.trees.drop(batch.reqs)
            return 0.0
        self.trees.keep(batch.reqs, logits, [self.progress.of(req) for req in batch.reqs])
        return time.perf_counter() - drafting_from


def _ranges(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """The concatenation of arange(starts[r], starts[r] + counts[r]) over r (`total` elements), without a
    Python loop. Host tensors."""
    offsets = torch.cumsum(counts, 0) - counts
    within = torch.arange(total) - offsets.repeat_interleave(counts, output_size=total)
    return starts.repeat_interleave(counts, output_size=total) + within
