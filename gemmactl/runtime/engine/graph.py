"""The decode step captured once in a CUDA graph (optionally fused by torch.compile first).

Eager decoding launches hundreds of small kernels per token and the host cannot keep up with
the GPU; one graph replay launches them all at once. The step's inputs (token, position) and its
output (logits) live in static buffers, and the KV caches are written in place at the position
tensor, so one capture serves every step. torch.compile fuses the step's small operations before
capture (its own cudagraphs are not used: they refuse a step that writes its caches in place);
its compiled code is kept on disk (TORCHINDUCTOR_CACHE_DIR), so a warm start does not compile again.
"""

from __future__ import annotations

import os
import time

import torch

COMPILE_ENV = "GEMMACTL_ENGINE_COMPILE"  # auto (on for CUDA) | on | max (inductor's autotuning too) | off
GRAPH_ENV = "GEMMACTL_ENGINE_GRAPH"  # auto (on for CUDA) | off


def wanted(env: str, model) -> bool:
    """Whether to compile / capture: on CUDA by default, and never for a model that streams layers
    or runs some on the host (copies between streams and host compute stay eager), nor for MoE
    experts (which experts a step runs, and whether they are cached, is decided on the host)."""
    setting = os.environ.get(env, "auto").lower()
    if setting in ("off", "0", "false") or not model.placement.resident_only or model.experts is not None:
        return False
    return model.device.type == "cuda" if setting == "auto" else True


class DecodeStep:
    """Runs the model one token at a time: a replayed CUDA graph where there is one, else eagerly."""

    def __init__(self, model, cache_dir=None):
        self.model = model
        device = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.graph = None
        self.compiled = False
        self.setup_s = 0.0
        step = model.step
        start = time.perf_counter()
        if wanted(COMPILE_ENV, model):
            if cache_dir is not None:
                os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
            autotune = os.environ.get(COMPILE_ENV, "").lower() == "max"
            step = torch.compile(step, mode="max-autotune-no-cudagraphs" if autotune else None, fullgraph=True,
                                 dynamic=False)
            self.compiled = True
        self._step = step
        if wanted(GRAPH_ENV, model):
            self._capture()
        self.setup_s = time.perf_counter() - start

    def _capture(self) -> None:
        model = self.model
        # Warm up on a side stream (compilation, cuBLAS handles, allocator), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(3):
                self._step(self.token, self.position)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = self._step(self.token, self.position)  # [V], a static output buffer
        model.reset()  # the warm-up and capture wrote position 0 of the caches

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [V] after token (a 0-dim or [1] tensor on the device) at position."""
        if self.graph is None:
            with torch.inference_mode():
                return self._step(token.reshape(1), torch.tensor([position], device=self.model.device), position + 1)
        self.token.copy_(token.reshape(1))
        self.position.fill_(position)
        self.graph.replay()
        return self.logits
