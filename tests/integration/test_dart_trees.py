"""DART trees that the target accepts (a store of the target's own continuations): τ well above 1 under
both schedules, the engine and frontend programs, per-node logit processors, truncated sampling and
penalties, and tree sizes that change with the batch (fixed schedule, auto, the guarded default), all
lossless."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sglang_dart.dart.settings import TREE_SIZES_ENV
from sglang_dart.dart.tree_sizes import default_schedule
from sglang_dart.server_process import SglangServer, default_engine_kwargs, serving
from tests.support.dart_assets import build_random_drafter, build_store_from_ids
from tests.support.dart_serving import (
    SEED,
    assert_same_first_tokens,
    dart_server_args,
    run_all,
)
from tests.support.engine_run import run_engines
from tests.support.prompts_many import many_prompts

pytestmark = pytest.mark.server


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
    outputs = run_all(qwen3_plain, prompts, 8, n=48)
    documents = [
        tokenizer(p)["input_ids"] + out["output_ids"] for p, out in zip(prompts, outputs, strict=True)
    ]
    store = build_store_from_ids(tiny_qwen3_dir, root / "own.store", documents)
    draft = build_random_drafter(root / "draft", tiny_qwen3_dir, dart_ngram_at_level0=True)
    return prompts, outputs, dart_server_args(draft, store, tokens=8, topk=len(tokenizer))


@pytest.fixture(scope="module")
def tree_servers(tiny_qwen3_dir, own_store_assets, server_logs) -> Iterator[dict[str, SglangServer]]:
    """The module's DART servers whose trees predict the target, started side by side at the first one's
    use: "dart" with overlap scheduling (SGLang's default), metrics on and custom logit processors allowed;
    "sync", the same trees with `--disable-overlap-schedule`, stopped by its τ test."""
    dart_args = [*own_store_assets[2], "--enable-metrics"]
    variants = {
        "dart": ([*dart_args, "--enable-custom-logit-processor", *SEED], "qwen3-dart-features"),
        "sync": ([*dart_args, "--disable-overlap-schedule"], "qwen3-tau-sync"),
    }
    servers = {
        name: SglangServer(tiny_qwen3_dir, args, server_logs / f"{log}.log")
        for name, (args, log) in variants.items()
    }
    with serving(servers):
        yield servers


@pytest.fixture(scope="module")
def accepting_servers(tree_servers) -> dict[str, SglangServer]:
    """DART under both schedules SGLang offers: "overlap" (the feature tests' DART server) and "sync"."""
    return {"overlap": tree_servers["dart"], "sync": tree_servers["sync"]}


@pytest.fixture(scope="module")
def feature_servers(qwen3_plain, tree_servers) -> dict[str, SglangServer]:
    """A plain and a DART server (trees that predict the target) that take custom logit processors; the
    plain one is the session's (tests/integration/conftest.py says why it runs without overlap)."""
    return {"plain": qwen3_plain, "dart": tree_servers["dart"]}


@pytest.mark.parametrize("schedule", ["overlap", "sync"])
def test_drafts_are_accepted_when_the_store_knows_the_target(own_store_assets, accepting_servers, schedule):
    """Synthetic τ check: with the trees predicting the target, τ must be well above 1. If verification or
    bookkeeping rejected everything, τ would be 1. Under both schedules SGLang offers: with overlap (its
    default) SGLang appends a step's tokens to the requests one step late, so the worker must not read them
    from there; `--disable-overlap-schedule` runs every step synchronously."""
    prompts, outputs, _ = own_store_assets
    server = accepting_servers[schedule]
    try:
        info = requests.get(f"{server.url}/server_info", timeout=30).json()
        assert info["disable_overlap_schedule"] == (schedule == "sync")
        speculative = run_all(server, prompts, 4, n=48)
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
    finally:
        if schedule == "sync":  # the overlap server serves the feature tests too
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
    missing = str(tmp_path / "missing.store")
    results, error = run_engines(
        [
            (kwargs, prompts[:8], {"max_new_tokens": 48, "temperature": 0.0}),
            ({**kwargs, "speculative_ngram_external_corpus_path": missing}, prompts[:1], {}),
        ]
    )
    assert isinstance(results, list), results
    for got, want in zip(results, outputs[:8], strict=True):
        assert got["output_ids"] == want["output_ids"]
    emitted = sum(len(r["output_ids"]) for r in results)
    steps = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    assert emitted / steps > 1.5, f"mean accepted length {emitted / steps:.2f}"
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


def test_frontend_programs_run_on_dart(own_store_assets, qwen3_plain, feature_servers):
    """SGLang frontend programs against a DART server: every variable and the whole text equal the same
    program's against the plain server, run four at a time, with drafts accepted on the way. (The DART
    server is the τ and logit-processor tests' one: its extra flags do not touch these requests.)"""
    import sglang as sgl

    prompts = own_store_assets[0]
    program = _frontend_program()
    jobs = [{"prompt": p} for p in prompts[:8]]
    plain = program.run_batch(jobs, backend=sgl.RuntimeEndpoint(qwen3_plain.url), num_threads=4)
    server = feature_servers["dart"]
    spec = program.run_batch(jobs, backend=sgl.RuntimeEndpoint(server.url), num_threads=4)
    assert server.healthy()
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
    assert_same_first_tokens(feature_servers["plain"], feature_servers["dart"], params)


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


@pytest.fixture(scope="module")
def schedule_servers(tiny_qwen3_dir, own_store_assets, server_logs) -> Iterator[dict[str, SglangServer]]:
    """DART servers under three tree-size schedules (SGLANG_DART_TREE_SIZES): "1:16,4:1" (trees of up to
    16, `--speculative-num-draft-tokens 16`), "auto" and the guarded CPU default (unset), logging every
    decode step; started side by side at the first one's use."""
    args = [*own_store_assets[2], "--decode-log-interval", "1"]
    schedules = {
        "1:16,4:1": ("1:16,4:1", _with_draft_tokens(args, 16), "qwen3-tree-sizes"),
        "auto": ("auto", args, "qwen3-tree-sizes-auto"),
        "guarded default": (None, args, "qwen3-tree-sizes-guarded-default"),
    }
    servers = {
        name: SglangServer(tiny_qwen3_dir, argv, server_logs / f"{log}.log", env={TREE_SIZES_ENV: value})
        for name, (value, argv, log) in schedules.items()
    }
    with serving(servers):
        yield servers


def _with_draft_tokens(args: list[str], tokens: int) -> list[str]:
    """`args` with `--speculative-num-draft-tokens` set to `tokens`."""
    at = args.index("--speculative-num-draft-tokens") + 1
    return [*args[:at], str(tokens), *args[at + 1 :]]


def test_requests_that_run_to_the_context_limit_equal_plain(qwen3_plain, schedule_servers):
    """Requests with no max_new_tokens end where SGLang's context limit ends them, in trees of 16 (two at a
    time, below the schedule's switch). A speculative step reserves KV slots twice its largest tree past
    a request's committed tokens, so the last steps need the row headroom `gpu_contracts` adds (without
    it the CPU scheduler died of an IndexError here), and their trees must not reach positions past the
    target's RoPE table (the pruner's trees of 16 reach 8 deep, context chains 15)."""
    context = 2048  # the tiny Qwen3's max_position_embeddings: the server's context length
    longest = context - 7  # SGLang admits inputs of up to (context - 1) - 5 tokens, exclusive
    lengths = range(longest - 30, longest + 1, 10)
    prompts = [[10 + (i + k) % (3 + k) for i in range(n)] for k, n in enumerate(lengths)]  # periodic
    params = {"temperature": 0.0, "ignore_eos": True}
    plain = qwen3_plain.generate_many(prompts, params, concurrency=2)
    assert [len(p) + o["meta_info"]["completion_tokens"] for p, o in zip(prompts, plain, strict=True)] == [
        context - 2
    ] * len(prompts)
    server = schedule_servers["1:16,4:1"]
    spec = server.generate_many(prompts, params, concurrency=2)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert max(o["meta_info"]["spec_accept_length"] for o in spec) > 1  # trees ran, and drafts were kept
    assert server.healthy()


def test_tree_size_follows_the_batch_size(own_store_assets, schedule_servers):
    """Schedule 1:16,4:1: steps with 4 or more running requests verify the roots alone (accept length
    exactly 1 in the per-step log line), smaller batches draft trees of 16 again (accept length > 1).
    Requests of staggered lengths take the batch from 12 down to 1, through both switches, and stay
    lossless. Trees of 16 are the batch-1 default on AMX CPUs and GPUs; on the CPU engine their verify
    attention (16 queries a request, two 16-row tasks per KV head here) runs in the Rust kernel."""
    prompts, outputs, _ = own_store_assets
    results, log = _staggered_lossless_run(schedule_servers["1:16,4:1"], prompts, outputs)
    steps = [(int(bs), float(tau)) for bs, tau in _DECODE_LINE.findall(log)]
    big = [tau for bs, tau in steps if bs >= 6]  # margin: the logged count may trail the batch that ran
    small = [tau for bs, tau in steps if bs <= 2]
    assert big and all(tau == 1.0 for tau in big), steps
    assert small and max(small) > 1.0, steps
    _check_drafted_counts(results, {1, 16})
    longest = results[-1]["meta_info"]["spec_cap_lens_histogram"]
    assert longest[1] > 0 and longest[16] > 0, longest  # both kinds of step, so SGLang's N - 1 would be off


@pytest.mark.parametrize("sizes", ["auto", "guarded default"])
def test_adaptive_tree_size_stays_lossless(own_store_assets, schedule_servers, sizes):
    """SGLANG_DART_TREE_SIZES=auto measures every candidate size (1, 2, 4, 8) in each batch-size bucket
    before it settles, and the guarded CPU default its schedule's sizes against the root alone (float32:
    trees of 8 below batch 4, of 2 at 4-7), so a run whose batch shrinks from 12 to 1 switches between
    root-only steps (accept length exactly 1) and trees (accept length > 1) many times; every output must
    still be the target's."""
    prompts, outputs, _ = own_store_assets
    results, log = _staggered_lossless_run(schedule_servers[sizes], prompts, outputs)
    default = default_schedule("cpu", 8)  # a float32 target's, on any CPU
    _check_drafted_counts(results, {1, 2, 4, 8} if sizes == "auto" else {1, *default.sizes})
    expected = "auto" if sizes == "auto" else f"{default.describe()}, guarded"
    assert f"DART tree size by batch size: {expected}" in log
    taus = [float(tau) for _, tau in _DECODE_LINE.findall(log)]
    assert any(tau == 1.0 for tau in taus) and any(tau > 1.0 for tau in taus), taus


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
