"""The replay contract of `DeviceGraphs` (emulated on a CPU): a replay gives the function's results for the
new inputs, one graph per name and input shapes, and every way out of graphs runs the function eagerly."""

from __future__ import annotations

import pytest
import torch

from sglang_dart.dart.device_graphs import DeviceGraphs
from sglang_dart.dart.settings import DRAFT_GRAPHS_ENV, DartArgsError, draft_graphs_choice


class _Counted:
    """fn(a, b) = (a * 2 + b, a.sum() as a one-element tensor), with a side effect on a persistent
    tensor (as the draft table's writes), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.table = torch.zeros(8)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        self.table[: a.shape[0]] = a
        return a * 2 + b, a.sum().reshape(1)


def test_replays_give_the_results_of_the_new_inputs_and_keep_one_graph_per_shape():
    graphs = DeviceGraphs(torch.device("cpu"), True, max_batch=4, emulate=True)
    fn = _Counted()
    for a, b in [(torch.arange(3.0), torch.ones(3)), (torch.tensor([5.0, -1, 2]), torch.zeros(3))]:
        out, total = graphs.run("piece", fn, (a, b), batch=3)
        torch.testing.assert_close(out, a * 2 + b)
        torch.testing.assert_close(total, a.sum().reshape(1))
        torch.testing.assert_close(fn.table[:3], a)  # the side effect, redone by the replay
    first = graphs.run("piece", fn, (torch.ones(3), torch.ones(3)), batch=3)[0]
    second = graphs.run("piece", fn, (torch.zeros(3), torch.ones(3)), batch=3)[0]
    assert first is second  # a graph's outputs: the next replay of the shape overwrites them
    longer = graphs.run("piece", fn, (torch.ones(4), torch.ones(4)), batch=4)[0]
    shorter = graphs.run("piece", fn, (torch.full((3,), 7.0), torch.zeros(3)), batch=3)[0]
    # The shapes of a piece share its output buffers, made for the largest batch: one largest output's
    # memory, not one per shape.
    assert shorter.data_ptr() == longer.data_ptr() == first.data_ptr()
    torch.testing.assert_close(shorter, torch.full((3,), 14.0))
    graphs.run("piece", fn, (torch.ones(3, dtype=torch.float64), torch.ones(3)), batch=3)
    graphs.run("other", fn, (torch.ones(3), torch.ones(3)), batch=3)
    assert len(graphs.graphs) == 4  # a new shape, a new dtype, a new name


def test_batches_past_the_limit_and_graphs_past_the_cap_run_eagerly():
    graphs = DeviceGraphs(torch.device("cpu"), True, max_graphs=1, max_batch=4, emulate=True)
    fn = _Counted()
    graphs.run("piece", fn, (torch.ones(8), torch.ones(8)), batch=8)
    assert not graphs.graphs and fn.calls == 1
    graphs.run("piece", fn, (torch.ones(2), torch.ones(2)), batch=2)
    out = graphs.run("piece", fn, (torch.ones(3), torch.ones(3)), batch=3)[0]
    assert len(graphs.graphs) == 1
    torch.testing.assert_close(out, torch.full((3,), 3.0))


def test_a_failed_capture_turns_graphs_off_and_the_step_still_gets_its_results():
    graphs = DeviceGraphs(torch.device("cpu"), True, emulate=True)
    captures = []

    def fails_when_captured(a: torch.Tensor) -> tuple[torch.Tensor]:
        captures.append(a.data_ptr())
        if len(captures) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return (a + 1,)

    (out,) = graphs.run("piece", fails_when_captured, (torch.zeros(2),), batch=2)
    torch.testing.assert_close(out, torch.ones(2))
    assert not graphs.enabled and "stream is capturing" in graphs.failure
    graphs.run("piece", fails_when_captured, (torch.zeros(2),), batch=2)
    assert not graphs.graphs


def test_without_cuda_or_when_disabled_graphs_are_off():
    fn = _Counted()
    assert not DeviceGraphs(torch.device("cpu"), True).enabled  # no CUDA: nothing to capture
    graphs = DeviceGraphs(torch.device("cpu"), False, emulate=True)
    for _ in range(3):
        graphs.run("piece", fn, (torch.ones(2), torch.ones(2)), batch=2)
    assert fn.calls == 3 and not graphs.graphs


def test_the_switch_takes_its_three_values_and_names_itself_when_wrong(monkeypatch):
    monkeypatch.delenv(DRAFT_GRAPHS_ENV, raising=False)
    assert draft_graphs_choice() == "1"
    for value in ("0", "Emulate ", "1"):
        monkeypatch.setenv(DRAFT_GRAPHS_ENV, value)
        assert draft_graphs_choice() == value.strip().lower()
    monkeypatch.setenv(DRAFT_GRAPHS_ENV, "yes")
    with pytest.raises(DartArgsError, match=DRAFT_GRAPHS_ENV):
        draft_graphs_choice()
