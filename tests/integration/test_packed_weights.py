"""A bf16 CPU server whose linears run on packed weight copies (`skinny_gemm`'s `packed` form) still serves
the weights SGLang loads in place: after `/update_weights_from_disk` its greedy output is that of a server
started on the new weights. Stale copies would mix the old linears with the new norms and embeddings."""

from __future__ import annotations

import pytest

from sglang_dart.cpu import skinny_gemm
from sglang_dart.server_process import SglangServer, serving
from tests.support.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(not skinny_gemm.packing_available(), reason="no packed bf16 products on this CPU"),
]

PROMPTS = ["def add(a, b):", "The weather today is", "1, 2, 3, 4,"]


def _greedy(server: SglangServer) -> list[list[int]]:
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    return [server.generate({"text": p, "sampling_params": params})["output_ids"] for p in PROMPTS]


def _load(server: SglangServer, model_dir: str) -> None:
    # No cache flush: the servers run without a radix cache, so nothing cached outlives the weights, and
    # SGLang asserts (and brings the server down) when the flush finds the last answered request still
    # in its running batch, which a loaded 2-core machine can make it do (seen once in the full suite).
    server.update_weights_from_disk(model_dir, flush_cache=False)


def test_weight_updates_reach_the_packed_products(tmp_path, server_logs):
    first = build_tiny_model(tmp_path / "first", seed=1)
    second = build_tiny_model(tmp_path / "second", seed=2)
    # Every bf16 product of up to 96 rows on packed copies, in both servers alike (no timed choice).
    env = {skinny_gemm.ENV: "packed"}
    args = ["--dtype", "bfloat16", "--disable-radix-cache"]  # no cached prefix across the weight change
    servers = {
        "updated": SglangServer(first, args, server_logs / "packed-updated.log", env=env),
        "fresh": SglangServer(second, args, server_logs / "packed-fresh.log", env=env),
    }
    with serving(servers):
        before = _greedy(servers["updated"])  # packs the first weights
        _load(servers["updated"], str(second))
        updated = _greedy(servers["updated"])
        fresh = _greedy(servers["fresh"])
    assert fresh != before, "the two models must answer differently for this test to mean anything"
    assert updated == fresh, "after the update the server still computes with copies of the old weights"
