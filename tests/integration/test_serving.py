"""Stock SGLang serving on CPU through its real entry points: HTTP, OpenAI API, frontend language."""

from __future__ import annotations

import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sglang_dart.server_process import SglangServer
from tests.support.idle_cpu import SLEEPING_AT_MOST, idle_scheduler_cores

pytestmark = pytest.mark.server

PROMPTS = [f"def function_{i}(value):\n    return value" + " +" * (i % 5) for i in range(16)]


def _greedy(server, text: str, n: int = 24) -> dict:
    return server.generate({"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}})


def test_generate_returns_requested_length(tiny_server):
    out = _greedy(tiny_server, "hello world", 20)
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    again = _greedy(tiny_server, "hello world", 20)
    assert again["output_ids"] == out["output_ids"], "greedy decoding must be deterministic"


def test_concurrent_requests_match_sequential(tiny_server):
    sequential = [_greedy(tiny_server, p)["output_ids"] for p in PROMPTS]
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        parallel = list(pool.map(lambda p: _greedy(tiny_server, p)["output_ids"], PROMPTS))
    assert parallel == sequential
    assert tiny_server.healthy()


def test_openai_chat_streaming(tiny_server):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    pieces, finished = [], None
    with requests.post(f"{tiny_server.url}/v1/chat/completions", json=body, stream=True, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            pieces.append(choice["delta"].get("content") or "")
            finished = choice.get("finish_reason") or finished
    assert finished in ("length", "stop")
    streamed = "".join(pieces)
    body["stream"] = False
    whole = requests.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=120).json()
    assert streamed == whole["choices"][0]["message"]["content"]


def test_client_abort_mid_stream_keeps_server_healthy(tiny_server):
    payload = {
        "text": "abort me",
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    rng = random.Random(0)
    for _ in range(4):
        with requests.post(f"{tiny_server.url}/generate", json=payload, stream=True, timeout=120) as resp:
            chunks = 0
            for line in resp.iter_lines():
                if line.startswith(b"data:"):
                    chunks += 1
                if chunks >= rng.randint(1, 6):
                    break  # leaving the block closes the connection mid-stream
    assert tiny_server.healthy()
    assert len(_greedy(tiny_server, "still alive", 8)["output_ids"]) == 8


def test_frontend_program(tiny_server):
    import sglang as sgl

    @sgl.function
    def complete(s, prefix):
        s += prefix
        s += sgl.gen("answer", max_tokens=12, temperature=0)

    backend = sgl.RuntimeEndpoint(tiny_server.url)
    state = complete.run(prefix="def add(a, b):", backend=backend)
    direct = _greedy(tiny_server, "def add(a, b):", 12)
    assert state["answer"] == direct["text"]


def test_an_idle_server_sleeps_instead_of_polling(tiny_server):
    """Launched without --sleep-on-idle (as a user would), a CPU server's scheduler waits for requests
    instead of polling a core (the plugin turns SGLang's idle sleeper on), and still answers at once."""
    assert "--sleep-on-idle" not in tiny_server.command()
    assert idle_scheduler_cores(tiny_server) < SLEEPING_AT_MOST
    request = {"text": "def wake(up):", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    assert tiny_server.generate(request)["meta_info"]["completion_tokens"] == 4


@pytest.mark.standalone
def test_server_starts_again_when_its_port_is_taken(tiny_llama_dir, server_logs):
    """The HTTP port can be taken between its choice and uvicorn's bind, which then leaves the server neither
    serving nor exiting: start() must see it and start again on another port, not wait out its timeout."""
    server = SglangServer(tiny_llama_dir, ["--dtype", "float32"], server_logs / "port-taken.log")
    taken = server.port
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        server.start(timeout=300)
    try:
        assert server.port != taken
        assert "error while attempting to bind" in server.log_text()  # the first launch's, kept
        assert server.healthy()
        assert len(server.greedy_ids([1, 2, 3], 4)) == 4
    finally:
        server.stop()
