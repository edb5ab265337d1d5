"""The ports test servers get (free, and outside the range outgoing connections draw local ports from), and
what an interrupted start leaves behind."""

from __future__ import annotations

import socket
import sys

import pytest

from sglang_dart import server_process
from sglang_dart.server_process import SglangServer, _ephemeral_port_range, free_port


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    low, high = _ephemeral_port_range()
    for _ in range(50):
        port = free_port()
        assert not low <= port <= high, port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_server_command_names_its_own_rendezvous_port(tmp_path):
    server = SglangServer("model", ["--dtype", "float32"], tmp_path / "log", device_args=[])
    command = server.command()
    nccl = int(command[command.index("--nccl-port") + 1])
    assert nccl != server.port and int(command[command.index("--port") + 1]) == server.port


def test_a_rendezvous_port_the_caller_gives_is_kept(tmp_path):
    server = SglangServer("model", ["--nccl-port", "29999"], tmp_path / "log", device_args=[])
    assert server.command().count("--nccl-port") == 1


@pytest.mark.parametrize(
    ("dp_args", "named"),
    [
        (["--dp-size", "2"], False),
        (["--dp-size=2"], False),
        (["--data-parallel-size", "4"], False),
        (["--dp-size", "1"], True),
        ([], True),
    ],
)
def test_data_parallel_replicas_choose_their_own_rendezvous_ports(tmp_path, dp_args, named):
    """SGLang gives every data-parallel replica the --nccl-port it is given, and the second cannot bind it."""
    server = SglangServer("model", ["--dtype", "float32", *dp_args], tmp_path / "log", device_args=[])
    assert ("--nccl-port" in server.command()) == named


class _SleepingServer(SglangServer):
    """A launch that never becomes healthy: a real child process in its own session."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(120)"]


def test_a_start_interrupted_stops_the_half_started_server(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM made SystemExit) while a server starts: no server is handed back for the caller
    to stop, so the half-started one must not outlive the program."""
    server = _SleepingServer("model", [], tmp_path / "log", device_args=[])

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(server_process.requests, "get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start(timeout=60)
    assert server.proc is not None and server.proc.poll() is not None
