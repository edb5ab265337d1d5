"""The verify step's host-built inputs in ONE upload, and the flat verify mask FlashInfer/Triton read on
CUDA (NGRAM's layout: for each request in turn a row-major [size, prefix + size] block, prefix columns all
visible, then the request's own [size, size] tree mask).

Everything the trees give the device (tokens, depths, the tree walk's links, the tree masks and, for the
CUDA layout, where each mask entry goes in the flat mask) travels in one int64 buffer, through pinned
memory on CUDA (`upload`). A copy from pageable memory would wait for the device to finish the work queued
before it, a host sync in the middle of the step. The flat mask is then one fill and one scatter, for the
whole batch: SGLang's NGRAM worker loops per request, two copies and a concatenation each."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from sglang_dart.attention.tree_attention import upload

_WORD = 8  # bytes per int64: the masks travel as bytes packed into whole words


class VerifyInputs(NamedTuple):
    """The verify's inputs on the device: `links` [5, bs, size] int64 (tokens, depths, retrieve index,
    first child, next sibling) and the custom mask (the flat CUDA layout, or the [bs * size * size] tree
    masks where the attention reads them as they are)."""

    links: torch.Tensor
    custom_mask: torch.Tensor


def full_mask_positions(prefix_lens: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """Where entry [i, r, c] of the tree masks goes in the flat CUDA mask ([bs * size * size] int64), and
    the flat mask's length. prefix_lens: [bs] committed KV lengths."""
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    bs = prefix.shape[0]
    row_len = prefix + size
    block = size * row_len
    starts = np.cumsum(block) - block
    rows = np.arange(size, dtype=np.int64)
    # Column c of tree row r of request i sits at starts[i] + r * row_len[i] + prefix[i] + c.
    at = (
        (starts + prefix).reshape(bs, 1, 1)
        + rows.reshape(1, size, 1) * row_len.reshape(bs, 1, 1)
        + rows.reshape(1, 1, size)
    )
    return at.reshape(-1), int(block.sum())


def _mask_row_bytes(size: int) -> int:
    """Bytes a tree-mask row takes in the buffer: `size`, padded to whole words."""
    return -(-size // _WORD) * _WORD


def pack(
    links: np.ndarray, tree_masks: np.ndarray, prefix_lens: np.ndarray | None
) -> tuple[np.ndarray, int | None]:
    """One flat int64 buffer: links [5, bs, size], the tree masks [bs, size, size] as bytes (each row padded
    to whole words), and with prefix_lens (the CUDA layout) the flat mask positions; and the flat mask's
    length (None without prefix_lens)."""
    bs, size, _ = tree_masks.shape
    mask_bytes = np.zeros((bs, size, _mask_row_bytes(size)), dtype=np.uint8)
    mask_bytes[:, :, :size] = tree_masks
    pieces = [np.ascontiguousarray(links, dtype=np.int64).reshape(-1), mask_bytes.view(np.int64).reshape(-1)]
    full_length = None
    if prefix_lens is not None:
        positions, full_length = full_mask_positions(prefix_lens, size)
        pieces.append(positions)
    return np.concatenate(pieces), full_length


def unpack(flat: torch.Tensor, bs: int, size: int, full_length: int | None) -> VerifyInputs:
    """The device views of `pack`'s buffer (uploaded as `flat`); full_length: the flat CUDA mask's length,
    or None for the tree masks alone."""
    width = _mask_row_bytes(size)
    n_links = 5 * bs * size
    n_mask = bs * size * width // _WORD
    links = flat[:n_links].view(5, bs, size)
    tree = flat[n_links : n_links + n_mask].view(torch.uint8).view(bs, size, width)[:, :, :size].bool()
    if full_length is None:
        return VerifyInputs(links, tree.reshape(-1))
    positions = flat[n_links + n_mask :]
    mask = torch.ones(full_length, dtype=torch.bool, device=flat.device)
    mask[positions] = tree.reshape(-1)
    return VerifyInputs(links, mask)


def verify_inputs(
    links: np.ndarray,
    tree_masks: np.ndarray,
    prefix_lens: np.ndarray | None,
    device: torch.device | str,
) -> VerifyInputs:
    """`pack`, one upload, `unpack`. prefix_lens (on the host) asks for the flat CUDA mask."""
    bs, size, _ = tree_masks.shape
    host, full_length = pack(links, tree_masks, prefix_lens)
    return unpack(upload(torch.from_numpy(host), device), bs, size, full_length)


def full_verify_mask(
    tree_masks: np.ndarray, prefix_lens: np.ndarray, device: torch.device | str
) -> torch.Tensor:
    """The flat CUDA mask alone (tree_masks [bs, size, size] bool, prefix_lens [bs]), on `device`."""
    bs, size, _ = tree_masks.shape
    links = np.zeros((5, bs, size), dtype=np.int64)
    return verify_inputs(links, tree_masks, prefix_lens, device).custom_mask
