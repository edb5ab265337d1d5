"""Choose the CPU linear layers' product forms when a model is loaded, not on its first serving calls.

`skinny_gemm` keeps, per weight shape, row bucket and torch thread count, the fastest of the product forms
that apply. Timed on serving calls, a bucket's first calls rotate through the forms, which round
differently (bf16 above all): a fresh server could answer a greedy request with another text than it
gives the same request later, and its first requests paid the slow forms. So once a model runner has
loaded its weights, every bucket up to `PACKED_MAX_ROWS` rows is timed here on random rows, the shapes
taking turns as in a forward and each sample on another weight of its shape (so that weights come from
memory, not from a warm cache), and serving calls find their choice made. Near ties may be decided
otherwise than serving calls would have (noise either way); a bucket nothing foresaw (a thread count set
later by hand), or one past the time budget (`budget_seconds`), is still timed on its serving calls.
Processes started together take turns (`timing_lock`): timed side by side, each measured the other.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sglang_dart._core import SKINNY_MATMUL_MAX_ROWS
from sglang_dart.cpu import skinny_gemm, small_step_threads, timing_lock

logger = logging.getLogger(__name__)


def served_weights(model: nn.Module) -> list[torch.Tensor]:
    """The 2-D weights whose products go through `skinny_gemm.linear`: unquantized SGLang linear layers
    (`skinny_gemm.install`), the lm_head's, and the plugin's own `Linear`s; a module with a
    `served_linear_weights()` method (the DART drafter, whose step multiplies by stacked weights) lists
    its own and its submodules'."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.utils.common import use_intel_amx_backend

    found: dict[int, torch.Tensor] = {}
    listed: list[str] = []  # prefixes of the modules that list their own
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in listed):
            continue
        if callable(getattr(module, "served_linear_weights", None)):
            listed.append(f"{name}." if name else "")
            found.update((id(w), w) for w in module.served_linear_weights())
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or type(weight.data) is not torch.Tensor:
            continue
        routed = isinstance(module, skinny_gemm.Linear) or (
            isinstance(module, LinearBase)
            and isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod)
            and not use_intel_amx_backend(module)
        )
        if routed:
            found[id(weight)] = weight
    lm_head = getattr(getattr(model, "lm_head", None), "weight", None)
    if isinstance(lm_head, torch.Tensor) and lm_head.dim() == 2 and not use_intel_amx_backend(model.lm_head):
        found[id(lm_head)] = lm_head
    return [w for w in found.values() if w.device.type == "cpu" and w.is_floating_point()]


def row_counts() -> list[int]:
    """One row count per bucket and set of forms that apply in it: each bucket's first count, and the
    first count past a form's reach (the Rust product's, the few-row forms') inside a bucket."""
    edges = (SKINNY_MATMUL_MAX_ROWS + 1, skinny_gemm.MAX_ROWS + 1)
    counts: set[int] = set()
    for bucket in range(1, skinny_gemm.PACKED_MAX_ROWS.bit_length() + 1):
        low, high = 1 << (bucket - 1), min((1 << bucket) - 1, skinny_gemm.PACKED_MAX_ROWS)
        counts.add(low)
        counts.update(edge for edge in edges if low <= edge <= high)
    return sorted(counts)


@dataclass
class _Pending:
    """An undecided bucket of one weight shape, and what its samples need."""

    group: list[torch.Tensor]  # the weights of that shape, taken in turn
    choice: skinny_gemm._BucketChoice
    x: torch.Tensor
    turn: int = 0

    def sample(self, form: str) -> float:
        weight = self.group[self.turn % len(self.group)]
        self.turn += 1
        start = time.perf_counter()
        skinny_gemm.PRODUCTS[form](self.x, weight)
        return time.perf_counter() - start


