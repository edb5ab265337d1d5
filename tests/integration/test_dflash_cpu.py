"""SGLang's builtin DFLASH (a parallel block drafter) serves on this CPU-only machine through the plugin,
with a drafter trained here by `python -m sglang_dart.train --format dflash`: its greedy output equals plain
decoding token for token (float32, 50 prompts, concurrency 8; 1 too in the nightly run), and drafts are
really accepted.

The drafter is trained here, beside the EAGLE3 module's (`peer_drafters`, tests/support/peer_training.py):
150 steps in float32 on the plain server's own greedy answers to the test prompts, so that it accepts enough
for the accept path (several tokens committed per verify step) to be exercised. Blocks of 4."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_dart.server_process import SglangServer
from tests.support.peer_training import DFLASH_ANSWER_TOKENS, DFLASH_BLOCK

pytestmark = pytest.mark.server

NEW_TOKENS = DFLASH_ANSWER_TOKENS
BLOCK = DFLASH_BLOCK


@pytest.fixture(scope="module")
def chat_prompts(smollm2_chat_prompts) -> list[list[int]]:
    return smollm2_chat_prompts


@pytest.fixture(scope="module")
def plain_answers(smollm2_plain_answers) -> list[list[int]]:
    return [answer[:NEW_TOKENS] for answer in smollm2_plain_answers]


@pytest.fixture(scope="module")
def dflash_drafter(peer_drafters) -> Path:
    """Trained through the CLI beside the EAGLE3 module's drafter (`peer_drafters`)."""
    trained = peer_drafters["dflash"]
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "top-1 by row" in trained.stdout and "ETA" in trained.stdout, trained.stdout[-2000:]  # progress
    return trained.out


@pytest.fixture(scope="module")
def dflash_server(smollm2_f32_dir, dflash_drafter, server_logs) -> Iterator[SglangServer]:
    args = [
        "--dtype", "float32", "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(dflash_drafter), "--max-running-requests", "8",
    ]  # fmt: skip
    server = SglangServer(smollm2_f32_dir, args, server_logs / "smollm2-dflash.log").start()
    yield server
    server.stop()


@pytest.mark.parametrize("concurrency", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_dflash_greedy_equals_plain(dflash_server, chat_prompts, plain_answers, concurrency):
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    outs = dflash_server.generate_many(chat_prompts, params, concurrency)
    for i, (out, want) in enumerate(zip(outs, plain_answers, strict=True)):
        assert out["output_ids"] == want, f"prompt {i}"
    # Speculation must really commit drafted tokens, or this would pass with DFLASH drafting nothing useful.
    emitted = sum(out["meta_info"]["completion_tokens"] for out in outs)
    steps = sum(out["meta_info"]["spec_verify_ct"] for out in outs)
    assert steps > 0
    print(f"DFLASH block {BLOCK}, concurrency {concurrency}: {emitted / steps:.2f} tokens per verify step")
    assert emitted / steps > 1.2, f"tokens per verify step {emitted / steps:.3f}"
    log = dflash_server.log_text()
    assert f"block_size={BLOCK}" in log and "attention_backend=torch_native" in log
    assert dflash_server.healthy()


def _untrained_drafter(out: Path, target_config: dict, **dflash: object) -> Path:
    """A DFLASH checkpoint in the trainer's layout for `target_config` (random weights), its dflash_config
    overridden by `dflash`."""
    from sglang_dart.train.dflash_model import DFlashDrafter, DFlashShape
    from sglang_dart.train.peer_dflash import draft_config, save

    config = draft_config(target_config, 1, BLOCK, 3, "<repo_name>")
    config["dflash_config"].update(dflash)
    save(DFlashDrafter(DFlashShape.from_config(config)), config, out)
    return out


def _launch_dflash(target: Path, draft: Path) -> subprocess.CompletedProcess:
    from sglang_dart.server_process import device_flag, free_port, run_launcher

    args = ["--model-path", str(target), *device_flag(), "--port", str(free_port()), "--dtype", "float32"]
    args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft)]
    return run_launcher(args)


@pytest.fixture(scope="module")
def refused_drafters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """The launcher's output for each bad drafter; the launches run side by side (each is mostly
    single-threaded imports) and each must fail."""
    target = json.loads((tiny_llama_dir / "config.json").read_text())
    root = tmp_path_factory.mktemp("bad-dflash")
    other = {**target, "hidden_size": 2 * target["hidden_size"], "intermediate_size": 32}
    drafts = {
        "mask outside": _untrained_drafter(root / "mask", target, mask_token_id=target["vocab_size"]),
        "another target": _untrained_drafter(root / "other", other),
    }
    with ThreadPoolExecutor(max_workers=len(drafts)) as pool:
        futures = {name: pool.submit(_launch_dflash, tiny_llama_dir, draft) for name, draft in drafts.items()}
        results = {name: future.result() for name, future in futures.items()}
    for name, result in results.items():
        assert result.returncode != 0, name
    return {name: result.stdout + result.stderr for name, result in results.items()}


@pytest.mark.standalone
def test_mask_id_outside_the_vocabulary_stops_the_server(refused_drafters):
    assert "DFLASH mask_token_id is outside the target vocab size" in refused_drafters["mask outside"]


@pytest.mark.standalone
def test_drafter_of_another_target_stops_the_server(refused_drafters):
    output = refused_drafters["another target"]
    assert "the DFLASH draft checkpoint was made for another target model: hidden_size" in output
