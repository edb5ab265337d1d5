"""DART through the real SGLang server on CPU: lossless greedy output at several batch sizes, drafts that
really get accepted, and clear start-up errors for what DART cannot run with."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sglang_dart.server_process import (
    SglangServer,
    dart_flags,
    default_engine_kwargs,
    device_flag,
    free_port,
    run_launcher,
)
from tests.support.dart_assets import build_random_drafter, build_store_for, build_store_from_ids
from tests.support.engine_run import run_engine
from tests.support.prompts_many import many_prompts

pytestmark = pytest.mark.server

NEW_TOKENS = 24


def _dart_args(draft: Path, store: Path, tokens: int = 8, topk: int = 4) -> list[str]:
    return [
        "--dtype",
        "float32",
        *dart_flags(draft, store),
        "--speculative-num-draft-tokens",
        str(tokens),
        "--speculative-eagle-topk",
        str(topk),
    ]


@pytest.fixture(scope="module")
def qwen3_assets(tiny_qwen3_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dart-qwen3")
    return build_random_drafter(root / "draft", tiny_qwen3_dir), build_store_for(
        tiny_qwen3_dir, root / "s.store"
    )


SEED = ["--random-seed", "0"]


@pytest.fixture(scope="module")
def qwen3_plain(tiny_qwen3_dir, server_logs) -> Iterator[SglangServer]:
    server = SglangServer(
        tiny_qwen3_dir, ["--dtype", "float32", *SEED], server_logs / "qwen3-plain.log"
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3_dart(tiny_qwen3_dir, qwen3_assets, server_logs) -> Iterator[SglangServer]:
    args = [*_dart_args(*qwen3_assets), *SEED]
    server = SglangServer(tiny_qwen3_dir, args, server_logs / "qwen3-dart.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3_dart_sync(tiny_qwen3_dir, qwen3_assets, server_logs) -> Iterator[SglangServer]:
    args = [*_dart_args(*qwen3_assets), *SEED, "--disable-overlap-schedule"]
    server = SglangServer(tiny_qwen3_dir, args, server_logs / "qwen3-dart-sync.log").start()
    yield server
    server.stop()


def _run_all(server: SglangServer, prompts: list[str], concurrency: int, n: int = NEW_TOKENS) -> list[dict]:
    payload = lambda p: {"text": p, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}  # noqa: E731
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: server.generate(payload(p)), prompts))


@pytest.mark.parametrize("schedule", ["overlap", "sync"])
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_qwen3_greedy_equals_plain(request, qwen3_plain, concurrency, schedule):
    """With overlap scheduling (SGLang's default) and without (`--disable-overlap-schedule`)."""
    dart = request.getfixturevalue("qwen3_dart" if schedule == "overlap" else "qwen3_dart_sync")
    prompts = many_prompts(56)
    reference = [out["output_ids"] for out in _run_all(qwen3_plain, prompts, 8)]
    speculative = _run_all(dart, prompts, concurrency)
    for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
        assert spec["output_ids"] == ref, prompt
        assert spec["meta_info"]["spec_verify_ct"] > 0
    assert dart.healthy()


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
# would visibly break.
LOW_TEMPERATURE = {"temperature": 0.1}


def _first_tokens(
    server: SglangServer, prompt: str, samples: int, length: int, params: dict
) -> list[list[int]]:
    out = server.generate(
        {
            "text": [prompt] * samples,
            "sampling_params": {"max_new_tokens": length, "ignore_eos": True, **params},
        },
        timeout=900,
    )
    return [o["output_ids"] for o in out]


def _assert_same_first_tokens(
    plain: SglangServer, spec: SglangServer, params: dict = LOW_TEMPERATURE
) -> None:
    """Two-sample chi-square homogeneity test on each of the first 3 sampled tokens. Each test at
    alpha = 1e-3; family-wise false-alarm rate <= 0.3%."""
    from scipy.stats import chi2_contingency

    samples, length, prompt = 600, 3, "def parse(line):"
    plain_out = _first_tokens(plain, prompt, samples, length, params)
    spec_out = _first_tokens(spec, prompt, samples, length, params)
    for pos in range(length):
        a = [o[pos] for o in plain_out]
        b = [o[pos] for o in spec_out]
        tokens = sorted(set(a) | set(b))
        table = [[a.count(t) for t in tokens], [b.count(t) for t in tokens]]
        # Merge rare tokens so every expected count is >= 5 (the test's validity condition).
        common = [i for i, t in enumerate(tokens) if table[0][i] + table[1][i] >= 10]
        rare = [i for i in range(len(tokens)) if i not in common]
        merged = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in table]
        merged = [
            [x for x, keep in zip(row, [*(True for _ in common), bool(rare)], strict=True) if keep]
            for row in merged
        ]
        assert len(merged[0]) >= 2, f"position {pos}: distribution too peaked to test"
        p_value = chi2_contingency(merged).pvalue
        assert p_value > 1e-3, f"position {pos}: p = {p_value:.2e}, tables {merged}"


