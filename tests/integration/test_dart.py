"""DART through the real SGLang server on CPU: lossless greedy output at several batch sizes, with and
without overlap scheduling, sampling that keeps the target's distribution, grammars, aborts, retraction,
root-only steps, chunked prefill, and clear start-up errors for what DART cannot run with."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import requests

from sglang_dart.dart.settings import TREE_SIZES_ENV
from sglang_dart.server_process import (
    SglangServer,
    device_flag,
    free_port,
    run_launcher,
    serving,
    start_together,
)
from tests.support.dart_assets import build_random_drafter, build_store_for
from tests.support.dart_serving import (
    SEED,
    assert_same_first_tokens,
    dart_server_args,
    run_all,
)
from tests.support.idle_cpu import SLEEPING_AT_MOST, idle_scheduler_cores
from tests.support.launcher_args import refusals
from tests.support.prompts_many import many_prompts
from tests.support.tiny_models import build_tiny_model

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def qwen3_assets(tiny_qwen3_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dart-qwen3")
    return build_random_drafter(root / "draft", tiny_qwen3_dir), build_store_for(
        tiny_qwen3_dir, root / "s.store"
    )


@pytest.fixture(scope="module")
def qwen3_dart_servers(tiny_qwen3_dir, qwen3_assets, server_logs) -> Iterator[dict[str, SglangServer]]:
    """DART as a GPU runs it ("overlap"): overlap scheduling, and the draft step's pieces replayed from
    per-shape graph buffers (`device_graphs`, emulated: no CUDA here); and "sync", without overlap
    scheduling, drafting eagerly. Started side by side."""
    args = [*dart_server_args(*qwen3_assets), *SEED]
    env = {"SGLANG_DART_DRAFT_GRAPHS": "emulate"}
    servers = {
        "overlap": SglangServer(tiny_qwen3_dir, args, server_logs / "qwen3-dart.log", env=env),
        "sync": SglangServer(
            tiny_qwen3_dir, [*args, "--disable-overlap-schedule"], server_logs / "qwen3-dart-sync.log"
        ),
    }
    with serving(servers):
        yield servers


@pytest.fixture(scope="module")
def qwen3_dart(qwen3_dart_servers) -> SglangServer:
    return qwen3_dart_servers["overlap"]


@pytest.fixture(scope="module")
def qwen3_dart_sync(qwen3_dart_servers) -> SglangServer:
    return qwen3_dart_servers["sync"]


def _bf16_config_copy(model: Path, out: Path) -> Path:
    """`model` with config.json saying bfloat16 (the weights stay float32)."""
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _variant_specs(tiny_qwen3_dir: Path, qwen3_assets: tuple[Path, Path], bf16_model: Path) -> dict:
    """DART servers that each differ from qwen3_dart in one setting: name -> (model, args, env, log)."""
    base = [*dart_server_args(*qwen3_assets), *SEED]
    unset_tuning = {TREE_SIZES_ENV: None, "GOMP_SPINCOUNT": None}  # the defaults are under test
    return {
        # Also without a radix cache, which SGLang requires for prompts given as input_embeds.
        "no-chains": (
            tiny_qwen3_dir,
            [*base, "--disable-radix-cache"],
            {"SGLANG_DART_CONTEXT_NODES": "0"},
            "qwen3-dart-no-chains",
        ),
        # Requests that re-enter through prefill: retracted by SGLang's test switch, or prefilled in
        # 16-token chunks.
        "reentry": (
            tiny_qwen3_dir,
            [*base, "--chunked-prefill-size", "16"],
            {"SGLANG_TEST_RETRACT": "1"},
            "qwen3-dart-reentry",
        ),
        "bf16-default-sizes": (
            bf16_model,
            [*dart_server_args(*qwen3_assets), "--dtype", "auto"],  # the later --dtype wins
            unset_tuning,
            "qwen3-bf16-default-sizes",
        ),
        # Plain decoding of the same bf16 model, for bf16-default-sizes's greedy output.
        "bf16-plain": (
            bf16_model,
            ["--dtype", "auto", *SEED, "--disable-overlap-schedule"],
            unset_tuning,
            "qwen3-bf16-plain",
        ),
        # A float16 target (as `--dtype auto` serves a float32 checkpoint on a CPU), every step a tree of 8.
        "f16-trees": (
            tiny_qwen3_dir,
            [*base, "--dtype", "float16"],
            {TREE_SIZES_ENV: "1:8", "GOMP_SPINCOUNT": None},
            "qwen3-f16-trees",
        ),
        "f16-plain": (
            tiny_qwen3_dir,
            ["--dtype", "float16", *SEED, "--disable-overlap-schedule"],
            {"GOMP_SPINCOUNT": None},
            "qwen3-f16-plain",
        ),
        # bf16 under the row-invariant setting (every product Rust's, whatever its rows), trees of 16 every
        # step, and its plain reference.
        "bf16-row-invariant-trees": (
            bf16_model,
            [*base, "--dtype", "auto"],
            {TREE_SIZES_ENV: "1:16", ROW_INVARIANT[0]: ROW_INVARIANT[1]},
            "qwen3-bf16-row-invariant-trees",
        ),
        "bf16-row-invariant-plain": (
            bf16_model,
            ["--dtype", "auto", *SEED, "--disable-overlap-schedule"],
            {ROW_INVARIANT[0]: ROW_INVARIANT[1]},
            "qwen3-bf16-row-invariant-plain",
        ),
        "root-only": (tiny_qwen3_dir, base, {TREE_SIZES_ENV: "1:1"}, "qwen3-root-only"),
        # Two schedulers, each with a DART worker of its own (SGLang's data-parallel replicas).
        "data-parallel": (tiny_qwen3_dir, [*base, "--dp-size", "2"], {}, "qwen3-dart-dp2"),
    }


# Started in groups at the first use of one of them (the last test to use one stops it): a start-up is
# mostly single-threaded imports, and two or three side by side took 33-36 s a server on 2 cores against
# 47 s one at a time; five together took 51 s a server.
VARIANT_GROUPS = [
    ("no-chains", "reentry"),
    ("bf16-default-sizes", "bf16-plain", "root-only", "data-parallel"),
    ("f16-trees", "f16-plain"),
    ("bf16-row-invariant-trees", "bf16-row-invariant-plain"),
]
# The setting that gives every linear, whatever its rows, to the Rust product (`skinny_gemm.rust_only`).
ROW_INVARIANT = ("SGLANG_DART_CPU_SKINNY_GEMM", "rust")


@pytest.fixture(scope="module")
def variant_servers(
    tiny_qwen3_dir, qwen3_assets, server_logs, tmp_path_factory
) -> Iterator[Callable[[str], SglangServer]]:
    """name -> a callable that returns that variant's server, started with its group."""
    bf16_model = _bf16_config_copy(tiny_qwen3_dir, tmp_path_factory.mktemp("bf16") / "qwen3-bf16")
    specs = _variant_specs(tiny_qwen3_dir, qwen3_assets, bf16_model)
    servers: dict[str, SglangServer] = {}

    def server(name: str) -> SglangServer:
        if name not in servers:
            group = next(g for g in VARIANT_GROUPS if name in g)
            for member in group:
                model, args, env, log = specs[member]
                servers[member] = SglangServer(model, args, server_logs / f"{log}.log", env=env)
            start_together(servers[member] for member in group)
        return servers[name]

    yield server
    for started in servers.values():
        started.stop()


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_plain) -> tuple[list[str], list[list[int]]]:
    """56 prompts and the plain server's greedy answers to them."""
    prompts = many_prompts(56)
    return prompts, [out["output_ids"] for out in run_all(qwen3_plain, prompts, 8)]


