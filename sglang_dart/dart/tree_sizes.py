"""How many tokens each request's tree holds, by running batch size.

A verify step costs about the same as a plain decode step while the batch is small (weights are read once
for all its tokens), but once the hardware is busy it costs in proportion to batch size × tree size, and a
big tree at a big batch makes DART slower than plain decoding. The schedule shrinks the tree as the batch
grows, down to 1 (the root alone: a plain decode step, no draft forward).

Written as `min_batch:size` pairs, e.g. `1:8,4:4,8:1`: batches of 1-3 requests verify 8 tokens each, 4-7
verify 4, 8 and more verify the root only. `fixed` keeps the server's --speculative-num-draft-tokens at
every batch size. Sizes above --speculative-num-draft-tokens are capped at it.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

FIXED = "fixed"


class PlannedSize(NamedTuple):
    """A step's tree size as its schedule planned it, and whether the step is a probe: a step run to
    re-measure a size not in use, whose time an adaptive schedule weighs in full (`record`)."""

    size: int
    probe: bool = False


class TreeSizesError(ValueError):
    """A tree-size schedule that cannot be parsed."""


@dataclass(frozen=True)
class TreeSizeSchedule:
    min_batches: tuple[int, ...]  # ascending, first is 1
    sizes: tuple[int, ...]  # tree size (root included) from the matching min_batch on

    @classmethod
    def fixed(cls, size: int) -> TreeSizeSchedule:
        return cls((1,), (size,))

    @classmethod
    def parse(cls, text: str, max_size: int) -> TreeSizeSchedule:
        text = text.strip()
        if text.lower() == FIXED:
            return cls.fixed(max_size)
        pairs: list[tuple[int, int]] = []
        for item in text.split(","):
            batch, sep, size = item.partition(":")
            try:
                if not sep:
                    raise ValueError
                pairs.append((int(batch), int(size)))
            except ValueError:
                raise TreeSizesError(
                    f"tree sizes {text!r}: {item.strip()!r} is not min_batch:size (e.g. 1:8,4:4,8:1)"
                ) from None
        pairs.sort()
        batches = [b for b, _ in pairs]
        if batches[0] != 1:
            raise TreeSizesError(f"tree sizes {text!r}: the first min_batch must be 1")
        if len(set(batches)) != len(batches):
            raise TreeSizesError(f"tree sizes {text!r}: a min_batch appears twice")
        if any(size < 1 for _, size in pairs):
            raise TreeSizesError(f"tree sizes {text!r}: sizes must be >= 1 (1 = the root alone)")
        return cls(tuple(batches), tuple(min(size, max_size) for _, size in pairs))

    def size_for(self, batch_size: int) -> int:
        return self.sizes[bisect.bisect_right(self.min_batches, max(batch_size, 1)) - 1]

    def plan(
        self, batch_size: int, requests: Sequence[str] = (), copying: Collection[str] = ()
    ) -> PlannedSize:
        """The next step's size (a fixed schedule never probes nor weighs requests)."""
        return PlannedSize(self.size_for(batch_size))

    def possible_sizes(self, batch_size: int) -> tuple[int, ...]:
        """Every size a step of this batch size may verify (no side effect, unlike an adaptive size_for)."""
        return (self.size_for(batch_size),)

    @property
    def max_size(self) -> int:
        return max(self.sizes)

    def record(self, batch_size: int, size: int, seconds: float, tokens: int, probe: bool = False) -> None:
        """A fixed schedule learns nothing from step times (the adaptive one does)."""

    def record_requests(self, batch_size: int, size: int, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """Nor from each request's tokens (the guard does)."""

    def keep_requests(self, rids: Iterable[str]) -> None:
        """It keeps nothing per request."""

    def describe(self) -> str:
        return ",".join(f"{b}:{s}" for b, s in zip(self.min_batches, self.sizes, strict=True))


# Defaults when neither the environment nor the drafter's config names a schedule.
# CPU: measured with SmolLM2-135M on 2 cores (benchmarks/results/throughput.md, run 5, and on an AVX2 EPYC
# in float32, runs 11-18): trees of 8 win at batch 1-2; trees of 4 and more lose from batch 4 on. Trees of
# 2 at batch 4 (8 rows, 1.50 tokens per step with the shipped drafter) ran 1.19x plain against 1.11x for
# root-only steps, 1.23x against 1.09x in CPU time; at batch 8 they tied (run 56): so 2 at batches 4-7.
# CPU with AMX and a bf16 target: oneDNN computes a linear layer of 8-32 rows at about the cost of one row,
# so trees win at batches 1-15 (run 20: trees of 16 2.07-2.11x plain at batch 1, of 8 1.41-1.48x at 4, of 4
# 1.26-1.34x at 8). Run 22: trees of 4 at batch 16 run 0.99-1.09x plain when every answer has the same
# length (plain's best case: its requests finish and are replaced in step) and 1.25x when lengths spread
# over 32-95 tokens; at 32, 0.87-0.92x and 1.15x. Root-only steps stay level (0.97-1.02x): trees of 4
# through batch 31, root-only from 32.
# CPU with AVX512-BF16 but no AMX (an AMD EPYC, run 23), bf16 target: a 576->1536 linear costs 0.08 ms for 1
# row and 0.16 ms for 16 in bf16 (0.27 ms in float32), so trees pay there too: with a drafter of 1,370
# steps, trees of 8 ran 1.64x plain at batch 1 (trees of 16: 1.54x), of 8 1.08x at 4, of 4 1.13x at 8 and
# 1.03x at 16, where the plain CPU default's root-only steps ran 0.97-1.01x. Run 24 (a stronger drafter,
# answer lengths 32-92): 1.72x / 1.38x / 1.34x / 1.31x at batches 1 / 4 / 8 / 16; trees of 16 at batch 1
# tied with trees of 8 (1.73x). Runs 25-26 (the draft computes only the rows a tree can reach, answer lengths
# 32-95): trees of 4 beat root-only steps at 32 in three runs (1.22x / 1.36x / 1.16x plain against 1.10x /
# 1.16x / 0.98x) and at 64 (1.27x against 0.93x): trees of 4 from batch 8 on, with no root-only tail.
# At batch 4 trees of 8 verify 32 rows, past the Rust tile's best range, and the guard flipped between them
# and root-only steps; trees of 4 there ran 1.10x plain against 1.05x (run 80, unguarded) and, guarded,
# 1.27x against 1.12x at 4 and 1.14x against 1.13x at 6 (run 81). At batches 2 and 3 too (16 and 24 rows):
# trees of 4 ran 1.54x and 1.47x plain against trees of 8's 1.35x and 1.22x (run 82). From batch 4 on,
# trees of 2 beat trees of 4 (runs 83-85, batches held full: 1.17x / 1.01x / 0.95x / 1.03x plain at 4 / 16
# / 32 / 64 against 1.09x / 0.97x / 0.88x / 0.85x): the Rust bf16 tile is at its best up to 8 rows, and a
# verify of 8-ish rows per step is what pays at small batches. So trees of 8 at batch 1, of 4 at 2-3, of 2
# from 4 on, guarded (runs 25-26's trees of 4 at 32-64 timed batches that shrank as requests finished).
# From 32 on the guard's mix of trees of 2 and root-only steps ran 0.99x / 1.02x and 1.10x / 1.04x plain at
# 32 / 64 against root-only steps alone's 1.06x / 1.25x and 1.07x / 1.13x (runs 87-88), and at 64
# trees of 2 alone lose to the root alone (run 90: 0.92x against 1.00x; switching between the two costs
# nothing measurable unless it happens every step), so root-only from 32, as on AMX.
# CUDA: fixed. A spec server captures its decode graphs for verify batches of exactly N tokens per
# request (SGLang's runner refuses other widths), so any other tree size would run without graphs; a
# schedule there is the user's call until one is measured.
CPU_AMX = "cpu-amx"
CPU_AVX512_BF16 = "cpu-avx512-bf16"
DEFAULT_SCHEDULES = {"cpu": "1:8,4:2,8:1", CPU_AMX: "1:16,4:8,8:4,32:1", CPU_AVX512_BF16: "1:8,2:4,4:2,32:1"}


def default_schedule_key(
    device: str, target_dtype: str, cpu_has_amx_bf16: bool, cpu_has_avx512_bf16: bool = False
) -> str:
    """Which default applies: the device, or for a bf16 target on a CPU with bf16 matrix instructions
    `cpu-amx` (AMX tiles) or `cpu-avx512-bf16` (AVX512-BF16 without AMX); `target_dtype` as torch prints
    it, e.g. `torch.bfloat16`."""
    if device != "cpu" or target_dtype.removeprefix("torch.") != "bfloat16":
        return device
    if cpu_has_amx_bf16:
        return CPU_AMX
    return CPU_AVX512_BF16 if cpu_has_avx512_bf16 else device


def default_schedule(device: str, max_size: int) -> TreeSizeSchedule:
    return TreeSizeSchedule.parse(DEFAULT_SCHEDULES.get(device, FIXED), max_size)
