"""The drafter pipeline end to end on a tiny target: the target regenerates its own answers through a real
server (`python -m sglang_dart.train.generate`), a drafter is trained on them (`python -m
sglang_dart.train`), and served: its drafts get accepted (so the taps it was trained on are the ones
SGLang captures at serving time) and the output stays the target's own greedy output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_dart.server_process import SglangServer, dart_flags, serving
from tests.support.dart_assets import build_random_drafter, build_store_for

pytestmark = pytest.mark.server


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _serve_each(
    target: Path, drafts: dict[str, Path], store: Path, logs: Path, prompts: list[list[int]]
) -> dict[str, list[dict]]:
    """Each drafter's answers to the prompts, from a DART server of its own; the servers start side by
    side (a start-up is mostly single-threaded imports)."""
    servers = {}
    for name, draft in drafts.items():
        args = [
            "--dtype", "float32",
            *dart_flags(draft, store),
            "--speculative-num-draft-tokens", "8",
            "--speculative-eagle-topk", "4",
        ]  # fmt: skip
        servers[name] = SglangServer(target, args, logs / f"pipeline-{name}.log")
    params = {"max_new_tokens": 32, "temperature": 0.0}
    with serving(servers):
        return {name: srv.generate_many(prompts, params, concurrency=8) for name, srv in servers.items()}


def _mean_accepted(outputs: list[dict]) -> float:
    return sum(len(o["output_ids"]) for o in outputs) / sum(o["meta_info"]["spec_verify_ct"] for o in outputs)


def test_generate_train_serve(tiny_qwen3_dir, tmp_path, server_logs):
    data = tmp_path / "data.jsonl"
    _run(
        "sglang_dart.train.generate",
        "--target", str(tiny_qwen3_dir), "--out", str(data),
        "--num-prompts", "96", "--max-new-tokens", "48", "--concurrency", "16", "--dtype", "float32",
    )  # fmt: skip
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 96 and all(len(r["input_ids"]) > r["prompt_len"] for r in rows)

    draft = tmp_path / "draft"
    _run(
        "sglang_dart.train",
        "--target", str(tiny_qwen3_dir), "--data", str(data), "--out", str(draft),
        "--draft-length", "3", "--draft-vocab-size", "256", "--max-steps", "400",
        "--anchors", "16", "--lr", "3e-3", "--no-bf16", "--target-dtype", "float32",
    )  # fmt: skip
    config = json.loads((draft / "config.json").read_text())
    assert config["draft_length"] == 3 and config["draft_vocab_size"] == 256
    report = json.loads((draft / "train_report.json").read_text())
    assert report["steps"] == 400 and report["held_out_sequences"] == 4 and report["train_sequences"] == 92
    assert report["args"]["row_decay"] == "0.5"  # DART's default γ, resolved before the report names it
    held_out = report["held_out"]  # the sequences kept out of training: the drafter learned the target
    assert 1.3 < held_out["tau_chain"] <= held_out["tau_topk_bound"] <= 3 + 1, held_out

    # The store holds unrelated text, so accepted drafts come from the drafter, not from the n-grams.
    store = build_store_for(tiny_qwen3_dir, tmp_path / "stdlib.store")
    prompts = [r["input_ids"][: r["prompt_len"]] for r in rows[:32]]
    expected = [r["input_ids"][r["prompt_len"] : r["prompt_len"] + 32] for r in rows[:32]]
    untrained = build_random_drafter(tmp_path / "random", tiny_qwen3_dir, draft_length=3)
    drafts = {"trained": draft, "random": untrained}
    answers = _serve_each(tiny_qwen3_dir, drafts, store, server_logs, prompts)
    trained, baseline = answers["trained"], answers["random"]
    for out, want in zip(trained, expected, strict=True):
        assert out["output_ids"] == want[: len(out["output_ids"])]
        assert len(out["output_ids"]) == len(want)
    tau_trained, tau_random = _mean_accepted(trained), _mean_accepted(baseline)
    assert tau_trained > 1.3 and tau_trained > tau_random + 0.2, (tau_trained, tau_random)


def _server_pids(model: Path) -> set[int]:
    """The SGLang servers running `model`: this worker's own test models, so that servers the other pytest
    worker starts meanwhile do not count."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"sglang.launch_server" in args and str(model).encode() in args:
            pids.add(int(proc.name))
    return pids


