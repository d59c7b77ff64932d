"""The decode step of a model with layers on the CPU, captured in CUDA graphs between them.

A layer the plan puts on the host runs there in torch's CPU int4 kernels (cpu_kernels.py): the
activations cross the link, the CPU computes, they cross back. The host's work cannot be captured,
so such a step used to run eagerly whole, every GPU layer's kernels launched one by one: on an
H200 an E4B-shaped eager step costs about 95 ms where its captured twin costs 31 (graph.py).
Here the step is cut into pieces: each stretch of GPU layers is one graph, each stretch of host
layers runs eagerly between two graphs, and a streamed layer begins a piece of its own.

The streamed layers' copies are not in the graphs: the host queues them between replays, in the
order and with the events LayerStreamer keeps (streaming.py), as an eager step does. So the copy of
the next streamed layer crosses the link while this piece computes and while the host runs its
layers after it: the link and the CPU work side by side, and the plan splits the layers that do
not fit between them (plan/engine_map.py simulates this schedule).

A host stretch: the graph before it ends with the activations in a device buffer; they cross to a
pinned host buffer (the host waits for that copy: the only wait of the step but the token's), the
CPU runs its layers over them (their KV caches are in host memory; attention reads the slots
written so far), and they cross back into the static input of the next graph, queued before its
replay. The per-layer inputs (Gemma 4) cross to the host once a step.

On a CPU "device" nothing is captured: the pieces run as the same functions, eagerly, which is how
the tests check that the cut step decodes what the whole step does.

Speculation's verify step is cut the same way (width: the k_max + 1 rows it runs, each row's
logits returned): eager, a verify step whose rows run alone through the GPU's layers launches each
row's kernels one by one, about as many launches as k_max + 1 decode steps; in pieces it replays
them. The host's layers run the rows together (rows_as_decode), as GemmaModel.forward runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gemmactl.runtime.engine.capture import fill_rows, warm_up
from gemmactl.runtime.engine.placement import HOST, STREAMED


@dataclass
class Piece:
    """A stretch of the step: GPU layers (a graph; streamed: the streamed layer it begins with) or
    host layers (eager)."""

    host: bool
    layers: list[int] = field(default_factory=list)
    streamed: int | None = None


def pieces_of(kinds: tuple[str, ...]) -> list[Piece]:
    """The step's pieces in layer order: a new piece at each change between GPU and host layers and
    at each streamed layer. The last piece is a GPU one (the head runs there), possibly empty."""
    pieces: list[Piece] = []
    for index, kind in enumerate(kinds):
        host = kind == HOST
        last = pieces[-1] if pieces else None
        if last is None or last.host != host or kind == STREAMED:
            pieces.append(Piece(host, streamed=index if kind == STREAMED else None))
        pieces[-1].layers.append(index)
    if not pieces or pieces[-1].host:
        pieces.append(Piece(False))
    return pieces


def cut_around_host(model) -> bool:
    """Whether a decode step can be cut around its host layers: a dense model with layers on the
    CPU (an MoE model's host layers stay eager)."""
    return HOST in model.placement.layers and model.experts is None


class HostPiecesDecode:
    """One token's step (or width tokens', a verify step's): graphs between the host's layers (or,
    off CUDA, the same pieces eagerly)."""

    def __init__(self, model, capture: bool | None = None, width: int = 1, rows_alone: bool = False):
        """width > 1: the step of width consecutive tokens, every row's logits [width, V];
        rows_alone: each row alone through the GPU's layers and the head (GemmaModel.forward)."""
        self.model = model
        device = model.device
        self.cuda = device.type == "cuda"
        self.captured = self.cuda if capture is None else capture
        self.width, self.rows_alone = width, rows_alone and width > 1
        self.token = torch.zeros(width, dtype=torch.long, device=device)  # [W]
        self.offsets = torch.arange(width, device=device)
        self.position = self.offsets.clone()  # [W]: the rows' positions
        with torch.inference_mode():
            self.x, self.per_layer = model.embed_tokens(self.token, self.rows_alone)  # the first piece's static inputs
        self.pieces = pieces_of(model.placement.layers)
        pin = self.cuda
        self.host_x = torch.empty(self.x.shape, dtype=self.x.dtype, pin_memory=pin)  # activations in
        self.host_y = torch.empty(self.x.shape, dtype=self.x.dtype, pin_memory=pin)  # ... and out
        self.host_per_layer = (torch.empty(self.per_layer.shape, dtype=self.per_layer.dtype, pin_memory=pin)
                               if self.per_layer is not None else None)
        self.crossed = torch.cuda.Event() if self.cuda else None
        # Each piece's input (a device buffer) and its body (a graph, or the function itself).
        self.inputs: list[torch.Tensor | None] = []
        self.bodies: list = []
        self.logits = None
        self._build()

    # -- building --------------------------------------------------------------------------------

    def _gpu_body(self, piece: Piece, last: bool):
        """The function one GPU piece runs: its layers over x, then (the last piece) the logits.
        end: the written positions' end where the host knows it (eager), None in a graph."""
        model = self.model

        many = self.width > 1

        def body(x: torch.Tensor, end: int | None = None) -> torch.Tensor:
            at, rope, inputs = model.inputs_on(model.device, self.position, self.per_layer)
            for index in piece.layers:
                x = model.layer_rows(self._layer(index), x, at, rope, inputs, end, many, self.rows_alone)
            return model.logits_of(x, many, self.rows_alone) if last else x

        return body

    def _layer(self, index: int):
        model = self.model
        if model.where[index] == STREAMED:
            return model.staged_layers[index][model.streamer.slot_of[index]]
        return model.layers[index]

    def _build(self) -> None:
        model = self.model
        if self.captured and self.cuda:
            # Warm up (cuBLAS handles, kernels, the allocator), eagerly: the whole step as forward runs it.
            many = self.width > 1
            warm_up(lambda: model.forward(self.x, self.per_layer, self.position, end=self.width, all_logits=many,
                                          rows_as_decode=many, rows_alone=self.rows_alone), 2)
            self.pool = torch.cuda.graph_pool_handle()
        x = self.x
        with torch.inference_mode():
            for number, piece in enumerate(self.pieces):
                self.inputs.append(x)  # a host piece: what crosses to the host (the previous graph's output)
                if piece.host:
                    self.bodies.append(None)
                    x = torch.empty_like(self.x)  # the next piece's input: what crosses back
                    continue
                body = self._gpu_body(piece, last=number == len(self.pieces) - 1)
                if self.captured:
                    x = self._capture(body, x)
                else:
                    self.bodies.append(body)
            if self.captured:
                self.logits = x  # the last graph's output: [V] ([W, V] for width W)
        model.reset()  # the warm-up and capture wrote the first positions of the caches

    def _capture(self, body, x: torch.Tensor) -> torch.Tensor:
        """body over x captured in a CUDA graph (kept in bodies); returns its static output. The
        graphs share one memory pool: each reads the one before it's output, and they are replayed
        in the order they were captured, as torch requires for sharing."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body(x)
        self.bodies.append(graph)
        return out

    # -- a step ----------------------------------------------------------------------------------

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [V] after token (a 0-dim or [1] tensor on the device) at position; for width W,
        logits [W, V] after W tokens at position, position + 1, ..."""
        model = self.model
        self.token.copy_(token.reshape(self.width))
        torch.add(self.offsets, position, out=self.position)
        with torch.inference_mode():
            fill_rows(model, self.token, self.x, self.per_layer, self.rows_alone)
            if self.host_per_layer is not None:  # queued now, waited for with the first crossing
                self.host_per_layer.copy_(self.per_layer, non_blocking=self.cuda)
            streamer = model.streamer
            if streamer is not None:
                streamer.begin()
            x = self.x  # eagerly: the activations so far
            for number, piece in enumerate(self.pieces):
                if piece.host:
                    y = self._host_run(piece, self.inputs[number] if self.captured else x, position)
                    if self.captured:
                        self.inputs[number + 1].copy_(y, non_blocking=True)  # queued before the next replay
                    else:
                        x = y.to(model.device, copy=True)
                    continue
                if piece.streamed is not None:
                    streamer.fetch(piece.streamed)  # the compute waits for its copy; the next copy starts
                if self.captured:
                    self.bodies[number].replay()
                else:
                    x = self.bodies[number](x, None if self.rows_alone else position + self.width)
                if piece.streamed is not None:
                    streamer.release(piece.streamed)
        return self.logits if self.captured else x

    def _host_run(self, piece: Piece, source: torch.Tensor, position: int) -> torch.Tensor:
        """The host's layers of one piece over source (the device's activations, crossing to the
        host first); returns their output in a pinned host buffer."""
        model = self.model
        self.host_x.copy_(source, non_blocking=self.cuda)
        if self.cuda:
            self.crossed.record()
            self.crossed.synchronize()  # the activations (and the per-layer inputs) are on the host
        width = self.width
        at, rope, _ = model.inputs_on(model.host, torch.arange(position, position + width), None)
        x = self.host_x
        for index in piece.layers:
            x = model.layer_forward(model.layers[index], x, at, rope, self.host_per_layer, end=position + width,
                                    rows_as_decode=width > 1)
        self.host_y.copy_(x)
        return self.host_y
