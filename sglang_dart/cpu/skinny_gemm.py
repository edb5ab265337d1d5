"""Linear layers with a few input rows, on the CPU: the shape of decode at small batches and of tree verify.

`F.linear(x, W)` with x of 2..~100 rows goes through the BLAS as `x @ W.T`. On some CPUs (measured: an
AMD EPYC with AVX2 and MKL 2024.2) that call costs up to 2-3x the one-row call for wide layers (the MLP's
gate/up projection, the lm_head) even though both only stream W from memory once; computing the same
product as `(W @ x.T).T` streams W at the one-row speed. For other shapes, and for bf16 without AVX-512,
the transposed form is slower. So each process decides per weight shape and dtype, on its own serving
calls: the first calls of a shape alternate the two forms and are timed, then the faster form is kept.

`SGLANG_DART_CPU_SKINNY_GEMM`: `auto` (default, time and choose), `transposed` or `torch` (force a form).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

ENV = "SGLANG_DART_CPU_SKINNY_GEMM"
MODES = ("auto", "transposed", "torch")
# Row counts the choice applies to: one row is a matrix-vector product either way; from ~128 rows on,
# the BLAS's own blocking wins (measured crossover on the EPYC).
MIN_ROWS, MAX_ROWS = 2, 96
# Timed calls per form before a shape's choice is made; the median resists the VM's stalls.
SAMPLES_PER_FORM = 8
# The transposed form must be clearly faster to be kept: x @ W.T is what every other engine computes.
REQUIRED_GAIN = 0.1


@dataclass
class _ShapeChoice:
    seconds: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))  # x @ W.T, (W @ x.T).T
    transposed: bool | None = None  # None while still timing


_mode: str | None = None
_choices: dict[tuple[int, int, torch.dtype], _ShapeChoice] = {}


def mode() -> str:
    global _mode
    if _mode is None:
        value = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if value not in MODES:
            raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
        _mode = value
    return _mode


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


def _timed_product(choice: _ShapeChoice, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One call while the shape is undecided: the form with fewer samples, timed; decide when both have
    enough."""
    plain_s, transposed_s = choice.seconds
    use_transposed = len(transposed_s) < len(plain_s)
    start = time.perf_counter()
    out = _transposed(x, weight) if use_transposed else F.linear(x, weight)
    (transposed_s if use_transposed else plain_s).append(time.perf_counter() - start)
    if len(transposed_s) >= SAMPLES_PER_FORM:
        plain, transposed = statistics.median(plain_s), statistics.median(transposed_s)
        choice.transposed = transposed < plain * (1 - REQUIRED_GAIN)
        logger.info(
            "sglang_dart: CPU linear %d->%d (%s, %d-%d rows) uses %s (median x @ W.T %.3f ms, "
            "(W @ x.T).T %.3f ms)",
            weight.shape[1], weight.shape[0], str(weight.dtype).removeprefix("torch."), MIN_ROWS, MAX_ROWS,
            "(W @ x.T).T" if choice.transposed else "x @ W.T", plain * 1e3, transposed * 1e3,
        )  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), in the faster form for this CPU and shape when x has a few rows."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not (MIN_ROWS <= rows <= MAX_ROWS) or x.device.type != "cpu" or mode() == "torch":
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if mode() == "transposed":
        out = _transposed(flat, weight)
    else:
        key = (weight.shape[0], weight.shape[1], weight.dtype)
        choice = _choices.get(key) or _choices.setdefault(key, _ShapeChoice())  # no allocation once seen
        if choice.transposed is None:
            out = _timed_product(choice, flat, weight)
        elif choice.transposed:
            out = _transposed(flat, weight)
        else:
            return F.linear(x, weight, bias)  # exactly SGLang's computation
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
