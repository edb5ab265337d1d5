"""Draft trees as ancestor masks, for attention and tree-walk tests and benchmarks."""

from __future__ import annotations

import random

import torch


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n]: row i marks node i and its ancestors; `parents[i]` is i's parent, -1 for the root."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        node = i
        while node != -1:
            mask[i, node] = True
            node = parents[node]
    return mask


def random_tree_mask(rng: random.Random, n: int) -> torch.Tensor:
    """[n, n] ancestor mask of a random tree: node 0 is the root, parents precede children."""
    return ancestor_mask([-1] + [rng.randrange(i) for i in range(1, n)])
