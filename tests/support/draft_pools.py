"""A DART draft forward over SGLang's own pools and the CPU tree-mask attention backend, built as the
worker builds it (a one-layer KV pool with scratch slots past the target's, a draft request table), for
the unit tests and `benchmarks/draft_forward.py`: what a draft model runner would hold, without a server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from sglang_dart.cpu.attention import TreeVerifyCpuAttnBackend
from sglang_dart.dart.drafting import DraftForward
from sglang_dart.drafter.sglang_model import LlamaForCausalLMDart


def draft_forward_over_pools(
    model: LlamaForCausalLMDart,
    req_to_token: torch.Tensor,
    num_slots: int,
    backend: Any = TreeVerifyCpuAttnBackend,
) -> DraftForward:
    device = req_to_token.device
    cfg = model.cfg
    dtype = model.drafter.fc.weight.dtype
    scratch = DraftForward.scratch_slots(req_to_token.shape[0], cfg.draft_length)
    width = req_to_token.shape[1] + cfg.draft_length + 1
    table = ReqToTokenPool(req_to_token.shape[0] - 1, width, device, False)
    pool = MHATokenToKVPool(
        num_slots + scratch - 1, 1, dtype, cfg.num_key_value_heads, cfg.head_dim, 1, "cpu", False
    )
    if device.type != "cpu":  # SGLang's pool knows real devices only: its buffers are moved there
        pool.k_buffer = [t.to(device) for t in pool.k_buffer]
        pool.v_buffer = [t.to(device) for t in pool.v_buffer]
    runner = SimpleNamespace(device=device, req_to_token_pool=table, token_to_kv_pool=pool)
    runner.attn_backend = backend(runner)
    return DraftForward(model, runner, req_to_token, num_slots, num_slots)
