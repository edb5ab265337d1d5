"""Device-only pieces of a decode step replayed as CUDA graphs, one per piece and input shape.

On a GPU the draft forward after a verify is host-bound: about a hundred small kernels, each launched from
Python (H200 run 5: 2.8 ms of a 5.9 ms batch-1 step, where plain decoding's whole step is 1.5 ms). Its
shapes depend on the batch and tree sizes alone (`draft_block`), so each piece is captured once per shape
and then replayed: one launch instead of many. The worker captures the likely shapes before serving
(`Drafting.capture_ahead`); any other is captured at its first use, which stalls that step.

Contract of a captured function `fn(*inputs) -> outputs`: it runs on the device alone (no host read, no
host-built tensor, no allocation that outlives it but its outputs), its inputs are device tensors whose
shapes and dtypes (with the piece's name) decide everything it computes, and the persistent tensors it
reads or writes (weights, request tables, pools) are never reallocated. Each replay copies the inputs into
the graph's own buffers and returns the graph's output tensors, which the next replay of the same shape
overwrites (and so does the next replay of any shape of that piece: their outputs share buffers): a caller
finishes with them (or copies them) before that.

Memory: graphs share one pool for their temporaries (dead once a graph has run; graphs run one at a time on
the step's stream), and the graphs of a piece share its output buffers, so the pieces hold about one
largest step's worth of activations however many shapes are captured (the draft's head ends in its top-k,
so no logits are kept). A capture that fails (an operation a graph cannot hold) is logged once and the pieces
then run eagerly, as they do on a CPU; nothing is lost but the speed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

Inputs = Sequence[torch.Tensor]
Outputs = tuple[torch.Tensor, ...]


@dataclass
class _Captured:
    inputs: tuple[torch.Tensor, ...]  # the graph's own input buffers
    outputs: Outputs
    replay: Callable[[], None]


class DeviceGraphs:
    """`run(name, fn, inputs)`: fn(*inputs), replayed from a graph captured at the first call of each
    (name, input shapes and dtypes). `enabled=False` runs fn eagerly (CPU, --disable-cuda-graph);
    `emulate=True` keeps the buffers and the replay contract without CUDA (a replay reruns fn on the
    buffers), so the contract is testable on a CPU."""

    def __init__(
        self,
        device: torch.device,
        enabled: bool,
        max_graphs: int = 512,
        max_batch: int | None = None,
        emulate: bool = False,
    ) -> None:
        self.device = device
        self.enabled = enabled and (emulate or device.type == "cuda")
        self.emulate = emulate
        self.max_graphs = max_graphs
        self.max_batch = max_batch
        self.graphs: dict[tuple[Any, ...], _Captured] = {}
        self.failure: str | None = None
        self._pool: Any = None
        self._stream: Any = None  # the capture stream, made at the first capture
        self._outputs: dict[tuple[Any, ...], torch.Tensor] = {}  # `_shared_views`
        # Set once the shapes known before serving are captured: a capture after that stalls a step (an
        # eager run and a device sync), so each one is logged.
        self.serving = False

    def run(self, name: str, fn: Callable[..., Outputs], inputs: Inputs, batch: int) -> Outputs:
        if not self.enabled or (self.max_batch is not None and batch > self.max_batch):
            return fn(*inputs)
        key = (name, *((tuple(x.shape), x.dtype) for x in inputs))
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                return fn(*inputs)
            try:
                captured = self._capture(name, fn, inputs, batch)
            except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager pieces
                self._give_up(name, exc)
                return fn(*inputs)
            self.graphs[key] = captured
            if self.serving:
                logger.info(
                    "DART: draft graph %s captured while serving, batch %d, inputs %s (%d graphs)",
                    name,
                    batch,
                    [tuple(x.shape) for x in inputs],
                    len(self.graphs),
                )
        for buffer, x in zip(captured.inputs, inputs, strict=True):
            buffer.copy_(x, non_blocking=True)
        captured.replay()
        return captured.outputs

    def _capture(self, name: str, fn: Callable[..., Outputs], inputs: Inputs, batch: int) -> _Captured:
        buffers = tuple(x.clone() for x in inputs)
        if self.emulate:
            views = self._shared_views(name, fn(*buffers), batch)

            def rerun() -> None:
                for view, out in zip(views, fn(*buffers), strict=True):
                    view.copy_(out)

            rerun()
            return _Captured(buffers, views, rerun)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # One eager run first, on the capture stream: lazy initialisations (library handles, workspaces,
        # kernel compilation) must not happen inside the capture; it also gives the outputs' shapes.
        with torch.cuda.stream(stream):
            views = self._shared_views(name, fn(*buffers), batch)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the server may use CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            for view, out in zip(views, fn(*buffers), strict=True):
                view.copy_(out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return _Captured(buffers, views, graph.replay)

    def _shared_views(self, name: str, outputs: Outputs, batch: int) -> Outputs:
        """Views, shaped as `outputs`, of buffers every graph of `name` writes its outputs to, so that
        outputs take the memory of the largest shape alone, not one copy per shape (a graph's temporaries
        are in the shared pool already). A buffer is made for the largest batch at the per-request size
        of the first shape that needs it (outputs grow with the batch); a shape needing more per request
        makes a larger one, and graphs captured before keep the old one alive."""
        views = []
        for i, out in enumerate(outputs):
            key = (name, i, out.dtype)
            buffer = self._outputs.get(key)
            if buffer is None or buffer.numel() < out.numel():
                per_request = -(-out.numel() // max(batch, 1))
                size = max(per_request * max(self.max_batch or batch, batch), out.numel())
                buffer = torch.empty(size, dtype=out.dtype, device=out.device)
                self._outputs[key] = buffer
            views.append(buffer[: out.numel()].view(out.shape))
        return tuple(views)

    def _give_up(self, name: str, exc: Exception) -> None:
        self.enabled = False
        self.failure = f"{name}: {type(exc).__name__}: {exc}"
        logger.warning(
            "DART: capturing the draft step's CUDA graph failed (%s); drafting runs eagerly from now on",
            self.failure,
        )