def test_sampling_keeps_the_target_distribution(qwen3_plain, qwen3_dart):
    """The 2nd and 3rd sampled tokens come out of tree verification; all three must be distributed as
    plain sampling's."""
    _assert_same_first_tokens(qwen3_plain, qwen3_dart)


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


def test_streaming_load_with_random_aborts(qwen3_dart, qwen3_plain):
    """64 concurrent streaming requests, a third of them dropped mid-stream; then the server is healthy
    (SGLang's idle KV leak check would have killed the scheduler) and still lossless."""
    import random

    import requests

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
    assert [o["output_ids"] for o in _run_all(qwen3_dart, check, 4)] == [
        o["output_ids"] for o in _run_all(qwen3_plain, check, 4)
    ]
    assert "leak" not in qwen3_dart.log_text().lower()


SMOL_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_chat_ids(smollm2_f32_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tests.support.prompts import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_f32_dir)
    return [chat_ids(tokenizer, p) for p in many_prompts(50)]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_server, smollm2_chat_ids) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda x: smollm2_server.greedy_ids(x, SMOL_TOKENS), smollm2_chat_ids))


@pytest.fixture(scope="module")
def smollm2_dart(smollm2_f32_dir, tmp_path_factory, server_logs) -> Iterator[SglangServer]:
    root = tmp_path_factory.mktemp("dart-smollm2")
    draft = build_random_drafter(root / "draft", smollm2_f32_dir)
    store = build_store_for(smollm2_f32_dir, root / "smol.store")
    server = SglangServer(smollm2_f32_dir, _dart_args(draft, store), server_logs / "smollm2-dart.log").start()
    yield server
    server.stop()


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_smollm2_greedy_equals_plain(smollm2_dart, smollm2_chat_ids, smollm2_reference, concurrency):
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        spec = list(pool.map(lambda x: smollm2_dart.greedy_ids(x, SMOL_TOKENS), smollm2_chat_ids))
    for i, (got, want) in enumerate(zip(spec, smollm2_reference, strict=True)):
        assert got == want, f"prompt {i}"
    assert smollm2_dart.healthy()