# Concurrency 1 and 4 are nightly (-m slow): CI checks both schedules here at 16 (a batch that drains
# through every smaller size), and test_dart_trees.py's τ check runs both at 4 with drafts accepted (the
# 56 prompts at 4 with overlap took 224 s of CI's critical path, session 59).
@pytest.mark.parametrize(
    ("concurrency", "schedule"),
    [
        pytest.param(1, "overlap", marks=pytest.mark.slow),
        pytest.param(1, "sync", marks=pytest.mark.slow),
        pytest.param(4, "overlap", marks=pytest.mark.slow),
        pytest.param(4, "sync", marks=pytest.mark.slow),
        (16, "overlap"),
        (16, "sync"),
    ],
)
def test_qwen3_greedy_equals_plain(request, qwen3_reference, concurrency, schedule):
    """With overlap scheduling (SGLang's default) and without (`--disable-overlap-schedule`)."""
    dart = request.getfixturevalue("qwen3_dart" if schedule == "overlap" else "qwen3_dart_sync")
    prompts, reference = qwen3_reference
    speculative = run_all(dart, prompts, concurrency)
    for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
        assert spec["output_ids"] == ref, prompt
        assert spec["meta_info"]["spec_verify_ct"] > 0
    assert dart.healthy()
    graphs = "emulated" if schedule == "overlap" else "off"
    log = dart.log_path.read_text()
    assert f"DART: draft step graphs {graphs}" in log
    # The shapes the schedule runs were captured before serving, typed as the steps' inputs are.
    assert "captured while serving" not in log


