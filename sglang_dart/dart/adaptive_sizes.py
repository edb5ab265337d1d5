"""Tree size chosen from measured throughput (`SGLANG_DART_TREE_SIZES=auto`).

Whether a tree pays depends on the hardware as much as on the drafter: where the target's matmuls cost
the same for 1 and 16 rows, a tree of 8 is nearly free; where they cost in proportion to rows (bf16 on a
CPU without bf16 instructions, or a GPU that is already busy), the same tree makes every step several
times dearer than the tokens it adds. No fixed schedule is right on every machine, so this one measures.

Per batch-size bucket (1, 2-3, 4-7, 8-15, ...) it keeps, for each candidate size (1, powers of two, and N),
a moving average of step seconds and of tokens emitted per step, and picks the size with the most tokens
per second. Every candidate is tried at least `warmup` times first; after that, one step in
`explore_every` tries a neighbour of the best, so the choice follows a drafter that gets better or worse
on the current traffic. The choice never changes what is generated: only how many tokens a step verifies.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"


@dataclass
class _SizeStats:
    seconds: float = 0.0  # moving average of one step's wall time
    tokens: float = 0.0  # moving average of tokens emitted by one step (all requests)
    samples: int = 0

    def add(self, seconds: float, tokens: float, weight: float) -> None:
        if self.samples == 0:
            self.seconds, self.tokens = seconds, tokens
        else:
            self.seconds += weight * (seconds - self.seconds)
            self.tokens += weight * (tokens - self.tokens)
        self.samples += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    stats: dict[int, _SizeStats]
    steps: int = 0
    explore_up: bool = True


def candidate_sizes(max_size: int) -> tuple[int, ...]:
    """1, the powers of two below max_size, and max_size."""
    sizes = {1, max_size}
    size = 2
    while size < max_size:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def bucket_of(batch_size: int) -> int:
    """1 -> 0, 2-3 -> 1, 4-7 -> 2, ...: steps of one bucket cost about alike per token."""
    return max(batch_size, 1).bit_length() - 1


class AdaptiveTreeSizes:
    def __init__(
        self, max_size: int, warmup: int = 2, explore_every: int = 50, smoothing: float = 0.2
    ) -> None:
        if max_size < 1:
            raise ValueError(f"tree size must be >= 1, got {max_size}")
        self.sizes = candidate_sizes(max_size)
        self.max_size = max_size
        self.warmup = warmup
        self.explore_every = explore_every
        self.smoothing = smoothing
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        if key not in self._buckets:
            self._buckets[key] = _Bucket({size: _SizeStats() for size in self.sizes})
        return self._buckets[key]

    def best(self, batch_size: int) -> int:
        """The measured best size for this batch size (the largest while nothing is measured)."""
        stats = self._bucket(batch_size).stats
        measured = [size for size in self.sizes if stats[size].samples]
        if not measured:
            return self.max_size
        return max(measured, key=lambda size: (stats[size].rate, -size))

    def size_for(self, batch_size: int) -> int:
        """The size the next step of a batch this large should verify (one call per step: it counts)."""
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        # Largest first: it shows at once whether trees pay here at all.
        for size in reversed(self.sizes):
            if bucket.stats[size].samples < self.warmup:
                return size
        best = self.best(batch_size)
        if bucket.steps % self.explore_every:
            return best
        index = self.sizes.index(best)
        bucket.explore_up = not bucket.explore_up
        step = 1 if bucket.explore_up else -1
        if not 0 <= index + step < len(self.sizes):
            step = -step
        return self.sizes[index + step] if 0 <= index + step < len(self.sizes) else best

    def record(self, batch_size: int, size: int, seconds: float, tokens: int) -> None:
        """One finished step: its batch size, the size it verified, its wall time and tokens emitted."""
        stats = self._bucket(batch_size).stats.get(size)
        if stats is not None and seconds > 0:
            stats.add(seconds, float(tokens), self.smoothing)

    def describe(self) -> str:
        return f"{AUTO} (measured per batch-size bucket among sizes {list(self.sizes)})"


@dataclass
class _OpenStep:
    batch_size: int
    size: int
    tokens: int
    started: float
    drafting: float  # seconds its end spent drafting for the next step
    carried: float  # seconds the step before spent drafting for this one


class StepClock:
    """Wall time of each decode step for the adaptive schedule, from one step's start to the next (so the
    scheduler's own work counts too), with the draft forward that prepares a step's trees counted in that
    step rather than in the one that ran it."""

    def __init__(self) -> None:
        self._open: _OpenStep | None = None
        self._carried = 0.0

    def start(self, now: float) -> tuple[int, int, float, int] | None:
        """A decode step starts: the previous one, if it ran just before, as (batch size, size, seconds,
        tokens)."""
        step, self._open = self._open, None
        if step is None:
            return None
        self._carried = step.drafting
        seconds = now - step.started - step.drafting + step.carried
        return step.batch_size, step.size, seconds, step.tokens

    def finish(self, started: float, batch_size: int, size: int, tokens: int, drafting: float) -> None:
        self._open = _OpenStep(batch_size, size, tokens, started, drafting, self._carried)
        self._carried = 0.0

    def interrupt(self) -> None:
        """Something other than a decode step ran (a prefill): the open step's interval would include it."""
        self._open = None
        self._carried = 0.0