def _time_buckets(pending: list[_Pending], deadline: float) -> bool:
    """SAMPLES_PER_FORM timed products per form of every pending bucket (one row count), round-robin over
    the shapes as a forward takes them: a shape's weights are then as cold as between layers (timed one
    shape after another they came out up to 2x faster than in a server and, near ties, chose otherwise).
    False, with nothing timed, if the first calls say the samples would run past `deadline`."""
    start = time.perf_counter()
    for entry in pending:  # first-call costs (oneDNN primitives, the Rust team's threads) stay out
        for form in entry.choice.forms:
            skinny_gemm.PRODUCTS[form](entry.x, entry.group[0])
    first_calls = time.perf_counter() - start
    if time.perf_counter() + first_calls * skinny_gemm.SAMPLES_PER_FORM > deadline:
        return False
    for entry in pending:
        entry.choice.seconds = {form: [] for form in entry.choice.forms}
    for sample in range(skinny_gemm.SAMPLES_PER_FORM):
        for entry in pending:
            forms = entry.choice.forms
            shift = sample % len(forms)
            for form in forms[shift:] + forms[:shift]:
                entry.choice.seconds[form].append(entry.sample(form))
    return True


def _groups(weights: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
    for weight in weights:
        groups[(*weight.shape, weight.dtype, weight.is_contiguous())].append(weight)
    return list(groups.values())


def drop_unused_packed_copies(weights: list[torch.Tensor], packed_before: set[int]) -> None:
    """Drop the packed copies made only to be timed: of weights whose shape no bucket chose packed for
    (the buckets left to serving calls pack again if they choose it)."""
    for group in _groups(weights):
        uses_packed = any(
            c.chosen == "packed" and key[:3] == (*group[0].shape, group[0].dtype)
            for key, c in skinny_gemm._choices.items()
        )
        if not uses_packed:
            for weight in group:
                if id(weight) not in packed_before:
                    skinny_gemm.packed_weights.drop(weight)


def tune_weights(
    weights: list[torch.Tensor],
    rows_to_tune: list[int] | None = None,
    deadline: float = math.inf,
    drop_copies: bool = True,
) -> collections.Counter | None:
    """Decide every undecided bucket of these row counts (default `row_counts()`, in that order) for these
    weights under torch's current thread count; returns how many buckets chose each form, or None if it
    stopped at the first row count whose samples would have run past `deadline`. `drop_copies`: drop the
    packed copies made only to be timed (a caller tuning row count by row count drops them at the end)."""
    chosen: collections.Counter = collections.Counter()
    groups = _groups(weights)
    packed_before = {id(w) for w in weights if skinny_gemm.packed_weights.has(w)}
    finished = True
    for rows in row_counts() if rows_to_tune is None else rows_to_tune:
        pending: list[_Pending] = []
        for group in groups:
            probe = torch.empty(rows, group[0].shape[1], dtype=group[0].dtype)
            forms = skinny_gemm.forms_for(rows, probe, group[0])
            if len(forms) == 1:  # F.linear, nothing to choose
                continue
            choice = skinny_gemm.bucket_choice(rows, group[0], forms)
            if choice.chosen is None:
                if "packed" in forms:
                    for weight in group:  # one-off reorders, not part of the product's time
                        skinny_gemm.packed_weights.get(weight)
                x = torch.randn(rows, group[0].shape[1]).to(group[0].dtype)
                pending.append(_Pending(group, choice, x))
        if not _time_buckets(pending, deadline):
            finished = False
            break
        for entry in pending:
            skinny_gemm.decide(entry.choice, entry.group[0], rows, when=", at start-up", level=logging.DEBUG)
            chosen[entry.choice.chosen] += 1
    if drop_copies:
        drop_unused_packed_copies(weights, packed_before)
    return chosen if finished else None


def thread_counts(model_runner: Any) -> list[int]:
    """The torch thread counts the runner's products run under: the configured one, and one thread where
    `small_step_threads` switches small forwards to it (and whatever runs after them in the step, such as
    a DART draft of more rows than its forward had: so every row count is tuned on one thread too)."""
    if small_step_threads.installed() and small_step_threads.rust_takes_the_linears(model_runner):
        configured = small_step_threads.configured_threads()
        return [configured] if configured == 1 else [configured, 1]
    return [torch.get_num_threads()]


BUDGET_ENV = "SGLANG_DART_GEMM_TUNING_SECONDS"
DEFAULT_BUDGET_SECONDS = 20.0


@functools.cache
def budget_seconds() -> float:
    """SGLANG_DART_GEMM_TUNING_SECONDS: the most a model runner spends choosing forms at start-up (0: none,
    every bucket is timed on its serving calls). Small row counts come first; larger ones left over are
    timed on their serving calls. SmolLM2-135M takes about 1.5 s; a model of billions of parameters, or a
    large vocabulary in float32, takes seconds per bucket of hundreds of rows."""
    value = os.environ.get(BUDGET_ENV, "").strip() or str(DEFAULT_BUDGET_SECONDS)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < math.inf:  # also rejects nan
        raise ValueError(f"{BUDGET_ENV}={value!r}: expected seconds, 0 or more")
    return seconds


@torch.no_grad()
def tune_model_runner(model_runner: Any) -> None:
    weights = served_weights(model_runner.model)
    if not weights or budget_seconds() == 0:
        return
    waiting_since = time.perf_counter()
    # Servers started together would time their forms against each other (`timing_lock`); the holder
    # spends at most the budget, so a third in line waits about two budgets.
    with timing_lock.timing_alone(max_wait=3 * budget_seconds()):
        waited = time.perf_counter() - waiting_since
        _tune_weights_of(model_runner, weights, waited)


def _tune_weights_of(model_runner: Any, weights: list[torch.Tensor], waited: float) -> None:
    start, before = time.perf_counter(), torch.get_num_threads()
    deadline = start + budget_seconds()
    chosen: collections.Counter = collections.Counter()
    skinny_gemm.size_rust_team(before)  # as a serving call would: never sized under a one-thread setting
    packed_before = {id(w) for w in weights if skinny_gemm.packed_weights.has(w)}
    left_from: int | None = None
    try:
        threads_used = thread_counts(model_runner)
        for rows in row_counts():  # a few rows first, at every thread count: decode and small verifies
            for threads in threads_used:
                torch.set_num_threads(threads)
                tuned = tune_weights(weights, [rows], deadline, drop_copies=False)
                if tuned is None:
                    left_from = rows
                    break
                chosen += tuned
            if left_from is not None:
                break
    finally:
        torch.set_num_threads(before)
        drop_unused_packed_copies(weights, packed_before)
    if chosen or left_from is not None:
        logger.info(
            "sglang_dart: CPU linear forms chosen at start-up for %d weights in %.1f s%s (%s buckets%s; "
            "set %s=torch to keep torch's own product)",
            len(weights), time.perf_counter() - start,
            f", after waiting {waited:.1f} s for another process's timing" if waited >= 0.5 else "",
            ", ".join(f"{form} {n}" for form, n in chosen.most_common()) or "no",
            "" if left_from is None else
            f"; from {left_from} rows on left to serving calls by {BUDGET_ENV}={budget_seconds():g}",
            skinny_gemm.ENV,
        )  # fmt: skip


def install() -> None:
    """Wrap SGLang's ModelRunner.initialize (CPU engine processes only): tune once the weights are in."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    budget_seconds()  # a bad value fails at start-up
    if skinny_gemm.mode() != "auto" or getattr(ModelRunner.initialize, "_sglang_dart", False):
        return
    sglang_initialize = ModelRunner.initialize

    def initialize(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        result = sglang_initialize(self, *args, **kwargs)
        if str(self.device) == "cpu":
            try:
                tune_model_runner(self)
            except Exception:  # an optimisation only: serving calls still time what is left undecided
                logger.warning("sglang_dart: CPU linear forms not chosen at start-up", exc_info=True)
        return result

    initialize._sglang_dart = True
    ModelRunner.initialize = initialize