def test_stopped_generate_keeps_its_rows_and_its_server_goes(tiny_qwen3_dir, tmp_path):
    """SIGTERM mid-run: finished conversations stay in OUT.partial, OUT is never written, the server
    the command started (in a session of its own) is stopped with it and its log stays beside OUT."""
    before = _server_pids(tiny_qwen3_dir)
    out = tmp_path / "data.jsonl"
    partial = tmp_path / "data.jsonl.partial"
    cmd = [
        sys.executable, "-m", "sglang_dart.train.generate",
        "--target", str(tiny_qwen3_dir), "--out", str(out),
        "--num-prompts", "200", "--max-new-tokens", "200", "--concurrency", "2", "--dtype", "float32",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (partial.exists() and partial.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no conversation written in 10 minutes"
            time.sleep(0.5)
        assert _server_pids(tiny_qwen3_dir) - before, "the generate server is not found by its model path"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "conversations; they are in" in stderr, stderr[-2000:]
    assert not out.exists()
    assert "/generate HTTP" in (tmp_path / "generate-server.log").read_text()  # the log outlives the run
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    assert 2 <= len(rows) < 200 and all(len(r["input_ids"]) > r["prompt_len"] for r in rows)
    deadline = time.monotonic() + 60
    while _server_pids(tiny_qwen3_dir) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _server_pids(tiny_qwen3_dir) - before, "the generate server outlived its command"


def test_generate_with_magpie_prompts_resumes_where_it_stopped(tiny_llama_dir, tiny_server, tmp_path):
    """`--magpie`: user turns sampled from the target join the pool's prompts; the prompt list is saved,
    and a run started again after an interruption answers only what its partial output lacks. Both runs
    use a server that is already up (`--server-url`), as a run resumed on a serving machine would."""
    out = tmp_path / "data.jsonl"
    cmd = (
        "--target", str(tiny_llama_dir), "--out", str(out), "--num-prompts", "5", "--magpie", "4",
        "--max-new-tokens", "8", "--concurrency", "4", "--server-url", tiny_server.url,
    )  # fmt: skip
    first = _run("sglang_dart.train.generate", *cmd)
    assert "magpie: " in first.stderr and "prompts written by the target" in first.stderr, first.stderr
    prompts = json.loads((tmp_path / "data.jsonl.prompts.json").read_text())
    assert not (tmp_path / "data.jsonl.magpie.jsonl").exists()  # the sampled prompts' side file is folded in
    written = prompts[5:]  # after the pool's: the target's own (a random tiny model ends few of its turns)
    assert len(written) <= 4 and len(set(prompts)) == len(prompts)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts

    # As a killed run leaves it: three rows in OUT.partial, a cut-off line after them, no OUT.
    (tmp_path / "data.jsonl.partial").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:3]) + '{"prompt": "cut'
    )
    out.unlink()
    second = _run("sglang_dart.train.generate", *cmd)
    assert f"resuming: 3 of {len(prompts)}" in second.stderr, second.stderr
    assert "written by the target" not in second.stderr  # the saved list is answered, no new one sampled
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    assert resumed[:3] == rows[:3] and sorted(r["prompt"] for r in resumed) == sorted(prompts)
    assert f"wrote {len(prompts)} conversations" in second.stdout
    assert not (tmp_path / "generate-server.log").exists()  # no server of its own
    assert tiny_server.healthy()  # and the one it used is still serving


def test_generate_answers_chat_files_after_their_last_user_turn(tiny_llama_dir, tiny_server, tmp_path):
    """`generate --prompts` with OpenAI and ShareGPT rows: each answer follows the chat-templated turns up
    to the last user turn, greedy, as the target answers that conversation itself."""
    from transformers import AutoTokenizer

    from sglang_dart.train.generate import chat_prompt_ids

    turns = [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "import os"},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": turns + [{"role": "assistant", "content": "dropped"}]})
        + "\n"
        + json.dumps({"conversations": [{"from": "human", "value": "class A:"}]})
        + "\n"
        + json.dumps({"conversations": []})
        + "\n"
    )
    data = tmp_path / "data.jsonl"
    _run(
        "sglang_dart.train.generate",
        "--target", str(tiny_llama_dir), "--out", str(data), "--prompts", str(prompts),
        "--max-new-tokens", "8", "--concurrency", "2", "--server-url", tiny_server.url,
    )  # fmt: skip
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert [r["prompt"] for r in rows] == ["import os", "class A:"]
    # Each row records its conversation's turns (what `--follow-ups` continues from).
    assert rows[0]["messages"] == turns
    assert rows[1]["messages"] == [{"role": "user", "content": "class A:"}]
    expected = [chat_prompt_ids(tokenizer, turns), chat_prompt_ids(tokenizer, "class A:")]
    for row, prefix in zip(rows, expected, strict=True):
        assert row["prompt_len"] == len(prefix) and row["input_ids"][: len(prefix)] == prefix
        assert len(row["input_ids"]) > len(prefix)
