"""How well each running request's own drafts are accepted, against what its batch-size bucket expects.

The guard (`adaptive_sizes.GuardedTreeSizes`) weighs a tree against the root alone with tokens per step
averaged over ~100 steps of whatever traffic ran: right for the traffic as a whole, wrong for the one
request in front of it whose drafts are poor (a prompt unlike the drafter's training data, a long
context) or unusually good. Each request here keeps two decayed sums over its own tree steps: drafts
accepted, and drafts its bucket expected at the time. Both start at PRIOR_DRAFTS (a share of 1: judged as
the traffic is) and that prior fades as the request's own steps do. Counted in drafts, it weighs as much
as the evidence against it: where the traffic expects two drafts a step, a request's first two or three
steps without any outweigh it; where it expects 0.4 (most steps of a typical request accept nothing), a
dozen must. Their ratio says how this request compares with the traffic. (A prior of 8 steps' worth added
afresh at every read never faded, while the decay caps a request's own steps at ~50: a request accepting a
tenth of the traffic's drafts stayed judged at a fifth of it or more, and ran trees costing 1.3 plain
steps that lost it 10-15%.)

A request whose latest tokens repeat an earlier passage of its own (quoting, translating line by line,
editing code: `ContextIndex.match_lens` of COPYING_MATCH or more) is judged at least as the traffic is,
whatever its history: its context chain is then likely right, and a request that opened in its own words
and then turns to copying would otherwise wait for a recheck, up to 64 steps, to show it. (Trees of 8
forced on 9 chat prompts: steps after a match of 8 accepted 4.2 drafts, none of them nothing; the rest 0.9.)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from sglang_dart.dart.progress import forget_all_but

# The prior, in drafts. Simulated (requests served in turn at batch 1, as `tests/unit/test_adaptive_sizes.py`
# serves them), 4-6 lose least on poor requests after good ones without holding requests that draft as the
# traffic does (where trees pay 1.08x, weighing such requests one by one kept 99.7% of it with 5).
PRIOR_DRAFTS = 5.0
# Each tree step multiplies a request's sums by this: ~50 recent steps speak for it, so a request whose
# answer moves from boilerplate to new ground (or back) is judged on where it is now.
DECAY = 0.98
COPYING_MATCH = 8


@dataclass
class _Sums:
    accepted: float = 0.0  # drafts accepted (tokens emitted past the one every step emits)
    expected: float = 0.0  # drafts the bucket expected in the same steps


class RequestAcceptance:
    def __init__(self, prior_drafts: float = PRIOR_DRAFTS, decay: float = DECAY) -> None:
        self.prior_drafts = prior_drafts
        self.decay = decay
        self._by_rid: dict[str, _Sums] = {}

    def add(self, rids: Sequence[str], tokens: Sequence[int], expected_drafts: float) -> None:
        """One tree step: each request's tokens emitted (its root's successor included) and the drafts per
        request its bucket expected of such a step."""
        if expected_drafts <= 0:
            return
        for rid, emitted in zip(rids, tokens, strict=True):
            sums = self._by_rid.get(rid)
            if sums is None:
                sums = self._by_rid[rid] = _Sums(self.prior_drafts, self.prior_drafts)
            sums.accepted = sums.accepted * self.decay + max(emitted - 1, 0)
            sums.expected = sums.expected * self.decay + expected_drafts

    def factor(self, rids: Sequence[str], expected_drafts: float, copying: Collection[str] = ()) -> float:
        """How many of the bucket's expected drafts these requests will accept, as a share (1 = as the
        traffic does; the mean over requests, 1 for those without tree steps yet, at least 1 for those
        `copying`)."""
        if not rids or expected_drafts <= 0:
            return 1.0
        total = 0.0
        for rid in rids:
            sums = self._by_rid.get(rid)
            share = 1.0 if sums is None else sums.accepted / sums.expected
            total += max(share, 1.0) if rid in copying else share
        return total / len(rids)

    def keep_only(self, rids: Iterable[str]) -> None:
        """Forget every request but these (the others finished, were aborted or retracted)."""
        forget_all_but(self._by_rid, set(rids))

    def __len__(self) -> int:
        return len(self._by_rid)
