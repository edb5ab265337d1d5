"""The training loop: anchor blocks sampled from the target's own sequences, cross-entropy of every draft
row against the target's greedy choice, mixed with cross-entropy against the target's own (top-K)
distribution where the features carry it (`soft_weight`), rows weighted by gamma^row (deeper rows matter
less: a node at depth j is only reached if every row before it was accepted)."""

from __future__ import annotations

import math
import random
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import nn

from sglang_dart.drafter.model import DartDrafter
from sglang_dart.train.blocks import BlockLogits, block_logits, packed_block_logits
from sglang_dart.train.features import SequenceFeatures
from sglang_dart.train.stop_signal import stop_on_signals, stop_requested
from sglang_dart.train.vocab import DraftVocab


@dataclass
class TrainSettings:
    anchors_per_sequence: int = 32  # DART's: beat 64 at equal minutes (acceptance.md, run 20)
    sequences_per_step: int = 4
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    max_steps: int = 2000
    max_seconds: float = math.inf
    row_decay: float = 0.8  # gamma; the command line gives DART 0.5 (run_summary.DEFAULT_ROW_DECAY)
    row_decay_final: float | None = None  # gamma at the end of the run, moved to linearly (None: fixed)
    soft_weight: float = 0.0  # share of the loss against the target's distribution (0: its argmax only)
    feature_noise: float = 0.0  # noise std on each tap, relative to its mean |value| (0: none)
    greedy_chains_only: bool = False  # supervise only where the data follows the target's greedy chain
    grad_clip: float = 1.0
    bf16_autocast: bool = True
    seed: int = 0
    log_every: int = 25
    progress_bar: bool | None = None  # a live line on a terminal (None: when stderr is one)


@dataclass
class RowStats:
    """Top-1 agreement with the target per draft row (row 0 = the next token after the root)."""

    correct: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)

    def add(self, row: int, correct: int, total: int) -> None:
        while len(self.correct) <= row:
            self.correct.append(0.0)
            self.total.append(0.0)
        self.correct[row] += correct
        self.total[row] += total

    def accuracy(self) -> list[float]:
        return [c / t if t else 0.0 for c, t in zip(self.correct, self.total, strict=True)]

    @classmethod
    def of_tally(cls, tally: list[list[float]]) -> RowStats:
        """From a [labels per row, top-1 hits per row] tally read off the device; rows without a label
        are left out, as `add` never saw them."""
        stats = cls()
        for row, (total, right) in enumerate(zip(*tally, strict=True)):
            if total:
                stats.add(row, int(right), int(total))
        return stats


@dataclass
class SequenceLoss:
    """A sequence's loss and its top-1 tally per draft row, [2, rows] (labels, hits) where the loss was
    computed: reading it is a host sync, so a packed step reads all its sequences' tallies at once."""

    loss: torch.Tensor
    tally: torch.Tensor

    @property
    def stats(self) -> RowStats:
        return RowStats.of_tally(self.tally.tolist())


def top1_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Bool per row of logits [..., V]: the label (-100: none) has the row's largest logit. For the
    trainers' progress stats only: on CPU this is about 9x cheaper than `argmax`, and it differs from
    it only on exact ties."""
    with torch.no_grad():
        logits = logits.detach()
        label_logit = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (labels >= 0) & (label_logit >= logits.amax(-1))


def soft_cross_entropy(logits: torch.Tensor, draft_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per row of logits [n, Vd]: cross-entropy against the target's top-K distribution (draft ids [n, K],
    -1 outside the draft vocabulary), renormalized over the tokens the draft vocabulary has."""
    probs = torch.where(draft_ids >= 0, probs.float(), 0.0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-6)
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, draft_ids.clamp(min=0))
    return -(probs * log_q).sum(-1)


# Row counts a training forward is padded to a multiple of (every format's trainer). oneDNN compiles a
# kernel for each new row count of a product and keeps about 1,024; a sequence's rows took any of some
# 500 counts, so most CPU steps compiled their products anew. Padded, DART trained 1.40x (one thread) to
# 1.57x (two) the steps a minute and EAGLE3 1.22x (benchmarks/results/acceptance.md, run 22).
ROW_BUCKET = 32


