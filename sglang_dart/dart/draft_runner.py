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
"""

from __future__ import annotations

import math

import torch

from sglang_dart.attention.tree_attention import attend, make_plan
from sglang_dart.drafter import DartDrafter


class DraftRunner:
    def __init__(self, drafter: DartDrafter, req_to_token: torch.Tensor, num_slots: int) -> None:
        cfg = drafter.cfg
        dtype, device = drafter.fc.weight.dtype, drafter.fc.weight.device
        self.drafter = drafter
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

    def _entry_slots(self, rpi: torch.Tensor, first: list[int], last: list[int]) -> torch.Tensor:
        """Token slots of positions first[r]..last[r] of each request r, grouped per request (one gather)."""
        counts = torch.tensor([b - a + 1 for a, b in zip(first, last, strict=True)], dtype=torch.int64)
        rows = rpi.cpu().to(torch.int64).repeat_interleave(counts)
        cols = _ranges(torch.tensor(first, dtype=torch.int64), counts)
        device = self.req_to_token.device
        return self.req_to_token[rows.to(device), cols.to(device)].to(torch.int64)

    @torch.no_grad()
    def store_entries(
        self, req_pool_indices: torch.Tensor, first: list[int], last: list[int], next_tokens: torch.Tensor
    ) -> None:
        """Store the K/V of entries first[r]..last[r]-1 of each request, as `step` would, with no attention,
        head or mask slots (next_tokens as for `step`: grouped per request, the token after each entry)."""
        counts = torch.tensor([b - a + 1 for a, b in zip(first, last, strict=True)], dtype=torch.int64)
        keep = torch.ones(int(counts.sum()), dtype=torch.bool)
        keep[torch.cumsum(counts, 0) - 1] = False  # the newest entry of each request has no slot yet
        if not bool(keep.any()):
            return
        device = self.residual.device
        residual = self.residual[self._entry_slots(req_pool_indices, first, last)[keep.to(device)]]
        positions = _ranges(torch.tensor(first, dtype=torch.int64), counts)[keep]
        attn_in = self.drafter.real_inputs(residual, next_tokens.to(torch.int64)[keep].to(device))
        _, k, v = self.drafter.project_qkv(attn_in, positions.to(device))
        slots = self._entry_slots(req_pool_indices, [a + 1 for a in first], last)  # entry t: slot of t+1
        self.keys[slots] = k
        self.values[slots] = v

    @torch.no_grad()
    def step(
        self,
        req_pool_indices: torch.Tensor,
        first: list[int],
        last: list[int],
        next_tokens: torch.Tensor,
        depths: int | None = None,
    ) -> torch.Tensor:
        """Draft entries first[r]..last[r] of each request r (their tokens must have stored residuals;
        next_tokens holds, grouped per request, the token after each), then the mask slots.
        Stores the K/V of every entry but the last one, returns logits [bs, D, draft_vocab]: D = d + 1,
        or the first `depths` of those rows (mask slots attend causally, so a later slot never changes an
        earlier row: the slots beyond them are not computed at all)."""
        drafter, d = self.drafter, self.num_masks
        if depths is not None:
            d = max(0, min(d, depths - 1))
        bs = len(first)
        rpi = req_pool_indices.to(torch.int64)
        real_counts = torch.tensor([b - a + 1 for a, b in zip(first, last, strict=True)], dtype=torch.int64)
        residual_real = self.residual[self._entry_slots(rpi, first, last)]
        real_in = drafter.real_inputs(residual_real, next_tokens.to(torch.int64))
        mask_in, mask_residual = drafter.mask_row(residual_real.dtype)

        # Flat row layout: request r owns [real rows | d mask rows].
        counts = real_counts + d
        starts = torch.cumsum(counts, 0) - counts
        real_pos = _ranges(starts, real_counts)
        total = int(counts.sum())
        attn_in = mask_in.expand(total, -1).clone()
        residual = mask_residual.expand(total, -1).clone()
        attn_in[real_pos] = real_in
        residual[real_pos] = residual_real
        first_t = torch.tensor(first, dtype=torch.int64)
        positions = _ranges(first_t, counts)

        q, k, v = drafter.project_qkv(attn_in, positions.to(attn_in.device))
        plan = make_plan(self.req_to_token[:, 1:], rpi, first_t, counts)  # entry t lives in slot of t+1
        context = attend(
            plan, q, k, v, self.keys, self.values, scaling=1.0 / math.sqrt(drafter.cfg.head_dim)
        ).reshape(total, -1)

        # Every real entry but the newest of each request has its slot (that of the token after it).
        stored_rows = _ranges(starts, real_counts - 1)
        if stored_rows.numel():
            slots = self._entry_slots(rpi, [a + 1 for a in first], last)
            self.keys[slots] = k[stored_rows]
            self.values[slots] = v[stored_rows]

        heads = (starts + real_counts - 1).unsqueeze(1) + torch.arange(d + 1).unsqueeze(0)
        heads = heads.reshape(-1)
        logits = drafter.head(residual[heads], context[heads])
        return logits.view(bs, d + 1, -1)


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(starts[r], starts[r] + counts[r]) over r, without a Python loop."""
    offsets = torch.cumsum(counts, 0) - counts
    within = torch.arange(int(counts.sum())) - offsets.repeat_interleave(counts)
    return starts.repeat_interleave(counts) + within
