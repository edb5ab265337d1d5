"""How well each running request's own drafts are accepted, against what its batch-size bucket expects.

The guard (`adaptive_sizes.GuardedTreeSizes`) weighs a tree against the root alone with tokens per step
averaged over ~100 steps of whatever traffic ran: right for the traffic as a whole, wrong for the one
request in front of it whose drafts are poor (a prompt unlike the drafter's training data, a long
context) or unusually good. Each request here keeps two decayed sums over its own tree steps: drafts
accepted, and drafts its bucket expected at the time. Their ratio, shrunk towards 1 by PRIOR_STEPS steps'
worth of the bucket's expectation, says how this request compares with the traffic: a few steps do not
decide, a few dozen do. (A prior counted in drafts that faded with the request's own steps judged faster:
it won in simulation, where poor requests are far below the traffic, and lost 1-6% on real chat prompts,
where most are marginal and a faster judge holds them on noise: throughput run 120.)

A request whose latest tokens repeat an earlier passage of its own (quoting, translating line by line,
editing code: `ContextIndex.match_lens` of COPYING_MATCH or more) is judged at least as the traffic is,
whatever its history: its context chain is then likely right, and a request that opened in its own words
and then turns to copying would otherwise wait for a recheck to show it. (Trees of 8 forced on 9 chat
prompts: steps after a match of 8 accepted 4.2 drafts, none of them nothing; the rest 0.9.)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from sglang_dart.dart.progress import forget_all_but

# Weight of the bucket's own expectation, in steps: with fewer of its own steps a request is mostly judged
# as the traffic is (its first steps accept by luck as much as by the prompt).
PRIOR_STEPS = 8.0
# Each tree step multiplies a request's sums by this: ~50 recent steps speak for it, so a request whose
# answer moves from boilerplate to new ground (or back) is judged on where it is now.
DECAY = 0.98
COPYING_MATCH = 8


@dataclass
class _Sums:
    accepted: float = 0.0  # drafts accepted (tokens emitted past the one every step emits)
    expected: float = 0.0  # drafts the bucket expected in the same steps


class RequestAcceptance:
    def __init__(self, prior_steps: float = PRIOR_STEPS, decay: float = DECAY) -> None:
        self.prior_steps = prior_steps
        self.decay = decay
        self._by_rid: dict[str, _Sums] = {}

    def add(self, rids: Sequence[str], tokens: Sequence[int], expected_drafts: float) -> None:
        """One tree step: each request's tokens emitted (its root's successor included) and the drafts per
        request its bucket expected of such a step."""
        if expected_drafts <= 0:
            return
        for rid, emitted in zip(rids, tokens, strict=True):
            sums = self._by_rid.setdefault(rid, _Sums())
            sums.accepted = sums.accepted * self.decay + max(emitted - 1, 0)
            sums.expected = sums.expected * self.decay + expected_drafts

    def factor(self, rids: Sequence[str], expected_drafts: float, copying: Collection[str] = ()) -> float:
        """How many of the bucket's expected drafts these requests will accept, as a share (1 = as the
        traffic does; the mean over requests, each shrunk towards 1, at least 1 for those `copying`)."""
        if not rids or expected_drafts <= 0:
            return 1.0
        prior = self.prior_steps * expected_drafts
        total = 0.0
        for rid in rids:
            sums = self._by_rid.get(rid)
            share = 1.0 if sums is None else (sums.accepted + prior) / (sums.expected + prior)
            total += max(share, 1.0) if rid in copying else share
        return total / len(rids)

    def keep_only(self, rids: Iterable[str]) -> None:
        """Forget every request but these (the others finished, were aborted or retracted)."""
        forget_all_but(self._by_rid, set(rids))

    def __len__(self) -> int:
        return len(self._by_rid)
