"""The row layout of the draft forward after a verify, computed on the device from the verify's own
results, so that drafting needs nothing read back first and every request takes a block of the same
width (one shape per tree size: what a captured graph needs).

Request i verified a tree of `size` nodes and accepted L_i of them (its path, root first: positions
committed_i .. committed_i + L_i - 1). Its block holds W = size + 1 + d rows:

    b = 0 .. L_i          real rows: draft entries committed_i - 1 + b (the entry before the root, then one
                          per accepted token; the last one is the newest, whose next token has no slot yet)
    b = L_i + 1 .. L_i + d  the mask slots
    b > L_i + d           padding, after the masks so that causal attention keeps it out of every row
                          that is read; it writes to one junk slot and its outputs are dropped

Every row sits at position committed_i - 1 + b and at that column of the draft's request table, so the
table is written for the block's columns only (the columns before them were written by the steps before).
Entries b < L_i keep their K/V in the slot of target token committed_i + b (the draft's sequence is the
target's shifted by one, `drafting.py`); the newest entry and the masks use the request's scratch slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    width: int  # W, rows per request
    real: torch.Tensor  # [bs * W] bool: a draft entry (else a mask slot or padding)
    next_tokens: torch.Tensor  # [bs * W] int64: the token after each entry (anything elsewhere)
    positions: torch.Tensor  # [bs * W] int64, also the request-table column of each row
    residual_slots: torch.Tensor  # [bs * W] int64: the residual row of each entry's token (junk elsewhere)
    kv_slots: torch.Tensor  # [bs * W] int64: where each row's K/V is written
    head_rows: torch.Tensor  # [bs * (d + 1)] int64: the newest entry and the masks, per request


def block_layout(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    committed: torch.Tensor,
    path_nodes: torch.Tensor,
    accept_lens: torch.Tensor,
    predict: torch.Tensor,
    roots: torch.Tensor,
    masks: int,
    scratch_base: int,
    scratch_stride: int,
    junk_slot: int,
    junk_residual: int,
) -> BlockLayout:
    """rows, committed [bs]: request-table rows and committed KV lengths (the roots' positions);
    path_nodes [bs, size]: the flat verify node of each accepted token, root first (-1 past the path);
    accept_lens [bs]: path lengths; predict [bs * size]: the target's token after each node; roots [bs]:
    the tree roots' tokens. Request i's scratch slots start at scratch_base + i * scratch_stride."""
    bs, size = path_nodes.shape
    width = size + 1 + masks
    device = path_nodes.device
    b = torch.arange(width, device=device).unsqueeze(0)  # [1, W]
    lens = accept_lens.to(torch.int64).unsqueeze(1)  # [bs, 1]
    rows = rows.to(torch.int64).unsqueeze(1)
    entry = committed.to(torch.int64).unsqueeze(1) - 1 + b  # [bs, W]
    real = b <= lens
    kept = b < lens  # entries whose next token has a slot: their K/V stays
    last_column = req_to_token.shape[1] - 1

    # Entry committed - 1 is followed by the root; entry committed - 1 + b by the target's token after
    # path node b - 1 (an accepted draft, or the bonus token after the last one).
    nodes = path_nodes.to(torch.int64).clamp(min=0)
    after_node = predict.to(torch.int64)[nodes[:, (b.squeeze(0) - 1).clamp(0, size - 1)]]
    next_tokens = torch.where(b == 0, roots.to(torch.int64).unsqueeze(1), after_node)

    # Target slots of positions committed - 1 .. committed - 1 + W, one gather: an entry's token is in the
    # first of each pair of neighbours, its next token in the second.
    columns = torch.cat([entry, entry[:, -1:] + 1], dim=1).clamp(max=last_column)
    slots = req_to_token[rows, columns].to(torch.int64)
    residual_slots = torch.where(real, slots[:, :-1], junk_residual)
    next_slots = slots[:, 1:]
    scratch = scratch_base + torch.arange(bs, device=device).unsqueeze(1) * scratch_stride + (b - lens)
    kv_slots = torch.where(kept, next_slots, torch.where(b <= lens + masks, scratch, junk_slot))

    head_rows = torch.arange(bs, device=device).unsqueeze(1) * width + lens + b[:, : masks + 1]
    return BlockLayout(
        width=width,
        real=real.reshape(-1),
        next_tokens=next_tokens.reshape(-1),
        positions=entry.reshape(-1),
        residual_slots=residual_slots.reshape(-1),
        kv_slots=kv_slots.reshape(-1),
        head_rows=head_rows.reshape(-1),
    )


def path_residual_slots(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    committed: torch.Tensor,
    accept_lens: torch.Tensor,
    size: int,
    junk_residual: int,
) -> torch.Tensor:
    """[bs * size]: the residual row of the token at position committed + j of each request, for the
    accepted tokens j < accept_lens (junk past the path)."""
    j = torch.arange(size, device=accept_lens.device).unsqueeze(0)
    columns = (committed.to(torch.int64).unsqueeze(1) + j).clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[rows.to(torch.int64).unsqueeze(1), columns].to(torch.int64)
    return torch.where(j < accept_lens.to(torch.int64).unsqueeze(1), slots, junk_residual).reshape(-1)
