"""A step cut around host layers (runtime/engine/graph_host.py) whose graphs are stand-ins, so the
captured path's wiring (static buffers, queued crossings) runs on the CPU."""

from __future__ import annotations

from gemmactl.runtime.engine.graph_host import HostPiecesDecode


class ReplayedPieces(HostPiecesDecode):
    """A replay runs the body again over the static input it was captured with and writes its
    static output, as a CUDA graph's replay would."""

    def _capture(self, body, x):
        out = body(x)

        class Graph:
            def replay(self):
                out.copy_(body(x))

        self.bodies.append(Graph())
        return out
