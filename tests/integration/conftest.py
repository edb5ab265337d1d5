"""Fixtures of the DART server tests. The plain tiny-Qwen3 server is one for the whole run (the DART
modules each compare with it; about 2 GB); the DART servers are one per test module, stopped when its last
test is done, so that no more than a few servers are up at a time (each holds 2-4 GB)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sglang_dart.server_process import SglangServer
from tests.support.dart_serving import SEED


@pytest.fixture(scope="session")
def qwen3_plain(tiny_qwen3_dir, server_logs) -> Iterator[SglangServer]:
    server = SglangServer(
        tiny_qwen3_dir, ["--dtype", "float32", *SEED], server_logs / "qwen3-plain.log"
    ).start()
    yield server
    server.stop()
