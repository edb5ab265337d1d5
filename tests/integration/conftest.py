"""Fixtures of the DART server tests, one instance per test module: a module's servers stop when its
last test is done, so that no more than a few servers are up at a time (each holds 1.5-4.5 GB)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_dart.server_process import SglangServer
from tests.support.dart_serving import SEED


@pytest.fixture(scope="module")
def qwen3_plain(tiny_qwen3_dir, server_logs) -> Iterator[SglangServer]:
    server = SglangServer(
        tiny_qwen3_dir, ["--dtype", "float32", *SEED], server_logs / "qwen3-plain.log"
    ).start()
    yield server
    server.stop()
