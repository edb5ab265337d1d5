"""Run the torch ops of small forwards (decode, tree verify) on one OpenMP thread.

A decode or verify forward of a few tokens is hundreds of tiny torch ops (K/V concats, row gathers, a
small attention per layer). Each that ATen parallelises wakes torch's sleeping OpenMP workers (the
launcher sets GOMP_SPINCOUNT=0, see `skinny_gemm`), which costs more than the op on the 2-core VM
measured: 120 rounds of a layer's in-between ops (RMSNorm, K/V concat, small attention) took 65 ms with
torch on 2 threads and 20 ms on one. The linear layers, where a small forward's real work is, keep both
cores: their few-row products run on the Rust team (`skinny_gemm`), which does not use torch's pool.

So forwards of at most `SGLANG_DART_SMALL_STEP_TOKENS` tokens (default 64, the Rust product's reach,
for float32 weights; for bf16 16, since torch's two threads win from about 20 rows; 0 turns this off)
set torch to one thread, however many requests share the forward, and larger ones (prefill, big batches)
restore the process's configured count, read at the first forward. Only models whose linears the Rust
product can take (float32, and bf16 where `skinny_gemm.rust_dtypes` offers it;
`SGLANG_DART_CPU_SKINNY_GEMM` auto or rust) are switched: other linears run on torch's pool, which needs
every thread. The setting stays in force after the forward, so
the sampler and the DART worker's draft forward and top-k of a small step run single-threaded too.
Where this is on, the Rust team's helpers also poll for 1 ms after each product before sleeping
(`SGLANG_DART_GEMM_SPIN_US`, unless set): torch's workers no longer need that core during a small
forward, and a polling helper joins the next product at once instead of after a VM wake-up.
(benchmarks/results/throughput.md, run 16.)
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from sglang_dart.cpu import skinny_gemm

logger = logging.getLogger(__name__)

ENV = "SGLANG_DART_SMALL_STEP_TOKENS"
DEFAULT_TOKENS = 64
# bf16: the Rust product beat torch's two threads up to about 20 rows on the AVX512-BF16 EPYC and lost
# beyond (32 rows: 56 against 38 ms for SmolLM2's linears), and a forward on one thread leaves torch no
# second thread for the rows it keeps: batch 4's trees of 8 (32 rows) ran 4% slower with 64 (run 43).
# Up to 16 tokens the request count does not matter: since the attention runs on the Rust team too
# (`rust_attention`), plain decoding of 5, 8 and 16 requests on one torch thread ran 1.14-1.18x faster
# than on two (run 122; run 44's 15% loss at 16 requests was torch's SDPA, which needed both cores).
BF16_DEFAULT_TOKENS = 16
# How long the Rust team's helpers poll after a product where this is on, unless the user set it.
TEAM_SPIN_US = 1000


@functools.cache
def small_step_tokens(dtype: torch.dtype = torch.float32) -> int:
    """The largest forward (in tokens) that runs torch on one thread: the setting, else the default for
    the weights' dtype."""
    default = BF16_DEFAULT_TOKENS if dtype == torch.bfloat16 else DEFAULT_TOKENS
    raw = os.environ.get(ENV, str(default)).strip()
    try:
        tokens = int(raw)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"{ENV}={raw!r}: expected a token count >= 0 (0 turns this off)")
    return tokens


@functools.cache
def configured_threads() -> int:
    """torch's thread count as SGLang set it up, captured before the first switch; the Rust team is
    sized from it here too, so that it never inherits the single-thread setting."""
    threads = torch.get_num_threads()
    skinny_gemm.size_rust_team(threads)
    # Polling no longer takes a core from torch's workers, which sleep through small forwards.
    os.environ.setdefault(skinny_gemm.TEAM_SPIN_ENV, str(TEAM_SPIN_US))
    logger.info(
        "sglang_dart: forwards of at most %d tokens (float32; bf16: %d) run torch ops on 1 thread, "
        "larger ones on %d (%s)",
        small_step_tokens(), small_step_tokens(torch.bfloat16), threads, ENV,
    )  # fmt: skip
    return threads


def threads_for(num_tokens: int, dtype: torch.dtype = torch.float32) -> int:
    return 1 if 0 < num_tokens <= small_step_tokens(dtype) else configured_threads()


def apply_for(num_tokens: int, dtype: torch.dtype = torch.float32) -> None:
    configured_threads()
    wanted = threads_for(num_tokens, dtype)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def _forward_tokens(forward_batch: Any) -> int:
    input_ids = getattr(forward_batch, "input_ids", None)
    return int(input_ids.numel()) if isinstance(input_ids, torch.Tensor) else 0


def rust_takes_the_linears(model_runner: Any) -> bool:
    return (
        getattr(model_runner, "dtype", None) in skinny_gemm.rust_dtypes()
        and str(getattr(model_runner, "device", "cpu")) == "cpu"
        and skinny_gemm.mode() in ("auto", "rust")
    )


@functools.cache
def log_openmp_spinning(rust_linears: bool) -> None:
    """Once per process: what libgomp was told, which the launcher decides from --dtype (`skinny_gemm`)."""
    spin = os.environ.get(skinny_gemm.SPIN_ENV)
    logger.info(
        "sglang_dart: Rust few-row linears %s; %s",
        "on" if rust_linears else "off",
        f"{skinny_gemm.SPIN_ENV}={spin}" if spin is not None else f"{skinny_gemm.SPIN_ENV} unset",
    )


def installed() -> bool:
    """Whether ModelRunner.forward is wrapped (`install`)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    return getattr(ModelRunner.forward, "_sglang_dart", False)


def install() -> None:
    """Wrap SGLang's ModelRunner.forward (CPU engine processes only) to pick torch's thread count."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    if small_step_tokens() == 0 or installed():
        return
    sglang_forward = ModelRunner.forward

    def forward(self, forward_batch, *args, **kwargs):  # noqa: ANN001, ANN202
        rust_linears = rust_takes_the_linears(self)
        log_openmp_spinning(rust_linears)
        if rust_linears and forward_batch.input_ids is not None:
            apply_for(_forward_tokens(forward_batch), self.dtype)
        return sglang_forward(self, forward_batch, *args, **kwargs)

    forward._sglang_dart = True
    ModelRunner.forward = forward
