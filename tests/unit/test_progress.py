"""The worker's own record of each request's tokens, which overlap scheduling makes the only current one:
SGLang appends a step's tokens to the request one step late."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import pytest

from sglang_dart.dart.progress import KEPT_TOKENS, RequestProgress


@dataclass
class Request:  # the three fields of SGLang's Req the record reads
    rid: str
    origin_input_ids: list[int]
    output_ids: array = field(default_factory=lambda: array("q"))


def test_a_prefill_starts_the_record_at_its_first_token():
    req = Request("a", [5, 6, 7, 8])
    progress = RequestProgress()
    progress.start(req, committed=4, tokens=[5, 6, 7, 8, 42])  # 42: the token the prefill sampled
    now = progress.of(req)
    assert (now.committed, now.root, now.context) == (4, 42, (7, 8))
    # Overlap: SGLang has not appended 42 yet.
    assert progress.unseen(req) == [42]
    req.output_ids.append(42)
    assert progress.unseen(req) == []


def test_a_verify_commits_the_root_and_the_accepted_drafts():
    req = Request("a", [1, 2], array("q", [3]))
    progress = RequestProgress()
    progress.start(req, committed=2, tokens=[1, 2, 3])
    progress.advance(req, [10, 11, 12])  # two accepted drafts and the bonus token
    now = progress.of(req)
    assert (now.committed, now.root, now.context) == (5, 12, (10, 11))
    assert progress.unseen(req) == [10, 11, 12]
    req.output_ids.extend([10, 11, 12])
    assert progress.unseen(req) == []


def test_short_sequences_pad_the_context():
    req = Request("a", [9])
    progress = RequestProgress()
    progress.start(req, committed=1, tokens=[9, 4])
    assert progress.of(req).context == (-1, 9)


def test_an_unknown_request_is_read_from_its_tokens():
    req = Request("b", [1, 2, 3], array("q", [4, 5]))
    now = RequestProgress().of(req)
    assert (now.committed, now.root, now.context) == (4, 5, (3, 4))


def test_one_step_of_any_size_is_kept_and_a_longer_lag_is_an_error():
    req = Request("a", [1])
    progress = RequestProgress()
    progress.start(req, committed=1, tokens=[1, 2])
    req.output_ids.append(2)
    big_step = list(range(100, 100 + KEPT_TOKENS + 10))  # a tree larger than KEPT_TOKENS, all accepted
    progress.advance(req, big_step)
    assert progress.unseen(req) == big_step
    progress.advance(req, big_step)  # SGLang two steps behind: more than the worker keeps
    with pytest.raises(AssertionError, match="lags"):
        progress.unseen(req)


def test_keep_only_forgets_requests_that_left_the_batch():
    a, b = Request("a", [1, 2]), Request("b", [3, 4])
    progress = RequestProgress()
    progress.start(a, 2, [1, 2, 7])
    progress.start(b, 2, [3, 4, 8])
    progress.keep_only([b])
    assert progress.of(a).root == 2  # read from the request again
    assert progress.of(b).root == 8


def test_request_rows_come_from_the_batch_not_from_released_requests():
    """With overlap a request that finished in the step before rides one more batch after SGLang released
    it (its req_pool_idx is None): the rows are read from the batch's host copy."""
    from types import SimpleNamespace

    import torch

    from sglang_dart.dart.drafting import request_rows

    released = SimpleNamespace(req_pool_idx=None)
    batch = SimpleNamespace(reqs=[released, SimpleNamespace(req_pool_idx=3)], req_pool_indices_cpu=None)
    assert request_rows(SimpleNamespace(**{**vars(batch), "req_pool_indices_cpu": torch.tensor([5, 3])})) == [
        5,
        3,
    ]
    assert request_rows(batch) == [None, 3]  # no host copy: what the requests say
