"""The decode step of an MoE model captured in CUDA graphs, one for each stretch between two routing
decisions.

Which experts a token runs, and whether each is cached, is decided on the host, so an MoE step
cannot be one graph. Eager, though, its dense part pays the host's launches: on an H200 an eager
step cost about 2.4 ms a layer (docs/benchmarks.md), which held a 26B-A4B-shaped model near
9 tok/s. Here the step is cut at each MoE layer's experts: graph i runs from the previous layer's
experts' sum to this layer's router (attention, the dense MLP, the router's top-k), then the host
reads the router's choice and launches the experts eagerly (runtime/engine/experts.py, copies from
the arena included), and their sum enters graph i+1 through a static buffer. The graphs share one
memory pool and are replayed in the order they were captured, as torch requires for sharing.

Captured the way graph.DecodeStep captures a dense step: static token and position, the rows of
the embedding tables gathered outside the graphs, every cache slot read with the unwritten ones
masked. Only where every layer is resident on the GPU; asked for with GEMMACTL_ENGINE_GRAPH=on
(not the default for MoE models until it has been measured on a GPU).
"""

from __future__ import annotations

import sys

import torch


class PiecewiseDecode:
    """One token's step of an MoE model: graphs between routing decisions, the experts eager."""

    def __init__(self, model):
        self.model = model
        device = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        with torch.inference_mode():
            self.x, self.per_layer = model.embed_tokens(self.token)  # the graphs' static inputs
        self.graphs: list = []
        self.calls: list = []  # the ExpertCall each graph but the last ends with (its static tensors)
        self.sums: list = []  # where the experts' sum of each call enters the next graph
        self._capture()

    def _capture(self) -> None:
        model = self.model
        # Warm up on a side stream (cuBLAS handles, kernels, the allocator), eagerly, experts included.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                model.forward(self.x, self.per_layer, self.position)
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        open_capture: list = []

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            capture = torch.cuda.graph(graph, pool=pool)
            capture.__enter__()
            open_capture.append(capture)
            self.graphs.append(graph)

        def end() -> None:
            open_capture.pop().__exit__(None, None, None)

        def cut(call):  # an MoE layer's experts: end this graph, start the next from their sum
            end()
            self.calls.append(call)
            self.sums.append(torch.empty_like(call.x))  # outside any capture: a buffer of its own
            begin()
            return self.sums[-1]

        with torch.inference_mode():
            begin()
            try:
                self.logits = model.forward(self.x, self.per_layer, self.position, experts_of=cut)  # [V]
            except BaseException:
                if open_capture:  # close the capture with the error, so the error is the one raised
                    try:
                        open_capture.pop().__exit__(*sys.exc_info())
                    except Exception:  # noqa: BLE001 - the first error is the one to report
                        pass
                raise
            end()
        model.reset()  # the warm-up and capture wrote position 0 of the caches
        experts = model.experts  # the warm-up's expert uses are not the caller's
        experts.counters.__init__()
        experts.cache.hits = experts.cache.misses = 0

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [V] after token (a 0-dim or [1] tensor on the device) at position."""
        self.token.copy_(token.reshape(1))
        self.position.fill_(position)
        with torch.inference_mode():
            x, per_layer = self.model.embed_tokens(self.token)
            self.x.copy_(x)
            if per_layer is not None:
                self.per_layer.copy_(per_layer)
            for i, graph in enumerate(self.graphs):
                graph.replay()
                if i < len(self.calls):
                    self.sums[i].copy_(self.calls[i].run())
        return self.logits
