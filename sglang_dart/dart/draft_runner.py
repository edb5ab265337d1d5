"""The DART draft layer run for a whole batch over SGLang's KV slots.

The draft keeps, per target KV slot, two things (buffers sized like the target pool, so slot lifetimes,
radix-cache sharing and freeing all follow the target's own bookkeeping):
- the fused residual fc(taps) of the token in that slot (it depends on the prefix up to that token only);
- the draft K/V of draft entry t, which pairs token t's residual with the embedding of token t+1, stored in
  the slot of token t+1: it depends on tokens 0..t+1 only, so a shared radix prefix shares it correctly.
The entry of the newest token (whose next token has no slot yet) is never stored; each step recomputes it
from the stored residual. Mask slots are never stored.

An entry's K/V is a function of its own residual and next token only (one layer: keys and values come from
the layer input), so a step that drafts nothing still stores its entries cheaply (`store_entries`) and a
later draft finds every entry of the prefix in place.

Device contract: the buffers live on the drafter's device. Row layouts are computed on the host from the
callers' Python lists and uploaded (non-blocking where the memory allows); nothing is read back from the
device (tests/unit/test_draft_runner.py runs the runner on the meta device, where any read raises).
"""

from __future__ import annotations

import math

import torch

from sglang_dart.attention.tree_attention import attend, make_plan, upload
from sglang_dart.drafter import DartDrafter


class DraftRunner:
    def __init__(self, drafter: DartDrafter, req_to_token: torch.Tensor, num_slots: int) -> None:
        cfg = drafter.cfg
        dtype, device = drafter.fc.weight.dtype, drafter.fc.weight.device
        self.drafter = drafter
        self.device = device
        self.req_to_token = req_to_token
        self.residual = torch.zeros(num_slots, cfg.hidden_size, dtype=dtype, device=device)
        self.keys = torch.zeros(num_slots, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.num_masks = cfg.draft_length

    @torch.no_grad()
    def store_residuals(self, slots: torch.Tensor, aux_hidden: torch.Tensor) -> None:
        """Fuse the target taps of freshly computed tokens into their slots."""
        if slots.numel():
            self.residual[slots] = self.drafter.fuse(aux_hidden.to(self.residual.dtype))

    def slots_of(self, rows: list[int], first: list[int], last: list[int]) -> torch.Tensor:
        """Token slots of positions first[r]..last[r] of each request r (req_to_token row rows[r]), grouped
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
        _, k, v = self.drafter.project_qkv(self.drafter.real_inputs(residual, tokens_d), positions_d)
        slots = self.slots_of(rows, [a + 1 for a in first], last)  # entry t lives in the slot of t + 1
        self.keys[slots] = k
        self.values[slots] = v

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
        real_counts = torch.tensor(real_list, dtype=torch.int64)
        counts = real_counts + d  # flat row layout: request r owns [real rows | d mask rows]
        starts = torch.cumsum(counts, 0) - counts
        first_t = torch.tensor(first, dtype=torch.int64)
        heads = (starts + real_counts - 1).unsqueeze(1) + torch.arange(d + 1).unsqueeze(0)
        num_stored = num_real - bs
        stored = _ranges(starts, real_counts - 1, num_stored)  # every real entry but the newest has its slot
        layout = upload(
            torch.cat(
                [
                    torch.tensor(next_tokens, dtype=torch.int64),
                    _ranges(starts, real_counts, num_real),
                    _ranges(first_t, counts, total),
                    heads.reshape(-1),
                    stored,
                ]
            ),
            self.device,
        )
        tokens_d, real_rows, positions, head_rows, stored_rows = layout.split(
            [len(next_tokens), num_real, total, bs * (d + 1), num_stored]
        )

        residual_real = self.residual[self.slots_of(rows, first, last)]
        real_in = drafter.real_inputs(residual_real, tokens_d)
        mask_in, mask_residual = drafter.mask_row(residual_real.dtype)
        attn_in = mask_in.expand(total, -1).clone()
        residual = mask_residual.expand(total, -1).clone()
        attn_in[real_rows] = real_in
        residual[real_rows] = residual_real

        q, k, v = drafter.project_qkv(attn_in, positions)
        rpi = torch.tensor(rows, dtype=torch.int64)
        plan = make_plan(self.req_to_token[:, 1:], rpi, first_t, counts)  # entry t lives in slot of t+1
        context = attend(
            plan, q, k, v, self.keys, self.values, scaling=1.0 / math.sqrt(drafter.cfg.head_dim)
        ).reshape(total, -1)
        if num_stored:
            slots = self.slots_of(rows, [a + 1 for a in first], last)
            self.keys[slots] = k[stored_rows]
            self.values[slots] = v[stored_rows]
        logits = drafter.head(residual[head_rows], context[head_rows])
        return logits.view(bs, d + 1, -1)


def _ranges(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """The concatenation of arange(starts[r], starts[r] + counts[r]) over r (`total` elements), without a
    Python loop. Host tensors."""
    offsets = torch.cumsum(counts, 0) - counts
    within = torch.arange(total) - offsets.repeat_interleave(counts, output_size=total)
    return starts.repeat_interleave(counts, output_size=total) + within
