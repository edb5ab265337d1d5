"""The main job until DART serving lands: serve SmolLM2-135M-Instruct with stock SGLang on this machine
(CPU when there is no GPU) and answer one chat request through the OpenAI-compatible API.

Run: `python -m sglang_dart.demo [--prompt TEXT] [--max-tokens N]`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import requests

from sglang_dart.assets import smollm2_dir
from sglang_dart.server_process import SglangServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_dart.demo", description=__doc__)
    parser.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    model = smollm2_dir()
    log = Path(tempfile.mkdtemp(prefix="sglang-dart-demo-")) / "server.log"
    print(f"model: {model}\nserver log: {log}", flush=True)
    server = SglangServer(model, [], log).start()
    try:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        start = time.perf_counter()
        reply = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=600).json()
        seconds = time.perf_counter() - start
        print(f"\n> {args.prompt}\n\n{reply['choices'][0]['message']['content']}\n")
        tokens = reply["usage"]["completion_tokens"]
        print(f"[{tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s]")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