def test_an_fp8_kv_pool_keeps_greedy_output_equal_to_plain(tiny_qwen3_dir, qwen3_assets, server_logs):
    """With `--kv-cache-dtype fp8_e5m2` the pool holds every key and value rounded to fp8; DART's tree
    rows and plain's decode rows attend over them by the same arithmetic (the Rust kernel reads fp8 rows
    widened exactly), so DART's greedy output is plain's, at any batch (float32 weights, whose linears
    give a row the same bits in any batch). Through torch's SDPA plain's own answers changed with the
    batch (bf16 SmolLM2: 10 of 12 prompts between concurrency 1 and 4); on this tiny float32 model they
    did not, so the bits are checked by test_rust_attention.py, and this checks serving on a real pool."""
    fp8 = ["--kv-cache-dtype", "fp8_e5m2"]
    servers = {
        "plain": SglangServer(
            tiny_qwen3_dir, ["--dtype", "float32", *SEED, *fp8], server_logs / "qwen3-fp8-plain.log"
        ),
        "dart": SglangServer(
            tiny_qwen3_dir,
            [*dart_server_args(*qwen3_assets), *SEED, *fp8],
            server_logs / "qwen3-fp8-dart.log",
        ),
    }
    prompts = many_prompts(24)
    with serving(servers):
        reference = [out["output_ids"] for out in run_all(servers["plain"], prompts, 1)]
        batched = [out["output_ids"] for out in run_all(servers["plain"], prompts, 8)]
        speculative = run_all(servers["dart"], prompts, 8)
    assert batched == reference
    for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
        assert spec["output_ids"] == ref, prompt
        assert spec["meta_info"]["spec_verify_ct"] > 0


def test_context_chains_are_accepted_losslessly(qwen3_plain, qwen3_dart, variant_servers):
    """The random drafter's drafts are nearly always rejected; context chains (on by default) predict
    where the tiny target's greedy output repeats itself: fewer verify steps than with chains off
    (`SGLANG_DART_CONTEXT_NODES=0`), and the target's own output either way."""
    prompts, new_tokens = many_prompts(12), 64
    reference = [out["output_ids"] for out in run_all(qwen3_plain, prompts, 8, new_tokens)]
    off = variant_servers("no-chains")  # stopped by the input_embeds test, which follows
    without = run_all(off, prompts, 4, new_tokens)
    with_chains = run_all(qwen3_dart, prompts, 4, new_tokens)
    for runs in (without, with_chains):
        assert [out["output_ids"] for out in runs] == reference

    def steps(runs: list[dict]) -> int:
        return sum(out["meta_info"]["spec_verify_ct"] for out in runs)

    print(f"context chains: {steps(with_chains)} verify steps, {steps(without)} without")
    assert steps(with_chains) < steps(without)


def _embedding_table(model_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        return weights.get_tensor("model.embed_tokens.weight").float()


def test_input_embeds_prompts_beside_token_prompts(tiny_qwen3_dir, qwen3_plain, variant_servers):
    """Prompts given as input_embeds, sent together with token prompts: SGLang put both kinds in one
    prefill batch, gathered embeddings for one kind only and the scheduler died of the shape mismatch
    (plain servers too); `prefill_batches` keeps the kinds apart. Either way in, the answer is the
    target's greedy answer to the same tokens."""
    from transformers import AutoTokenizer

    server = variant_servers("no-chains")  # stopped by the weight-update test, which follows
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in many_prompts(6)]
    greedy = {"max_new_tokens": 24, "temperature": 0.0}
    reference = [qwen3_plain.generate({"input_ids": ids, "sampling_params": greedy}) for ids in prompt_ids]
    table = _embedding_table(tiny_qwen3_dir)
    bodies = [
        body
        for ids in prompt_ids
        for body in (
            {"input_embeds": table[ids].tolist(), "sampling_params": greedy},
            {"input_ids": ids, "sampling_params": greedy},
        )
    ]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        answers = list(pool.map(server.generate, bodies))
    assert [a["output_ids"] for a in answers] == [r["output_ids"] for r in reference for _ in range(2)]
    assert server.healthy()


def test_weight_updates_reach_the_target_and_serving_goes_on(
    tiny_qwen3_dir, qwen3_plain, variant_servers, tmp_path
):
    """/update_weights_from_disk: SGLang updates the target, then asked the speculative worker to load the
    same weights into draft runners DART does not have, and the scheduler died (AttributeError). DART's
    drafter keeps its own checkpoint and reads the target's embedding table in place, so after an update
    the answers are the new target's, and after updating back, the plain server's again."""
    server = variant_servers("no-chains")
    try:
        prompts = many_prompts(4)
        reference = [o["output_ids"] for o in run_all(qwen3_plain, prompts, 4, 24)]
        # No cache flush: the server runs without a radix cache (see test_packed_weights.py for why not).
        server.update_weights_from_disk(
            build_tiny_model(tmp_path / "other", arch="qwen3", seed=1), flush_cache=False
        )
        assert [o["output_ids"] for o in run_all(server, prompts, 4, 24)] != reference
        server.update_weights_from_disk(tiny_qwen3_dir, flush_cache=False)
        again = run_all(server, prompts, 4, 24)
        assert [o["output_ids"] for o in again] == reference
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in again)
        assert server.healthy()
    finally:
        server.stop()


