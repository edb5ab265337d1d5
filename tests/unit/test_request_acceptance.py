"""Each running request's own acceptance against its bucket's (`request_acceptance.py`): unknown requests
are judged as the traffic is, a few steps move the estimate little, many decide it, and requests that
left the batch are forgotten."""

from __future__ import annotations

import pytest

from sglang_dart.dart.request_acceptance import PRIOR_STEPS, RequestAcceptance


def test_a_request_without_tree_steps_is_judged_as_the_traffic_is():
    acceptance = RequestAcceptance()
    assert acceptance.factor(["a", "b"], 1.5) == 1.0
    assert acceptance.factor([], 1.5) == 1.0


def test_poor_drafts_lower_a_request_s_share_gradually():
    acceptance = RequestAcceptance()
    shares = []
    for _ in range(40):
        acceptance.add(["poor"], [1], 1.5)  # nothing accepted where 1.5 drafts were expected
        shares.append(acceptance.factor(["poor"], 1.5))
    assert shares[0] > 0.85  # one step is luck as much as the prompt
    assert shares == sorted(shares, reverse=True)
    assert shares[-1] < 0.25
    # As many of the bucket's steps as the prior weighs: halfway from the traffic's share to its own.
    assert shares[int(PRIOR_STEPS) - 1] == pytest.approx(0.5, abs=0.1)


def test_good_drafts_raise_it_and_the_batch_share_is_the_mean():
    acceptance = RequestAcceptance()
    for _ in range(30):
        acceptance.add(["good", "poor"], [4, 1], 1.5)
    good, poor = acceptance.factor(["good"], 1.5), acceptance.factor(["poor"], 1.5)
    assert good > 1.5 and poor < 0.5
    assert acceptance.factor(["good", "poor", "new"], 1.5) == pytest.approx((good + poor + 1.0) / 3)


def test_recent_steps_speak_for_a_request():
    """An answer that moves from new ground to boilerplate is judged on where it is now."""
    acceptance = RequestAcceptance()
    for _ in range(60):
        acceptance.add(["r"], [1], 1.5)
    for _ in range(60):
        acceptance.add(["r"], [3], 1.5)
    assert acceptance.factor(["r"], 1.5) > 1.0


def test_a_bucket_that_expects_nothing_teaches_nothing():
    acceptance = RequestAcceptance()
    acceptance.add(["r"], [1], 0.0)
    assert len(acceptance) == 0
    assert acceptance.factor(["r"], 0.0) == 1.0


def test_requests_that_left_the_batch_are_forgotten():
    acceptance = RequestAcceptance()
    acceptance.add(["a", "b", "c"], [1, 2, 3], 1.0)
    acceptance.keep_only(["b", "z"])
    assert len(acceptance) == 1
    assert acceptance.factor(["a"], 1.0) == 1.0  # a new request of the same id starts afresh
    with pytest.raises(ValueError):  # one count per request, or the step is misread
        acceptance.add(["a", "b"], [1], 1.0)


def test_a_request_copying_its_own_context_is_judged_at_least_as_the_traffic_is():
    """Its context chain is likely right whatever its drafts so far; a good request keeps its own."""
    acceptance = RequestAcceptance()
    for _ in range(30):
        acceptance.add(["poor", "good"], [1, 4], 1.5)
    poor, good = acceptance.factor(["poor"], 1.5), acceptance.factor(["good"], 1.5)
    assert poor < 0.4 and good > 1.5
    assert acceptance.factor(["poor"], 1.5, copying={"poor"}) == 1.0
    assert acceptance.factor(["good"], 1.5, copying={"good"}) == good
    assert acceptance.factor(["poor", "good"], 1.5, copying={"poor"}) == pytest.approx((1.0 + good) / 2)
