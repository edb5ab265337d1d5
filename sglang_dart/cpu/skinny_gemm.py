"""Linear layers with a few input rows, on the CPU: the shape of decode at small batches and of tree verify.

`F.linear(x, W)` with x of 1..~100 rows goes through the BLAS as `x @ W.T`. On some CPUs (measured: an
AMD EPYC with AVX2 and MKL 2024.2) the 8-row call costs 2-3x the one-row call for wide layers even though
both only stream W from memory once, which makes a tree verify step cost far more than a decode step.
Four forms compute the same product:
- `torch`: `F.linear`, exactly SGLang's computation;
- `transposed`: `(W @ x.T).T`, which the BLAS runs at the one-row speed for some wide shapes;
- `packed` (bf16 weights): torch's own oneDNN product with the weight reordered once, at its first use,
  into oneDNN's blocked layout and kept beside it (`PackedWeights`). `F.linear` hands oneDNN the weight
  in its plain layout, and its kernel copies it into the blocked one on every call; up to 16 rows both
  give the same bits (DART 7-11% faster on the AMX Xeon, benchmarks/results/throughput.md, run 65);
  beyond, the rounding may differ in the last bit, as between torch's own kernels for other row counts.
  It is offered up to `PACKED_MAX_ROWS` rows (the others up to `MAX_ROWS`). The copies cost as much
  memory as the weights they pack, within `SGLANG_DART_PACKED_WEIGHTS_GB` (default 4; 0 turns the form
  off); past it the rest stay unpacked.
- `rust`: `sglang_dart._core.skinny_matmul` (float32, up to 64 rows), which reads each weight row once
  for all input rows (AVX2/FMA where the CPU has them), on the calling thread plus a small team of
  helper threads (`rust/dart-core/src/team.rs`). In the server on the EPYC it beat the BLAS at 1-31 rows
  on every SmolLM2 layer and the lm_head (benchmarks/results/throughput.md, run 15). For bf16 weights
  `skinny_matmul_bf16` does the same with AVX512-BF16 dot products (float32 sums, rounded once): on the
  AVX512-BF16 EPYC all of SmolLM2's linears took 11 ms for one row against torch's 19-24, 15 against
  23-27 for 8 rows, level at about 20 rows and slower beyond (runs 43-46). Without AVX512-BF16 it runs
  the float32 product's AVX2 tiles on weights widened as they load: on the AVX2-only EPYC, where torch's
  bf16 products cost in proportion to their rows, 16-21 ms for one row and 26-37 for 8 against torch's
  17-21 and 116-143 (run 119). `auto` offers it where it has either kernel and the CPU no AMX
  (`bf16_kernel_pays`). float16 weights (SGLang's `--dtype auto` serves a float32 checkpoint in float16)
  go to `skinny_matmul_f16`, which widens each weight vector as it loads it (AVX-512 tiles of 16 lanes, or
  the float32 product's AVX2 tiles with F16C): torch's float16 products cost in proportion to their rows
  on every CPU of ours (`f16_rust_only`).
Which is fastest depends on the CPU, the BLAS, the shape and the row count, so each process decides per
weight shape, dtype, row-count bucket (1, 2-3, 4-7, 8-15, ...) and torch thread count: the forms are timed
and the fastest is kept. `gemm_tuning` times every bucket of a model's weights when it is loaded; a bucket
left undecided is timed on its first serving calls, which then rotate through the forms.

`SGLANG_DART_CPU_SKINNY_GEMM`: `auto` (default, time and choose), or `torch`, `transposed`, `packed`
(force a form wherever it applies), or `rust`: every float32, bf16 and float16 product, whatever its rows
(`rust_only`), so that no row's bits depend on the others anywhere, prefills included. The Rust team
has as many threads (caller included) as torch uses in the process unless `SGLANG_DART_GEMM_THREADS`
says otherwise; `SGLANG_DART_GEMM_SPIN_US` (default 0; 1000 where `small_step_threads` is on) makes its
helpers poll that long after each product before sleeping.

After each parallel region libgomp's workers spin (GOMP_SPINCOUNT, 300000 by default) waiting for the
next one, and on a 2-core machine that spinning takes a core from the Rust helpers. So where the Rust
form may be used (a float32 target), `keep_openmp_from_spinning` sets GOMP_SPINCOUNT=0 unless the user
set it. Elsewhere the spinning pays: with a bf16 target, where every linear is torch's, turning it off
made plain decoding 1.4x slower (benchmarks/results/throughput.md, run 20).
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sglang_dart._core import (
    SKINNY_BF16_KERNEL,
    SKINNY_F16_KERNEL,
    SKINNY_MATMUL_MAX_ROWS,
    skinny_matmul,
    skinny_matmul_bf16,
    skinny_matmul_f16,
)

logger = logging.getLogger(__name__)

ENV = "SGLANG_DART_CPU_SKINNY_GEMM"
FORMS = ("torch", "transposed", "rust", "packed")
MODES = ("auto", *FORMS)
# From ~128 rows on, the BLAS's own blocking wins over the Rust and transposed forms (measured crossover
# on the EPYC).
MAX_ROWS = 96
# The packed form is torch's own product without the per-call reorder, which stays worth skipping further:
# on the AMX Xeon all of SmolLM2's linears took 26.6 against 31.4 ms at 128 rows (DART's verify from batch
# 25 with trees of 4, prefill chunks), 35.5 against 48.0 at 256, level at 512 (cold weights, 2 threads).
# Past this the BLAS decides.
PACKED_MAX_ROWS = 511
# Timed calls per form before a bucket's choice is made; the median resists the VM's stalls.
SAMPLES_PER_FORM = 8
# Another form must be clearly faster to replace x @ W.T, which is what every other engine computes.
REQUIRED_GAIN = 0.1


@dataclass
class _BucketChoice:
    forms: tuple[str, ...]  # the forms that apply to this bucket
    seconds: dict[str, list[float]] = field(default_factory=dict)
    chosen: str | None = None  # None while still timing


_mode: str | None = None
# Keyed by (out features, in features, dtype, row bucket, torch threads, forms that apply): a bucket's row
# counts may straddle a form's reach (the Rust product's 64 rows, the few-row forms' MAX_ROWS), and each
# set of forms is timed on its own, so that no row count is left to a choice it could not take.
_choices: dict[tuple[int, int, torch.dtype, int, int, tuple[str, ...]], _BucketChoice] = {}


def mode() -> str:
    global _mode
    if _mode is None:
        value = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if value not in MODES:
            raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
        _mode = value
    return _mode


SPIN_ENV = "GOMP_SPINCOUNT"


# --dtype values SGLang loads as float32; `auto` never does (it maps a float32 config to float16).
FLOAT32_DTYPE_NAMES = ("float32", "float")


def keep_openmp_from_spinning(dtype: str) -> None:
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it, so this must run in the launching process
    once the server arguments are known and before it spawns the scheduler processes (they inherit the
    environment). `dtype` is the server's --dtype: the Rust product takes float32 weights only."""
    if mode() in ("auto", "rust") and str(dtype).strip().lower() in FLOAT32_DTYPE_NAMES:
        os.environ.setdefault(SPIN_ENV, "0")


