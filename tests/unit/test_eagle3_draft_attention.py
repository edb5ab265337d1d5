"""The CPU draft-decode attention plans (sglang_dart/peers/eagle3_draft_attention.py) give every drafted
token exactly the keys SGLang's GPU multi-step draft backends give it (triton
`generate_draft_decode_kv_indices`, page size 1): the committed prefix, then its branch's draft slots up to
the current step. Also: the EAGLE3 CPU patch routes SGLang's draft backend factory to these backends."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_dart.peers.eagle3_draft_attention import CpuMultiStepDraftBackend


def _runner(req_to_token: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=object(),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1),
    )


@pytest.mark.parametrize("topk,steps", [(1, 2), (1, 4), (2, 3), (4, 3)])
@pytest.mark.parametrize("seed", range(3))
def test_draft_step_plans_see_prefix_and_own_branch(topk, steps, seed):
    rng = random.Random(seed)
    max_reqs, pool_len = 6, 48
    req_to_token = torch.randperm(max_reqs * pool_len).view(max_reqs, pool_len).to(torch.int32)
    bs = rng.randint(1, 4)
    pool_idx = rng.sample(range(max_reqs), bs)
    seq_lens = [rng.randint(1, pool_len - topk * steps) for _ in range(bs)]
    # What SGLang's prepare_for_draft hands over: the reserved slots after each prefix, (req, branch, step).
    out_cache_loc = torch.cat(
        [req_to_token[p, s : s + topk * steps] for p, s in zip(pool_idx, seq_lens, strict=True)]
    ).to(torch.int64)
    backend = CpuMultiStepDraftBackend(_runner(req_to_token), topk, steps)
    assert len(backend.attn_backends) == steps - 1
    batch = SimpleNamespace(
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        req_pool_indices=torch.tensor(pool_idx),
        out_cache_loc=out_cache_loc,
    )
    backend.init_forward_metadata(batch)
    for step, step_backend in enumerate(backend.attn_backends):
        plan = step_backend._plan
        for b, (pool, seq) in enumerate(zip(pool_idx, seq_lens, strict=True)):
            for t in range(topk):
                row = b * topk + t
                expected = req_to_token[pool, :seq].tolist()
                expected += [int(req_to_token[pool, seq + t * steps + j]) for j in range(step + 1)]
                seen = plan.key_loc[row][plan.mask[row, 0]].tolist()
                assert seen == expected, (step, b, t)
                # The query writes its K/V to this step's slot of its branch, at position seq + step.
                assert int(plan.key_loc[row, -1]) == int(req_to_token[pool, seq + t * steps + step])
                assert int(plan.query_pos[row, 0]) == seq + step


def test_install_routes_the_draft_backend_factory(tiny_llama_dir):
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from sglang_dart.peers import eagle3_cpu
    from sglang_dart.peers.eagle3_draft_attention import DraftStepCpuAttnBackend

    eagle3_cpu.install()
    eagle3_cpu.install()  # idempotent: patching twice must not wrap twice
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    args = SimpleNamespace(
        attention_backend="torch_native", decode_attention_backend=None, prefill_attention_backend=None
    )
    factory = DraftBackendFactory.__new__(DraftBackendFactory)
    factory.server_args, factory.draft_model_runner = args, _runner(req_to_token)
    factory.topk, factory.speculative_num_steps, factory.draft_attn_backend = 1, 3, None
    decode = factory.create_decode_backend()
    assert isinstance(decode, CpuMultiStepDraftBackend)
    assert all(isinstance(b, DraftStepCpuAttnBackend) for b in decode.attn_backends)
    with get_context().preserve_config():
        get_context().set_server_args(ServerArgs(model_path=str(tiny_llama_dir), device="cpu"))
        factory.draft_model_runner.model_config = SimpleNamespace(hf_config=object())
        extend = factory.create_draft_extend_backend()
    assert type(extend).__name__ == "TreeVerifyCpuAttnBackend"
