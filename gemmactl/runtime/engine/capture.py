"""What the engine's captured steps share (graph.py: the dense decode and verify steps;
graph_moe.py: an MoE step in pieces or whole): the warm-up on a side stream that a CUDA graph
capture needs, the capture of one body, and the host's row gather for a step that starts from
the gathered rows."""

from __future__ import annotations

import torch


def warm_up(body, times: int) -> None:
    """Run body `times` times on a side stream (compilation, cuBLAS handles, the allocator), as a
    capture needs before it begins."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(times):
            body()
    torch.cuda.current_stream().wait_stream(stream)


def capture_body(body, warmups: int):
    """(graph, output): body warmed up, then captured in a CUDA graph; its output a static buffer."""
    warm_up(body, warmups)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        output = body()
    return graph, output


def fill_rows(model, tokens: torch.Tensor, x, per_layer, rows_alone: bool = False) -> None:
    """The host's row gather for a captured step that starts from the gathered rows (rows_alone:
    each token's projection alone, GemmaModel.embed_tokens)."""
    with torch.inference_mode():
        rows, per_layer_rows = model.embed_tokens(tokens, rows_alone)
        x.copy_(rows)
        if per_layer_rows is not None:
            per_layer.copy_(per_layer_rows)
