"""The batched CUDA verify mask (sglang_dart/dart/verify_mask.py), checked against a block-by-block
construction and against how the CPU attention reads the same layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_dart.attention.tree_attention import make_plan
from sglang_dart.dart.verify_mask import full_verify_mask, verify_inputs


def _random_trees(bs: int, size: int, seed: int) -> np.ndarray:
    """Ancestor masks of random trees: node 0 is the root, node i's parent is any earlier node."""
    rng = np.random.default_rng(seed)
    masks = np.zeros((bs, size, size), dtype=bool)
    for r in range(bs):
        for i in range(size):
            masks[r, i, i] = True
            if i:
                masks[r, i] |= masks[r, rng.integers(0, i)]
    return masks


def _block_by_block(trees: np.ndarray, prefix_lens: list[int]) -> torch.Tensor:
    blocks = []
    for tree, prefix in zip(trees, prefix_lens, strict=True):
        size = tree.shape[0]
        block = np.concatenate([np.ones((size, prefix), dtype=bool), tree], axis=1)
        blocks.append(torch.from_numpy(block).flatten())
    return torch.cat(blocks)


@pytest.mark.parametrize(
    ("prefix_lens", "size"),
    [([5], 1), ([5], 8), ([3, 17, 1, 40], 8), ([0, 9], 4), ([12] * 16, 6), ([2, 300, 7], 16)],
)
def test_equals_the_block_by_block_layout(prefix_lens, size):
    trees = _random_trees(len(prefix_lens), size, seed=size + len(prefix_lens))
    got = full_verify_mask(trees, torch.tensor(prefix_lens, dtype=torch.int32), "cpu")
    want = _block_by_block(trees, prefix_lens)
    assert got.dtype == torch.bool and torch.equal(got, want)


def test_the_attention_reads_the_tree_back():
    """make_plan takes both layouts (full GPU rows, or the tree part alone): the masks it derives agree."""
    prefix_lens, size = [4, 11, 2], 5
    trees = _random_trees(len(prefix_lens), size, seed=3)
    req_to_token = torch.arange(3 * 32, dtype=torch.int32).view(3, 32)
    rpi = torch.tensor([2, 0, 1])
    query_lens = torch.full((3,), size)
    full = full_verify_mask(trees, torch.tensor(prefix_lens), "cpu")
    from_full = make_plan(req_to_token, rpi, torch.tensor(prefix_lens), query_lens, full)
    from_tree = make_plan(req_to_token, rpi, torch.tensor(prefix_lens), query_lens, torch.from_numpy(trees))
    assert torch.equal(from_full.mask, from_tree.mask)
    # A node sees its ancestors only, never a sibling branch.
    assert not bool(from_full.mask.all())


@pytest.mark.parametrize("size", [1, 5, 8, 9, 16, 61])
@pytest.mark.parametrize("full", [False, True])
def test_one_buffer_carries_links_and_masks(size, full):
    """pack / unpack: the links and the tree masks come back as they went, for tree sizes that do and do
    not fill whole 8-byte words; with prefix lengths, the mask comes back in the flat CUDA layout."""
    prefix_lens = [3, 40, 0]
    trees = _random_trees(len(prefix_lens), size, seed=size)
    links = np.random.default_rng(size).integers(-1, 50_000, size=(5, len(prefix_lens), size))
    prefix = np.asarray(prefix_lens) if full else None
    got = verify_inputs(links, trees, prefix, "cpu")
    assert torch.equal(got.links, torch.from_numpy(links))
    want = _block_by_block(trees, prefix_lens) if full else torch.from_numpy(trees).reshape(-1)
    assert got.custom_mask.dtype == torch.bool and torch.equal(got.custom_mask, want)


def test_the_device_side_needs_nothing_from_the_host_but_the_one_buffer(monkeypatch):
    """Everything after the upload is derived on the device: with the buffer 'uploaded' to the meta
    device, any host tensor mixed in would raise."""
    import sglang_dart.dart.verify_mask as verify_mask

    uploads = []

    def to_meta(host: torch.Tensor, device: object) -> torch.Tensor:
        uploads.append(host.numel())
        return host.to("meta")

    monkeypatch.setattr(verify_mask, "upload", to_meta)
    trees = _random_trees(4, 8, seed=1)
    got = verify_inputs(np.zeros((5, 4, 8), dtype=np.int64), trees, np.array([5, 6, 7, 8]), "meta")
    assert len(uploads) == 1
    assert got.links.device.type == "meta" and got.custom_mask.device.type == "meta"
    assert got.custom_mask.shape == (8 * (5 + 6 + 7 + 8 + 4 * 8),)
