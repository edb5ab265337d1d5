"""Start the real `python -m sglang.launch_server` as a subprocess on a free port, and stop it cleanly.

Used by the demo, the benchmarks and the tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psutil
import requests

# A small KV pool: SGLang would otherwise size it from free RAM (16 GB here), which takes half a minute.
# No --sleep-on-idle: the plugin turns SGLang's idle sleeper on for every CPU-engine server
# (`sglang_dart.cpu.idle_sleep`), so these servers idle like a user's.
CPU_ARGS = ["--device", "cpu", "--max-total-tokens", "32768"]


def default_device_args() -> list[str]:
    """CPU_ARGS where SGLang runs its CPU engine (no accelerator, or SGLANG_DART_CPU=1); none on a GPU
    host, where SGLang's own defaults (CUDA, its memory planner) apply."""
    from sglang_dart.cpu.detect import cpu_engine_wanted

    return list(CPU_ARGS) if cpu_engine_wanted() else []


def default_engine_kwargs() -> dict[str, object]:
    """`sglang.Engine` keyword arguments equivalent to `default_device_args()`."""
    flags = default_device_args()
    return {"device": "cpu", "max_total_tokens": 32768} if flags else {}


def device_flag() -> list[str]:
    """`--device cpu` where SGLang runs its CPU engine, nothing on a GPU host (SGLang picks CUDA)."""
    return default_device_args()[:2]


def dart_flags(draft: Path | str, store: Path | str) -> list[str]:
    """The stock flags that serve DART with a drafter directory and a 3-gram store."""
    return [
        "--speculative-algorithm",
        "DART",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-ngram-external-corpus-path",
        str(store),
    ]


