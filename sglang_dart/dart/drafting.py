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
whose rows hold the target's, shifted: a prefill's draft copies the row up to its newest entry, and each
later step writes the columns of the entries it stores. The newest entry (its next token has no slot yet)
and the mask slots are written to scratch slots past the end of the target's slot range (the draft pool is
made larger by that much; the shared allocator never hands them out) and are never kept: each step
recomputes them.

A step that drafts nothing (a root-only step) stores its tokens' residuals, which need the step's taps,
but defers their entries' K/V (`pending`): the next step that drafts stores them first, or a flush stores
them once some request has `FLUSH_GAP` of them. So a long
run of root-only steps costs one small projection per `FLUSH_GAP` steps instead of one per step: py-spy
put the per-step store at 1% of a batch-16 float32 step on a 2-core EPYC, 0.2% deferred. On a CPU such a
step defers the residuals' fuse too (`defer_residuals`): the fc and a dozen small indexing ops per step
were 1.2% of a batch-1 bf16 SmolLM2 step on a 2-core EPYC, where each op costs the host. A request can
finish with entries still pending, leaving stale K/V in slots the radix cache keeps; so a prefill
recomputes the `FLUSH_GAP` entries before its cached prefix too, from the residuals that are always
stored. Stale K/V can only make drafts worse, never change what the target accepts.

Device contract: the draft after a verify is laid out on the device from the verify's results
(`block_step`, `draft_block.py`); other row layouts (a prefill's, a flush's) are computed on the host from
the callers' Python lists and uploaded in one tensor (non-blocking where the memory allows). Nothing is
read back from the device but the step's results and candidates, in one transfer at its end.

