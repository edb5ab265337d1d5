"""CPU implementations of the `sgl_kernel` ops that SGLang's CPU engine reaches (names and argument order
as SGLang calls them). Each is a few vectorised torch/numpy operations; shapes are small on this path."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sglang_dart.cpu.eagle_ops import assign_draft_cache_locs_contiguous_cpu, build_tree_kernel_efficient_cpu


def _segment_offsets(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For per-request ranges [start, end): the request index and the in-request column of every element.
    In numpy: a spec server runs this every decode step (SGLang's slot allocation), and a handful of
    torch ops on a 16-element tensor cost several times the numpy ones on the host."""
    first = start.numpy().astype(np.int64)
    lengths = end.numpy().astype(np.int64) - first
    rows = np.repeat(np.arange(lengths.size), lengths)
    # Element j of request r: column first[r] + (j - offset of r's run).
    cols = np.arange(rows.size) + np.repeat(first - (np.cumsum(lengths) - lengths), lengths)
    return torch.from_numpy(rows), torch.from_numpy(cols)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    _pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th consecutive slice of out_cache_loc."""
    rows, cols = _segment_offsets(start_offset, end_offset)
    if rows.numel():
        req_to_token[req_pool_indices.to(torch.int64)[rows], cols] = out_cache_loc[: rows.numel()].to(
            req_to_token.dtype
        )


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    _pool_len: int,
) -> None:
    """The inverse gather: out_cache_loc gets req_to_token[req_pool_indices[i], start[i]:end[i]], in order."""
    rows, cols = _segment_offsets(start_offset, end_offset)
    if rows.numel():
        out_cache_loc[: rows.numel()] = req_to_token[req_pool_indices.to(torch.int64)[rows], cols].to(
            out_cache_loc.dtype
        )


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every KV buffer (one base pointer and row size in bytes each), copy row src_loc[j] to tgt_loc[j].

    All source rows are read before any target row is written, so overlapping moves are safe.
    """
    src = src_loc.to(torch.int64).cpu().numpy()
    tgt = tgt_loc.to(torch.int64).cpu().numpy()
    if src.size == 0:
        return
    if src.min() < 0 or tgt.min() < 0:
        raise ValueError("copy_all_layer_kv_cache_cpu: negative KV location")
    # Rows already in place: a verify's root always is, and so is every accepted path that runs along
    # the tree's first nodes (targets are distinct, so dropping them changes no other row).
    moved = src != tgt
    if not moved.any():
        return
    src, tgt = src[moved], tgt[moved]
    rows_needed = int(max(src.max(), tgt.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        # Sound because SGLang's KV pool passes the data_ptr() and row size of buffers it owns and keeps
        # alive, each holding at least one row per KV location; the locations are pool slots (< pool size),
        # so the view of rows_needed rows stays inside the buffer.
        raw = (ctypes.c_uint8 * (rows_needed * stride)).from_address(base)
        view = np.frombuffer(raw, dtype=np.uint8).reshape(rows_needed, stride)
        view[tgt] = view[src]  # fancy indexing copies the source rows first


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Turn per-request [D, D] ancestor masks (row i marks i's ancestors and i itself, in node order, every
    ancestor before its descendants) into the traversal arrays SGLang's tree verification walks:
    positions (prefix length + depth), flat row index, first child and next sibling (-1: none)."""
    bs, d = batch_size, draft_token_num
    mask = tree_mask.reshape(-1)[: bs * d * d].reshape(bs, d, d).to(torch.bool)
    idx = torch.arange(d)
    earlier = idx.unsqueeze(0) < idx.unsqueeze(1)  # [i, j]: j < i
    ancestors = mask & earlier
    depth = ancestors.sum(dim=2)
    none = torch.full((bs, d), -1, dtype=torch.int64)
    # Nearest ancestor = the parent: the largest marked j < i.
    parent = torch.where(ancestors.any(dim=2), torch.where(ancestors, idx, -1).amax(dim=2), none)
    # First child: the smallest k > i whose row marks i.
    later_marks = mask.transpose(1, 2) & earlier.T  # [b, i, k]: k > i and i is an ancestor of k
    first_child = torch.where(later_marks.any(dim=2), torch.where(later_marks, idx, d).amin(dim=2), none)
    # Next sibling: the smallest k > i with the same (existing) parent.
    same_parent = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent.unsqueeze(2) >= 0) & earlier.T
    sibling = torch.where(same_parent.any(dim=2), torch.where(same_parent, idx, d).amin(dim=2), none)

    n = bs * d
    positions.view(-1)[:n] = (
        (verified_seq_len[:bs].to(torch.int64).unsqueeze(1) + depth).reshape(-1).to(positions.dtype)
    )
    retrive_index.view(-1)[:n] = torch.arange(n, dtype=retrive_index.dtype)
    retrive_next_token.view(-1)[:n] = first_child.reshape(-1).to(retrive_next_token.dtype)
    retrive_next_sibling.view(-1)[:n] = sibling.reshape(-1).to(retrive_next_sibling.dtype)


def walk_trees(
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    bs: int,
    max_path: int,
    choose: Callable[[list[int]], list[int]],
) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """Greedy tree acceptance for the first `bs` requests, depth by depth: from the root, descend to the
    child whose draft token equals the target's choice at the current node; stop when no child matches or
    the depth budget (max_path - 1 drafts) is used up. `choose(rows)` gives the target's token at each of
    the given logits rows (retrive_index values), all walking requests' rows of a depth in one call.
    Returns host lists: each request's path of flat indices (-1 padded to max_path), its accepted draft
    count, and every row whose choice was read with that choice (the path's and the bonus node's). The walk
    runs on host lists: a tensor store per node costs more than the whole walk."""
    cand = candidates.tolist()
    index = retrive_index.tolist()
    first_child = retrive_next_token.tolist()
    next_sibling = retrive_next_sibling.tolist()
    paths = [[-1] * max_path for _ in range(bs)]
    node = [0] * bs
    accepted = [0] * bs
    for b in range(bs):
        paths[b][0] = index[b][0]
    rows_seen: list[int] = []
    tokens_seen: list[int] = []
    walking = list(range(bs))
    while walking:
        rows = [paths[b][accepted[b]] for b in walking]
        tokens = choose(rows)
        rows_seen += rows
        tokens_seen += tokens
        still = []
        for b, token in zip(walking, tokens, strict=True):
            if accepted[b] + 1 >= max_path:  # the depth budget is spent: `token` is the bonus
                continue
            child = first_child[b][node[b]]
            while child != -1 and cand[b][child] != token:
                child = next_sibling[b][child]
            if child == -1:
                continue
            accepted[b] += 1
            node[b] = child
            paths[b][accepted[b]] = index[b][child]
            still.append(b)
        walking = still
    return paths, accepted, rows_seen, tokens_seen


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree acceptance (`walk_trees`) on the target's argmax at every node, target_predict. Writes,
    per request, the flat indices of the accepted path into accept_index, the number of accepted drafts
    into accept_token_num, and into predicts (flat) the target token at every node of the path, the bonus
    token at its end included."""
    bs, max_path = accept_index.shape
    target = target_predict.reshape(-1).tolist()
    paths, counts, rows, tokens = walk_trees(
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        bs,
        max_path,
        lambda rows: [target[row] for row in rows],
    )
    accept_index.copy_(torch.tensor(paths, dtype=accept_index.dtype).view(bs, max_path))
    accept_token_num[:bs] = torch.tensor(counts, dtype=accept_token_num.dtype)
    predicts.view(-1)[torch.tensor(rows, dtype=torch.int64)] = torch.tensor(tokens, dtype=predicts.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """Compact: the KV slots of the accepted draft nodes (accept_index entries other than -1), in order."""
    flat = accept_index.reshape(-1).to(torch.int64)
    chosen = flat[flat != -1]
    accept_out_cache_loc[: chosen.numel()] = out_cache_loc[chosen].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """bonus_tokens[i] = the last accepted token of request i (accept_lens counts the bonus token)."""
    bs = accept_lens.numel()
    at = torch.arange(bs, dtype=torch.int64) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[at].to(bonus_tokens.dtype)


PROVIDED_OPS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn
    for fn in (
        assign_draft_cache_locs_contiguous_cpu,  # EAGLE's ops (eagle_ops.py)
        build_tree_kernel_efficient_cpu,
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        copy_all_layer_kv_cache_cpu,
        reconstruct_indices_from_tree_mask,
        verify_tree_greedy_cpu,
        fill_accept_out_cache_loc_cpu,
        fill_bonus_tokens_cpu,
    )
}