_RNG = random.SystemRandom()  # not the global generator, which a program may have seeded


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now and outside the kernel's ephemeral range. A port from that range can be taken by
    any outgoing connection's local end before the server binds it (seconds later), even by our own
    readiness polls to it: on loopback such a poll can connect to itself and hold the port."""
    low, high = _ephemeral_port_range()
    ranges = [(1024, low - 1), (high + 1, 65535)]
    candidates = [r for r in ranges if r[1] - r[0] >= 1000]
    for _ in range(200):
        start, end = _RNG.choice(candidates) if candidates else (1024, 65535)
        port = _RNG.randint(start, end)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # the kernel's choice, as a last resort
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How a server tells that a port it was given was taken before it could bind it: uvicorn's HTTP port
# (the server then neither serves nor exits) or torch.distributed's rendezvous port (the server exits).
# start() recognises these and starts again on other ports.
_PORT_TAKEN = ("error while attempting to bind on address", "address already in use")


class ServerFailed(RuntimeError):
    pass


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, a job runner, a terminal closing) raise SystemExit in the main thread, so
    the `finally` blocks that stop servers run: each server runs in its own session and would otherwise
    outlive the program that started it, holding its memory and ports. Call it from a program's main."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


class SglangClient:
    """HTTP calls to a running SGLang server at `url` (one this module started, or any other)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def model_info(self, timeout: float = 30.0) -> dict:
        resp = requests.get(f"{self.url}/model_info", timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def generate(self, payload: dict, timeout: float = 300.0) -> dict:
        resp = requests.post(f"{self.url}/generate", json=payload, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def generate_many(
        self, prompts: list[list[int]], params: dict | list[dict], concurrency: int, timeout: float = 300.0
    ) -> list[dict]:
        """One /generate per token-id prompt (params: shared, or one per prompt), `concurrency` in flight
        at once; results in prompt order."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(
                pool.map(
                    lambda job: self.generate({"input_ids": job[0], "sampling_params": job[1]}, timeout),
                    zip(prompts, per_prompt, strict=True),
                )
            )

    def update_weights_from_disk(
        self, model_dir: Path | str, flush_cache: bool = True, timeout: float = 300.0
    ) -> None:
        """Load the weights in `model_dir` into the running model in place (SGLang's weight-update API)."""
        body = {"model_path": str(model_dir), "flush_cache": flush_cache}
        resp = requests.post(f"{self.url}/update_weights_from_disk", json=body, timeout=timeout)
        resp.raise_for_status()
        if not resp.json().get("success"):
            raise ServerFailed(f"weight update from {model_dir} failed: {resp.json()}")

    def greedy_ids(self, input_ids: list[int], max_new_tokens: int, timeout: float = 300.0) -> list[int]:
        out = self.generate(
            {
                "input_ids": input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            },
            timeout=timeout,
        )
        return list(out["output_ids"])


class SglangServer(SglangClient):
    def __init__(
        self,
        model_path: Path | str,
        args: list[str],
        log_path: Path,
        device_args: list[str] | None = None,
        env: dict[str, str | None] | None = None,
    ) -> None:
        self.model_path = str(model_path)
        # Extra variables for the server process; None unsets one the caller's environment has.
        self.env = {k: v for k, v in {**os.environ, **env}.items() if v is not None} if env else None
        self.args = list(args)
        self.device_args = default_device_args() if device_args is None else list(device_args)
        self.log_path = Path(log_path)
        self._choose_ports()
        self.proc: subprocess.Popen | None = None
        self._log_start = 0  # where the current launch's output starts in the log

    def _choose_ports(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # SGLang's own choice of rendezvous port comes from the ephemeral range (see free_port). Data-parallel
        # replicas each need one of their own and a given --nccl-port would be shared, so SGLang picks those.
        self.nccl_port = None
        pick = "--nccl-port" not in self.args and not self._data_parallel()
        while pick and self.nccl_port in (None, self.port):
            self.nccl_port = free_port()

    def _data_parallel(self) -> bool:
        """--dp-size (or --data-parallel-size) above 1, given as two words or with '='."""
        for i, arg in enumerate(self.args):
            name, _, value = arg.partition("=")
            if name in ("--dp-size", "--data-parallel-size"):
                value = value or (self.args[i + 1] if i + 1 < len(self.args) else "1")
                return value != "1"
        return False

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *([] if self.nccl_port is None else ["--nccl-port", str(self.nccl_port)]),
            *self.device_args,
            *self.args,
        ]

    def start(self, timeout: float = 600.0, attempts: int = 3) -> SglangServer:
        """Launch and wait until /health_generate answers; a port lost to another process before the
        server bound it costs a restart on a new port, not a failure (`attempts` launches at most)."""
        for attempt in range(1, attempts + 1):
            if self._launch(timeout, append=attempt > 1):
                return self
            if attempt < attempts:
                self._choose_ports()
        raise ServerFailed(f"the HTTP port was taken before the server could bind it, {attempts} times")

    def _launch(self, timeout: float, append: bool) -> bool:
        """True once healthy; False if the port was taken (server stopped); raises on any other failure.
        append: a restart's log follows the failed launch's in the same file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab" if append else "wb")  # noqa: SIM115 - owned by the child for its lifetime
        self._log_start = log.tell()
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
        )
        log.close()
        try:
            ready = self._wait_until_ready(timeout)
        except BaseException:
            # Interrupted while starting (Ctrl-C, SIGTERM turned into SystemExit) or failed: the caller
            # holds no started server to stop, so a half-started one would outlive it with its memory.
            self.stop()
            raise
        if not ready:
            self.stop()
        return ready

    def _wait_until_ready(self, timeout: float) -> bool:
        """True once healthy; False if the port was taken; raises on any other failure."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(sign in self._log_end().lower() for sign in _PORT_TAKEN):
                return False
            if self.proc.poll() is not None:
                raise ServerFailed(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health_generate", timeout=30).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise ServerFailed(f"server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def _log_end(self, size: int = 16384) -> str:
        """The end of this launch's part of the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(self._log_start, log.seek(0, os.SEEK_END) - size))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return self.alive() and requests.get(f"{self.url}/health_generate", timeout=60).status_code == 200
        except requests.RequestException:
            return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def processes(self) -> list[psutil.Process]:
        """The launcher and every process under it (scheduler, detokenizer, ...); none once stopped."""
        if not self.alive():
            return []
        try:
            launcher = psutil.Process(self.proc.pid)
            return [launcher, *launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def resident_bytes(self) -> int:
        """Resident memory of the server's processes (launcher, scheduler, detokenizer), 0 once stopped."""
        total = 0
        for process in self.processes():
            try:
                total += process.memory_info().rss
            except psutil.Error:  # it left between listing and reading: count the others
                pass
        return total

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


class NotEnoughMemory(RuntimeError):
    pass


def check_room_for(more: int, like: SglangServer, spare_bytes: int = 2**30) -> None:
    """Raise NotEnoughMemory unless `more` servers the size of `like` (started) fit in the memory available
    now, with `spare_bytes` left. Past it the machine swaps or thrashes: six bf16 SmolLM2 servers (~3.7 GiB
    each on a CPU, most of it three Python processes with torch loaded) filled 24 GiB, and a server stalled
    for minutes in the middle of a measurement."""
    if more <= 0:
        return
    each = like.resident_bytes()
    available = psutil.virtual_memory().available
    if more * each + spare_bytes > available:
        gib = 2**30
        raise NotEnoughMemory(
            f"{more} more server(s) of ~{each / gib:.1f} GiB each do not fit in the {available / gib:.1f} "
            f"GiB available (keeping {spare_bytes / gib:.0f} GiB spare): the machine would swap and every "
            "measurement would be void. Run fewer servers at once."
        )


def start_together(servers: Iterable[SglangServer]) -> None:
    """Start the servers side by side (a start-up is mostly single-threaded imports: two take about 1.5x
    the time of one on two cores); if any fails, all are stopped and its error raised."""
    servers = list(servers)
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            for started in [pool.submit(server.start) for server in servers]:
                started.result()
    except BaseException:
        for server in servers:
            server.stop()
        raise


@contextmanager
def serving(servers: dict[str, SglangServer], start: bool = True) -> Iterator[dict[str, SglangServer]]:
    """The servers, started side by side (`start=False`: the caller starts each when it needs it), all
    stopped on the way out."""
    try:
        if start:
            start_together(servers.values())
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def run_launcher(
    args: list[str], timeout: float = 300.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m sglang.launch_server ARGS` to completion (for start-up errors); env adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
