"""The drafter's training forward: every real position of a sequence plus d mask slots for each of a set
of anchor positions, in one pass. `block_attention_mask` states which row sees which; `block_attention`
computes that attention by parts, without the dense mask.

Serving (DartDrafter.forward) runs one anchor at a time: the real positions up to the anchor p, then d mask
slots at positions p+1..p+d that see real positions <= p and the earlier slots of their own block. Training
puts many such blocks after one copy of the real positions. Because real positions never attend to mask
slots, each block sees exactly what the serving forward would, so both produce the same logits (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang_dart.drafter.model import DartDrafter


@dataclass(frozen=True)
class BlockLogits:
    all: torch.Tensor  # [len(real_rows) + A·d, Vd]: `real`'s rows, then `masks`' (one tensor, for a loss)
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


def block_attention(
    queries: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    real_rows: torch.Tensor,
    anchors: torch.Tensor,
    draft_length: int,
    scale: float,
) -> torch.Tensor:
    """What `block_attention_mask` allows, computed by parts instead of over the dense [R, R] mask.

    queries: [m + A·d, heads, hd], the wanted real rows' queries (positions `real_rows`) then every slot's;
    k, v: [n + A·d, kv_heads, hd], every real position's then every slot's. Returns [m + A·d, heads·hd].
    Each query sees the real keys up to a limit (its own position, or its block's anchor) and a slot
    also the earlier slots of its block, so the products are queries × real keys plus one d × d product
    per block: about a third of the dense square's work, which was most of a training step's attention."""
    num_slots = anchors.shape[0] * draft_length
    m, n = queries.shape[0] - num_slots, k.shape[0] - num_slots
    heads, kv_heads, hd = queries.shape[1], k.shape[1], k.shape[2]
    group = heads // kv_heads
    # [kv_heads, group, Q, hd]: query heads grouped under the key/value head they share (GQA)
    q = queries.view(-1, kv_heads, group, hd).permute(1, 2, 0, 3)
    k_real, v_real = k[:n].permute(1, 0, 2).unsqueeze(1), v[:n].permute(1, 0, 2).unsqueeze(1)
    limits = torch.cat([real_rows, anchors.repeat_interleave(draft_length)])
    hidden = torch.arange(n, device=k.device).unsqueeze(0) > limits.unsqueeze(1)  # [Q, n]
    scores = torch.matmul(q, k_real.transpose(-1, -2)).mul(scale).masked_fill(hidden, float("-inf"))
    # real rows: the causal prefix alone
    out_real = torch.matmul(torch.softmax(scores[:, :, :m], -1), v_real)
    # slots: the prefix up to their anchor, then slots 1..j of their own block
    a, d = anchors.shape[0], draft_length
    q_slots = q[:, :, m:].reshape(kv_heads, group, a, d, hd)
    k_block = k[n:].view(a, d, kv_heads, hd).permute(2, 0, 1, 3).unsqueeze(1)  # [kv, 1, a, d, hd]
    v_block = v[n:].view(a, d, kv_heads, hd).permute(2, 0, 1, 3).unsqueeze(1)
    later = torch.ones(d, d, dtype=torch.bool, device=k.device).triu(1)
    block_scores = (
        torch.matmul(q_slots, k_block.transpose(-1, -2)).mul(scale).masked_fill(later, float("-inf"))
    )
    block_scores = block_scores.reshape(kv_heads, group, a * d, d)
    probs = torch.softmax(torch.cat([scores[:, :, m:], block_scores], -1), -1)
    out_slots = torch.matmul(probs[..., :n], v_real) + torch.matmul(
        probs[..., n:].reshape(kv_heads, group, a, d, d), v_block
    ).reshape(kv_heads, group, a * d, hd)
    out = torch.cat([out_real, out_slots], 2)  # [kv_heads, group, Q, hd]
    return out.permute(2, 0, 1, 3).reshape(queries.shape[0], heads * hd)


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
    return packed_block_logits(model, [(taps, next_tokens, anchors, real_rows)])[0]


def packed_block_logits(
    model: DartDrafter,
    sequences: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> list[BlockLogits]:
    """`block_logits` of several sequences, each (taps, next_tokens, anchors, real_rows), from one pass of
    every row-wise product (the taps' fc, the projections, the MLP and the head over all sequences' rows
    at once) and one `block_attention` per sequence, which alone mixes rows. On a GPU a sequence at a
    time left it waiting on the host between small kernels; on a CPU the products are as large either way."""
    cfg = model.cfg
    d = cfg.draft_length
    residual_real = model.fuse(torch.cat([taps for taps, _, _, _ in sequences]))
    real_in = model.real_inputs(residual_real, torch.cat([tokens for _, tokens, _, _ in sequences]))
    mask_in, mask_residual = model.mask_row(residual_real.dtype)
    attn_parts, residual_parts, position_parts, spans = [], [], [], []
    real_at = row_at = 0
    for taps, _, anchors, _ in sequences:
        n, slots = taps.shape[0], anchors.shape[0] * d
        attn_parts += [real_in[real_at : real_at + n], mask_in.expand(slots, -1)]
        residual_parts += [residual_real[real_at : real_at + n], mask_residual.expand(slots, -1)]
        slot_positions = (anchors.unsqueeze(1) + torch.arange(1, d + 1, device=taps.device)).reshape(-1)
        position_parts += [torch.arange(n, device=taps.device), slot_positions]
        spans.append((row_at, n, slots))
        real_at, row_at = real_at + n, row_at + n + slots
    attn_in = torch.cat(attn_parts)
    q, k, v = model.project_qkv(attn_in, torch.cat(position_parts))
    residual = torch.cat(residual_parts)
    rows, contexts, wanted_counts = [], [], []
    scale = 1.0 / math.sqrt(cfg.head_dim)
    for (start, n, slots), (taps, _, anchors, real_rows) in zip(spans, sequences, strict=True):
        wanted = torch.arange(n, device=taps.device) if real_rows is None else real_rows.to(taps.device)
        wanted = wanted.to(torch.int64)
        end = start + n + slots
        queries = torch.cat([q[start + wanted], q[start + n : end]])
        context = block_attention(queries, k[start:end], v[start:end], wanted, anchors, d, scale)
        contexts.append(context.to(attn_in.dtype))
        rows.append(torch.cat([start + wanted, torch.arange(start + n, end, device=taps.device)]))
        wanted_counts.append(wanted.shape[0])
    logits = model.head(residual[torch.cat(rows)], torch.cat(contexts))
    out, at = [], 0
    for (_, _, slots), (_, _, anchors, _), wanted in zip(spans, sequences, wanted_counts, strict=True):
        mine = logits[at : at + wanted + slots]
        out.append(
            BlockLogits(all=mine, real=mine[:wanted], masks=mine[wanted:].view(anchors.shape[0], d, -1))
        )
        at += wanted + slots
    return out