def bucketed(count: int) -> int:
    """`count` rounded up to a multiple of ROW_BUCKET."""
    return -(-count // ROW_BUCKET) * ROW_BUCKET


def pad_rows(rows: torch.Tensor, count: int, value: float | int = 0) -> torch.Tensor:
    """rows [n, ...] followed by count - n rows filled with `value` (rows itself when count <= n)."""
    extra = count - rows.shape[0]
    if extra <= 0:
        return rows
    return torch.cat([rows, rows.new_full((extra, *rows.shape[1:]), value)])


def padded_rows(
    taps: torch.Tensor, next_tokens: torch.Tensor, first: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(taps, next_tokens, wanted_from): a sequence's real rows followed by filler rows up to a bucketed
    count, and the first of the rows whose row-0 logits are computed, moved back from `first` so that
    their count is bucketed too. Filler rows come after every real one, so no real row or mask slot
    attends to them (each sees keys up to its own position or its anchor)."""
    padded = bucketed(taps.shape[0])
    wanted_from = max(0, padded - bucketed(padded - first))
    return pad_rows(taps, padded), pad_rows(next_tokens, padded), wanted_from


def greedy_run_lengths(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[T-1]: at real position t, how many tokens from x_{t+1} on the sequence keeps to the target's
    greedy choice (x_{u+1} == argmax at u for u = t, t+1, ...). Computed on the tensors' device, no host
    read: the index of the first departure at or after t (a reversed running minimum), minus t."""
    num_real = input_ids.shape[0] - 1
    follows = input_ids[1:] == labels[:num_real]
    index = torch.arange(num_real, device=input_ids.device)
    departures = torch.where(follows, num_real, index)
    first_departure = departures.flip(0).cummin(0).values.flip(0)
    return first_departure - index


def sequence_loss(
    model: DartDrafter,
    feats: SequenceFeatures,
    vocab: DraftVocab,
    anchors: torch.Tensor,
    row_decay: float,
    soft_weight: float = 0.0,
    greedy_chains_only: bool = False,
) -> SequenceLoss:
    """Real position t (t < T-1) carries (taps_t, x_{t+1}); row i of the anchor at p is supervised by the
    target's argmax at position p+1+i (and, with `soft_weight`, by its distribution there). Row 0 learns at
    the real positions from `feats.first_anchor()` on: a drafter is only served answers, and a prompt's
    positions (a chat template's system prompt above all) would teach it text it is never asked for.

    With `greedy_chains_only`, row i of the anchor at p learns only where x_{p+1} .. x_{p+1+i} are the
    target's own greedy tokens: served, the root is always the target's choice and row i is asked for the
    greedy chain's next token, so on text the target did not write (documents, other models' answers) a
    label past a departure would teach a continuation no verify step ever accepts. On the target's own
    greedy answers it drops only the near-ties where the feature pass and the generating engine disagree."""
    rows = _block_rows(model, feats, anchors)
    out = block_logits(model, rows.taps, rows.next_tokens, anchors, rows.real_rows)
    return _loss_of_logits(
        out, rows, feats, vocab, anchors, model.cfg.draft_length, row_decay, soft_weight, greedy_chains_only
    )


@dataclass(frozen=True)
class _BlockRows:
    """What a sequence's training forward reads: its real rows padded to a bucketed count, the real rows
    whose row-0 logits are wanted (from `wanted_from` on), and the first one supervised."""

    taps: torch.Tensor
    next_tokens: torch.Tensor
    real_rows: torch.Tensor
    first: int
    wanted_from: int


def _block_rows(model: DartDrafter, feats: SequenceFeatures, anchors: torch.Tensor) -> _BlockRows:
    num_real = feats.input_ids.shape[0] - 1
    first = min(feats.first_anchor(), num_real)
    taps, next_tokens, wanted_from = padded_rows(
        feats.taps[:num_real].to(model.fc.weight.dtype), feats.input_ids[1:], first
    )
    real_rows = torch.arange(wanted_from, taps.shape[0], device=anchors.device)
    return _BlockRows(taps, next_tokens, real_rows, first, wanted_from)


def packed_sequence_losses(
    model: DartDrafter,
    batch: list[tuple[SequenceFeatures, torch.Tensor]],
    vocab: DraftVocab,
    row_decay: float,
    soft_weight: float = 0.0,
    greedy_chains_only: bool = False,
) -> list[SequenceLoss]:
    """`sequence_loss` of each (features, anchors) pair, their forwards packed into one
    (`packed_block_logits`): the same losses, up to the rounding of differently sized products."""
    rows = [_block_rows(model, feats, anchors) for feats, anchors in batch]
    parts = [(r.taps, r.next_tokens, a, r.real_rows) for r, (_, a) in zip(rows, batch, strict=True)]
    outs = packed_block_logits(model, parts)
    d = model.cfg.draft_length
    return [
        _loss_of_logits(out, r, feats, vocab, anchors, d, row_decay, soft_weight, greedy_chains_only)
        for out, r, (feats, anchors) in zip(outs, rows, batch, strict=True)
    ]


def _loss_of_logits(
    out: BlockLogits,
    rows: _BlockRows,
    feats: SequenceFeatures,
    vocab: DraftVocab,
    anchors: torch.Tensor,
    d: int,
    row_decay: float,
    soft_weight: float,
    greedy_chains_only: bool,
) -> SequenceLoss:
    """`sequence_loss` from the sequence's block logits."""
    num_real = feats.input_ids.shape[0] - 1
    first, wanted_from, real_rows = rows.first, rows.wanted_from, rows.real_rows
    labels = vocab.to_draft(feats.labels)  # draft ids, -100 outside the draft vocabulary
    # Rows the padding added (prompt rows before `first`, filler rows past the sequence) learn nothing.
    row0_labels = torch.full_like(real_rows, -100)
    row0_labels[first - wanted_from : num_real - wanted_from] = labels[1 + first : num_real + 1]
    label_index = anchors.unsqueeze(1) + 1 + torch.arange(1, d + 1, device=anchors.device)  # [A, d]
    valid = label_index < labels.shape[0]
    clamped = label_index.clamp(max=labels.shape[0] - 1)
    mask_labels = torch.where(valid, labels[clamped], -100)
    if greedy_chains_only:
        runs = greedy_run_lengths(feats.input_ids, feats.labels)
        row0_run = torch.zeros_like(real_rows)
        row0_run[first - wanted_from : num_real - wanted_from] = runs[first:num_real]
        row0_labels = torch.where(row0_run >= 1, row0_labels, -100)
        depth = torch.arange(1, d + 1, device=anchors.device)  # row j needs x_{p+1} .. x_{p+1+j} greedy
        mask_labels = torch.where(runs[anchors].unsqueeze(1) >= depth + 1, mask_labels, -100)
    # One loss over every logits row at once (slicing it per draft row made the backward fill and add
    # a zero gradient of all the logits once per row): row 0 at every real position, row j of every
    # anchor at p+1+j; each draft row's mean, weighted by gamma^row.
    targets = torch.cat([row0_labels, mask_labels.reshape(-1)])
    row_of = torch.cat(
        [
            torch.zeros_like(row0_labels),
            torch.arange(1, d + 1, device=anchors.device).repeat(anchors.shape[0]),
        ]
    )
    keep = targets >= 0
    logits = out.all.float()
    per_token = nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    if soft_weight > 0 and feats.soft_ids is not None and feats.soft_probs is not None:
        positions = torch.cat([(real_rows + 1).clamp(max=labels.shape[0] - 1), clamped.reshape(-1)])
        draft_ids = vocab.t2d[feats.soft_ids[positions].long()]
        soft = soft_cross_entropy(logits, draft_ids, feats.soft_probs[positions])
        per_token = (1 - soft_weight) * per_token + soft_weight * torch.where(keep, soft, 0.0)
    # Per draft row sums by index_add (a boolean index would cost a host sync on a GPU); nothing here is
    # read on the host (the tally is read by whoever steps, once for all of a step's sequences).
    zeros = torch.zeros(d + 1, dtype=per_token.dtype, device=per_token.device)
    sums = zeros.index_add(0, row_of, per_token)
    with torch.no_grad():
        counts = zeros.index_add(0, row_of, keep.to(zeros.dtype))
        correct = zeros.index_add(0, row_of, top1_hits(logits, targets).to(zeros.dtype))
    present = counts > 0
    decay = row_decay ** torch.arange(d + 1, device=sums.device, dtype=sums.dtype)
    weights = torch.where(present, decay, 0.0)
    row_means = sums / counts.clamp(min=1)
    # Where every label fell outside the draft vocabulary, all weights are 0 and so is the loss (its
    # gradient too): the clamp keeps 0/0 out and is far below any present row's weight.
    loss = (row_means * weights).sum() / weights.sum().clamp(min=1e-12)
    return SequenceLoss(loss, torch.stack([counts, correct]))


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress_line(
    step: int, settings: TrainSettings, elapsed: float, loss: float, accuracy: list[float]
) -> str:
    """`step 120/2000 loss 2.314 top-1 by row [0.61 0.32 ...] 45s, ETA 11m50s`: the ETA is whichever budget
    (steps or time) runs out first, at the rate so far."""
    remaining = (settings.max_steps - step) * elapsed / max(step, 1)
    if math.isfinite(settings.max_seconds):
        remaining = min(remaining, settings.max_seconds - elapsed)
    acc = " ".join(f"{a:.2f}" for a in accuracy)
    return (
        f"step {step}/{settings.max_steps} loss {loss:.3f} top-1 by row [{acc}] "
        f"{_duration(elapsed)}, ETA {_duration(remaining)}"
    )


def bf16_autocast_pays() -> bool:
    """Whether CPU training autocasts to bf16 unless told otherwise: only where the CPU multiplies bf16
    natively (AMX, AVX512-BF16; `fast_dtype`). Elsewhere bf16 products are emulated: on an AVX2-only EPYC
    an EAGLE3 drafter for SmolLM2 trained 9 steps a minute with autocast, 75 without."""
    from sglang_dart.dart.settings import fast_dtype_here

    return fast_dtype_here("cpu") == "bfloat16"


def bf16_autocast(enabled: bool, device: torch.device) -> AbstractContextManager:
    """bf16 autocast for a forward on `device` (CPU or CUDA), or none."""
    if enabled and device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def noised_taps(taps: torch.Tensor, num_taps: int, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """taps [T, num_taps * H] plus Gaussian noise of std `sigma` times each tap's mean absolute value in its
    row (not its RMS, which a few outsized channels dominate), in float32. A regulariser: served drafters
    always read exact target states, so this only keeps the drafter from fitting the few thousand training
    answers too closely."""
    rows = taps.float().view(taps.shape[0], num_taps, -1)
    scale = rows.abs().mean(-1, keepdim=True)
    # drawn by a CPU generator (seeded from the step's rng), then moved to wherever the taps are
    noise = torch.randn(rows.shape, generator=generator, dtype=rows.dtype).to(rows.device)
    return (rows + sigma * scale * noise).view(taps.shape)


def sample_anchors(num_real: int, count: int, rng: random.Random, first: int = 0) -> torch.Tensor:
    """`count` distinct anchors (at most all) among real positions first..num_real-1, sorted."""
    count = min(count, num_real - first)
    return torch.tensor(sorted(rng.sample(range(first, num_real), count)), dtype=torch.long)


def budget_spent(settings: TrainSettings, step: int, elapsed: float, from_step: int = 0) -> float:
    """The share of the run done, 0 to 1, by whichever budget (steps counted from `from_step`, or time)
    runs out first: what the learning-rate and row-decay schedules move along."""
    by_steps = (step - from_step) / max(1, settings.max_steps - from_step)
    return min(1.0, max(by_steps, elapsed / settings.max_seconds))


def lr_factor(settings: TrainSettings, step: int, elapsed: float) -> float:
    """Linear warm-up, then cosine decay to 10% over whichever budget (steps or time) runs out first (every
    format's trainer uses this schedule)."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = budget_spent(settings, step, elapsed, settings.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def row_decay_at(settings: TrainSettings, step: int, elapsed: float) -> float:
    """The step's γ: `row_decay` throughout, or moved linearly to `row_decay_final` over whichever budget
    (steps or time) runs out first, so that a run can learn the near rows first and the far ones later."""
    if settings.row_decay_final is None:
        return settings.row_decay
    progress = budget_spent(settings, step, elapsed)
    return settings.row_decay + (settings.row_decay_final - settings.row_decay) * progress


class SequenceStep(Protocol):
    """One sequence's loss (each row, step or block position weighted by `row_decay` to its index's power)
    and its top-1 stats per row (or unrolled step, or block position)."""

    def __call__(
        self, feats: SequenceFeatures, rng: random.Random, row_decay: float
    ) -> tuple[torch.Tensor, RowStats]: ...


class BatchStep(Protocol):
    """A step's sequences' losses and top-1 stats, in order, from forwards that may share their work."""

    def __call__(
        self, batch: list[SequenceFeatures], rng: random.Random, row_decay: float
    ) -> list[tuple[torch.Tensor, RowStats]]: ...


def _step_backward(
    batch: list[SequenceFeatures],
    settings: TrainSettings,
    device: torch.device,
    sequence_step: SequenceStep,
    rng: random.Random,
    window: RowStats,
    batch_step: BatchStep | None = None,
    row_decay: float | None = None,
) -> float:
    """One optimizer step's forwards (`batch_step`'s, or `sequence_step`'s one sequence at a time) and ONE
    backward of their mean loss; returns that mean. All forwards
    share one autocast region, so each weight is cast to bf16 once a step, not once a sequence, and its
    gradient is cast back and added to `.grad` once (a DART step on CPU 4-5% cheaper: the 8,192-row head
    alone is read and written twice a cast). The graphs of the step's sequences are alive together until
    the backward. Losses are summed in float32: a sequence with nothing to learn returns a zero of the
    autocast dtype. `row_decay` is the step's γ (None: the settings' fixed one)."""
    gamma = settings.row_decay if row_decay is None else row_decay
    losses = []
    with bf16_autocast(settings.bf16_autocast, device):
        if batch_step is not None:
            results = batch_step(batch, rng, gamma)
        else:
            results = [sequence_step(feats, rng, gamma) for feats in batch]
        for loss, stats in results:
            losses.append(loss)
            for row, (c, t) in enumerate(zip(stats.correct, stats.total, strict=True)):
                window.add(row, int(c), int(t))
    mean = torch.stack([loss.float() for loss in losses]).sum() / len(batch)
    mean.backward()
    return float(mean.detach())


def fit(
    model: nn.Module,
    usable: list[SequenceFeatures],
    settings: TrainSettings,
    sequence_step: SequenceStep,
    log=print,
    unit: str = "row",
    log_seconds: float | None = None,
    batch_step: BatchStep | None = None,
) -> list[float]:
    """The loop every format's trainer runs, in place; returns every step's loss (`batch_step`, where a
    format has one, computes a step's sequences together). Each step takes
    `sequences_per_step` sequences in a reshuffled round robin, AdamW with `lr_factor`'s schedule and
    gradient clipping, until the step or time budget runs out. Progress: a live line on a terminal and,
    every `log_every` steps (and every `log_seconds`, for formats whose steps can take seconds) and at the
    end, a logged line with the loss and the top-1 per `unit` since the line before, and the ETA."""
    rng = random.Random(settings.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    live = sys.stderr.isatty() if settings.progress_bar is None else settings.progress_bar
    order: list[int] = []
    losses: list[float] = []
    window, shown, logged_at, logged_step = RowStats(), 0.0, 0.0, 0
    start = time.monotonic()

    def line(step: int, elapsed: float, recent: list[float]) -> str:
        text = progress_line(step, settings, elapsed, sum(recent) / len(recent), window.accuracy())
        return text.replace("top-1 by row", f"top-1 by {unit}")

    model.train()
    with stop_on_signals():  # a first SIGTERM/SIGINT ends the loop after its step; the run saves
        for step in range(settings.max_steps):
            elapsed = time.monotonic() - start
            if elapsed > settings.max_seconds:
                log(f"time budget reached after {step} steps")
                break
            if stop_requested():
                log(f"stopped by a signal after {step} steps")
                break
            for group in optimizer.param_groups:
                group["lr"] = settings.learning_rate * lr_factor(settings, step, elapsed)
            optimizer.zero_grad(set_to_none=True)
            batch = []
            for _ in range(settings.sequences_per_step):
                if not order:
                    order = list(range(len(usable)))
                    rng.shuffle(order)
                batch.append(usable[order.pop()])
            gamma = row_decay_at(settings, step, elapsed)
            step_loss = _step_backward(batch, settings, device, sequence_step, rng, window, batch_step, gamma)
            nn.utils.clip_grad_norm_(params, settings.grad_clip)
            optimizer.step()
            losses.append(step_loss)
            elapsed = time.monotonic() - start
            if live and (elapsed - shown >= 0.5 or step + 1 == settings.max_steps):
                sys.stderr.write(f"\r\033[K{line(step + 1, elapsed, losses[-20:])}")
                sys.stderr.flush()
                shown = elapsed
            by_time = log_seconds is not None and elapsed - logged_at >= log_seconds
            if settings.log_every and ((step + 1) % settings.log_every == 0 or by_time):
                if live:
                    sys.stderr.write("\r\033[K")
                log(line(step + 1, elapsed, losses[logged_step:]))
                window, logged_at, logged_step = RowStats(), elapsed, step + 1
    if live:
        sys.stderr.write("\n")
    if len(losses) > logged_step:  # the steps since the last logged line
        log(line(len(losses), time.monotonic() - start, losses[logged_step:]))
    model.eval()
    return losses


def train(
    model: DartDrafter,
    data: list[SequenceFeatures],
    vocab: DraftVocab,
    settings: TrainSettings,
    log=print,
) -> list[float]:
    """Train in place; returns the loss of every step."""
    usable = [f for f in data if f.input_ids.shape[0] >= 3]
    if not usable:
        raise ValueError("no training sequence has the 3 tokens an anchor needs")
    sequence_step, batch_step = dart_steps(model, vocab, settings)
    return fit(model, usable, settings, sequence_step, log, batch_step=batch_step)


def dart_steps(
    model: DartDrafter, vocab: DraftVocab, settings: TrainSettings
) -> tuple[SequenceStep, BatchStep]:
    """What a DART training step runs, one sequence at a time and packed (`fit` takes the packed one;
    `benchmarks/train_step.py` times both): each sequence moved to the drafter's device, its anchors drawn
    and its taps noised where asked, in the same order either way."""
    device = model.fc.weight.device
    on_device = vocab.to(device)

    def prepared(feats: SequenceFeatures, rng: random.Random) -> tuple[SequenceFeatures, torch.Tensor]:
        """The sequence on the device with its anchors drawn (and its taps noised, where asked)."""
        feats = feats.to(device)
        num_real = feats.input_ids.shape[0] - 1
        first = feats.first_anchor()
        anchors = sample_anchors(num_real, settings.anchors_per_sequence, rng, first).to(device)
        if settings.feature_noise > 0:
            generator = torch.Generator().manual_seed(rng.getrandbits(63))
            num_taps = feats.taps.shape[1] // model.cfg.target_hidden_size
            taps = noised_taps(feats.taps, num_taps, settings.feature_noise, generator)
            feats = replace(feats, taps=taps)
        return feats, anchors

    def sequence_step(
        feats: SequenceFeatures, rng: random.Random, row_decay: float
    ) -> tuple[torch.Tensor, RowStats]:
        feats, anchors = prepared(feats, rng)
        result = sequence_loss(
            model,
            feats,
            on_device,
            anchors,
            row_decay,
            settings.soft_weight,
            settings.greedy_chains_only,
        )
        return result.loss, result.stats

    def batch_step(
        batch: list[SequenceFeatures], rng: random.Random, row_decay: float
    ) -> list[tuple[torch.Tensor, RowStats]]:
        ready = [prepared(feats, rng) for feats in batch]  # the rng draws in the one-at-a-time order
        results = packed_sequence_losses(
            model, ready, on_device, row_decay, settings.soft_weight, settings.greedy_chains_only
        )
        tallies = torch.stack([result.tally for result in results]).tolist()  # the step's one host read
        return [(r.loss, RowStats.of_tally(t)) for r, t in zip(results, tallies, strict=True)]

    return sequence_step, batch_step