def test_parallel_samples_equal_plain(qwen3_plain, qwen3_dart):
    """`n` > 1 (SGLang forks the request after one shared prefill): greedy copies are all the target's
    output; sampled copies each run to their length."""
    prompts = many_prompts(2)
    greedy = {"text": prompts, "sampling_params": {"n": 4, "max_new_tokens": 24, "temperature": 0.0}}
    spec, ref = qwen3_dart.generate(greedy), qwen3_plain.generate(greedy)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in ref] and len(spec) == 8
    sampled_params = {**greedy["sampling_params"], "temperature": 1.0, "ignore_eos": True}
    sampled = {**greedy, "sampling_params": sampled_params}
    assert [len(o["output_ids"]) for o in qwen3_dart.generate(sampled)] == [24] * 8
    assert qwen3_dart.healthy()


# The random tiny model is nearly uniform at temperature 1; at 0.1 its next-token distributions have a
# dominant token and a tail (measured: about 70% / 30% over 15-30 tokens), which a greedy-only verifier


def test_sampling_keeps_the_target_distribution(qwen3_plain, qwen3_dart):
    """The 2nd and 3rd sampled tokens come out of tree verification; all three must be distributed as
    plain sampling's."""
    assert_same_first_tokens(qwen3_plain, qwen3_dart)


def test_sampled_logprobs_are_the_targets(tiny_qwen3_dir, qwen3_dart):
    """Sampled tokens come out of tree verification, but their returned logprobs must still be the
    target's log-probabilities of those tokens: checked by scoring each output with the HF model itself
    (a server would answer from its radix cache for prefixes it has already served)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, torch_dtype=torch.float32).eval()
    for i, prompt in enumerate(many_prompts(4)):
        params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": i}
        out = qwen3_dart.generate({"text": prompt, "sampling_params": params, "return_logprob": True})
        assert out["meta_info"]["spec_verify_ct"] > 0
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = torch.tensor([prompt_ids + out["output_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        rows = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
        want = logprobs[rows, ids[0, rows + 1]].tolist()
        assert got == pytest.approx(want, abs=2e-3), prompt


def test_grammar_constrained_requests(qwen3_plain, qwen3_dart):
    """Regex-constrained requests: the grammar mask is applied to every tree node before acceptance, so
    greedy output equals the plain server's and sampled output always matches the pattern."""
    pattern = r"(yes|no|maybe), [a-z]{2,6}( [a-z]{2,6}){0,3}\."
    for prompt in many_prompts(6):
        greedy = {"max_new_tokens": 64, "temperature": 0.0, "regex": pattern}
        spec = qwen3_dart.generate({"text": prompt, "sampling_params": greedy})
        assert (
            spec["output_ids"]
            == qwen3_plain.generate({"text": prompt, "sampling_params": greedy})["output_ids"]
        )
        assert spec["meta_info"]["spec_verify_ct"] > 0
        sampled = {**greedy, "temperature": 1.0}
        for seed in range(3):
            out = qwen3_dart.generate({"text": prompt, "sampling_params": {**sampled, "sampling_seed": seed}})
            assert re.fullmatch(pattern, out["text"]), out["text"]


def test_token_ids_outside_the_vocabulary_are_refused_and_serving_goes_on(qwen3_plain, qwen3_dart):
    """An id past the vocabulary (or negative) reached SGLang's embedding and killed the scheduler with
    every request on it; `request_checks` answers 400 before that, on plain and DART servers alike."""
    vocab = json.loads((Path(qwen3_plain.model_path) / "config.json").read_text())["vocab_size"]
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    for server in (qwen3_plain, qwen3_dart):
        for ids in ([5, 6, vocab], [[5, 6, 7], [5, -1, 7]]):
            resp = requests.post(f"{server.url}/generate", json={"input_ids": ids, "sampling_params": greedy})
            assert resp.status_code == 400 and "outside the model's vocabulary" in resp.text, resp.text
        assert server.healthy()
        assert (
            len(server.generate({"input_ids": [5, 6, vocab - 1], "sampling_params": greedy})["output_ids"])
            == 8
        )