def test_retracted_requests_resume_losslessly(
    tiny_qwen3_dir, qwen3_assets, qwen3_plain, server_logs, monkeypatch
):
    """SGLang's test switch retracts running requests every few steps; they come back through prefill and
    must rebuild their draft state from the slots SGLang re-assigns."""
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    server = SglangServer(
        tiny_qwen3_dir, [*_dart_args(*qwen3_assets), *SEED], server_logs / "qwen3-dart-retract.log"
    ).start()
    try:
        prompts = many_prompts(12)
        spec = [o["output_ids"] for o in _run_all(server, prompts, 12, n=40)]
        assert spec == [o["output_ids"] for o in _run_all(qwen3_plain, prompts, 12, n=40)]
        assert re.search(r"retraction\. #retracted_reqs: [1-9]", server.log_text())
        assert server.healthy()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def own_store_assets(
    tiny_qwen3_dir, qwen3_plain, tmp_path_factory
) -> tuple[list[str], list[dict], list[str]]:
    """Prompts, the plain server's greedy outputs, and DART args whose trees predict those outputs: a store
    of the target's own continuations, used from the first level on."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("own-store")
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompts = many_prompts(24)
    outputs = _run_all(qwen3_plain, prompts, 8, n=48)
    documents = [
        tokenizer(p)["input_ids"] + out["output_ids"] for p, out in zip(prompts, outputs, strict=True)
    ]
    store = build_store_from_ids(tiny_qwen3_dir, root / "own.store", documents)
    draft = build_random_drafter(root / "draft", tiny_qwen3_dir, dart_ngram_at_level0=True)
    return prompts, outputs, _dart_args(draft, store, tokens=8, topk=len(tokenizer))


@pytest.mark.parametrize("schedule", ["overlap", "sync"])
def test_drafts_are_accepted_when_the_store_knows_the_target(
    tiny_qwen3_dir, own_store_assets, server_logs, schedule
):
    """Synthetic τ check: with the trees predicting the target, τ must be well above 1. If verification or
    bookkeeping rejected everything, τ would be 1. Under both schedules SGLang offers: with overlap (its
    default) SGLang appends a step's tokens to the requests one step late, so the worker must not read them
    from there; `--disable-overlap-schedule` runs every step synchronously."""
    prompts, outputs, dart_args = own_store_assets
    sync = ["--disable-overlap-schedule"] if schedule == "sync" else []
    server = SglangServer(
        tiny_qwen3_dir, [*dart_args, *sync, "--enable-metrics"], server_logs / f"qwen3-tau-{schedule}.log"
    ).start()
    try:
        info = requests.get(f"{server.url}/server_info", timeout=30).json()
        assert info["disable_overlap_schedule"] == (schedule == "sync")
        speculative = _run_all(server, prompts, 4, n=48)
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()
    for spec, ref in zip(speculative, outputs, strict=True):
        assert spec["output_ids"] == ref["output_ids"]
    emitted = sum(len(o["output_ids"]) for o in speculative)
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in speculative)
    assert emitted / steps > 1.5, f"mean accepted length {emitted / steps:.2f}"
    _check_observability(speculative, metrics, server.log_text())


def _engine_kwargs(model: Path, cli_args: list[str]) -> dict:
    """sglang.Engine keyword arguments for a model and `--flag value` pairs."""
    flags = dict(zip(cli_args[::2], cli_args[1::2], strict=True))
    kwargs = {flag[2:].replace("-", "_"): int(v) if v.isdigit() else v for flag, v in flags.items()}
    base = {"model_path": str(model), **default_engine_kwargs()}
    return {**base, **kwargs}


def test_engine_runs_dart_losslessly(tiny_qwen3_dir, own_store_assets, tmp_path):
    """`sglang.Engine(speculative_algorithm="DART", ...)`: the offline entry point takes the server's
    arguments, gives the target's greedy output with drafts accepted, and refuses a bad configuration with
    an exception raised in the caller's process, naming the problem."""
    prompts, outputs, dart_args = own_store_assets
    kwargs = _engine_kwargs(tiny_qwen3_dir, dart_args)
    results = run_engine(kwargs, prompts[:8], {"max_new_tokens": 48, "temperature": 0.0})
    assert isinstance(results, list), results
    for got, want in zip(results, outputs[:8], strict=True):
        assert got["output_ids"] == want["output_ids"]
    emitted = sum(len(r["output_ids"]) for r in results)
    steps = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    assert emitted / steps > 1.5, f"mean accepted length {emitted / steps:.2f}"
    missing = str(tmp_path / "missing.store")
    error = run_engine({**kwargs, "speculative_ngram_external_corpus_path": missing}, prompts[:1], {})
    assert isinstance(error, str) and "does not exist" in error, error


def _frontend_program():
    import sglang as sgl

    @sgl.function
    def program(s, prompt):
        """Every frontend construct that reaches the server: free generation, a choice scored by prefill
        logprobs, forks sharing the prefix (radix cache), a regex and stop strings."""
        s += prompt
        s += sgl.gen("answer", max_tokens=32, temperature=0)
        s += "\nVerdict: " + sgl.select("verdict", choices=["yes", "no", "maybe"])
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f" ({i}) " + sgl.gen("branch", max_tokens=16, temperature=0)
        s += forks[0]["branch"] + forks[1]["branch"]
        s += "\nCount: " + sgl.gen("count", max_tokens=8, regex=r"[0-9]{1,4}", temperature=0)
        s += sgl.gen("tail", max_tokens=32, stop=["\n", "def"], temperature=0)

    return program