def _torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


THREADS_ENV = "SGLANG_DART_GEMM_THREADS"
TEAM_SPIN_ENV = "SGLANG_DART_GEMM_SPIN_US"


def size_rust_team(threads: int) -> None:
    """The Rust team reads its size once, at its first product; this sets it unless the user did."""
    os.environ.setdefault(THREADS_ENV, str(threads))


@functools.cache
def _size_rust_team() -> None:
    size_rust_team(torch.get_num_threads())  # as many threads as torch's pool here


def _half_bits(t: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16 (and the Rust float16 product takes bits too): the bytes as uint16, no copy.
    return t.view(torch.int16).numpy().view(np.uint16)


# The Rust product of half-precision weights, by dtype: on their bits.
_HALF_PRODUCTS = {torch.bfloat16: skinny_matmul_bf16, torch.float16: skinny_matmul_f16}


def _rust(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _size_rust_team()
    x, out = x.contiguous(), x.new_empty(x.shape[0], weight.shape[0])
    product = _rust_block_product(weight.detach())
    # Past the product's row limit (prefill, `rust_only`) in blocks of rows: a row's bits do not depend on
    # the others.
    for first in range(0, x.shape[0], SKINNY_MATMUL_MAX_ROWS):
        block = slice(first, first + SKINNY_MATMUL_MAX_ROWS)
        product(x[block], out[block])
    return out


def _rust_block_product(weight: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`(rows, out)` -> out = rows @ weight.T by the Rust product, for up to SKINNY_MATMUL_MAX_ROWS rows."""
    half_product = _HALF_PRODUCTS.get(weight.dtype)
    if half_product is None:
        values = weight.numpy()
        return lambda rows, out: skinny_matmul(rows.numpy(), values, out.numpy())
    bits = _half_bits(weight)
    return lambda rows, out: half_product(_half_bits(rows), bits, _half_bits(out))


def _cpu_has_amx() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a private torch function: another torch version may lack it
        return False


@functools.cache
def bf16_kernel_pays() -> bool:
    """Whether `auto` offers the Rust bf16 product: where it runs a vector kernel (AVX512-BF16, or AVX2 and
    FMA with the weights widened to float32) and the CPU has no AMX. Its portable path is only correct, not
    fast; with AMX torch's bf16 products use the tiles, which this kernel has not been measured against."""
    return SKINNY_BF16_KERNEL != "portable" and not _cpu_has_amx()


@functools.cache
def f16_kernel_pays() -> bool:
    """Whether `auto` gives float16 products to Rust: where it has a vector kernel (AVX-512, or AVX2 with
    F16C) and the CPU no AMX (AMX CPUs also have AVX512-FP16, which torch's float16 products were not
    measured against). On the AVX512-BF16 EPYC, one of each of SmolLM2's layer shapes and its lm_head in
    float16: torch 1.31 / 2.61 / 10.68 / 21.33 ms for 1 / 2 / 8 / 16 rows, the Rust product's AVX-512
    kernel 1.22 / 1.39 / 2.43 / 4.69 (its AVX2 tiles 1.40 / 1.49 / 3.34 / 6.56)."""
    return SKINNY_F16_KERNEL != "portable" and not _cpu_has_amx()


def rust_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes the Rust product takes here: float32 always, bf16 and float16 where they pay or
    it is forced."""
    forced = mode() == "rust"
    return (
        torch.float32,
        *((torch.bfloat16,) if forced or bf16_kernel_pays() else ()),
        *((torch.float16,) if forced or f16_kernel_pays() else ()),
    )


def f16_rust_only() -> bool:
    """Whether `auto` gives every float16 product to Rust, untimed, whatever its rows (in blocks past 64):
    torch's float16 product costs in proportion to its rows while one row ties with Rust's, so timed
    choices would mix the two across row counts, and a token verified in a tree would get other bits than
    decoded alone (as `bf16_rust_only` found for bf16 on AVX2)."""
    return mode() == "auto" and f16_kernel_pays()


def rust_only(dtype: torch.dtype) -> bool:
    """Whether every product of `dtype` goes to Rust, untimed, whatever its rows (in blocks past 64):
    `bf16_rust_only` or `f16_rust_only` for half precision under `auto`, and every dtype the Rust product
    takes under `SGLANG_DART_CPU_SKINNY_GEMM=rust`. Then a row's bits never depend on the forward's other
    rows, prefills included: with the Rust attention (any query count) a server's greedy output does not
    depend on how its batches were composed or which forward filled its radix cache, and greedy DART
    equals plain decoding at every batch size. The price is prefill speed where torch's products reuse
    each loaded weight across more rows: one SmolLM2 layer's linears over 2,048 rows on the AVX512-BF16
    EPYC, bf16, 72 ms against torch's 34 (throughput.md, run 125)."""
    if mode() == "rust":
        return dtype in rust_dtypes()
    if dtype == torch.bfloat16:
        return bf16_rust_only()
    return dtype == torch.float16 and f16_rust_only()


def bf16_rust_only() -> bool:
    """Whether `auto` gives every bf16 product to Rust, untimed, whatever its rows and torch's thread count:
    where its kernel is AVX2 (no bf16 instructions). There torch's bf16 product costs in proportion to its
    rows (8 rows 4-5x the Rust one's time) while one row ties, so timed choices picked torch for some row
    counts and Rust for others, and a token verified in a tree got other bits than decoded alone: greedy
    output unlike plain decoding's (7 chat prompts, 128 tokens: 5 differed). The Rust product gives a row
    the same bits whatever the call's other rows; past 64 rows it runs in blocks, which also cut the time
    to first token 2.0-4.3x against torch's (`benchmarks/results/throughput.md`, run 119)."""
    return SKINNY_BF16_KERNEL == "avx2" and mode() == "auto" and bf16_kernel_pays()


# Up to this many rows a bf16 product goes to the AVX512-BF16 kernel untimed (`bf16_rust_untimed`): trees of
# 8 or 16 at batch 1, and every forward `small_step_threads` runs on one thread (bf16: at most 16 tokens,
# however many requests).
EXACT_BF16_ROWS = 16


def bf16_rust_untimed(rows: int) -> bool:
    """Whether `auto` gives a bf16 product of `rows` rows to Rust without timing the other forms: always
    where the kernel is AVX2 (`bf16_rust_only`), and up to EXACT_BF16_ROWS rows where it is AVX512-BF16
    while torch runs on one thread (`_bf16_rust_now`). There timed choices mixed the Rust, torch and
    packed products across row buckets (a demo server: packed 52, torch 30, Rust 23 buckets), which round
    differently, so a token verified in a tree of 8 got other bits than decoded alone and greedy bf16
    DART parted from plain decoding (the demo's answer at its 34th character); with one form for 1-16 rows
    the two give the same text, and batch 1 ran faster too (plain 1.08-1.24x, DART 1.08-1.20x, paired;
    `benchmarks/results/throughput.md`, run 121). Past 16 rows plain decoding's own bits depend on how
    its batch is composed, and oneDNN's products, which reuse each loaded weight across more rows, keep
    their timed chance."""
    if bf16_rust_only():
        return True
    return (
        SKINNY_BF16_KERNEL == "avx512-bf16"
        and mode() == "auto"
        and bf16_kernel_pays()
        and rows <= EXACT_BF16_ROWS
        and _bf16_rust_now()
    )


def _bf16_rust_now() -> bool:
    """bf16 products go to Rust only while torch runs on one thread (`small_step_threads`): beside torch's
    pool, whose OpenMP workers spin for bf16, the Rust helpers and torch's workers took the second core
    from each other, and plain decoding at batch 16 ran 9% slower with the two mixed (run 45; again 0.89-0.93x
    in run 122, where the same batch on one torch thread ran 1.05-1.12x faster)."""
    return mode() == "rust" or torch.get_num_threads() == 1


PACKED_BUDGET_ENV = "SGLANG_DART_PACKED_WEIGHTS_GB"
DEFAULT_PACKED_BUDGET_GB = 4.0
# The row count oneDNN lays the packed weight out for; any count can use it (verify trees, few requests).
PACKED_FOR_ROWS = 16


@functools.cache
def packing_available() -> bool:
    """Whether torch's oneDNN takes bf16 products with a prepacked weight here (AVX-512 and up)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private ops: another torch build may lack them
        return False


@functools.cache
def packed_budget_bytes() -> int:
    """SGLANG_DART_PACKED_WEIGHTS_GB in bytes (read once: `forms_for` asks on every product)."""
    value = os.environ.get(PACKED_BUDGET_ENV, "").strip() or str(DEFAULT_PACKED_BUDGET_GB)
    try:
        gigabytes = float(value)
    except ValueError:
        gigabytes = -1.0
    if not gigabytes >= 0:  # also rejects nan
        raise ValueError(f"{PACKED_BUDGET_ENV}={value!r}: expected a size in GB, 0 or more")
    return int(gigabytes * 2**30)


class PackedWeights:
    """oneDNN-packed copies of bf16 weights, one per weight tensor while it lives, within a byte budget.
    `clear()` drops them all: after a weight update, SGLang writes new values into the same tensors."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.bytes = 0

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight`, made now if the budget allows; None if it does not."""
        key = id(weight)
        entry = self._by_id.get(key)
        if entry is not None and entry[0]() is weight:
            return entry[1]
        size = weight.numel() * weight.element_size()
        if self.bytes + size > packed_budget_bytes():
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKED_FOR_ROWS)
        # When the weight goes, so does its copy (and its id may then name another tensor).
        ref = weakref.ref(weight, lambda _, key=key, size=size: self._forget(key, size))
        self._by_id[key] = (ref, packed)
        self.bytes += size
        return packed

    def has(self, weight: torch.Tensor) -> bool:
        entry = self._by_id.get(id(weight))
        return entry is not None and entry[0]() is weight

    def drop(self, weight: torch.Tensor) -> None:
        """Forget `weight`'s packed copy, if it has one."""
        if self.has(weight):
            self._forget(id(weight), weight.numel() * weight.element_size())

    def _forget(self, key: int, size: int) -> None:
        if self._by_id.pop(key, None) is not None:
            self.bytes -= size

    def clear(self) -> None:
        self._by_id.clear()
        self.bytes = 0


packed_weights = PackedWeights()


def _packed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    packed = packed_weights.get(weight)
    if packed is None:  # over the budget: the same product, unpacked
        return _torch(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


PRODUCTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch": _torch,
    "transposed": _transposed,
    "rust": _rust,
    "packed": _packed,
}


def forms_for(rows: int, x: torch.Tensor, weight: torch.Tensor) -> tuple[str, ...]:
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    packed_fits = (
        weight.dtype == x.dtype == torch.bfloat16
        and weight.dim() == 2
        and packing_available()
        and packed_budget_bytes() > 0
        and not training  # oneDNN's packed product has no backward
    )
    rust_takes = (
        weight.dtype == x.dtype
        and weight.dtype in rust_dtypes()
        and weight.is_contiguous()
        # The Rust product has no backward: training (the drafter's) stays with torch.
        and not training
    )
    if rust_takes and (
        rust_only(weight.dtype) or (weight.dtype == torch.bfloat16 and bf16_rust_untimed(rows))
    ):
        return ("rust",)  # (past 64 rows only `rust_only`: `_rust` takes them in blocks)
    rust_fits = (
        rust_takes and rows <= SKINNY_MATMUL_MAX_ROWS and (weight.dtype != torch.bfloat16 or _bf16_rust_now())
    )
    if rows > MAX_ROWS:  # (past PACKED_MAX_ROWS only where `rust_only` let `linear` ask)
        return ("torch", "packed") if packed_fits and rows <= PACKED_MAX_ROWS else ("torch",)
    one_row = ("torch", *(("rust",) if rust_fits else ()), *(("packed",) if packed_fits else ()))
    # (W @ x.T).T is F.linear's own call for one row
    return one_row if rows == 1 else (*one_row[:1], "transposed", *one_row[1:])


def _bucket(rows: int) -> int:
    return rows.bit_length()  # 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4, ...


def _bucket_range(bucket: int) -> str:
    low, high = 1 << (bucket - 1), min((1 << bucket) - 1, PACKED_MAX_ROWS)
    return f"{low} row" if low == high == 1 else f"{low}-{high} rows"


def _timed_product(choice: _BucketChoice, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One call while the bucket is undecided: the form with the fewest samples, timed; decide when all
    have enough."""
    form = min(choice.forms, key=lambda f: len(choice.seconds.setdefault(f, [])))
    if form == "packed":
        packed_weights.get(weight)  # a one-off reorder, not part of the product's time
    start = time.perf_counter()
    out = PRODUCTS[form](x, weight)
    choice.seconds[form].append(time.perf_counter() - start)
    if all(len(choice.seconds[f]) >= SAMPLES_PER_FORM for f in choice.forms):
        decide(choice, weight, x.shape[0])
    return out


def decide(
    choice: _BucketChoice, weight: torch.Tensor, rows: int, when: str = "", level: int = logging.INFO
) -> None:
    """Keep the form with the lowest median time, unless torch's is within REQUIRED_GAIN of it."""
    medians = {f: statistics.median(choice.seconds[f]) for f in choice.forms}
    fastest = min(medians, key=medians.__getitem__)
    keep_torch = medians["torch"] * (1 - REQUIRED_GAIN) <= medians[fastest]
    choice.chosen = "torch" if keep_torch else fastest
    logger.log(
        level,
        "sglang_dart: CPU linear %d->%d (%s, %s, %d threads%s) uses %s (median ms: %s)",
        weight.shape[1], weight.shape[0], str(weight.dtype).removeprefix("torch."),
        _bucket_range(_bucket(rows)), torch.get_num_threads(), when, choice.chosen,
        ", ".join(f"{f} {s * 1e3:.3f}" for f, s in medians.items()),
    )  # fmt: skip


def bucket_choice(rows: int, weight: torch.Tensor, forms: tuple[str, ...]) -> _BucketChoice:
    """The choice `linear` consults for `rows` rows of `weight` under torch's current thread count."""
    # torch's thread count is part of the key: each form's speed depends on it (small_step_threads).
    key = (weight.shape[0], weight.shape[1], weight.dtype, _bucket(rows), torch.get_num_threads(), forms)
    return _choices.get(key) or _choices.setdefault(key, _BucketChoice(forms))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), in the faster form for this CPU, shape and row count."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    current = mode()
    if rows < 1 or x.device.type != "cpu" or current == "torch":
        return F.linear(x, weight, bias)
    if rows > PACKED_MAX_ROWS and not rust_only(x.dtype):
        return F.linear(x, weight, bias)
    forms = forms_for(rows, x, weight)
    if forms == ("torch",):  # nothing else applies (more rows than the few-row forms take)
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if len(forms) == 1:  # nothing to choose (`bf16_rust_untimed`)
        out = PRODUCTS[forms[0]](flat, weight)
    elif current != "auto":
        if current not in forms:
            return F.linear(x, weight, bias)
        out = PRODUCTS[current](flat, weight)
    else:
        choice = bucket_choice(rows, weight, forms)
        if choice.chosen is None:
            out = _timed_product(choice, flat, weight)
        elif choice.chosen == "torch":
            return F.linear(x, weight, bias)  # exactly SGLang's computation
        else:
            out = PRODUCTS[choice.chosen](flat, weight)
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

    mode()  # bad values fail at start-up, not on the first request
    packed_budget_bytes()
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
    drop_packed_weights_after_updates()


WEIGHT_UPDATES = (
    "update_weights_from_disk",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
    "update_weights_from_ipc",
)


def drop_packed_weights_after_updates() -> None:
    """SGLang updates weights in place (RL rollouts, /update_weights_from_disk): the packed copies would
    go stale, so every update drops them all; the next products pack the new values."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    for name in WEIGHT_UPDATES:
        update = getattr(WeightUpdater, name, None)
        if update is None or getattr(update, "_sglang_dart", False):
            continue

        @functools.wraps(update)
        def dropping(*args, _update=update, **kwargs):  # noqa: ANN002, ANN003, ANN202
            try:
                return _update(*args, **kwargs)
            finally:  # a failed update may have written some tensors already
                packed_weights.clear()

        dropping._sglang_dart = True
        setattr(WeightUpdater, name, dropping)
