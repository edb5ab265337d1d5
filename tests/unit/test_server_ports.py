"""The ports test servers get (free, and outside the range outgoing connections draw local ports from), what
an interrupted start leaves behind, and how much memory a started one holds."""

from __future__ import annotations

import socket
import subprocess
import sys

import psutil
import pytest

from sglang_dart import server_process
from sglang_dart.server_process import (
    NotEnoughMemory,
    SglangServer,
    _ephemeral_port_range,
    check_room_for,
    free_port,
)


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


HELD_MIB = 256


class _LauncherWithAWorker(SglangServer):
    """Like SGLang's launcher: most of the memory is held by a child process (its scheduler)."""

    def command(self) -> list[str]:
        worker = f"held = b'x' * ({HELD_MIB} << 20); print('up', flush=True); import time; time.sleep(120)"
        launcher = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {worker!r}])"
        return [sys.executable, "-c", launcher]


def test_a_servers_memory_counts_its_child_processes_and_the_room_check_refuses_what_does_not_fit(tmp_path):
    server = _LauncherWithAWorker("model", [], tmp_path / "log", device_args=[])
    command = server.command()
    server.proc = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True, text=True)
    try:
        assert server.proc.stdout.readline().strip() == "up"
        assert [p.pid for p in server.processes()][0] == server.proc.pid
        assert len(server.processes()) == 2  # the launcher and its worker
        held = server.resident_bytes()
        assert held >= HELD_MIB << 20
        check_room_for(0, server)
        check_room_for(1, server)  # 256 MiB and 1 GiB spare fit on any machine that runs the tests
        too_many = psutil.virtual_memory().available // held + 1
        with pytest.raises(NotEnoughMemory, match=f"{too_many} more server"):
            check_room_for(too_many, server)
    finally:
        server.stop()
    assert server.resident_bytes() == 0 and server.processes() == []