def test_frontend_programs_run_on_dart(tiny_qwen3_dir, own_store_assets, qwen3_plain, server_logs):
    """SGLang frontend programs against a DART server: every variable and the whole text equal the same
    program's against the plain server, run four at a time, with drafts accepted on the way."""
    import sglang as sgl

    prompts, _, dart_args = own_store_assets
    program = _frontend_program()
    jobs = [{"prompt": p} for p in prompts[:8]]
    plain = program.run_batch(jobs, backend=sgl.RuntimeEndpoint(qwen3_plain.url), num_threads=4)
    server = SglangServer(tiny_qwen3_dir, dart_args, server_logs / "qwen3-dart-frontend.log").start()
    try:
        spec = program.run_batch(jobs, backend=sgl.RuntimeEndpoint(server.url), num_threads=4)
        assert server.healthy()
    finally:
        server.stop()
    for got, want in zip(spec, plain, strict=True):
        assert got.error() is None and want.error() is None, (got.error(), want.error())
        for name in ("answer", "verdict", "count", "tail"):
            assert got[name] == want[name], name
        assert got.text() == want.text()
    answers = [state.get_meta_info("answer") for state in spec]
    emitted = sum(meta["completion_tokens"] for meta in answers)
    steps = sum(meta["spec_verify_ct"] for meta in answers)
    assert emitted / steps > 1.5, f"mean accepted length {emitted / steps:.2f}"


def _processor_requests(prompts: list[str], unconstrained: list[dict]) -> list[dict]:
    """Requests with SGLang's own custom logit processors, mixed in one batch: a history-reading one (no
    token of the last 6 repeated), a stateless one (the first unconstrained token of each of its prompts
    banned: one list for all, as that processor requires), and none."""
    from sglang.srt.sampling.custom_logit_processor import (
        DeepseekOCRNoRepeatNGramLogitProcessor,
        DisallowedTokensLogitsProcessor,
    )

    no_repeat = DeepseekOCRNoRepeatNGramLogitProcessor.to_str()
    disallow = DisallowedTokensLogitsProcessor.to_str()
    banned = sorted({free["output_ids"][0] for free in unconstrained[1::3]})
    requests_ = []
    for i, prompt in enumerate(prompts):
        params = {"max_new_tokens": 48, "temperature": 0.0}
        body = {"text": prompt, "sampling_params": params}
        if i % 3 == 0:
            params["custom_params"] = {"ngram_size": 1, "window_size": 6}
            body["custom_logit_processor"] = no_repeat
        elif i % 3 == 1:
            params["custom_params"] = {"token_ids": banned}
            body["custom_logit_processor"] = disallow
        requests_.append(body)
    return requests_


@pytest.fixture(scope="module")
def feature_servers(tiny_qwen3_dir, own_store_assets, server_logs) -> Iterator[dict[str, SglangServer]]:
    """A plain and a DART server (trees that predict the target) that take custom logit processors. The
    plain one runs without overlap scheduling: with it, SGLang's penalizers count a request's tokens one
    step late (they read its output while the step producing the newest token is still in flight), so
    penalties would lag by one token behind plain decoding's own definition, which DART follows."""
    flag = ["--enable-custom-logit-processor", *SEED]
    plain = ["--dtype", "float32", "--disable-overlap-schedule"]
    servers = {}
    try:
        for name, args in (("plain", plain), ("dart", own_store_assets[2])):
            log = server_logs / f"qwen3-{name}-features.log"
            servers[name] = SglangServer(tiny_qwen3_dir, [*args, *flag], log).start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _both(servers: dict[str, SglangServer], bodies: list[dict]) -> dict[str, list[dict]]:
    """Every request sent to both servers, all at once; then both must still be healthy."""
    outputs = {}
    for name, server in servers.items():
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            outputs[name] = list(pool.map(server.generate, bodies))
        assert server.healthy()
    for i, (spec, plain) in enumerate(zip(outputs["dart"], outputs["plain"], strict=True)):
        assert spec["output_ids"] == plain["output_ids"], (i, bodies[i]["sampling_params"])
        assert spec["meta_info"]["spec_verify_ct"] > 0
    return outputs


