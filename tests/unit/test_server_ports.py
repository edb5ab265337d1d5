"""The ports test servers get: free, and outside the range outgoing connections draw local ports from."""

from __future__ import annotations

import socket

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
