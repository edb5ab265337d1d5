"""The CPU default's guard (`GuardedTreeSizes`) in simulated traffic, as shipped (`now`) and without one of
its defences (`before`, `--without`): the stall clip and probe back-off (`adaptive_sizes.STALL_CLIP`,
`PROBE_BACKOFF_BELOW`), or the estimates that follow the machine's drift (`FOLLOW_DRIFT`).

Requests of 128 tokens are served at a fixed batch size, the guard planning each step with the batch's
rids as the worker does. A tree step costs `cost` root-only steps (+-5%) and accepts a geometric number of
drafts (probability p per level, per request); a share of steps is stalled 2.5x, as this VM's are, and
with `--spells` a step may start a slow spell: 50 steps at 3x, as seen in run 121. Each row prints
DART / plain; plain decoding pays the same stalls and spells. Lossless either way: only how many tokens a
step verifies changes.

    python benchmarks/guard_sim.py --stalls 0 0.02 0.05 --seeds 4
    python benchmarks/guard_sim.py --without drift --stalls 0.02 --spells 0.005
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterator

from sglang_dart.dart import adaptive_sizes
from sglang_dart.dart.adaptive_sizes import GuardedTreeSizes
from sglang_dart.dart.tree_sizes import TreeSizeSchedule

TOKENS_PER_REQUEST = 128
REQUESTS = 40
STALL_FACTOR = 2.5
SPELL_STEPS = 50
SPELL_FACTOR = 3.0


def traffic(name: str) -> list[float]:
    """Per-request acceptance probabilities of one traffic mix."""
    rng = random.Random(1)
    half = REQUESTS // 2
    if name == "mixed":
        return [rng.choice([0.05, 0.2, 0.4, 0.6, 0.75]) for _ in range(REQUESTS)]
    if name == "alternating":
        return [0.7 if i % 2 else 0.08 for i in range(REQUESTS)]
    if name == "poor-few-good":
        return [0.75 if i % 5 == 0 else 0.1 for i in range(REQUESTS)]
    if name == "poor-then-good":
        return [0.1] * half + [0.75] * half
    if name == "good-then-poor":
        return [0.75] * half + [0.1] * half
    return [float(name)] * REQUESTS  # all alike


MIXES = ("mixed", "alternating", "poor-few-good", "poor-then-good", "good-then-poor", "0.6", "0.3", "0.15")


def step_slowdown(stall: float, spell: float) -> float:
    """How much slower plain decoding's average step is for the stalls and spells (a spell starts at a
    step outside one with probability `spell`: a share SPELL_STEPS * spell / (1 + SPELL_STEPS * spell) of
    the steps run in one)."""
    in_spell = SPELL_STEPS * spell / (1 + SPELL_STEPS * spell)
    return (1 + stall * (STALL_FACTOR - 1)) * (1 + in_spell * (SPELL_FACTOR - 1))


def serve(
    acceptances: list[float], batch_size: int, cost: float, stall: float, seed: int, spell: float = 0.0
) -> tuple[float, list[float]]:
    """Simulated seconds (a root-only step of one request = 1) to serve the requests, and each request's
    share of them (a step's time split evenly over its requests)."""
    rng = random.Random(seed)  # acceptance
    machine = random.Random(seed + 10_000)  # step times, stalls and spells: alike for both guards' steps
    guard = GuardedTreeSizes(TreeSizeSchedule.parse("1:8,4:8", 8))
    queue = list(enumerate(acceptances))
    running: dict[str, list[float]] = {}  # rid -> [acceptance, tokens so far]
    total = 0.0
    shares = [0.0] * len(acceptances)
    spell_left = 0
    while queue or running:
        while queue and len(running) < batch_size:
            rid, acceptance = queue.pop(0)
            running[str(rid)] = [acceptance, 0]
        rids = list(running)
        planned = guard.plan(len(rids), rids)
        seconds = len(rids) * (cost if planned.size > 1 else 1.0) * machine.uniform(0.95, 1.05)
        if machine.random() < stall:
            seconds *= STALL_FACTOR
        if spell_left == 0 and machine.random() < spell:
            spell_left = SPELL_STEPS
        if spell_left:
            seconds *= SPELL_FACTOR
            spell_left -= 1
        tokens = []
        for rid in rids:
            emitted = 1
            while planned.size > 1 and emitted < planned.size and rng.random() < running[rid][0]:
                emitted += 1
            tokens.append(emitted)
        guard.record(len(rids), planned.size, seconds, sum(tokens), planned.probe)
        guard.record_requests(len(rids), planned.size, rids, tokens)
        total += seconds
        for rid, emitted in zip(rids, tokens, strict=True):
            shares[int(rid)] += seconds / len(rids)
            running[rid][1] += emitted
            if running[rid][1] >= TOKENS_PER_REQUEST:
                del running[rid]
        guard.keep_requests(list(running))
    return total, shares


# What `before` turns off: the constants and the values that disable them.
WITHOUT = {
    "clip": {"STALL_CLIP": math.inf, "PROBE_BACKOFF_BELOW": 0.0},  # probes every explore_every steps
    "drift": {"FOLLOW_DRIFT": False},  # estimates of sizes not in use stay as their probe left them
}


def speedup(
    acceptances: list[float],
    batch_size: int,
    cost: float,
    stall: float,
    seeds: int,
    now: bool,
    spell: float = 0.0,
    without: str = "clip",
) -> tuple[float, float]:
    """DART / plain over the traffic and for its worst request (each averaged over the seeds)."""
    shipped = {name: getattr(adaptive_sizes, name) for name in WITHOUT[without]}
    if not now:
        for name, value in WITHOUT[without].items():
            setattr(adaptive_sizes, name, value)
    try:
        runs = [serve(acceptances, batch_size, cost, stall, seed, spell) for seed in range(seeds)]
    finally:
        for name, value in shipped.items():
            setattr(adaptive_sizes, name, value)
    plain_request = TOKENS_PER_REQUEST * step_slowdown(stall, spell)
    seconds = sum(total for total, _ in runs) / seeds
    by_request = [sum(shares[i] for _, shares in runs) / seeds for i in range(len(acceptances))]
    return len(acceptances) * plain_request / seconds, plain_request / max(by_request)


def grid(args: argparse.Namespace) -> Iterator[tuple[int, float, str]]:
    for batch_size in args.batch_sizes:
        for cost in args.costs:
            for mix in MIXES:
                yield batch_size, cost, mix


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stalls", type=float, nargs="+", default=[0.0, 0.02, 0.05])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--costs", type=float, nargs="+", default=[1.3, 1.6, 2.0, 3.0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--spells", type=float, default=0.0, help="chance a step starts a slow spell")
    parser.add_argument("--without", choices=sorted(WITHOUT), default="clip", help="what `before` lacks")
    args = parser.parse_args()
    for stall in args.stalls:
        worst = {False: math.inf, True: math.inf}
        worst_request = {False: math.inf, True: math.inf}
        logs = {False: 0.0, True: 0.0}
        rows = 0
        for batch_size, cost, mix in grid(args):
            ratios = {}
            for now in (False, True):
                ratios[now] = speedup(
                    traffic(mix), batch_size, cost, stall, args.seeds, now, args.spells, args.without
                )
                worst[now] = min(worst[now], ratios[now][0])
                worst_request[now] = min(worst_request[now], ratios[now][1])
                logs[now] += math.log(ratios[now][0])
            rows += 1
            print(
                f"stall {stall:.2f} batch {batch_size} tree cost {cost:.1f} {mix:15s} "
                f"before {ratios[False][0]:.3f}x now {ratios[True][0]:.3f}x "
                f"(worst request before {ratios[False][1]:.3f}x now {ratios[True][1]:.3f}x)",
                flush=True,
            )
        print(
            f"== stall {stall:.2f}: worst before {worst[False]:.3f}x now {worst[True]:.3f}x; geometric mean "
            f"before {math.exp(logs[False] / rows):.3f}x now {math.exp(logs[True] / rows):.3f}x; worst "
            f"request before {worst_request[False]:.3f}x now {worst_request[True]:.3f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