def test_streaming_load_with_random_aborts(qwen3_dart, qwen3_plain):
    """64 concurrent streaming requests, a third of them dropped mid-stream; then the server is healthy
    (SGLang's idle KV leak check would have killed the scheduler) and still lossless."""
    import random

    rng = random.Random(7)
    prompts = many_prompts(64)

    def stream(i: int) -> int:
        body = {
            "text": prompts[i],
            "sampling_params": {"max_new_tokens": 48, "temperature": 0.0 if i % 2 else 0.8},
            "stream": True,
        }
        stop_after = rng.randint(1, 8) if i % 3 == 0 else None
        chunks = 0
        with requests.post(f"{qwen3_dart.url}/generate", json=body, stream=True, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data:"):
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        break
        return chunks

    with ThreadPoolExecutor(max_workers=64) as pool:
        assert all(c > 0 for c in pool.map(stream, range(64)))
    import time

    time.sleep(3)  # let the scheduler go idle and run its memory check
    assert qwen3_dart.healthy()
    check = many_prompts(4)
    assert [o["output_ids"] for o in run_all(qwen3_dart, check, 4)] == [
        o["output_ids"] for o in run_all(qwen3_plain, check, 4)
    ]
    assert "leak" not in qwen3_dart.log_text().lower()


def test_retracted_requests_resume_losslessly(qwen3_plain, variant_servers):
    """SGLang's test switch retracts running requests every few steps; they come back through prefill and
    must rebuild their draft state from the slots SGLang re-assigns."""
    server = variant_servers("reentry")  # stopped by the chunked-prefill test, which follows
    prompts = many_prompts(12)
    spec = [o["output_ids"] for o in run_all(server, prompts, 12, n=40)]
    assert spec == [o["output_ids"] for o in run_all(qwen3_plain, prompts, 12, n=40)]
    assert re.search(r"retraction\. #retracted_reqs: [1-9]", server.log_text())
    assert server.healthy()


def test_chunked_prefill_and_stop_strings(qwen3_plain, variant_servers):
    """Prompts longer than the prefill chunk (the draft entry at each chunk boundary is recomputed from the
    stored residual) and stop strings give the plain server's output."""
    server = variant_servers("reentry")
    try:
        long_prompts = [p * 4 for p in many_prompts(8)]
        spec_ids = [o["output_ids"] for o in run_all(server, long_prompts, 4)]
        assert spec_ids == [o["output_ids"] for o in run_all(qwen3_plain, long_prompts, 4)]
        greedy = {"max_new_tokens": 24, "temperature": 0.0}
        free_text = qwen3_plain.generate({"text": long_prompts[0], "sampling_params": greedy})["text"]
        body = {"text": long_prompts[0], "sampling_params": {**greedy, "stop": free_text[5:8]}}
        spec, plain = server.generate(body), qwen3_plain.generate(body)
        assert spec["text"] == plain["text"]
        assert spec["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
        assert plain["meta_info"]["finish_reason"]["type"] == "stop"
    finally:
        server.stop()


def test_bf16_greedy_equals_plain_where_one_product_takes_every_few_row_linear(variant_servers):
    """In bf16 a token verified in a tree gets the bits it gets decoded alone where one Rust product takes
    every linear of 1-16 rows (`skinny_gemm.bf16_rust_untimed`: AVX512-BF16 or AVX2, no AMX): greedy DART
    then equals plain decoding in bf16 too, as it does in float32. Before, timed choices mixed forms that
    round differently across row counts, and the shipped drafter's demo answer parted from plain's at its
    34th character (this tiny model's answers happened to agree). (Runs before the test that stops
    bf16-default-sizes.)"""
    from sglang_dart.cpu.skinny_gemm import bf16_kernel_pays

    plain = variant_servers("bf16-plain")
    try:
        if not bf16_kernel_pays():
            pytest.skip("torch's timed bf16 products here (AMX, or no vector kernel for the Rust one)")
        dart = variant_servers("bf16-default-sizes")
        # Prompts of a few tokens: a prefill of more than 16 rows is still a timed choice, made apart in
        # each server, so two servers (two plain ones too) may round a longer prompt differently.
        prompts = [f"Tell me one fact about {topic}." for topic in ("rivers", "bread", "chess", "rain")]
        prompts += [f"def {name}(items):" for name in ("total", "longest", "unique", "merge")]
        reference = run_all(plain, prompts, 1, n=32)
        speculative = run_all(dart, prompts, 1, n=32)
        for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
            assert spec["output_ids"] == ref["output_ids"], prompt
        # Trees ran (the guard's warm-up and settling probes run them whatever the drafts).
        assert sum(out["meta_info"]["spec_num_proposed_drafts"] for out in speculative) > 0
    finally:
        plain.stop()


def test_float16_prompt_tokens_get_the_bits_of_decode_steps(variant_servers):
    """Every float16 forward here gives a token the same bits whatever else the forward holds (the F16C
    product, Rust's row-wise ops, Rust's attention at any query count), so a prompt's K/V are the same
    whether a prefill or decode steps computed them, and with the radix cache a greedy answer does not
    depend on what the server served before. Where it shows: the log-probabilities that decode steps gave
    a request's tokens equal, to the bit, those one prefill of the same tokens gives (torch's SDPA in
    prefills of more than 32 tokens parted them at every token)."""
    from sglang_dart.cpu.skinny_gemm import f16_kernel_pays

    if not f16_kernel_pays():
        pytest.skip("torch's float16 products here (AMX, or no AVX2/F16C)")
    _assert_prefill_logprobs_equal_decode_steps(variant_servers("f16-plain"), many_prompts(3))


def _assert_greedy_equals_plain(
    plain: SglangServer, dart: SglangServer, concurrencies: tuple[int, ...]
) -> None:
    """12 prompts, 32 greedy tokens: DART's output at each concurrency equals plain's at concurrency 1,
    and trees ran."""
    prompts = many_prompts(12)
    reference = run_all(plain, prompts, 1, n=32)
    for concurrency in concurrencies:
        speculative = run_all(dart, prompts, concurrency, n=32)
        for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
            assert spec["output_ids"] == ref["output_ids"], (concurrency, prompt)
        assert sum(out["meta_info"]["spec_num_proposed_drafts"] for out in speculative) > 0


def _assert_prefill_logprobs_equal_decode_steps(server: SglangServer, prompts: list[str]) -> None:
    """Each prompt's greedy answer, then the prompt and answer again as one prompt whose answer part is
    computed anew in one extend: every answer token's log-probability the same to the bit both ways."""
    greedy = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    for prompt in prompts:
        first = server.generate(
            {"text": prompt, "sampling_params": greedy, "return_logprob": True, "logprob_start_len": 0}
        )
        prompt_ids = [token for _, token, _ in first["meta_info"]["input_token_logprobs"]]
        again = server.generate(
            {
                "input_ids": prompt_ids + first["output_ids"],
                "sampling_params": {**greedy, "max_new_tokens": 1},
                "return_logprob": True,
                "logprob_start_len": len(prompt_ids),  # these tokens are computed again, in one extend
            }
        )
        prefilled = again["meta_info"]["input_token_logprobs"]
        decoded = first["meta_info"]["output_token_logprobs"]
        assert [token for _, token, _ in prefilled] == first["output_ids"]
        # The first one's comes from the prompt's last position, which the cache holds: SGLang gives none.
        assert [logprob for logprob, _, _ in prefilled[1:]] == [logprob for logprob, _, _ in decoded[1:]], (
            prompt
        )


def test_float16_greedy_equals_plain_on_the_f16c_product(variant_servers):
    """In float16 every linear goes to the Rust F16C product (`skinny_gemm.f16_rust_only`), which gives a
    row the same bits whatever the call's other rows: a token verified in a tree of 8 gets the bits it gets
    decoded alone, and greedy DART equals plain decoding, one request at a time and four together. Torch's
    float16 product costs in proportion to its rows, so timed choices would split by row count."""
    from sglang_dart.cpu.skinny_gemm import f16_kernel_pays

    if not f16_kernel_pays():
        pytest.skip("torch's float16 products here (AMX, or no AVX2/F16C)")
    plain, dart = variant_servers("f16-plain"), variant_servers("f16-trees")
    try:
        _assert_greedy_equals_plain(plain, dart, concurrencies=(1, 4))
        assert "Rust few-row linears on" in dart.log_text()
    finally:
        plain.stop()
        dart.stop()


def test_default_tree_sizes_follow_the_loaded_dtype(variant_servers):
    """With no schedule set, the worker picks the CPU default from the dtype the target was loaded in, not
    from --dtype: a model whose config says bf16, served with --dtype auto, gets `cpu-amx`'s schedule on a
    CPU with AMX tiles, `cpu-avx512-bf16`'s on one with AVX512-BF16 only (the plain CPU one elsewhere,
    with a hint that float32 serves DART faster there)."""
    from sglang_dart.dart.adaptive_sizes import GuardedTreeSizes
    from sglang_dart.dart.settings import cpu_has_amx_bf16, cpu_has_avx512_bf16
    from sglang_dart.dart.tree_sizes import default_schedule, default_schedule_key

    key = default_schedule_key("cpu", "torch.bfloat16", cpu_has_amx_bf16(), cpu_has_avx512_bf16())
    expected = GuardedTreeSizes(default_schedule(key, 8))  # on a CPU the default is guarded
    server = variant_servers("bf16-default-sizes")
    try:
        out = server.generate({"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        log = server.log_text()
    finally:
        server.stop()
    assert len(out["output_ids"]) == 4
    assert f"DART tree size by batch size: {expected.describe()}\n" in log, expected.describe()
    # bf16: the Rust product only where its kernel pays (AVX512-BF16 or AVX2, no AMX); torch's OpenMP
    # workers keep their spinning (1.4x, run 20).
    from sglang_dart.cpu.skinny_gemm import bf16_kernel_pays

    linears = "on" if bf16_kernel_pays() else "off"
    assert f"Rust few-row linears {linears}; GOMP_SPINCOUNT unset" in log
    # Where bf16 products are emulated (no AMX, no AVX512-BF16, no Rust bf16 kernel) the log says float32
    # serves DART faster.
    from sglang_dart.dart.settings import slow_half_precision_hint

    hint = slow_half_precision_hint(
        "cpu", "torch.bfloat16", cpu_has_amx_bf16(), cpu_has_avx512_bf16(), bf16_kernel_pays()
    )
    assert ("--dtype float32 is where DART speeds decoding up" in log) == (hint is not None)


def test_openmp_spinning_is_off_for_a_float32_target(qwen3_dart):
    """The launcher keeps torch's OpenMP workers from spinning where the Rust product takes the linears
    (float32 weights), so that they leave the core to its helper threads."""
    if "GOMP_SPINCOUNT" in os.environ:
        pytest.skip("GOMP_SPINCOUNT is set for the test run; the launcher keeps a value the user sets")
    assert "Rust few-row linears on; GOMP_SPINCOUNT=0" in qwen3_dart.log_text()


def test_an_idle_dart_server_sleeps_instead_of_polling(qwen3_dart):
    """Nothing in the DART worker keeps an idle server's scheduler busy (SGLang's idle sleeper is on)."""
    request = {
        "text": "idle after this",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    assert qwen3_dart.generate(request)["meta_info"]["completion_tokens"] == 8
    assert idle_scheduler_cores(qwen3_dart) < SLEEPING_AT_MOST


def test_root_only_steps_are_plain_decoding(qwen3_plain, variant_servers):
    """Schedule 1:1, every step verifies the roots alone. Such steps run as SGLang's own decode forward
    and sampler, except for batches with logprobs or a grammar, which take the size-1 verify path. Both
    must match the plain server: greedy tokens, sampled distribution, logprobs, constrained output."""
    server = variant_servers("root-only")
    try:
        prompts = many_prompts(16)
        reference = [out["output_ids"] for out in run_all(qwen3_plain, prompts, 4)]
        speculative = run_all(server, prompts, 4)
        for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
            assert spec["output_ids"] == ref, prompt
            assert spec["meta_info"]["spec_verify_ct"] > 0
            assert spec["meta_info"]["spec_num_correct_drafts"] == 0  # roots only, nothing drafted
            assert spec["meta_info"]["spec_num_proposed_drafts"] == 0
            assert spec["meta_info"]["spec_cap_length"] == 1.0
        assert_same_first_tokens(qwen3_plain, server)

        greedy = {"max_new_tokens": 16, "temperature": 0.0}
        for prompt in prompts[:4]:
            payload = {"text": prompt, "sampling_params": greedy, "return_logprob": True}
            spec, ref = server.generate(payload), qwen3_plain.generate(payload)
            assert spec["output_ids"] == ref["output_ids"]
            got = [lp for lp, _, _ in spec["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=2e-3), prompt
        constrained = {**greedy, "max_new_tokens": 32, "regex": r"(yes|no), [a-z]{2,6}\."}
        for prompt in prompts[:3]:
            payload = {"text": prompt, "sampling_params": constrained}
            assert server.generate(payload)["output_ids"] == qwen3_plain.generate(payload)["output_ids"]
        assert server.healthy()
    finally:
        server.stop()


def test_data_parallel_replicas_keep_greedy_output_equal_to_plain(qwen3_reference, variant_servers):
    """With --dp-size 2 SGLang runs two schedulers behind one server and hands them requests in turn; each
    loads its own DART worker, drafter and KV pools, and every answer is plain's."""
    prompts, reference = (part[:24] for part in qwen3_reference)
    server = variant_servers("data-parallel")
    try:
        speculative = run_all(server, prompts, 8)
        log = server.log_text()
    finally:
        server.stop()
    for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
        assert spec["output_ids"] == ref, prompt
        assert spec["meta_info"]["spec_verify_ct"] > 0
    for rank in (0, 1):  # both replicas built a DART worker and served requests (each one speculated)
        assert f"DP{rank}] DART tree size by batch size" in log
        assert f"DP{rank}] Prefill batch" in log


def test_under_the_row_invariant_setting_bf16_dart_equals_plain_at_any_batch(variant_servers):
    """`SGLANG_DART_CPU_SKINNY_GEMM=rust` gives every linear to the Rust product whatever its rows (and
    SiLU-and-mul to its kernel at any size; attention is Rust's at any query count anyway), so no row's
    bits depend on the forward's other rows. Then greedy bf16 DART equals plain decoding with trees of 16
    at concurrency 8 (verify forwards of up to 128 rows, which `auto` leaves to timed torch products) on
    prompts of any length, and a prefill's log-probabilities equal the decode steps'. (Runs after the tests
    that stop the bf16 and float16 variants: on 2 cores and 24 GiB, more servers side by side starved.)"""
    plain, dart = variant_servers("bf16-row-invariant-plain"), variant_servers("bf16-row-invariant-trees")
    try:
        _assert_greedy_equals_plain(plain, dart, concurrencies=(1, 8))
        _assert_prefill_logprobs_equal_decode_steps(plain, many_prompts(3))
        _assert_prefill_logprobs_equal_decode_steps(dart, many_prompts(3)[1:])
    finally:
        plain.stop()
        dart.stop()


def _dart_argv(model: Path, draft: Path | None, store: Path | None, extra: list[str] = ()) -> list[str]:
    args = ["--model-path", str(model), *device_flag(), "--port", str(free_port()), "--dtype", "float32"]
    args += ["--max-total-tokens", "4096", "--speculative-algorithm", "DART", *extra]
    if draft is not None:
        args += ["--speculative-draft-model-path", str(draft)]
    if store is not None:
        args += ["--speculative-ngram-external-corpus-path", str(store)]
    return args


@pytest.mark.standalone
def test_startup_errors_name_the_problem(tiny_qwen3_dir, smollm2_f32_dir, qwen3_assets, tmp_path):
    draft, store = qwen3_assets
    corrupt = tmp_path / "corrupt.store"
    corrupt.write_bytes(store.read_bytes()[:100])
    foreign_draft = build_random_drafter(tmp_path / "smol-draft", smollm2_f32_dir)
    other_arch = build_random_drafter(tmp_path / "arch", tiny_qwen3_dir, architectures=["LlamaForCausalLM"])
    # A store built with another tokenizer (SmolLM2's, 49152 ids) for the tiny Qwen3 (512 ids).
    foreign_store = build_store_for(smollm2_f32_dir, tmp_path / "smol.store", texts=["def f(x): return x"])
    # One through the real launcher: the refusal reaches the user and the launcher exits, before any
    # scheduler loads the target.
    launched = run_launcher(_dart_argv(tiny_qwen3_dir, foreign_draft, store), timeout=300)
    assert launched.returncode != 0 and "hidden_size" in launched.stdout + launched.stderr
    assert "Load weight" not in launched.stdout + launched.stderr
    # The others as the launcher prepares its arguments, in one process (each launch costs ~30 s of imports
    # on a 2-core machine); the last case is the control that nothing else is wrong.
    cases = {
        "--speculative-draft-model-path": (None, store, [], {}),
        "--speculative-ngram-external-corpus-path": (draft, None, [], {}),
        "does not exist": (draft, tmp_path / "missing.store", [], {}),
        "unusable": (draft, corrupt, [], {}),
        # A drafter trained for another target: hidden size and vocabulary do not fit.
        "hidden_size": (foreign_draft, store, [], {}),
        # A drafter whose config.json names another architecture: SGLang would load another model class.
        "LlamaForCausalLMDart": (other_arch, store, [], {}),
        "vocabulary": (draft, foreign_store, [], {}),
        "--tp-size": (draft, store, ["--tp-size", "2"], {}),
        # The newer spelling of --enable-return-hidden-states.
        "--enable-return-hidden-states": (draft, store, ["--return-hidden-states-mode", "last"], {}),
        # It would start tokenizer processes that cannot resolve DART.
        "does not support --tokenizer-worker-num": (draft, store, ["--tokenizer-worker-num", "2"], {}),
        "SGLANG_DART_DRAFT_GRAPHS": (draft, store, [], {"SGLANG_DART_DRAFT_GRAPHS": "yes"}),
    }
    argvs = [(_dart_argv(tiny_qwen3_dir, d, s, extra), env) for d, s, extra, env in cases.values()]
    *refused, accepted = refusals([*argvs, (_dart_argv(tiny_qwen3_dir, draft, store), {})])
    for expected, refusal in zip(cases, refused, strict=True):
        assert refusal is not None and expected in refusal, (expected, refusal)
    assert accepted is None


def test_linear_forms_are_chosen_at_start_up(qwen3_plain, qwen3_dart):
    """Target and drafter choose their CPU linear forms once loaded (`cpu/gemm_tuning`), and the requests
    of this module's tests found every choice made: no serving call timed a form (a serving-time choice
    is logged per bucket), so a fresh server computes a request as it will later."""
    for server, runners in ((qwen3_plain, 1), (qwen3_dart, 2)):
        log = server.log_text()
        assert len(re.findall(r"CPU linear forms chosen at start-up for \d+ weights", log)) == runners
        assert not re.findall(r"CPU linear \d+->\d+ \(.*\) uses ", log)