def test_custom_logit_processors_run_on_every_tree_node(feature_servers, own_store_assets):
    """`--enable-custom-logit-processor`: a processor changes what greedy decoding picks, at every tree
    node, so DART's output must still equal the plain server's with the same processor, including one
    that reads the request's history (which at a node must include the drafts on the path to it)."""
    prompts, unconstrained, _ = own_store_assets
    bodies = _processor_requests(prompts[:12], unconstrained[:12])
    outputs = _both(feature_servers, bodies)
    for i, (out, free) in enumerate(zip(outputs["dart"], unconstrained, strict=False)):
        ids = out["output_ids"]
        if i % 3 == 0:  # the processor's own guarantee: no token repeats one of the 6 before it
            assert all(ids[j] not in ids[max(0, j - 6) : j] for j in range(len(ids))), i
        else:  # banned first tokens change the output; no processor leaves it as it was
            assert (ids != free["output_ids"]) == (i % 3 == 1), i
    assert any(outputs["dart"][i]["output_ids"] != unconstrained[i]["output_ids"] for i in range(0, 12, 3))
    sampled = {**bodies[1], "sampling_params": {**bodies[1]["sampling_params"], "temperature": 1.0}}
    banned = set(sampled["sampling_params"]["custom_params"]["token_ids"])
    for seed in range(4):
        sampled["sampling_params"]["sampling_seed"] = seed
        assert not banned & set(feature_servers["dart"].generate(sampled)["output_ids"])


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.3, "top_k": 3, "top_p": 0.9},
        {"temperature": 0.5, "top_k": 4, "top_p": 0.8, "min_p": 0.05},
    ],
)
def test_truncated_sampling_keeps_the_target_distribution(feature_servers, params):
    """top-k, top-p and min-p sampling on a server whose trees predict the target, so that the 2nd and 3rd
    tokens often come from deeper tree nodes: each must be distributed as plain sampling's."""
    _assert_same_first_tokens(feature_servers["plain"], feature_servers["dart"], params)


def test_penalties_apply_per_tree_node(feature_servers, own_store_assets):
    """Frequency, presence and repetition penalties and min_new_tokens: at a tree node they must count
    the drafts on the path to it, as plain decoding counts every token it has output (SGLang's own
    speculative verify relaxes this), so greedy output equals the plain server's."""
    prompts, unconstrained, _ = own_store_assets
    penalties = [
        {"frequency_penalty": 0.8},
        {"presence_penalty": 1.2},
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 0.4, "repetition_penalty": 1.2},
        {},
    ]
    bodies = []
    for i, prompt in enumerate(prompts[:15]):
        params = {"max_new_tokens": 48, "temperature": 0.0, **penalties[i % len(penalties)]}
        bodies.append({"text": prompt, "sampling_params": params})
    for body, free in zip(bodies[10:12], unconstrained[10:12], strict=True):
        # a stop token the unconstrained answer produces early, held back until 12 tokens are out
        body["sampling_params"].update(min_new_tokens=12, stop_token_ids=[free["output_ids"][3]])
    outputs = _both(feature_servers, bodies)
    penalized_ = [i for i, body in enumerate(bodies) if len(body["sampling_params"]) > 2]
    changed = [outputs["plain"][i]["output_ids"] != unconstrained[i]["output_ids"] for i in penalized_]
    assert sum(changed) >= len(penalized_) // 2, changed  # the penalties are strong enough to matter


_DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?accept len: ([\d.]+)")


def _staggered_lossless_run(
    server: SglangServer, prompts: list[str], outputs: list[dict]
) -> tuple[list[dict], str]:
    """12 concurrent greedy requests of 4, 8, ... 48 tokens, so the running batch shrinks from 12 to 1;
    each output must be a prefix of the target's own. Stops the server; returns the outputs and its log."""
    lengths = [4 + 4 * i for i in range(12)]  # up to the 48 tokens of the reference outputs
    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            results = list(
                pool.map(
                    lambda p, n: server.generate(
                        {"text": p, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}
                    ),
                    prompts[:12],
                    lengths,
                )
            )
        log = server.log_text()
        assert server.healthy()
    finally:
        server.stop()
    for out, ref, n in zip(results, outputs[:12], lengths, strict=True):
        assert out["output_ids"] == ref["output_ids"][:n]
    return results, log


