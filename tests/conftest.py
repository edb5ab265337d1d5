"""Shared fixtures: test models built on the fly or converted from a PyPI wheel, real SGLang servers, and
the one-process set-up SGLang's model code needs when a test builds a model in process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_dart.server_process import SglangServer, free_port, serving
from tests.support.tiny_models import build_tiny_model

# The servers must start with nothing set by hand: the package alone switches SGLang to its CPU engine.
for _var in ("SGLANG_USE_CPU_ENGINE", "SGLANG_DART_CPU"):
    os.environ.pop(_var, None)
# DART servers verify full trees at every batch size unless a test asks for a schedule (monkeypatch), so
# the lossless checks at batch 16 exercise tree verification, not the root-only steps that a batch-size
# schedule would switch to.
os.environ["SGLANG_DART_TREE_SIZES"] = "fixed"
# DART servers on this CPU run with overlap scheduling, the path a GPU server takes by default (on a CPU
# DART turns it off unless told); tests of the synchronous path pass --disable-overlap-schedule.
os.environ["SGLANG_DART_CPU_OVERLAP"] = "1"
# DART servers assert their bookkeeping invariants and their host-read budget every step
# (sglang_dart/dart/worker.py, host_reads.py).
os.environ["SGLANG_DART_CHECKS"] = "1"
# Every server checks SGLang's own KV-pool invariants after each busy step (no leaked or double-freed slot).
os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def smollm2_f32_dir() -> Path:
    from sglang_dart.assets import smollm2_dir

    return smollm2_dir("float32")


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[SglangServer]:
    server = SglangServer(tiny_llama_dir, ["--dtype", "float32"], server_logs / "tiny.log")
    with serving({"tiny": server}):
        yield server


# The SmolLM2 speculative modules (DART, EAGLE3, DFLASH) check the same 50 chat prompts against one set of
# plain answers: the longest any of them needs; a module that decodes fewer tokens compares with a prefix
# (greedy decoding's first n tokens do not depend on max_new_tokens).
SMOLLM2_PROMPTS = 50
SMOLLM2_PLAIN_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2_chat_prompts(smollm2_f32_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tests.support.prompts import chat_ids
    from tests.support.prompts_many import many_prompts

    tokenizer = AutoTokenizer.from_pretrained(smollm2_f32_dir)
    return [chat_ids(tokenizer, p) for p in many_prompts(SMOLLM2_PROMPTS)]


@pytest.fixture(scope="session")
def smollm2_plain_answers(
    smollm2_f32_dir: Path, smollm2_chat_prompts: list[list[int]], server_logs: Path
) -> list[list[int]]:
    """A plain server's greedy answers (SMOLLM2_PLAIN_TOKENS tokens at most) to smollm2_chat_prompts. The
    server stops once they are in: a SmolLM2 server holds about 5.6 GB, which the later modules need."""
    params = {"max_new_tokens": SMOLLM2_PLAIN_TOKENS, "temperature": 0.0}
    plain = SglangServer(smollm2_f32_dir, ["--dtype", "float32"], server_logs / "smollm2.log")
    with serving({"plain": plain}):
        outs = plain.generate_many(smollm2_chat_prompts, params, concurrency=8)
    return [out["output_ids"] for out in outs]


# tryfirst: xdist reads the groups in its own collection hook.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`, scripts/test.sh) every server test goes to one worker, in
    file order, and the unit tests run on the other, with the `standalone` server tests (launcher refusals,
    the port race: they share no server). The shared-server tests keep about one core busy; two workers of
    them would each start their own servers and hold twice the memory (about 17 GB at the peak for one)."""
    servers = pytest.mark.xdist_group("servers")
    for item in items:
        if "integration" in item.path.parts and item.get_closest_marker("standalone") is None:
            item.add_marker(servers)


@pytest.fixture(scope="module")
def sglang_single_process(tiny_llama_dir: Path) -> Iterator[None]:
    """What a scheduler process sets up before it builds a model: its server arguments published and a
    (one-process, gloo) tensor-parallel group, which SGLang's parallel linear layers consult."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    if parallel_state.model_parallel_is_initialized():
        pytest.skip("this process already has a model-parallel group")
    with get_context().preserve_config():
        get_context().set_server_args(
            ServerArgs(model_path=str(tiny_llama_dir), device="cpu", dtype="float32")
        )
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, backend="gloo")
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
