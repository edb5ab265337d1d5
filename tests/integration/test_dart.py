"""DART through the real SGLang server on CPU: lossless greedy output at several batch sizes, drafts that
really get accepted, and clear start-up errors for what DART cannot run with."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_dart.server_process import SglangServer, free_port, run_launcher
from tests.support.dart_assets import build_random_drafter, build_store_for, build_store_from_ids
from tests.support.prompts_many import many_prompts

pytestmark = pytest.mark.server

NEW_TOKENS = 24


def _dart_args(draft: Path, store: Path, tokens: int = 8, topk: int = 4) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--speculative-algorithm",
        "DART",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-ngram-external-corpus-path",
        str(store),
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


@pytest.fixture(scope="module")
def qwen3_plain(tiny_qwen3_dir, server_logs) -> Iterator[SglangServer]:
    server = SglangServer(tiny_qwen3_dir, ["--dtype", "float32"], server_logs / "qwen3-plain.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3_dart(tiny_qwen3_dir, qwen3_assets, server_logs) -> Iterator[SglangServer]:
    server = SglangServer(tiny_qwen3_dir, _dart_args(*qwen3_assets), server_logs / "qwen3-dart.log").start()
    yield server
    server.stop()


def _run_all(server: SglangServer, prompts: list[str], concurrency: int, n: int = NEW_TOKENS) -> list[dict]:
    payload = lambda p: {"text": p, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}  # noqa: E731
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: server.generate(payload(p)), prompts))


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_qwen3_greedy_equals_plain(qwen3_plain, qwen3_dart, concurrency):
    prompts = many_prompts(56)
    reference = [out["output_ids"] for out in _run_all(qwen3_plain, prompts, 8)]
    speculative = _run_all(qwen3_dart, prompts, concurrency)
    for prompt, spec, ref in zip(prompts, speculative, reference, strict=True):
        assert spec["output_ids"] == ref, prompt
        assert spec["meta_info"]["spec_verify_ct"] > 0
    assert qwen3_dart.healthy()


def test_drafts_are_accepted_when_the_store_knows_the_target(
    tiny_qwen3_dir, qwen3_plain, tmp_path, server_logs
):
    """Synthetic τ check: a store of the target's own greedy continuations, used from the first level on,
    makes the trees predict the target. If verification or bookkeeping rejected everything, τ would be 1."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompts = many_prompts(24)
    outputs = _run_all(qwen3_plain, prompts, 8, n=48)
    documents = [
        tokenizer(p)["input_ids"] + out["output_ids"] for p, out in zip(prompts, outputs, strict=True)
    ]
    store = build_store_from_ids(tiny_qwen3_dir, tmp_path / "own.store", documents)
    draft = build_random_drafter(tmp_path / "draft", tiny_qwen3_dir, dart_ngram_at_level0=True)
    vocab = len(tokenizer)
    server = SglangServer(
        tiny_qwen3_dir, _dart_args(draft, store, tokens=8, topk=vocab), server_logs / "qwen3-tau.log"
    ).start()
    try:
        speculative = _run_all(server, prompts, 4, n=48)
    finally:
        server.stop()
    for spec, ref in zip(speculative, outputs, strict=True):
        assert spec["output_ids"] == ref["output_ids"]
    emitted = sum(len(o["output_ids"]) for o in speculative)
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in speculative)
    assert emitted / steps > 1.5, f"mean accepted length {emitted / steps:.2f}"


def _launch_dart(model: Path, draft: Path | None, store: Path | None, extra: list[str] = ()) -> str:
    args = ["--model-path", str(model), "--device", "cpu", "--port", str(free_port()), "--dtype", "float32"]
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
    # A store built with another tokenizer (SmolLM2's, 49152 ids) for the tiny Qwen3 (512 ids).
    foreign_store = build_store_for(smollm2_f32_dir, tmp_path / "smol.store", texts=["def f(x): return x"])
    assert "vocabulary" in _launch_dart(tiny_qwen3_dir, draft, foreign_store)
    assert "--tp-size" in _launch_dart(tiny_qwen3_dir, draft, store, ["--tp-size", "2"])
