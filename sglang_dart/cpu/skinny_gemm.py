"""Linear layers with a few input rows, on the CPU: the shape of decode at small batches and of tree verify.

`F.linear(x, W)` with x of 2..~100 rows goes through the BLAS as `x @ W.T`. On some CPUs (measured: an
AMD EPYC with AVX2 and MKL 2024.2) that call costs 2-3x the one-row call even though both only stream W
from memory once; computing the same product as `(W @ x.T).T` streams W at the one-row speed. On others
(bf16 without AVX-512 here) the transposed form is slower. So each process times the two forms once per
dtype, on weights too large for the caches as a serving model's are, and keeps the faster one.

`SGLANG_DART_CPU_SKINNY_GEMM`: `auto` (default, time and choose), `transposed` or `torch` (force a form).
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

ENV = "SGLANG_DART_CPU_SKINNY_GEMM"
MODES = ("auto", "transposed", "torch")
# Row counts the choice applies to: one row is a matrix-vector product either way; from ~128 rows on,
# the BLAS's own blocking wins (measured crossover on the EPYC).
MIN_ROWS, MAX_ROWS = 2, 96
# The transposed form is kept only when it is clearly faster: the timing is short and the VM noisy.
REQUIRED_GAIN = 0.15

_choice: dict[torch.dtype, bool] = {}  # dtype -> use the transposed form


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


def _time_forms(dtype: torch.dtype, rows: int = 8) -> tuple[float, float]:
    """Seconds per pass of each form over ~96 MB of weights (past the caches), interleaved, best of 3."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(2048, 1024, generator=generator).to(dtype) for _ in range(48 // dtype.itemsize)]
    x = torch.randn(rows, 1024, generator=generator).to(dtype)
    best = [float("inf"), float("inf")]
    for _ in range(4):  # the first round warms both paths up and is not counted
        for form, run in enumerate((F.linear, lambda a, w: _transposed(a, w))):
            start = time.perf_counter()
            for w in weights:
                run(x, w)
            best[form] = min(best[form], time.perf_counter() - start)
    return best[0], best[1]


def use_transposed(dtype: torch.dtype) -> bool:
    chosen = _choice.get(dtype)
    if chosen is None:
        wanted = mode()
        if wanted == "auto":
            plain, transposed = _time_forms(dtype)
            chosen = transposed < plain * (1 - REQUIRED_GAIN)
            logger.info(
                "sglang_dart: CPU linear layers with %d-%d rows in %s use the %s form "
                "(x @ W.T %.1f ms, (W @ x.T).T %.1f ms over 96 MB of weights)",
                MIN_ROWS, MAX_ROWS, dtype, "(W @ x.T).T" if chosen else "x @ W.T",
                plain * 1e3, transposed * 1e3,
            )  # fmt: skip
        else:
            chosen = wanted == "transposed"
        _choice[dtype] = chosen
    return chosen


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), in the faster form for this CPU when x has a few rows."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not (MIN_ROWS <= rows <= MAX_ROWS) or x.device.type != "cpu" or not use_transposed(x.dtype):
        return F.linear(x, weight, bias)
    out = _transposed(x.reshape(rows, x.shape[-1]), weight)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def install() -> None:
    """Route SGLang's unquantized linear layers and its plain lm_head product through `linear`.
    Only the branches that would call F.linear / x @ W.T are taken over; every other branch (AMX packed
    weights, quantization, LoRA, fp32 lm_head) stays SGLang's."""
    from sglang.srt.layers import logits_processor
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.utils.common import use_intel_amx_backend

    mode()  # a bad value fails at start-up, not on the first request
    if getattr(UnquantizedLinearMethod.apply, "_sglang_dart", False):
        return
    sglang_apply = UnquantizedLinearMethod.apply
    sglang_lm_head = logits_processor.LogitsProcessor._compute_lm_head

    def apply(self, layer, x, bias=None):  # noqa: ANN001, ANN202
        if use_intel_amx_backend(layer) or type(layer.weight.data) is not torch.Tensor:
            return sglang_apply(self, layer, x, bias)
        return linear(x, layer.weight, bias)

    def compute_lm_head(self, hidden_states, lm_head, embedding_bias=None):  # noqa: ANN001, ANN202
        plain_weight = (
            hasattr(lm_head, "weight")
            and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
            and not logits_processor.should_apply_lm_head_quant_method(
                lm_head, getattr(lm_head, "quant_method", None)
            )
            and not self.use_fp32_lm_head
            and not use_intel_amx_backend(lm_head)
            and self.rl_on_policy_target is None
        )
        if not plain_weight:
            return sglang_lm_head(self, hidden_states, lm_head, embedding_bias)
        return linear(hidden_states.to(lm_head.weight.dtype), lm_head.weight)

    apply._sglang_dart = True
    UnquantizedLinearMethod.apply = apply
    logits_processor.LogitsProcessor._compute_lm_head = compute_lm_head
