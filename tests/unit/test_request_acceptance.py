"""Each running request's own acceptance against its bucket's (`request_acceptance.py`): unknown requests
are judged as the traffic is, a few steps move the estimate as far as the drafts they missed say, many
decide it, and requests that left the batch are forgotten."""

from __future__ import annotations

import pytest

from sglang_dart.dart.request_acceptance import PRIOR_DRAFTS, RequestAcceptance


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
    assert shares[0] > 0.7  # one step is luck as much as the prompt
    assert shares == sorted(shares, reverse=True)
    assert shares[-1] < 0.1
    # As many missed drafts as the prior weighs: halfway from the traffic's share to its own.
    assert shares[round(PRIOR_DRAFTS / 1.5) - 1] == pytest.approx(0.5, abs=0.1)


def test_the_prior_fades():
    """Long after its start a request is judged on its own steps alone. A prior added afresh at every
    read outweighed ~50 decayed steps for good: a request accepting nothing stayed at 0.14 of the
    traffic's share, above what holds trees costing 1.3 plain steps where the traffic fills 2.5."""
    acceptance = RequestAcceptance()
    for _ in range(150):
        acceptance.add(["poor"], [1], 1.5)
    assert acceptance.factor(["poor"], 1.5) < 0.01


def test_the_prior_weighs_as_much_as_the_missed_drafts():
    """Three steps without an accepted draft say much where the traffic expects two a step, little where
    it expects 0.4 (most steps of a request as good as the traffic accept nothing then)."""
    acceptance = RequestAcceptance()
    for _ in range(3):
        acceptance.add(["rich"], [1], 2.0)
        acceptance.add(["sparse"], [1], 0.4)
    assert acceptance.factor(["rich"], 2.0) < 0.5
    assert acceptance.factor(["sparse"], 0.4) > 0.75


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
    assert poor < 0.2 and good > 1.5
    assert acceptance.factor(["poor"], 1.5, copying={"poor"}) == 1.0
    assert acceptance.factor(["good"], 1.5, copying={"good"}) == good
    assert acceptance.factor(["poor", "good"], 1.5, copying={"poor"}) == pytest.approx((1.0 + good) / 2)
