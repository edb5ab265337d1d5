"""The flat verify mask FlashInfer/Triton read on CUDA (NGRAM's layout): for each request in turn a row-major
[size, prefix + size] block, prefix columns all visible, then the request's own [size, size] tree mask.

Built with one scatter for the whole batch: a per-request loop costs two small host-to-device copies and a
concatenation per request, which grows with the batch (SGLang's NGRAM worker notes the same overhead)."""

from __future__ import annotations

import numpy as np
import torch


def full_verify_mask(
    tree_masks: np.ndarray, prefix_lens: torch.Tensor, device: torch.device | str
) -> torch.Tensor:
    """tree_masks: [bs, size, size] bool (node i may see node j); prefix_lens: [bs] committed KV lengths
    (on the host). Returns the flat bool mask on `device`."""
    bs, size, _ = tree_masks.shape
    prefix = prefix_lens.to(torch.int64).cpu()
    row_len = prefix + size
    block = size * row_len
    starts = torch.cumsum(block, 0) - block
    rows = torch.arange(size, dtype=torch.int64)
    # Column c of tree row r of request i sits at starts[i] + r * row_len[i] + prefix[i] + c.
    tree_at = (
        (starts + prefix).view(bs, 1, 1)
        + rows.view(1, size, 1) * row_len.view(bs, 1, 1)
        + rows.view(1, 1, size)
    )
    flat = torch.ones(int(block.sum()), dtype=torch.bool, device=device)
    tree = torch.from_numpy(np.ascontiguousarray(tree_masks, dtype=bool)).to(device, non_blocking=True)
    flat[tree_at.reshape(-1).to(device, non_blocking=True)] = tree.reshape(-1)
    return flat