`Drafting` is the step's drafting phase: after a prefill or a verify, it stores the draft state of the
tokens the step committed and drafts from them (`DraftForward`), and keeps the candidates (`Trees`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from sglang_dart.attention.tree_attention import upload
from sglang_dart.dart.device_graphs import DeviceGraphs
from sglang_dart.dart.draft_block import block_layout, path_residual_slots
from sglang_dart.dart.phase_timer import PhaseTimer
from sglang_dart.dart.progress import KEPT_TOKENS, Progress, RequestProgress
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
        graphs: DeviceGraphs | None = None,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.drafter = model.drafter
        self.draft_runner = draft_runner
        self.req_to_token = target_req_to_token
        self.draft_table = draft_runner.req_to_token_pool.req_to_token
        self.device = target_req_to_token.device
        # Every draft row's position is a column of the draft table.
        self.drafter.cache_rope(self.draft_table.shape[1])
        dtype = self.drafter.fc.weight.dtype
        # One row past the slots: where padding rows of a block step read and write (`draft_block`).
        self.junk_residual = num_slots
        self.residual = torch.zeros(num_slots + 1, cfg.hidden_size, dtype=dtype, device=self.device)
        self.num_masks = cfg.draft_length
        self.scratch_base = scratch_base
        max_batch = target_req_to_token.shape[0]
        self.junk_slot = scratch_base + max_batch * (self.num_masks + 1)  # the last scratch slot
        self.graphs = graphs or DeviceGraphs(self.device, enabled=False)
        self._unfused: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, taps): `defer_residuals`

    @staticmethod
    def scratch_slots(max_batch: int, draft_length: int) -> int:
        """Scratch slots the draft pool needs past the target's: the newest entry and the mask slots of
        every request of the largest batch, and one junk slot for the padding rows of block steps."""
        return max_batch * (draft_length + 1) + 1

    def defer_residuals(self, slots: torch.Tensor, taps: torch.Tensor) -> None:
        """Keep the taps of tokens whose residuals nothing reads yet (a root-only step's, on a CPU), to be
        fused into their slots with the next ones (`fuse_deferred`): one fc over up to FLUSH_GAP steps
        reads its weights once. Every other access to `residual` fuses them first, so the writes land in
        step order whatever slots were freed and handed out again in between. `taps` must not be a buffer
        the next forward overwrites."""
        self._unfused.append((slots, taps))
        if len(self._unfused) >= FLUSH_GAP:
            self.fuse_deferred()

    @torch.no_grad()
    def fuse_deferred(self) -> None:
        """Store the residuals `defer_residuals` kept: one fc, then each step's slots in order (a slot a
        later step reuses ends with the later residual)."""
        if not self._unfused:
            return
        unfused, self._unfused = self._unfused, []
        fused = self.drafter.fuse(torch.cat([taps for _, taps in unfused]).to(self.residual.dtype))
        start = 0
        for slots, _ in unfused:
            self.residual[slots] = fused[start : start + slots.shape[0]]
            start += slots.shape[0]

    @torch.no_grad()
    def store_residuals(self, slots: torch.Tensor, aux_hidden: torch.Tensor) -> None:
        """Fuse the target taps of freshly computed tokens into their slots."""
        self.fuse_deferred()
        if slots.numel():
            self.residual[slots] = self.drafter.fuse(aux_hidden.to(self.residual.dtype))

    def _table_index(
        self, rows: list[int], first: list[int], last: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) on the device of positions first[r]..last[r] of each request r (request-table
        row rows[r]), grouped per request: built on the host, uploaded in one tensor."""
        count_list = [b - a + 1 for a, b in zip(first, last, strict=True)]
        counts, total = torch.tensor(count_list, dtype=torch.int64), sum(count_list)
        index = torch.stack(
            [
                torch.tensor(rows, dtype=torch.int64).repeat_interleave(counts, output_size=total),
                _ranges(torch.tensor(first, dtype=torch.int64), counts, total),
            ]
        )
        rows_d, cols_d = upload(index, self.req_to_token.device)
        return rows_d, cols_d

    def slots_of(self, rows: list[int], first: list[int], last: list[int]) -> torch.Tensor:
        """Target slots of positions first[r]..last[r] of each request r (req_to_token row rows[r]), grouped
        per request (one gather on the device)."""
        rows_d, cols_d = self._table_index(rows, first, last)
        return self.req_to_token[rows_d, cols_d].to(torch.int64)

    @torch.no_grad()
    def store_entries(
        self, rows: list[int], first: list[int], last: list[int], next_tokens: list[int]
    ) -> None:
        """Store the K/V of entries first[r]..last[r]-1 of each request, as `step` would, with no attention,
        head or mask slots (next_tokens as for `step`: grouped per request, the token after each entry), and
        their columns of the draft's request table (block steps write it from their own first column on)."""
        self.fuse_deferred()
        tokens, _ = _split_at_newest(first, last, next_tokens)  # the newest entry has no slot yet
        if not tokens:
            return
        # An entry's position is its column; its residual is its token's, its K/V in the next token's slot.
        rows_d, entries = self._table_index(rows, first, [b - 1 for b in last])
        residual = self.residual[self.req_to_token[rows_d, entries].to(torch.int64)]
        tokens_d = upload(torch.tensor(tokens, dtype=torch.int64), self.device)
        k, v = self.drafter.project_kv(self.drafter.real_inputs(residual, tokens_d), entries)
        slots = self.req_to_token[rows_d, entries + 1].to(torch.int64)
        pool = self.draft_runner.token_to_kv_pool
        pool.set_kv_buffer(self.model.attn, KVWriteLoc(slots, None), k, v)
        self.draft_table[rows_d, entries] = slots.to(self.draft_table.dtype)

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
        self.fuse_deferred()
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

    @torch.no_grad()
    def step_from_newest(
        self, rows: list[int], first: list[int], last: list[int], next_tokens: list[int]
    ) -> torch.Tensor:
        """`step`'s logits for the same arguments (no `depths`), for less work: only the rows that give
        logits attend. Entries first[r]..last[r]-1 are stored as `store_entries` stores them (their K/V
        alone: no query, no attention), then the newest entry and the mask slots are drafted over them.
        A prefill's draft attends from every prompt token otherwise, queries and attention that no logit
        reads: O(prompt^2) for a prompt of thousands of tokens."""
        self.store_entries(rows, first, last, next_tokens)
        _, newest = _split_at_newest(first, last, next_tokens)
        return self.step(rows, list(last), list(last), newest)

    @torch.no_grad()
    def rehearse(
        self,
        bs: int,
        size: int,
        depths: int | None,
        taps: tuple[int, torch.dtype],
        finish: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        """One draft step after a verify of `size` nodes per request (then drafting `depths` deep, or not
        at all), on made-up inputs shaped and typed as a verify's (`Drafting.after_verify`), so that its
        pieces' graphs are captured before serving. Run before any request: its writes go to request-table
        row 0, the scratch slots and the junk row (every path is empty), none of which holds anything yet.
        taps: the width and dtype of the target's taps."""
        device = self.device
        rows = torch.zeros(bs, dtype=torch.int64, device=device)  # as SGLang's req_pool_indices
        committed = torch.ones(bs, dtype=torch.int64, device=device)  # as SGLang's seq_lens
        path_nodes = torch.full((bs, size), -1, dtype=torch.int32, device=device)  # as its accept_index
        accept_lens = torch.zeros(bs, dtype=torch.int32, device=device)
        predict = torch.zeros(bs * size, dtype=torch.int32, device=device)
        roots = torch.zeros(bs, dtype=torch.int64, device=device)  # as the verify's draft tokens
        hidden = torch.zeros(bs * size, taps[0], dtype=taps[1], device=device)
        self.store_path_residuals(rows, committed, path_nodes, accept_lens, hidden)
        if depths is not None:
            self.block_step(
                rows, [1] * bs, committed, path_nodes, accept_lens, predict, roots, depths, finish
            )

    @torch.no_grad()
    def store_path_residuals(
        self,
        rows: torch.Tensor,
        committed: torch.Tensor,
        path_nodes: torch.Tensor,
        accept_lens: torch.Tensor,
        taps: torch.Tensor,
    ) -> None:
        """Fuse the taps of the tokens a verify accepted into their slots, on the device (a graph per
        shape on a GPU): path node j of request i (j < accept_lens[i], path_nodes [bs, size] flat verify
        nodes) is the token at position committed[i] + j. Every node column is fused; those past a path go
        to the junk row."""
        self.fuse_deferred()  # in step order: a deferred slot may have been handed out again
        self.graphs.run(
            "path-residuals",
            self._store_path_residuals,
            (rows, committed, path_nodes, accept_lens, taps),
            rows.shape[0],
        )

    def _store_path_residuals(
        self,
        rows: torch.Tensor,
        committed: torch.Tensor,
        path_nodes: torch.Tensor,
        accept_lens: torch.Tensor,
        taps: torch.Tensor,
    ) -> tuple[()]:
        slots = path_residual_slots(
            self.req_to_token, rows, committed, accept_lens, path_nodes.shape[1], self.junk_residual
        )
        nodes = path_nodes.to(torch.int64).clamp(min=0).reshape(-1)
        self.residual[slots] = self.drafter.fuse(taps[nodes].to(self.residual.dtype))
        return ()

    @torch.no_grad()
    def block_step(
        self,
        rows: torch.Tensor,
        committed_list: list[int],
        committed: torch.Tensor,
        path_nodes: torch.Tensor,
        accept_lens: torch.Tensor,
        predict: torch.Tensor,
        roots: torch.Tensor,
        depths: int,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Draft from the entries a verify committed, laid out on the device (`draft_block`): nothing is
        read back, and the forward has one shape per (batch, tree size, depth), so on a GPU its pieces
        before and after the attention replay captured graphs (`device_graphs`). Entries before
        committed - 1 must be stored (a deferred tail flushed first); the residuals of the path must be
        stored (`store_path_residuals`). Returns logits [bs, D, draft_vocab] as `step` does, or
        finish(logits) (device work alone, such as the top-k: it runs in the head's graph), valid until
        the next block step."""
        self.fuse_deferred()
        masks = max(0, min(self.num_masks, depths - 1))
        bs, size = path_nodes.shape
        width = size + 1 + masks
        q, k, v, kv_slots, positions, residual, head_rows = self.graphs.run(
            f"block-inputs-{masks}",
            partial(self._block_inputs, masks),
            (rows, committed, path_nodes, accept_lens, predict, roots),
            bs,
        )
        prefix = committed.to(torch.int64) - 1
        batch = self._extend_batch(
            rows.to(torch.int64),
            prefix,
            torch.full_like(prefix, width),
            [c - 1 for c in committed_list],
            [width] * bs,
            kv_slots,
            positions,
        )
        backend = self.draft_runner.attn_backend
        backend.init_forward_metadata(batch)
        with forward_context(ForwardContext(attn_backend=backend)):
            context = self.model.attend(q, k, v, batch)
        head = partial(self._block_head, bs, masks, finish)
        name = "block-head" if finish is None else f"block-head-{_name_of(finish)}"
        (out,) = self.graphs.run(name, head, (residual, context, head_rows), bs)
        return out

    def _block_inputs(
        self,
        masks: int,
        rows: torch.Tensor,
        committed: torch.Tensor,
        path_nodes: torch.Tensor,
        accept_lens: torch.Tensor,
        predict: torch.Tensor,
        roots: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """A block step up to its attention, on the device alone (a graph holds it): the row layout, the
        draft table's columns, q/k/v. Returns (q, k, v, kv_slots, positions, residual, head_rows)."""
        drafter = self.drafter
        layout = block_layout(
            self.req_to_token,
            rows,
            committed,
            path_nodes,
            accept_lens,
            predict,
            roots,
            masks,
            self.scratch_base,
            self.num_masks + 1,
            self.junk_slot,
            self.junk_residual,
        )
        bs, width = rows.shape[0], layout.width
        rows_by_row = rows.to(torch.int64).unsqueeze(1).expand(bs, width).reshape(-1)
        self.draft_table[rows_by_row, layout.positions] = layout.kv_slots.to(self.draft_table.dtype)

        residual_rows = self.residual[layout.residual_slots]
        real_in = drafter.real_inputs(residual_rows, layout.next_tokens)
        mask_in, mask_residual = drafter.mask_row(residual_rows.dtype)
        real = layout.real.unsqueeze(1)
        attn_in = torch.where(real, real_in, mask_in)
        residual = torch.where(real, residual_rows, mask_residual)
        q, k, v = drafter.project_qkv(attn_in, layout.positions)
        return q, k, v, layout.kv_slots, layout.positions, residual, layout.head_rows

    def _block_head(
        self,
        bs: int,
        masks: int,
        finish: Callable[[torch.Tensor], torch.Tensor] | None,
        residual: torch.Tensor,
        context: torch.Tensor,
        head_rows: torch.Tensor,
    ) -> tuple[torch.Tensor]:
        """A block step after its attention (a graph holds it): the head rows' logits [bs, D, vocab], or
        what `finish` makes of them."""
        logits = self.drafter.head(residual[head_rows], context[head_rows]).view(bs, masks + 1, -1)
        return (logits if finish is None else finish(logits),)

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
        """Draft from a prefill: every extended token's residual is stored, then the K/V of each request's
        new entries (the entry before the chunk too: its next token was not known before), and one draft
        step from the newest entry (`DraftForward.step_from_newest`)."""
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
            logits = runner.step_from_newest(rows, firsts, lasts, nexts)
        self.trees.keep(batch.reqs, logits, [self.progress.of(req) for req in batch.reqs])

    def capture_ahead(
        self, possible_sizes: Callable[[int], tuple[int, ...]], max_batch: int, taps: tuple[int, torch.dtype]
    ) -> int:
        """Capture the draft step's graphs for the shapes serving will meet (`shapes_to_capture`), most
        likely first, up to half the graph budget (the rest is captured at first use): before serving, so
        that no step pays a capture. Returns how many graphs there are."""
        graphs = self.forward.graphs
        for bs, size, depths in shapes_to_capture(possible_sizes, max_batch):
            if not graphs.enabled or len(graphs.graphs) >= graphs.max_graphs // 2:
                break
            self.forward.rehearse(bs, size, depths, taps, self.trees.candidates_of)
        return len(graphs.graphs)

    def after_verify(
        self,
        batch: Any,
        taps: torch.Tensor,
        step: VerifiedStep,
        depths: int | None,
    ) -> UnsettledStep:
        """Store the draft state of the tokens a step committed and, when the next step builds trees
        (`depths`: how deep they can reach), draft from them: everything up to the candidates runs on the
        device from the step's own results (`draft_block`), and nothing is read back. The results and the
        candidates start on their way to the host in one transfer; `settle` takes them there (at the next
        step's start, so that the scheduler's work on this step's results overlaps the device's)."""
        runner = self.forward
        rows = request_rows(batch)
        now = [self.progress.of(req) for req in batch.reqs]
        committed = [p.committed for p in now]
        rows_d = _rows_on_device(batch, rows, step.roots.device)
        bs = len(rows)
        path_nodes = step.accept_index.view(bs, -1)
        if not runner.graphs.enabled and path_nodes.shape[1] > 1:  # graphs need one shape per tree size
            path_nodes = _longest_paths_on_cpu(path_nodes, step.accept_lens)
        roots_only = path_nodes.shape[1] == 1  # every request accepted its root alone
        candidates = None
        drafting_seconds = 0.0
        with self.timer.phase("draft"):
            if depths is None and roots_only and _host_is_the_device(runner, taps):
                # Residuals nothing reads before the next flush or draft.
                runner.defer_residuals(_root_slots(runner, rows_d, step), _root_rows(taps, path_nodes))
            else:
                runner.store_path_residuals(rows_d, step.committed, path_nodes, step.accept_lens, taps)
            drafting_from = time.perf_counter()
            if depths is not None:
                self._flush_deferred(batch.reqs, rows, now)
                candidates = runner.block_step(
                    rows_d,
                    committed,
                    step.committed,
                    path_nodes,
                    step.accept_lens,
                    step.predict,
                    step.roots,
                    depths,
                    finish=self.trees.candidates_of,  # the top-k, in the head's graph on a GPU
                )
                drafting_seconds = time.perf_counter() - drafting_from  # queued, on a GPU: no wait here
        predict = step.predict.reshape(-1)
        if roots_only:  # the target's token after each root tells all
            parts = [_root_rows(predict, path_nodes).float()]
        else:
            parts = [step.accept_lens.float(), path_nodes.reshape(-1).float(), predict.float()]
        if candidates is not None:
            parts.append(candidates.reshape(-1))
        return UnsettledStep(
            reqs=list(batch.reqs),
            rows=rows,
            now=now,
            depths=depths,
            read=DeviceRead(parts[0] if len(parts) == 1 else torch.cat(parts)),
            path_width=path_nodes.shape[1],
            tree_nodes=step.predict.numel(),
            candidates_shape=None if candidates is None else tuple(candidates.shape),
            drafting_seconds=drafting_seconds,
        )

    def settle(self, step: UnsettledStep) -> VerifiedHost:
        """Bring a step's results and candidates to the host (its one read) and update the host's state:
        each request's progress advances past the step, the candidates are kept for the pruner, or, after a
        step that drafted nothing, its entries are deferred (flushed once a request has FLUSH_GAP of them)."""
        with self.timer.phase("settle"):
            host = VerifiedHost.parse(
                step.read.numpy(), len(step.rows), step.path_width, step.tree_nodes, step.candidates_shape
            )
        reqs, now, bs = step.reqs, step.now, len(step.rows)
        new_tokens = [host.new_tokens(i) for i in range(bs)]
        for req, tokens in zip(reqs, new_tokens, strict=True):
            self.progress.advance(req, tokens)
        if step.depths is not None:
            self.pending = {}  # every entry but the newest is stored
            self.trees.keep_host(reqs, host.probs, host.tokens, [self.progress.of(req) for req in reqs])
            return host
        self.trees.drop(reqs)
        # Entries first .. last of each request are not stored (requests that left the batch have none).
        committed = [at.committed for at in now]
        firsts = [self.pending.get(req.rid, c - 1) for req, c in zip(reqs, committed, strict=True)]
        lasts = [c + len(t) - 1 for c, t in zip(committed, new_tokens, strict=True)]
        if max((b - a for a, b in zip(firsts, lasts, strict=True)), default=0) >= FLUSH_GAP:
            nexts = [t for i in range(bs) for t in _tokens_after(now[i], firsts[i], new_tokens[i])]
            with self.timer.phase("draft"):
                self.forward.store_entries(step.rows, firsts, lasts, nexts)
            self.pending = {}
        else:
            self.pending = {req.rid: first for req, first in zip(reqs, firsts, strict=True)}
        return host

    def _flush_deferred(self, reqs: list[Any], rows: list[int], now: list[Progress]) -> None:
        """Store the K/V of entries earlier root-only steps deferred, up to the one before each root (a
        block step starts there)."""
        flush_rows, firsts, lasts, nexts = [], [], [], []
        for req, row, at in zip(reqs, rows, now, strict=True):
            first = self.pending.get(req.rid)
            if first is None or first >= at.committed - 1:
                continue
            flush_rows.append(row)
            firsts.append(first)
            lasts.append(at.committed - 1)
            nexts.extend(_tokens_after(at, first, []))
        if flush_rows:
            self.forward.store_entries(flush_rows, firsts, lasts, nexts)


@dataclass(frozen=True)
class VerifiedStep:
    """A verify's results on the device, as drafting reads them."""

    committed: torch.Tensor  # [bs] int64: KV lengths before the step (the roots' positions)
    roots: torch.Tensor  # [bs] int64: the roots' tokens
    predict: torch.Tensor  # [bs * size]: the target's token after each verified node
    accept_lens: torch.Tensor  # [bs]: accepted tokens per request, root included
    accept_index: torch.Tensor  # [bs, size]: the accepted nodes (flat), root first, -1 after
    root_slots: torch.Tensor | None = None  # [bs] int64: the roots' KV slots, where the caller has them


class DeviceRead:
    """A device tensor on its way to the host. On CUDA it is copied into pinned memory without waiting and
    `numpy()` waits for that copy alone; elsewhere `numpy()` reads it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        # The device tensor is held until the copy is waited for, so its memory is not handed out before.
        self._tensor, self._host, self._copied = tensor, None, None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def numpy(self) -> np.ndarray:
        if self._host is not None:
            self._copied.synchronize()
            return self._host.numpy()
        return self._tensor.cpu().numpy()


@dataclass
class UnsettledStep:
    """A verify (or root-only) step whose drafting ran on the device and whose results are on their way to
    the host (`Drafting.settle`)."""

    reqs: list[Any]
    rows: list[int]
    now: list[Progress]  # each request's progress before the step
    depths: int | None  # how deep the next step's trees can reach (None: it drafted nothing)
    read: DeviceRead  # accept lengths, path nodes, the target's tokens, then the candidates
    path_width: int  # 1: every path was its root alone, and `read` starts with the token after each root
    tree_nodes: int
    candidates_shape: tuple[int, ...] | None
    drafting_seconds: float


@dataclass
class VerifiedHost:
    """A verify's results and the next candidates on the host, from one transfer."""

    lens: list[int]
    paths: list[list[int]]
    predict: list[int]
    probs: np.ndarray | None  # [bs, D, k] float32
    tokens: np.ndarray | None  # [bs, D, k] int64

    @classmethod
    def parse(
        cls,
        host: np.ndarray,
        bs: int,
        path_width: int,
        tree_nodes: int,
        candidates_shape: tuple[int, ...] | None,
    ) -> VerifiedHost:
        """The transfer `Drafting.after_verify` starts: float32 carries the ids exactly (vocabularies
        < 2**24, checked at start-up) and the node indices (< bs * tree size). With paths 1 wide, every path
        was its root alone and the transfer starts with the target's token after each root."""
        if path_width == 1:
            lens, paths = [1] * bs, [[i] for i in range(bs)]
            predicted = host[:bs].astype(np.int64).tolist()  # node i: the target's token after root i
            end = bs
        else:
            lens = host[:bs].astype(np.int64).tolist()
            nodes = host[bs : bs + bs * path_width].astype(np.int64).reshape(bs, path_width).tolist()
            paths = [row[:n] for row, n in zip(nodes, lens, strict=True)]
            end = bs + bs * path_width + tree_nodes
            predicted = host[bs + bs * path_width : end].astype(np.int64).tolist()
        probs = tokens = None
        if candidates_shape is not None:
            both = host[end:].reshape(candidates_shape)
            probs, tokens = both[0], both[1].astype(np.int64)
        return cls(lens, paths, predicted, probs, tokens)

    def new_tokens(self, i: int) -> list[int]:
        """Request i's accepted drafts and its bonus token: the target's token after each path node."""
        return [self.predict[node] for node in self.paths[i]]


def shapes_to_capture(
    possible_sizes: Callable[[int], tuple[int, ...]], max_batch: int
) -> list[tuple[int, int, int | None]]:
    """(batch, verified tree size, draft depths or None) of the draft steps after a verify that batches up
    to max_batch can run, most likely first. A step drafts for a size its own batch may plan (depths =
    size - 1; none for the root alone). It verifies the size planned one step earlier, for a batch as large
    or larger (requests leave between steps, none join without a prefill, which plans afresh), or the root
    alone (a request without candidates). Most likely: verifying what it plans."""
    likely: list[tuple[int, int, int | None]] = []
    rest: list[tuple[int, int, int | None]] = []
    verified_from = [{1}] * (max_batch + 2)  # verified_from[bs]: sizes planned for batches >= bs, and 1
    for bs in range(max_batch, 0, -1):
        verified_from[bs] = verified_from[bs + 1].union(possible_sizes(bs))
    for bs in range(1, max_batch + 1):
        verified = verified_from[bs]
        for planned in sorted(possible_sizes(bs), reverse=True):
            depths = planned - 1 if planned > 1 else None
            likely.append((bs, planned, depths))
            rest.extend((bs, size, depths) for size in sorted(verified - {planned}, reverse=True))
    return likely + rest


def _longest_paths_on_cpu(path_nodes: torch.Tensor, accept_lens: torch.Tensor) -> torch.Tensor:
    """The path columns a block step lays out: all of them on an accelerator (one shape per tree size, no
    read), only as many as the longest path on a CPU, where the host is the device and a narrower block
    saves rows (about 30% of an isolated batch-1 draft step, SmolLM2 shapes in bf16)."""
    if accept_lens.device.type != "cpu":
        return path_nodes
    longest = int(accept_lens.numpy().max(initial=1))  # a host array: nothing to sync
    return path_nodes[:, :longest]


def _root_rows(rows: torch.Tensor, path_nodes: torch.Tensor) -> torch.Tensor:
    """The rows of `rows` (one per verified node) at each request's root, when every path is its root
    alone: all of them after a root-only step (one node per request)."""
    if rows.shape[0] == path_nodes.shape[0]:
        return rows
    return rows[path_nodes[:, 0].to(torch.int64)]


def _root_slots(runner: DraftForward, rows_d: torch.Tensor, step: VerifiedStep) -> torch.Tensor:
    """The roots' KV slots: the caller's, or looked up in the request table."""
    if step.root_slots is not None:
        return step.root_slots
    return runner.req_to_token[rows_d, step.committed].to(torch.int64)


def _host_is_the_device(runner: DraftForward, taps: torch.Tensor) -> bool:
    """Whether the draft runs on the host, op by op: no graphs (they need one shape per tree size)."""
    return taps.device.type == "cpu" and not runner.graphs.enabled


def _rows_on_device(batch: Any, rows: list[int], device: torch.device) -> torch.Tensor:
    """The batch's request-table rows on the device: SGLang's own tensor where it has one."""
    rows_d = getattr(batch, "req_pool_indices", None)
    if isinstance(rows_d, torch.Tensor) and rows_d.device == device:
        return rows_d
    return upload(torch.tensor(rows, dtype=torch.int64), device)


def _tokens_after(at: Progress, first: int, new_tokens: list[int]) -> list[int]:
    """The token after each entry from `first` on: the request's tokens at positions first + 1 up to its
    root (kept in `recent`), then the step's new tokens."""
    return [*at.recent[len(at.recent) - (at.committed - first) :], *new_tokens]


def _split_at_newest(
    first: list[int], last: list[int], next_tokens: list[int]
) -> tuple[list[int], list[int]]:
    """next_tokens grouped per request as `DraftForward.step` takes them (the token after each of entries
    first[r]..last[r]), split into the tokens after the entries before each newest one, and the token
    after each newest entry."""
    before: list[int] = []
    newest: list[int] = []
    offset = 0
    for a, b in zip(first, last, strict=True):
        before.extend(next_tokens[offset : offset + b - a])
        newest.append(next_tokens[offset + b - a])
        offset += b - a + 1
    return before, newest


def _ranges(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """The concatenation of arange(starts[r], starts[r] + counts[r]) over r (`total` elements), without a
    Python loop. Host tensors."""
    offsets = torch.cumsum(counts, 0) - counts
    within = torch.arange(total) - offsets.repeat_interleave(counts, output_size=total)
    return starts.repeat_interleave(counts, output_size=total) + within


def _name_of(fn: Callable[..., Any]) -> str:
    """A function's name, for the graph key of a piece that ends in it."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__
