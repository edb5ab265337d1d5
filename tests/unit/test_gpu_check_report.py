"""benchmarks/gpu_check.py's bookkeeping (the servers themselves run on a GPU host): where an output
departs from plain's, plain's margin there is read from its top-2 log-probs; an optional peer server that
fails is recorded and dropped, any other failure stops the check."""

from __future__ import annotations

import pytest

from benchmarks.gpu_check import _each, _margins_at_differences


class _Replays:
    """Answers /generate with fixed top-2 log-probs per output position, and records the requests."""

    def __init__(self, top: list[list[tuple[float, int]]]) -> None:
        self.top, self.requests, self.stopped = top, [], False

    def generate(self, payload: dict) -> dict:
        self.requests.append(payload)
        n = payload["sampling_params"]["max_new_tokens"]
        return {
            "meta_info": {"output_top_logprobs": [[(lp, t, None) for lp, t in row] for row in self.top[:n]]}
        }

    def stop(self) -> None:
        self.stopped = True


def test_margin_is_read_at_the_first_difference_only():
    plain = [{"output_ids": [5, 6, 7]}, {"output_ids": [1, 2, 3]}]
    other = [{"output_ids": [5, 6, 7]}, {"output_ids": [1, 9, 4]}]
    server = _Replays([[(-0.1, 1), (-3.0, 8)], [(-0.50, 2), (-0.52, 9)], [(-0.2, 3), (-2.0, 4)]])
    found = _margins_at_differences(server, [[10], [11]], plain, other, new_tokens=3)
    assert len(server.requests) == 1 and server.requests[0]["input_ids"] == [11]
    assert server.requests[0]["sampling_params"]["max_new_tokens"] == 2  # up to the differing token
    assert found == [
        {
            "at": 1,
            "margin": pytest.approx(0.02),
            "replayed_same_token": True,
            "other_took_second_choice": True,
        }
    ]


def test_optional_server_failure_is_recorded_and_the_others_go_on():
    servers = {"plain": _Replays([]), "dart": _Replays([]), "eagle3": _Replays([])}
    report: dict = {}

    def work(server: _Replays) -> str:
        if server is dropped:
            raise RuntimeError("draft graph capture failed")
        return "ok"

    dropped = servers["eagle3"]
    assert _each(servers, report, work) == {"plain": "ok", "dart": "ok"}
    assert "eagle3" not in servers and dropped.stopped
    assert "draft graph capture failed" in report["errors"]["eagle3"]
    dropped = servers["dart"]
    with pytest.raises(RuntimeError):
        _each(servers, report, work)  # DART is no optional server
