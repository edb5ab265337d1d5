"""SGLang's RMSNorm, SiLU-and-multiply and rotary embedding on a CPU in one Rust call each.

On a CPU without SGLang's `sgl_kernel` CPU build (not on PyPI), these layers run their `forward_native`:
strings of small torch operations (RMSNorm with a residual: about ten), each paying a dispatch that costs
more than its arithmetic at the few rows of a decode or tree verify. In a batch-1 SmolLM2 server (bf16,
AMX Xeon) they took 38% of a plain step: RMSNorm 86 us a call, rotary 135, SiLU-and-mul 41, against a
few microseconds of work. `_core`'s row-wise ops (`rust/dart-core/src/rowwise.rs`) compute each in one
pass, rounding where torch rounds.

`install()` wraps the three classes' `forward_native` (subclasses that keep it get the wrapper, those
that override it keep theirs); a call takes the Rust path only in the plain case (a CPU tensor in
float32, bf16 or float16, default options, no autograd), and `forward_native` otherwise. Active on the
CPU engine only; `SGLANG_DART_CPU_ROWWISE=0` keeps torch's operations.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sglang_dart import _core
from sglang_dart.cpu import skinny_gemm

ENV = "SGLANG_DART_CPU_ROWWISE"
_MARK = "_sglang_dart_rowwise"

# Rust kernels by element type; bf16 passes as its bits (int16), float16 as its bits (uint16).
_KERNELS: dict[torch.dtype, dict[str, Callable[..., None]]] = {
    torch.float32: {
        "rms_norm": _core.rms_norm_f32,
        "add_rms_norm": _core.add_rms_norm_f32,
        "silu_and_mul": _core.silu_and_mul_f32,
        "rotary": _core.rotary_f32,
    },
    torch.bfloat16: {
        "rms_norm": _core.rms_norm_bf16,
        "add_rms_norm": _core.add_rms_norm_bf16,
        "silu_and_mul": _core.silu_and_mul_bf16,
        "rotary": _core.rotary_bf16,
    },
    torch.float16: {
        "rms_norm": _core.rms_norm_f16,
        "add_rms_norm": _core.add_rms_norm_f16,
        "silu_and_mul": _core.silu_and_mul_f16,
        "rotary": _core.rotary_f16,
    },
}


def enabled() -> bool:
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 1 (Rust row-wise ops, the default) or 0 (torch's)")
    return value == "1"


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (no copy): bf16 as its bits in int16, float16 as its bits in uint16
    (what the Rust kernels take; numpy's own float16 would need another Rust type)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


# torch splits an elementwise op over its threads from this many elements on (its grain size): a SiLU-and-mul
# that large runs faster on torch's pool than on one core here (64 rows of 2 x 1536 in bf16 on the AMX
# Xeon: 43 against 86 us), so it stays torch's; norms and rotary win at every size measured.
TORCH_PARALLEL_ELEMENTS = 32768


def _small_enough(x: torch.Tensor) -> bool:
    """Too small a SiLU-and-mul for torch to share it out over its threads (or torch has one), or one of a
    dtype whose forwards are row-invariant (`skinny_gemm.rust_only`: every product Rust's): there a
    prefill's rows must get the bits a decode's do, and torch's exp rounds apart from the kernel's."""
    small = x.numel() // 2 < TORCH_PARALLEL_ELEMENTS or torch.get_num_threads() == 1
    return small or skinny_gemm.rust_only(x.dtype)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these inputs take the Rust path here: installed (the CPU engine, not turned off) and
    CPU tensors of one type the kernels take, with no gradient to record."""
    return installed() and _plain(*tensors)


def silu_pays(x: torch.Tensor) -> bool:
    """Whether SiLU-and-mul of x goes to Rust: installed, x plain and `_small_enough`."""
    return _small_enough(x) and applies(x)


def _plain(*tensors: torch.Tensor) -> bool:
    """All on the CPU, of one element type the kernels take, and no gradient to record."""
    dtype = tensors[0].dtype
    if dtype not in _KERNELS:
        return False
    grad = torch.is_grad_enabled()
    return all(
        t.dtype == dtype and t.device.type == "cpu" and not (grad and t.requires_grad) for t in tensors
    )


class _Weights:
    """numpy views of weights that serve every call (a layer's norm weight, a rotary table), made once
    per tensor: a view is kept while its tensor's storage is the one the layer holds."""

    LIMIT = 4096  # tensors replaced by new ones (weights reloaded) leave entries behind: start over past it

    def __init__(self) -> None:
        self._views: dict[int, tuple[int, torch.Tensor, np.ndarray]] = {}

    def view(self, t: torch.Tensor) -> np.ndarray:
        key = id(t)
        held = self._views.get(key)
        if held is not None and held[1] is t and held[0] == t.data_ptr():
            return held[2]
        if len(self._views) >= self.LIMIT:
            self._views.clear()
        array = numpy_view(t.detach())
        self._views[key] = (t.data_ptr(), t, array)
        return array


_weights = _Weights()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = False
) -> torch.Tensor:
    """SGLang's RMSNorm with default options: `x * rsqrt(mean(x²) + eps) * weight` in float32, rounded
    to x's type, into a new tensor. `cast_before_weight`: the normalised row is rounded to x's type
    before the weight multiplies it (`weight * normed.to(dtype)`, the DART drafter's norm)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _KERNELS[x.dtype]["rms_norm"](
        numpy_view(rows), _weights.view(weight), numpy_view(out), eps, cast_before_weight
    )
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's fused add + RMSNorm, in place as its fused kernels do it: residual becomes `x +
    residual` (summed in float32, rounded) and x its RMSNorm. Returns (x, residual); where either was
    not contiguous, a contiguous copy stands in for it."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).contiguous()
    residual_rows = residual.reshape(-1, shape[-1]).contiguous()
    _KERNELS[x.dtype]["add_rms_norm"](numpy_view(rows), numpy_view(residual_rows), _weights.view(weight), eps)
    return rows.view(shape), residual_rows.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]`, each result rounded to x's type as torch rounds it."""
    half = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((rows.shape[0], half), dtype=x.dtype)
    _KERNELS[x.dtype]["silu_and_mul"](numpy_view(rows), numpy_view(out))
    return out.view(*x.shape[:-1], half)


def rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_size: int,
    neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, in place, of query and key [tokens, heads * head_size] at positions [tokens]
    by the cos | sin rows of `cos_sin` [max positions, rotary_dim]. Returns (query, key); where one's
    rows were not contiguous, a copy stands in for it."""
    positions = positions.reshape(-1)
    if positions.dtype != torch.int64:
        positions = positions.to(torch.int64)
    tokens = positions.shape[0]
    q_rows, k_rows = query.reshape(tokens, -1), key.reshape(tokens, -1)
    if q_rows.stride(-1) != 1:
        q_rows = q_rows.contiguous()
    if k_rows.stride(-1) != 1:
        k_rows = k_rows.contiguous()
    _KERNELS[query.dtype]["rotary"](
        positions.numpy(), _weights.view(cos_sin), numpy_view(q_rows), numpy_view(k_rows), head_size, neox
    )
    return q_rows.view(query.shape), k_rows.view(key.shape)


def _rms_norm_native(native: Callable[..., Any]) -> Callable[..., Any]:
    def forward_native(
        self: Any, x: torch.Tensor, residual: Any = None, post_residual_addition: Any = None
    ) -> Any:
        if (
            post_residual_addition is None
            and not self.fp32_residual
            and not self.cast_x_before_out_mul
            and self.override_orig_dtype is None
            and self.variance_size_override is None
            and x.shape[-1] == self.hidden_size
            and x.numel() > 0
            and self.weight.is_contiguous()
        ):
            if residual is None:
                if _plain(x, self.weight):
                    return rms_norm(x, self.weight, self.variance_epsilon)
            elif (
                residual.shape == x.shape
                and residual.data_ptr() != x.data_ptr()
                and _plain(x, residual, self.weight)
            ):
                return add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return native(self, x, residual, post_residual_addition)

    return forward_native


def _silu_and_mul_native(native: Callable[..., Any]) -> Callable[..., Any]:
    def forward_native(self: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.numel() > 0 and _small_enough(x) and _plain(x):
            return silu_and_mul(x)
        return native(self, x)

    return forward_native


def _rotary_native(native: Callable[..., Any]) -> Callable[..., Any]:
    def forward_native(
        self: Any,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        offsets: Any = None,
        fused_set_kv_buffer_arg: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = getattr(self, "cos_sin_cache", None)
        if (
            offsets is None
            and fused_set_kv_buffer_arg is None
            and cache is not None
            and not hasattr(self, "sin_cos_cache")
            and cache.dim() == 2
            and cache.shape[1] == self.rotary_dim
            and cache.is_contiguous()
            and positions.numel() > 0
            and positions.device.type == "cpu"
            and _plain(query, key, cache)
            and query.stride(-1) == 1
            and key.stride(-1) == 1
        ):
            return rotary(positions, query, key, cache, self.head_size, self.is_neox_style)
        return native(self, positions, query, key, offsets, fused_set_kv_buffer_arg)

    return forward_native


def install() -> None:
    """Wrap SGLang's RMSNorm, SiluAndMul and RotaryEmbedding `forward_native` (once; before the model is
    built, since SGLang binds each layer's forward method when it constructs it)."""
    if not enabled():
        return
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    for cls, wrap in (
        (RMSNorm, _rms_norm_native),
        (SiluAndMul, _silu_and_mul_native),
        (RotaryEmbedding, _rotary_native),
    ):
        native = cls.forward_native
        if getattr(native, _MARK, False):
            continue
        wrapped = wrap(native)
        setattr(wrapped, _MARK, True)
        wrapped.__wrapped__ = native  # type: ignore[attr-defined]  # torch's own, for tests and fallbacks
        wrapped.__doc__ = f"{native.__doc__ or ''} (on a CPU: sglang_dart's Rust row-wise ops)".strip()
        cls.forward_native = wrapped


def installed() -> bool:
    """Whether `install()` wrapped SGLang's layers in this process (without importing SGLang: a trainer
    that never did is not serving)."""
    layernorm = sys.modules.get("sglang.srt.layers.layernorm")
    return layernorm is not None and bool(getattr(layernorm.RMSNorm.forward_native, _MARK, False))