def test_tree_size_follows_the_batch_size(tiny_qwen3_dir, own_store_assets, server_logs, monkeypatch):
    """Schedule 1:8,4:1: steps with 4 or more running requests verify the roots alone (accept length
    exactly 1 in the per-step log line), smaller batches draft trees again (accept length > 1). Requests of
    staggered lengths take the batch from 12 down to 1, through both switches, and stay lossless."""
    monkeypatch.setenv("SGLANG_DART_TREE_SIZES", "1:8,4:1")
    prompts, outputs, dart_args = own_store_assets
    args = [*dart_args, "--decode-log-interval", "1"]
    server = SglangServer(tiny_qwen3_dir, args, server_logs / "qwen3-tree-sizes.log").start()
    results, log = _staggered_lossless_run(server, prompts, outputs)
    steps = [(int(bs), float(tau)) for bs, tau in _DECODE_LINE.findall(log)]
    big = [tau for bs, tau in steps if bs >= 6]  # margin: the logged count may trail the batch that ran
    small = [tau for bs, tau in steps if bs <= 2]
    assert big and all(tau == 1.0 for tau in big), steps
    assert small and max(small) > 1.0, steps
    _check_drafted_counts(results, {1, 8})
    longest = results[-1]["meta_info"]["spec_cap_lens_histogram"]
    assert longest[1] > 0 and longest[8] > 0, longest  # both kinds of step, so SGLang's N - 1 would be off


@pytest.mark.parametrize("sizes", ["auto", "guarded default"])
def test_adaptive_tree_size_stays_lossless(tiny_qwen3_dir, own_store_assets, server_logs, monkeypatch, sizes):
    """SGLANG_DART_TREE_SIZES=auto measures every candidate size (1, 2, 4, 8) in each batch-size bucket
    before it settles, and the guarded CPU default its schedule's size against the root alone (float32:
    trees of 8 below batch 4), so a run whose batch shrinks from 12 to 1 switches between root-only steps
    (accept length exactly 1) and trees (accept length > 1) many times; every output must still be the
    target's."""
    if sizes == "auto":
        monkeypatch.setenv("SGLANG_DART_TREE_SIZES", "auto")
    else:
        monkeypatch.delenv("SGLANG_DART_TREE_SIZES", raising=False)
    prompts, outputs, dart_args = own_store_assets
    args = [*dart_args, "--decode-log-interval", "1"]
    log_name = f"qwen3-tree-sizes-{sizes.replace(' ', '-')}.log"
    server = SglangServer(tiny_qwen3_dir, args, server_logs / log_name).start()
    results, log = _staggered_lossless_run(server, prompts, outputs)
    _check_drafted_counts(results, {1, 2, 4, 8} if sizes == "auto" else {1, 8})
    expected = "auto" if sizes == "auto" else "1:8,4:1, guarded"
    assert f"DART tree size by batch size: {expected}" in log
    taus = [float(tau) for _, tau in _DECODE_LINE.findall(log)]
    assert any(tau == 1.0 for tau in taus) and any(tau > 1.0 for tau in taus), taus


