"""Draft-decode attention for SGLang's EAGLE worker on the CPU engine: the CPU counterpart of the GPU
backends' `...MultiStepDraftBackend` (one backend per draft step, planned together).

At draft step s (0-based) the drafted token of branch t of request b attends to the request's committed
prefix req_to_token[pool, :seq_len] and to its branch's own draft slots
req_to_token[pool, seq_len + t * num_steps + 0..s], the layout SGLang's EAGLE worker reserves and its
triton `generate_draft_decode_kv_indices` reads (page size 1)."""

from __future__ import annotations

from typing import Any

import torch

from sglang_dart.attention.tree_attention import AttentionPlan, make_plan
from sglang_dart.cpu.attention import TreeVerifyCpuAttnBackend


class DraftStepCpuAttnBackend(TreeVerifyCpuAttnBackend):
    """One draft step: its plan comes from `CpuMultiStepDraftBackend`, not from the forward batch."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        pass  # planned with the other steps by the container

    def use_plan(self, plan: AttentionPlan | None) -> None:
        self._plan = plan


class CpuMultiStepDraftBackend:
    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        if model_runner.token_to_kv_pool_allocator.page_size != 1:
            raise NotImplementedError("EAGLE draft decode on CPU supports --page-size 1 only")
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.attn_backends = [DraftStepCpuAttnBackend(model_runner) for _ in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        topk, steps = self.topk, self.speculative_num_steps
        seq_lens = (
            forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        )
        seq_lens = seq_lens.to(torch.int64).cpu()
        bs = seq_lens.numel()
        pool_rows = forward_batch.req_pool_indices.to(torch.int64)
        # One key table row per (request, branch): prefix, then that branch's draft slots in step order.
        width = int(seq_lens.max()) + steps if bs else steps
        cols = torch.arange(width).unsqueeze(0)  # [1, W]
        seq = seq_lens.repeat_interleave(topk).unsqueeze(1)  # [bs*topk, 1]
        branch = torch.arange(topk).repeat(bs).unsqueeze(1)
        source = torch.where(
            cols < seq, cols, cols + branch * steps
        )  # draft slot s sits at seq + t*steps + s
        source = source.clamp(max=self.req_to_token.shape[1] - 1)
        table = self.req_to_token[pool_rows.repeat_interleave(topk).unsqueeze(1), source]
        rows = torch.arange(bs * topk)
        per_step_loc = forward_batch.out_cache_loc.view(bs, topk, steps).permute(2, 0, 1).reshape(steps, -1)
        ones = torch.ones(bs * topk, dtype=torch.int64)
        for step, backend in enumerate(self.attn_backends):
            backend.use_plan(make_plan(table, rows, seq.squeeze(1) + step, ones, None, per_step_loc[step]))


def create_decode_backend(factory: Any) -> CpuMultiStepDraftBackend:
    return CpuMultiStepDraftBackend(factory.draft_model_runner, factory.topk, factory.speculative_num_steps)


def create_extend_backend(factory: Any) -> TreeVerifyCpuAttnBackend:
    return TreeVerifyCpuAttnBackend(factory.draft_model_runner)
