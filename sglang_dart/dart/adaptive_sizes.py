"""Tree size chosen from measured throughput (`SGLANG_DART_TREE_SIZES=auto`).

Whether a tree pays depends on the hardware as much as on the drafter: where the target's matmuls cost
the same for 1 and 16 rows, a tree of 8 is nearly free; where they cost in proportion to rows (bf16 on a
CPU without bf16 instructions, or a GPU that is already busy), the same tree makes every step several
times dearer than the tokens it adds. No fixed schedule is right on every machine, so this one measures.

Per batch-size bucket (1, 2-3, 4-7, 8-15, ...) it keeps, for each candidate size (1, powers of two, and N), a
moving average of step seconds and of tokens emitted per step, both per request (a bucket's batches differ up
to 2x in size), and picks the size with the most tokens per second. Every candidate is tried at least `warmup`
times first (their plain mean: one step slowed down by the VM must not decide). After that, one step in
`explore_every` probes another size, in turn a neighbour of the best and the root alone (plain decoding, the
size that must never be lost to), and that probe's step time replaces the size's (measured against the next
step of the size in use, whose drift the estimate then follows: `FOLLOW_DRIFT`): the costs of sizes not in
use go stale, and a stale one that is too high would otherwise never be tried again (a probe that comes out
too low makes its size the chosen one, which is measured every step from then on and so corrects itself within
a few steps). A size replaces the one in use only if it measures 5% faster, so noise alone does not move the
choice, and one step (a probe too) counts at most 1.5x its size's mean step time (`STALL_CLIP`), so a
step the machine stalled does not either. So the choice follows a drafter that gets better or worse on the
current traffic. It never changes what is generated: only how many tokens a step verifies. The chosen size
of a bucket is logged when it changes.

While a probed size measures under half the rate of the one in use, the gap between probes doubles, up to
8x (`PROBE_BACKOFF_BELOW`): a tree that costs three plain steps and fills one token is not worth a look
every 50 steps.

Tokens per step are averaged over about 100 steps (weight 0.01; a probe adds one sample), step times over
about 5 (weight 0.2): a step's time varies little, but how many drafts it accepts varies from none to the
whole path. With the short average two poor steps sent a paying tree below plain decoding, and one probe
step decided its way back (peers run 4: 17 switches in 7 minutes at batch 1; simulated trees that pay
1.45x ran root-only in 36-55% of steps). The guard also probes each of its two sizes every 5 steps until
it has 20 steps of it, so an unlucky warm-up does not decide either (a tree that measured under 0.7x the
root alone's rate excepted: it costs over 1.4 root-only steps, and the regular probes re-check it).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from sglang_dart.dart.request_acceptance import RequestAcceptance
from sglang_dart.dart.tree_sizes import PlannedSize, TreeSizeSchedule

logger = logging.getLogger(__name__)

AUTO = "auto"
PROBE_WEIGHT = 1.0  # share of a probe's step time in its size's estimate: it re-measures the cost
TOKENS_SMOOTHING = 0.01  # weight of one step's tokens: acceptance is noisy per step, steady over many
# The guard's two sizes: until one has GUARD_SETTLE_SAMPLES steps it is probed every SETTLE_EVERY steps, so
# a few lucky or unlucky warm-up steps do not decide for the hundreds of steps regular probes would take to
# correct them. Not for `auto`: its five sizes include trees that cost many plain steps each.
GUARD_SETTLE_SAMPLES = 20
SETTLE_EVERY = 5
# Only trees measured at least this share of the best's rate are settled. A tree emits at least one token
# per request, so one below 0.7 costs over 1.4 root-only steps: 20 settling steps of it cost as much as 8
# lost steps or more (a scrambled drafter's trees of 4 at 64 requests: 2.2 root-only steps each).
SETTLE_WITHIN = 0.7
SWITCH_MARGIN = 0.05  # another size must beat the one in use by this much: noise is no reason to switch
# A step the machine stalled (another process took the cores for a moment) says nothing of what its size
# costs: once a size has CLIP_AFTER samples, one step counts at most STALL_CLIP times its mean. Unclipped,
# one stall of 2.5x raised a root-only estimate by 30% (weight 0.2), enough to hand the steps to trees
# that lose until the next probe: simulated with 2% of steps stalled, trees at 1.3x a plain step's cost
# that emit 1.18 tokens ran in 26-37% of the steps against 2-3% without stalls; clipped, 4-12%
# (`tests/unit/test_adaptive_sizes.py`).
STALL_CLIP = 1.5
CLIP_AFTER = 3
# A probe whose size measured under PROBE_BACKOFF_BELOW of the chosen size's rate doubles its bucket's gap
# between regular probes, up to MAX_PROBE_BACKOFF times `explore_every`; a probe within it restores the
# gap. Where trees cost three plain steps and emit 1.2-1.4 tokens, each probe of them lost ~1.7 plain
# steps, 3-4% of the time at one probe in 50; backed off, under 1%. Not below 0.5: trees that lose by
# less are the ones better traffic soonest makes pay, and probes are how the guard finds out.
PROBE_BACKOFF_BELOW = 0.5
MAX_PROBE_BACKOFF = 8
# The machine's speed drifts (a shared VM: tens of percent within minutes, spells of 2-4x slower steps),
# and the size in use is timed every step while the others are timed by a probe now and then. Compared
# raw, a drift reads as a change of one size's cost: a slow spell made the tree in use look slower than
# the root alone's stale estimate, and a probe of the root alone just after it beat the tree's spell-time
# estimate, so root-only steps ran until the next probe of the tree (run 121: ~45 s with probes backed
# off). So a probe is judged against the step of the size in use that follows it (its time as a share
# of that step's, applied to the size in use's estimate), and while FOLLOW_DRIFT every step of the size in
# use scales the estimates probes left by its own change: between probes the sizes keep the ratio of
# costs the last probe measured. (A size with regular steps of its own, a held request's root-only steps,
# keeps its own estimate.) Simulated over 64 traffic/cost cases with 2% of steps stalled and slow spells
# (`benchmarks/guard_sim.py --stalls 0.02 --spells 0.005 --seeds 4`): worst case 0.962x -> 1.008x plain,
# geometric mean 1.174x -> 1.197x; without spells (0-5% stalled) 0.972-0.974x and 1.116-1.118x before
# and after.
FOLLOW_DRIFT = True
# A step of the size in use this far from its estimate (either way) says the machine changed speed: a
# probe just before it is measured against it, not against the estimate (steps vary by a few percent).
MACHINE_CHANGED = 1.25
# A batch the guard holds at the root alone for its requests' poor drafts (while its bucket runs trees)
# still runs a tree one step in this many: its requests' acceptance is only measured on tree steps, and a
# request judged on a few unlucky ones must get the chance to show better. (Spacing rechecks by what they
# lose, up to 64 steps, with a prior that faded, won in simulation and lost 1-6% on real chat prompts at
# batch 1, where most poor requests are marginal: see throughput run 120.)
RECHECK_HELD_EVERY = 8


@dataclass
class _SizeStats:
    seconds: float = 0.0  # moving average of one step's wall time
    tokens: float = 0.0  # moving average of tokens emitted by one step (all requests)
    samples: int = 0
    anchored: bool = False  # the estimate is a probe's, relative to the size in use (FOLLOW_DRIFT)

    def add(self, seconds: float, tokens: float, weight: float, tokens_weight: float) -> None:
        # The plain mean while there are few samples, then a moving average.
        first = 1.0 / (self.samples + 1)
        if self.samples >= CLIP_AFTER:
            seconds = min(seconds, STALL_CLIP * self.seconds)
        self.seconds += max(weight, first) * (seconds - self.seconds)
        self.tokens += max(tokens_weight, first) * (tokens - self.tokens)
        self.samples += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    stats: dict[int, _SizeStats]  # by candidate size, ascending
    steps: int = 0
    probes: int = 0  # how many probes so far: picks the next one in turn
    chosen: int | None = None  # the size in use (logged when it changes); None during the warm-up
    held: int = 0  # steps held at the root alone for their requests' poor drafts (`GuardedTreeSizes`)
    probe_gap: int = 0  # steps between regular probes; 0 until a probe backs off (`PROBE_BACKOFF_BELOW`)
    pending: tuple[int, float, float] | None = None  # a probe's size, seconds, tokens, per request


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


def _bucket_range(key: int) -> str:
    low, high = 1 << key, (2 << key) - 1
    return str(low) if low == high else f"{low}-{high}"


class AdaptiveTreeSizes:
    label = AUTO  # names the schedule in its log lines
    settle_samples = 0  # no settling probes (GUARD_SETTLE_SAMPLES)

    def __init__(
        self,
        max_size: int,
        warmup: int = 3,
        explore_every: int = 50,
        smoothing: float = 0.2,
        tokens_smoothing: float = TOKENS_SMOOTHING,
    ) -> None:
        if max_size < 1:
            raise ValueError(f"tree size must be >= 1, got {max_size}")
        self.sizes = candidate_sizes(max_size)
        self.max_size = max_size
        self.warmup = warmup
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.tokens_smoothing = tokens_smoothing
        self._buckets: dict[int, _Bucket] = {}

    def candidates(self, smallest_batch: int) -> tuple[int, ...]:
        """The sizes measured for the bucket whose smallest batch size this is."""
        return self.sizes

    def possible_sizes(self, batch_size: int) -> tuple[int, ...]:
        """Every size a step of this batch size may verify: its bucket's candidates (nothing is counted)."""
        return tuple(sorted(set(self.candidates(1 << bucket_of(batch_size)))))

    def _bucket(self, batch_size: int) -> _Bucket:
        key = bucket_of(batch_size)
        if key not in self._buckets:
            sizes = sorted(set(self.candidates(1 << key)))
            self._buckets[key] = _Bucket({size: _SizeStats() for size in sizes})
        return self._buckets[key]

    def best(self, batch_size: int) -> int:
        """The size steps of this batch size run, probes aside: the one in use, unless another measured
        SWITCH_MARGIN faster (the largest while nothing is measured)."""
        bucket = self._bucket(batch_size)
        stats = bucket.stats
        measured = [size for size in stats if stats[size].samples]
        if not measured:
            return max(stats)
        top = max(measured, key=lambda size: (stats[size].rate, -size))
        current = bucket.chosen
        if current is not None and stats[current].rate * (1 + SWITCH_MARGIN) >= stats[top].rate:
            return current
        return top

    def size_for(self, batch_size: int) -> int:
        """The size the next step of a batch this large should verify (one call per step: it counts)."""
        return self.plan(batch_size).size

    def plan(
        self, batch_size: int, requests: Sequence[str] = (), copying: Collection[str] = ()
    ) -> PlannedSize:
        """`size_for`, and whether that step is a probe. The flag travels with the step to `record`, so a
        planned probe that never ran (a prefill came between, or the step fell back to the root alone)
        leaves nothing behind. `requests` (the batch's rids) and those of them `copying` an earlier passage
        of their own count only for the guard."""
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        # Largest first: it shows at once whether trees pay here at all.
        for size in reversed(bucket.stats):
            if bucket.stats[size].samples < self.warmup:
                return PlannedSize(size)
        best = self.best(batch_size)
        if best != bucket.chosen:
            bucket.chosen = best
            self._log_choice(batch_size, bucket)
        # Settling re-tries a size an unlucky warm-up may have misjudged. A tree that measured far behind
        # (under SETTLE_WITHIN of the best's rate) is left to the regular probes; the root alone, the size
        # never to lose to, is always settled.
        best_rate = bucket.stats[best].rate
        unsettled = [
            size
            for size, st in bucket.stats.items()
            if size != best
            and st.samples < self.settle_samples
            and (size == 1 or st.rate >= SETTLE_WITHIN * best_rate)
        ]
        if unsettled and bucket.steps % SETTLE_EVERY == 0:
            probe = unsettled[bucket.probes % len(unsettled)]
            bucket.probes += 1
            return PlannedSize(probe, probe=True)
        if bucket.steps % (bucket.probe_gap or self.explore_every):
            return PlannedSize(best)
        probes = self._probes(best, tuple(bucket.stats))
        if not probes:  # a single candidate size
            return PlannedSize(best)
        probe = probes[bucket.probes % len(probes)]
        bucket.probes += 1
        return PlannedSize(probe, probe=True)

    @staticmethod
    def _probes(best: int, sizes: tuple[int, ...]) -> list[int]:
        """Sizes a probe tries in turn: the best's neighbours among the bucket's sizes, and the root
        alone."""
        index = sizes.index(best)
        around = {sizes[i] for i in (index - 1, index + 1) if 0 <= i < len(sizes)}
        return sorted((around | {1}) - {best})

    def record(self, batch_size: int, size: int, seconds: float, tokens: int, probe: bool = False) -> None:
        """One finished step: its batch size, the size it verified, its wall time and tokens emitted, and
        whether it ran as a probe (`plan`)."""
        bucket = self._bucket(batch_size)
        stats = bucket.stats.get(size)
        if stats is None or seconds <= 0:
            return
        weight = PROBE_WEIGHT if probe else self.smoothing
        # Per request: a bucket spans batch sizes up to 2x apart (a batch drains as its answers finish),
        # and tokens per step scale with the batch while their average spans ~100 steps and the time's ~5.
        # Raw, the two averages described different batches and a size in use looked up to 1.5x faster
        # or slower than it was; per request they compare like with like.
        requests = max(batch_size, 1)
        seconds, per_request = seconds / requests, float(tokens) / requests
        in_use = bucket.stats.get(bucket.chosen) if bucket.chosen is not None else None
        if in_use is None or stats is not in_use:
            if probe and in_use is not None and in_use.samples >= CLIP_AFTER:
                bucket.pending = (size, seconds, per_request)  # judged against the next step in use
                return
            stats.add(seconds, per_request, weight, self.tokens_smoothing)
            stats.anchored = False
            if probe and in_use is not None:
                self._pace_probes(bucket, stats)
            return
        before = stats.seconds
        stats.add(seconds, per_request, weight, self.tokens_smoothing)
        if before > 0 and FOLLOW_DRIFT:
            self._follow_drift(bucket, stats, stats.seconds / before)
        if bucket.pending is not None:
            self._judge_probe(bucket, stats, self._probe_reference(before, seconds))

    @staticmethod
    def _follow_drift(bucket: _Bucket, in_use: _SizeStats, factor: float) -> None:
        """The size in use changed its time by `factor`: scale the estimates probes left alike."""
        for stats in bucket.stats.values():
            if stats is not in_use and stats.anchored:
                stats.seconds *= factor

    @staticmethod
    def _probe_reference(estimate: float, step: float) -> float:
        """What a probe's time is measured against: the estimate of the size in use (steadier than one
        step), unless the step after the probe shows the machine changed speed (MACHINE_CHANGED), then
        that step, counted as at most STALL_CLIP of the estimate (it may be a stall)."""
        if estimate <= 0:
            return step
        if estimate / MACHINE_CHANGED <= step <= estimate * MACHINE_CHANGED:
            return estimate
        return min(step, STALL_CLIP * estimate)

    def _judge_probe(self, bucket: _Bucket, in_use: _SizeStats, reference: float) -> None:
        """The pending probe's time as a share of `reference`, applied to the size in use's estimate."""
        size, seconds, tokens = bucket.pending
        bucket.pending = None
        probed = bucket.stats[size]
        if probed is in_use:  # the probed size was chosen meanwhile: its own steps measure it now
            return
        probed.add(in_use.seconds * seconds / reference, tokens, PROBE_WEIGHT, self.tokens_smoothing)
        probed.anchored = True
        self._pace_probes(bucket, probed)

    def _pace_probes(self, bucket: _Bucket, probed: _SizeStats) -> None:
        """After a probe: probe less often while what it tried stays far behind the size in use."""
        if probed.rate < PROBE_BACKOFF_BELOW * bucket.stats[bucket.chosen].rate:
            gap = bucket.probe_gap or self.explore_every
            bucket.probe_gap = min(2 * gap, MAX_PROBE_BACKOFF * self.explore_every)
        else:
            bucket.probe_gap = 0

    def record_requests(self, batch_size: int, size: int, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """One finished step's tokens per request (only the guard weighs requests one by one)."""

    def keep_requests(self, rids: Iterable[str]) -> None:
        """Forget every request but these (only the guard keeps any)."""

    def _log_choice(self, batch_size: int, bucket: _Bucket) -> None:
        rates = ", ".join(
            f"{size}: {stats.rate:.1f}" for size, stats in bucket.stats.items() if stats.samples
        )
        logger.info(
            "DART %s: batches of %s requests now verify %d token(s) each (tokens/s by size: %s)",
            self.label,
            _bucket_range(bucket_of(batch_size)),
            bucket.chosen,
            rates,
        )

    def describe(self) -> str:
        return f"{AUTO} (measured per batch-size bucket among sizes {list(self.sizes)})"


class GuardedTreeSizes(AdaptiveTreeSizes):
    """A batch-size schedule with a guard: per batch-size bucket, the schedule's tree size and the root
    alone (a plain decode step) are both measured, and steps run the one with more tokens per second. So
    trees run where they pay, and where the drafts are poor (prompts unlike the drafter's training data,
    a weak drafter) or the hardware makes trees dear, the server falls back to plain decoding by itself
    instead of running slower than it. Two candidates, not `auto`'s five: fewer probes, and a choice that
    noise moves less. Those averages are the traffic's; each step is then judged for the requests in it
    (`plan`), by their own acceptance so far. Explicit schedules (SGLANG_DART_TREE_SIZES) run unguarded,
    as given, unless prefixed `guarded:`."""

    label = "guarded"
    settle_samples = GUARD_SETTLE_SAMPLES

    def __init__(self, schedule: TreeSizeSchedule, **kwargs: float) -> None:
        super().__init__(schedule.max_size, **kwargs)
        self.schedule = schedule
        self.acceptance = RequestAcceptance()

    def candidates(self, smallest_batch: int) -> tuple[int, ...]:
        return (1, self.schedule.size_for(smallest_batch))

    def plan(
        self, batch_size: int, requests: Sequence[str] = (), copying: Collection[str] = ()
    ) -> PlannedSize:
        """The bucket's plan, then judged for these requests: their own acceptance so far
        (`request_acceptance.py`; at least the traffic's for those `copying`) scales the drafts the
        bucket's tree is expected to add, so a request whose drafts are poor runs root-only steps while
        the traffic around it runs trees, and one whose drafts are good runs trees where the traffic does
        not. Probes and the warm-up stay as planned."""
        planned = super().plan(batch_size)
        bucket = self._bucket(batch_size)
        tree = max(bucket.stats)
        if planned.probe or not requests or tree == 1:
            return planned
        tree_stats, root_stats = bucket.stats[tree], bucket.stats[1]
        if min(tree_stats.samples, root_stats.samples) < self.warmup:  # sampled times are > 0 (`record`)
            return planned
        expected = tree_stats.tokens - 1.0
        share = self.acceptance.factor(requests, expected, copying)
        tree_rate = (1.0 + expected * share) / tree_stats.seconds
        root_rate = root_stats.rate
        if planned.size == tree and tree_rate * (1 + SWITCH_MARGIN) < root_rate:
            bucket.held += 1
            return planned if bucket.held % RECHECK_HELD_EVERY == 0 else PlannedSize(1)
        if planned.size == 1 and tree_rate > root_rate * (1 + SWITCH_MARGIN):
            return PlannedSize(tree)
        return planned

    def record_requests(self, batch_size: int, size: int, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """A tree step's tokens per request, against the drafts its bucket expected of it."""
        stats = self._bucket(batch_size).stats.get(size)
        if size > 1 and stats is not None and stats.samples:
            self.acceptance.add(rids, tokens, stats.tokens - 1.0)

    def keep_requests(self, rids: Iterable[str]) -> None:
        self.acceptance.keep_only(rids)

    def describe(self) -> str:
        return f"{self.schedule.describe()}, guarded (root-only steps where trees measure slower)"


@dataclass
class _OpenStep:
    batch_size: int
    size: int
    tokens: int
    started: float
    drafting: float  # seconds its end spent drafting for the next step
    carried: float  # seconds the step before spent drafting for this one
    probe: bool  # run as a probe (`AdaptiveTreeSizes.plan`)


class StepClock:
    """Wall time of each decode step for the adaptive schedule, from one step's start to the next (so the
    scheduler's own work counts too), with the draft forward that prepares a step's trees counted in that
    step rather than in the one that ran it."""

    def __init__(self) -> None:
        self._open: _OpenStep | None = None
        self._carried = 0.0

    def start(self, now: float) -> tuple[int, int, float, int, bool] | None:
        """A decode step starts: the previous one, if it ran just before, as `record`'s arguments
        (batch size, size, seconds, tokens, probe)."""
        step, self._open = self._open, None
        if step is None:
            return None
        self._carried = step.drafting
        seconds = now - step.started - step.drafting + step.carried
        return step.batch_size, step.size, seconds, step.tokens, step.probe

    def finish(
        self,
        started: float,
        batch_size: int,
        size: int,
        tokens: int,
        drafting: float,
        probe: bool = False,
    ) -> None:
        self._open = _OpenStep(batch_size, size, tokens, started, drafting, self._carried, probe)
        self._carried = 0.0

    def interrupt(self) -> None:
        """Something other than a decode step ran (a prefill): the open step's interval would include it."""
        self._open = None
        self._carried = 0.0