def test_default_tree_sizes_follow_the_loaded_dtype(
    tiny_qwen3_dir, qwen3_assets, server_logs, monkeypatch, tmp_path
):
    """With no schedule set, the worker picks the CPU default from the dtype the target was loaded in, not
    from --dtype: a model whose config says bf16, served with --dtype auto, gets `cpu-amx`'s schedule on a
    CPU with AMX tiles, `cpu-avx512-bf16`'s on one with AVX512-BF16 only (the plain CPU one elsewhere)."""
    from sglang_dart.dart.adaptive_sizes import GuardedTreeSizes
    from sglang_dart.dart.settings import cpu_has_amx_bf16, cpu_has_avx512_bf16
    from sglang_dart.dart.tree_sizes import default_schedule, default_schedule_key

    monkeypatch.delenv("SGLANG_DART_TREE_SIZES", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    model = tmp_path / "qwen3-bf16"
    shutil.copytree(tiny_qwen3_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    draft, store = qwen3_assets
    key = default_schedule_key("cpu", "torch.bfloat16", cpu_has_amx_bf16(), cpu_has_avx512_bf16())
    expected = GuardedTreeSizes(default_schedule(key, 8))  # on a CPU the default is guarded
    args = [*_dart_args(draft, store), "--dtype", "auto"]  # the later --dtype wins
    server = SglangServer(model, args, server_logs / "qwen3-bf16-default-sizes.log").start()
    try:
        out = server.generate({"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        log = server.log_text()
    finally:
        server.stop()
    assert len(out["output_ids"]) == 4
    assert f"DART tree size by batch size: {expected.describe()}\n" in log, expected.describe()
    # No Rust product for bf16 weights, so torch's OpenMP workers keep their spinning (1.4x, run 20).
    assert "Rust few-row linears off; GOMP_SPINCOUNT unset" in log


def test_openmp_spinning_is_off_for_a_float32_target(qwen3_dart):
    """The launcher keeps torch's OpenMP workers from spinning where the Rust product takes the linears
    (float32 weights), so that they leave the core to its helper threads."""
    if "GOMP_SPINCOUNT" in os.environ:
        pytest.skip("GOMP_SPINCOUNT is set for the test run; the launcher keeps a value the user sets")
    assert "Rust few-row linears on; GOMP_SPINCOUNT=0" in qwen3_dart.log_text()


def test_root_only_steps_are_plain_decoding(
    tiny_qwen3_dir, qwen3_assets, qwen3_plain, server_logs, monkeypatch
):
    """Schedule 1:1, every step verifies the roots alone. Such steps run as SGLang's own decode forward
    and sampler, except for batches with logprobs or a grammar, which take the size-1 verify path. Both
    must match the plain server: greedy tokens, sampled distribution, logprobs, constrained output."""
    monkeypatch.setenv("SGLANG_DART_TREE_SIZES", "1:1")
    args = [*_dart_args(*qwen3_assets), *SEED]
    server = SglangServer(tiny_qwen3_dir, args, server_logs / "qwen3-root-only.log").start()
    try:
        prompts = many_prompts(16)
        reference = [out["output_ids"] for out in _run_all(qwen3_plain, prompts, 4)]
        speculative = _run_all(server, prompts, 4)
        for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
            assert spec["output_ids"] == ref, prompt
            assert spec["meta_info"]["spec_verify_ct"] > 0
            assert spec["meta_info"]["spec_num_correct_drafts"] == 0  # roots only, nothing drafted
            assert spec["meta_info"]["spec_num_proposed_drafts"] == 0
            assert spec["meta_info"]["spec_cap_length"] == 1.0
        _assert_same_first_tokens(qwen3_plain, server)

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


def _check_observability(outputs: list[dict], metrics: str, log: str) -> None:
    """τ and the drafted/accepted counts reach meta_info, /metrics and the decode log line, and agree
    with what was emitted."""
    for out in outputs:
        meta = out["meta_info"]
        emitted, steps = len(out["output_ids"]), meta["spec_verify_ct"]
        assert meta["spec_accept_length"] == pytest.approx(emitted / steps)
        # prefill emits one token, every verify step its accepted drafts plus one of the target's own (the
        # last step may accept more than max_new_tokens lets out)
        assert meta["spec_num_correct_drafts"] >= emitted - 1 - steps > 0
    _check_drafted_counts(outputs, {8})
    for name in ("sglang:spec_accept_length", "sglang:spec_cap_length"):
        gauge = [line for line in metrics.splitlines() if line.startswith(name)]
        assert gauge and float(gauge[0].rsplit(" ", 1)[1]) > 1.0, gauge
    assert "accept len:" in log and "cap len:" in log


def _check_drafted_counts(outputs: list[dict], tree_sizes: set[int]) -> None:
    """Each request's drafted count is what its steps verified less one root per step (SGLang's own count
    assumes N - 1 drafts at every step), its accept rate the accepted share of those drafts."""
    for out in outputs:
        meta = out["meta_info"]
        steps = meta["spec_verify_ct"]
        sizes = meta["spec_cap_lens_histogram"]  # steps by tokens verified per step
        assert sum(sizes) == steps and {n for n, count in enumerate(sizes) if count} <= tree_sizes, sizes
        verified = sum(n * count for n, count in enumerate(sizes))
        assert meta["spec_cap_length"] == pytest.approx(verified / steps)
        proposed = verified - steps
        assert meta["spec_num_proposed_drafts"] == proposed
        assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / max(proposed, 1))


def _launch_dart(model: Path, draft: Path | None, store: Path | None, extra: list[str] = ()) -> str:
    args = ["--model-path", str(model), *device_flag(), "--port", str(free_port()), "--dtype", "float32"]
    args += ["--max-total-tokens", "4096", "--speculative-algorithm", "DART", *extra]
    if draft is not None:
        args += ["--speculative-draft-model-path", str(draft)]
    if store is not None:
        args += ["--speculative-ngram-external-corpus-path", str(store)]
    result = run_launcher(args, timeout=300)
    assert result.returncode != 0
    return result.stdout + result.stderr


def test_startup_errors_name_the_problem(tiny_qwen3_dir, smollm2_f32_dir, qwen3_assets, tmp_path):
    draft, store = qwen3_assets
    assert "--speculative-draft-model-path" in _launch_dart(tiny_qwen3_dir, None, store)
    assert "--speculative-ngram-external-corpus-path" in _launch_dart(tiny_qwen3_dir, draft, None)
    assert "does not exist" in _launch_dart(tiny_qwen3_dir, draft, tmp_path / "missing.store")
    corrupt = tmp_path / "corrupt.store"
    corrupt.write_bytes(store.read_bytes()[:100])
    assert "unusable" in _launch_dart(tiny_qwen3_dir, draft, corrupt)
    # A drafter trained for another target: hidden size and vocabulary do not fit.
    foreign_draft = build_random_drafter(tmp_path / "smol-draft", smollm2_f32_dir)
    assert "hidden_size" in _launch_dart(tiny_qwen3_dir, foreign_draft, store)
    # A drafter whose config.json names another architecture: SGLang would load another model class.
    other_arch = build_random_drafter(tmp_path / "arch", tiny_qwen3_dir, architectures=["LlamaForCausalLM"])
    assert "LlamaForCausalLMDart" in _launch_dart(tiny_qwen3_dir, other_arch, store)
    # A store built with another tokenizer (SmolLM2's, 49152 ids) for the tiny Qwen3 (512 ids).
    foreign_store = build_store_for(smollm2_f32_dir, tmp_path / "smol.store", texts=["def f(x): return x"])
    assert "vocabulary" in _launch_dart(tiny_qwen3_dir, draft, foreign_store)
    assert "--tp-size" in _launch_dart(tiny_qwen3_dir, draft, store, ["--tp-size", "2"])
    hidden = ["--return-hidden-states-mode", "last"]  # the newer spelling of --enable-return-hidden-states
    assert "--enable-return-hidden-states" in _launch_dart(tiny_qwen3_dir, draft, store, hidden)
    workers = ["--tokenizer-worker-num", "2"]  # would start tokenizer processes that cannot resolve DART
    assert "does not support --tokenizer-worker-num" in _launch_dart(tiny_qwen3_dir, draft, store, workers)


def test_chunked_prefill_and_stop_strings(tiny_qwen3_dir, qwen3_assets, qwen3_plain, server_logs):
    """Prompts longer than the prefill chunk (the draft entry at each chunk boundary is recomputed from the
    stored residual) and stop strings give the plain server's output."""
    args = [*_dart_args(*qwen3_assets), *SEED, "--chunked-prefill-size", "16"]
    server = SglangServer(tiny_qwen3_dir, args, server_logs / "qwen3-dart-chunked.log").start()
    try:
        long_prompts = [p * 4 for p in many_prompts(8)]
        spec_ids = [o["output_ids"] for o in _run_all(server, long_prompts, 4)]
        assert spec_ids == [o["output_ids"] for o in _run_all(qwen3_plain, long_prompts, 4)]
        greedy = {"max_new_tokens": 24, "temperature": 0.0}
        free_text = qwen3_plain.generate({"text": long_prompts[0], "sampling_params": greedy})["text"]
        body = {"text": long_prompts[0], "sampling_params": {**greedy, "stop": free_text[5:8]}}
        spec, plain = server.generate(body), qwen3_plain.generate(body)
        assert spec["text"] == plain["text"]
        assert spec["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
        assert plain["meta_info"]["finish_reason"]["type"] == "stop"
    finally:
        server.stop()
