"""The drafter's training forward: every real position of a sequence plus d mask slots for each of a set
of anchor positions, in one pass with a block mask.

Serving (DartDrafter.forward) runs one anchor at a time: the real positions up to the anchor p, then d mask
slots at positions p+1..p+d that see real positions <= p and the earlier slots of their own block. Training
puts many such blocks after one copy of the real positions. Because real positions never attend to mask
slots, each block sees exactly what the serving forward would, so both produce the same logits (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sglang_dart.drafter.model import DartDrafter


@dataclass(frozen=True)
class BlockLogits:
    real: torch.Tensor  # [n or len(real_rows), Vd]: row 0 of the anchor at each wanted real position
    masks: torch.Tensor  # [A, d, Vd]: rows 1..d of each anchor's block


def block_attention_mask(num_real: int, anchors: torch.Tensor, draft_length: int) -> torch.Tensor:
    """Boolean [R, R] (True = may attend) over R = num_real + A * d rows: real rows causal among
    themselves; slot j of anchor p sees real rows <= p and slots 1..j of its own block."""
    device = anchors.device
    num_anchors, d = anchors.shape[0], draft_length
    rows = num_real + num_anchors * d
    allowed = torch.zeros(rows, rows, dtype=torch.bool, device=device)
    real = torch.arange(num_real, device=device)
    allowed[:num_real, :num_real] = real.unsqueeze(0) <= real.unsqueeze(1)
    slot_anchor = anchors.repeat_interleave(d)  # [A*d]
    allowed[num_real:, :num_real] = real.unsqueeze(0) <= slot_anchor.unsqueeze(1)
    block = torch.arange(num_anchors, device=device).repeat_interleave(d)
    slot = torch.arange(d, device=device).repeat(num_anchors)
    same_block = block.unsqueeze(0) == block.unsqueeze(1)
    allowed[num_real:, num_real:] = same_block & (slot.unsqueeze(0) <= slot.unsqueeze(1))
    return allowed


def block_logits(
    model: DartDrafter,
    taps: torch.Tensor,
    next_tokens: torch.Tensor,
    anchors: torch.Tensor,
    real_rows: torch.Tensor | None = None,
) -> BlockLogits:
    """taps: [n, 3·H_target] target taps of real positions 0..n-1; next_tokens: [n] the token after each;
    anchors: [A] real positions that each get a block of d mask slots; real_rows: the real positions
    whose row-0 logits are wanted (`BlockLogits.real` in that order), None for all of them.

    Every real position still enters attention as a key, but only the wanted ones (and the mask slots)
    go on as queries through the MLP and the head: a prompt's positions, which training never
    supervises, cost the head's products for nothing (about a third of a sequence's real rows)."""
    cfg = model.cfg
    n, d, num_anchors = taps.shape[0], cfg.draft_length, anchors.shape[0]
    residual_real = model.fuse(taps)
    mask_in, mask_residual = model.mask_row(residual_real.dtype)
    attn_in = torch.cat([model.real_inputs(residual_real, next_tokens), mask_in.expand(num_anchors * d, -1)])
    residual = torch.cat([residual_real, mask_residual.expand(num_anchors * d, -1)])
    slot_positions = (anchors.unsqueeze(1) + torch.arange(1, d + 1, device=taps.device)).reshape(-1)
    positions = torch.cat([torch.arange(n, device=taps.device), slot_positions])
    q, k, v = model.project_qkv(attn_in, positions)
    allowed = block_attention_mask(n, anchors, d)
    if real_rows is not None:
        slots = torch.arange(n, attn_in.shape[0], device=taps.device)
        queries = torch.cat([real_rows.to(device=taps.device, dtype=torch.int64), slots])
        q, allowed, residual = q[queries], allowed[queries], residual[queries]
    context = nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=allowed,
        scale=1.0 / math.sqrt(cfg.head_dim),
        enable_gqa=cfg.num_attention_heads != cfg.num_key_value_heads,
    )
    context = context.transpose(0, 1).reshape(q.shape[0], -1).to(attn_in.dtype)
    logits = model.head(residual, context)
    wanted = n if real_rows is None else real_rows.shape[0]
    return BlockLogits(real=logits[:wanted], masks=logits[wanted:].view(num_anchors, d, -1))
