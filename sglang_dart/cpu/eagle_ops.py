"""CPU versions of the two `sgl_kernel` ops SGLang's EAGLE workers call on a CPU-only machine
(`build_tree_kernel_efficient_cpu` in speculative/eagle_utils.py, `assign_draft_cache_locs_contiguous_cpu`
in speculative/eagle_worker_common.py), vectorised over requests and tree nodes in torch. Argument order
and outputs are those of SGLang's call sites and its triton kernels (kernels/ops/speculative/)."""

from __future__ import annotations

import torch

# speculative/eagle_utils.py TreeMaskMode
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    _pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """out_cache_loc[b * n : (b + 1) * n] = req_to_token[req_pool_indices[b], seq_lens[b] : seq_lens[b] + n],
    n = topk * num_steps: the slots the scheduler reserved after each request's committed tokens."""
    bs = seq_lens.numel()
    n = topk * num_steps
    if bs == 0 or n == 0:
        return
    cols = seq_lens.to(torch.int64).unsqueeze(1) + torch.arange(n, dtype=torch.int64)
    rows = req_pool_indices.to(torch.int64).unsqueeze(1)
    out_cache_loc[: bs * n] = req_to_token[rows, cols].reshape(-1).to(out_cache_loc.dtype)


def _tree_parents(parent_list: torch.Tensor, selected: torch.Tensor, topk: int) -> torch.Tensor:
    """[bs, D] tree position of each node's parent: 0 for the root's children, -1 where the parent is not
    among the selected nodes (and for the root itself)."""
    bs, d_minus_1 = selected.shape
    parent_score = torch.div(selected, topk, rounding_mode="floor")  # [bs, D-1] index into parent_list
    from_root = parent_score == 0
    if parent_list.shape[1] > 0:
        wanted = parent_list.gather(1, parent_score.clamp(0, parent_list.shape[1] - 1))  # [bs, D-1]
    else:
        wanted = torch.full_like(parent_score, -1)
    hits = selected.unsqueeze(1) == wanted.unsqueeze(2)  # [bs, node, pp]
    found = hits.any(dim=2)
    first = hits.to(torch.int8).argmax(dim=2) + 1  # tree position of the first selected match
    parent = torch.where(from_root, 0, torch.where(found, first, -1))
    return torch.cat([torch.full((bs, 1), -1, dtype=parent.dtype), parent], dim=1)


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int = FULL_MASK,
) -> None:
    """The draft tree of every request: node 0 is the root (the bonus token), node i >= 1 the drafted
    token selected_index[b, i - 1]. Writes the ancestor mask (each node sees the root, itself and its
    ancestors, following at most `depth` links), positions (prefix length + depth), flat retrieve
    indices, first child and next sibling (children in increasing node order; -1: none). The retrieve
    links must arrive filled with -1, as SGLang allocates them."""
    mode = int(tree_mask_mode)
    if mode == QLEN_ONLY_BITPACKING:
        raise NotImplementedError("build_tree_kernel_efficient_cpu: bit-packed tree masks are not supported")
    bs, d = verified_seq_len.numel(), draft_token_num
    if bs == 0:
        return
    selected = selected_index.to(torch.int64).reshape(bs, -1)[:, : d - 1]
    parent = _tree_parents(parent_list.to(torch.int64).reshape(bs, -1), selected, topk)  # [bs, D]
    nodes = torch.arange(d)

    # Ancestors: walk up from every node at once, `depth` links at most (the triton kernel's bound).
    ancestor = torch.zeros(bs, d, d, dtype=torch.bool)
    ancestor[:, :, 0] = True
    depth_of = torch.zeros(bs, d, dtype=torch.int64)
    cur = nodes.expand(bs, d).clone()
    batch_idx = torch.arange(bs).unsqueeze(1).expand(bs, d)
    for _ in range(depth):
        active = cur > 0
        if not bool(active.any()):
            break
        ancestor[batch_idx[active], nodes.expand(bs, d)[active], cur[active]] = True
        depth_of += active.to(torch.int64)
        cur = torch.where(active, parent.gather(1, cur.clamp(min=0)), cur)
    # A parent of 0 (the root) or -1 (not found) ends a walk: the root is marked already.

    seq_lens = verified_seq_len.to(torch.int64)
    positions.view(-1)[: bs * d] = (seq_lens.unsqueeze(1) + depth_of).reshape(-1).to(positions.dtype)

    # Links: first child = the smallest child, next sibling = the next larger child of the same parent.
    is_child = (parent.unsqueeze(1) == nodes.view(1, d, 1)) & (nodes.view(1, 1, d) > 0)  # [b, p, i]
    none = torch.full((bs, d), -1, dtype=torch.int64)
    first_child = torch.where(is_child.any(2), torch.where(is_child, nodes, d).amin(2), none)
    later = nodes.view(1, d, 1) < nodes.view(1, 1, d)  # [i, j]: j > i
    same_parent = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent.unsqueeze(2) >= 0) & later
    sibling = torch.where(same_parent.any(2), torch.where(same_parent, nodes, d).amin(2), none)
    sibling[:, 0] = -1
    flat = (torch.arange(bs).unsqueeze(1) * d + nodes).to(retrieve_index.dtype)
    retrieve_index.view(bs, -1)[:, :d] = flat
    retrieve_next_token.view(bs, -1)[:, :d] = first_child.to(retrieve_next_token.dtype)
    retrieve_next_sibling.view(bs, -1)[:, :d] = sibling.to(retrieve_next_sibling.dtype)

    block = ancestor.to(tree_mask.dtype)
    if mode == QLEN_ONLY:
        tree_mask.view(-1)[: bs * d * d] = block.reshape(-1)
        return
    # FULL_MASK: per request a [D, seq_len + D] block; the prefix columns keep what the caller filled.
    row_len = seq_lens + d
    start = torch.cumsum(d * row_len, 0) - d * row_len
    cols = start.view(bs, 1, 1) + nodes.view(1, d, 1) * row_len.view(bs, 1, 1) + seq_lens.view(bs, 1, 1)
    tree_mask.view(-1)[(cols + nodes.view(1, 1, d)).reshape(-1)] = block.reshape(-1)
