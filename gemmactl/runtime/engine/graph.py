"""The decode step captured once in a CUDA graph (optionally fused by torch.compile first).

Eager decoding launches hundreds of small kernels per token and the host cannot keep up with
the GPU; one graph replay launches them all at once. The step's inputs (token, position) and its
output (logits) live in static buffers, and the KV caches are written in place at the position
tensor, so one capture serves every step. torch.compile fuses the step's small operations before
capture (its own cudagraphs are not used: they refuse a step that writes its caches in place);
its compiled code is kept on disk (TORCHINDUCTOR_CACHE_DIR), so a warm start does not compile again.

A model that streams layers is captured too (by default on CUDA), without compile fusion: the graph holds the copies from
pinned host memory into the staging areas on their own stream, and the events that order them
against the compute, so a replay overlaps copy and compute as the eager step does, without the
host launching each kernel. Embedding tables in host memory are read outside the graph (a row
gather on the host), and the rows enter it through static buffers; with every layer resident the
graph between is fused too (220 tok/s against 93 unfused for an E4B shape on an H100). Eager, a
streamed step is bound by the host's launches: on an H200, an E4B-shaped step with half its layers streamed took 95 ms eager
and 31 ms captured, where the copies alone take 26 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import time

import torch

from gemmactl.runtime.engine.capture import capture_body, fill_rows
from gemmactl.runtime.engine.placement import HOST, RESIDENT

COMPILE_ENV = "GEMMACTL_ENGINE_COMPILE"  # auto (on for CUDA) | on | max (inductor's autotuning too) | off
GRAPH_ENV = "GEMMACTL_ENGINE_GRAPH"  # auto (on for CUDA) | on (forced, also off CUDA where every layer is resident) | off


MOE_ENV = "GEMMACTL_ENGINE_MOE"  # pieces (default) | copies (the pieces, every expert copied into staging rows) | table
OFF = ("off", "0", "false")


def _setting(env: str) -> str:
    return os.environ.get(env, "auto").lower()


def moe_table_wanted(model) -> bool:
    """Whether to capture an MoE model's whole step in one graph, its experts found through a
    device table (graph_moe.TableDecode): asked for with MOE_ENV=table, where the pieces would be
    captured and the experts are in the grouped kernel's layout. Not the default: on an H200 at
    4 GiB (26B-A4B shape) it decoded 22.2 tok/s against the pieces' 28.3 with a uniform router,
    reading its misses in place at about half the copy engine's rate, and 35.2 against 33.5 with
    a skewed one (docs/benchmarks.md)."""
    return (moe_pieces_wanted(model) and os.environ.get(MOE_ENV, "pieces").lower() == "table"
            and model.experts.table_ready())


def moe_table_refused(model) -> str | None:
    """Why the whole-step graph was asked for (MOE_ENV=table) and the pieces run instead, in a
    line for the caller's notices; None where it was not asked for or runs."""
    if os.environ.get(MOE_ENV, "pieces").lower() != "table" or not moe_pieces_wanted(model):
        return None
    if model.experts.table_ready():
        return None
    why = ("experts are homed on the CPU (--expert-cpu-share)" if model.experts.store.homed
           else "the experts are not in the grouped kernel's layout")
    return f"{MOE_ENV}=table: {why}, so the MoE step is captured in pieces"


def moe_pieces_wanted(model) -> bool:
    """Whether to capture an MoE model's step between its routing decisions (graph_moe.py): on
    CUDA unless GRAPH_ENV is off, with every layer resident and the experts in an arena."""
    placement = model.placement
    return (model.experts is not None and _setting(GRAPH_ENV) not in OFF
            and model.device.type == "cuda" and all(kind == RESIDENT for kind in placement.layers)
            and model.experts.store.arena is not None)


def moe_fused_wanted(model) -> bool:
    """Whether the MoE step's pieces are fused by torch.compile before capture (graph_moe.py):
    where COMPILE_ENV is on or max. Not by default (auto) until measured against the pieces
    unfused (benchmarks/engine_moe_step_profile.py --fused off,on)."""
    return _setting(COMPILE_ENV) in ("on", "1", "true", "max")


def host_pieces_wanted(model) -> bool:
    """Whether to capture a dense model's step in pieces around its layers on the host
    (graph_host.py): on CUDA unless GRAPH_ENV is off."""
    from gemmactl.runtime.engine.graph_host import cut_around_host

    return (cut_around_host(model) and model.device.type == "cuda"
            and _setting(GRAPH_ENV) not in OFF)


def wanted(env: str, model) -> bool:
    """Whether to compile / capture: on CUDA by default. Never whole for a model that runs layers on
    the host (host compute cannot be captured: host_pieces_wanted says when the stretches between
    are), nor for MoE experts (which experts a step runs,
    and whether they are cached, is decided on the host; moe_pieces_wanted says when the pieces
    between are captured). Streamed layers: captured, never fused (the copies run on their own
    stream). Every layer resident with the tables in host memory: fused between the rows gathered
    on the host."""
    setting = _setting(env)
    placement = model.placement
    if setting in OFF or HOST in placement.layers or model.experts is not None:
        return False
    if not placement.resident_only:
        if env == COMPILE_ENV and all(kind == RESIDENT for kind in placement.layers):
            # Every layer resident, the tables in host memory: the rows are gathered outside the
            # graph and the step between is fused as a resident one is. Measured on an H100 for an
            # E4B shape at 4 GiB: 220 tok/s fused against 93 captured unfused (docs/benchmarks.md).
            return model.device.type == "cuda" and _setting(GRAPH_ENV) not in OFF
        return env == GRAPH_ENV and model.device.type == "cuda"
    if env == COMPILE_ENV and model.device.type != "cuda":
        # Off CUDA the step is eager and passes the written positions' end, on which a compiled
        # step would specialize: a recompile every token. A compiled step reading every slot
        # instead measured 37-41 ms a token against eager's 40-47 on the real 270M at a
        # 4,096-token context on 2 cores, after an 80 s compile: not worth it there.
        return False
    return model.device.type == "cuda" if setting == "auto" else True


def row_stable_options() -> dict:
    """Inductor's settings for a fused step asked to round a row as a one-token step does
    (GEMMACTL_ENGINE_NORM=kernel: the norms in their own kernel inside it, row_norm.py): its
    deterministic mode too (torch 2.10 and later), which picks a reduction kernel's launch by rule
    rather than by timing it, so an attention softmax over one row's scores, compiled once into the
    decode step and again into the verify step, is launched alike in both. Not the default: on an
    H100 the two made the tiny models' fused verify step exact but not the E4B shape's, and the
    norms' kernel cost a tenth of the decode rate (docs/speculation.md). Empty otherwise, or where
    torch has no such mode."""
    import torch._inductor.config as inductor

    from gemmactl.runtime.engine import ops

    return {"deterministic": True} if ops.NORM_SETTING == "kernel" and hasattr(inductor, "deterministic") else {}


class DecodeStep:
    """Runs the model one token at a time: a replayed CUDA graph where there is one, else eagerly."""

    def __init__(self, model, cache_dir=None):
        self.model = model
        device = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.graph = None
        self.compiled = False
        self._forward = None  # model.forward fused, where the capture starts from gathered rows
        self.setup_s = 0.0
        step = model.step
        start = time.perf_counter()
        if wanted(COMPILE_ENV, model):
            if cache_dir is not None:
                os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
            autotune = os.environ.get(COMPILE_ENV, "").lower() == "max"

            def fuse(function):
                if autotune:
                    return torch.compile(function, mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
                return torch.compile(function, fullgraph=True, dynamic=False, options=row_stable_options())

            step = fuse(step)
            # the tables in host memory: the graph starts from the gathered rows (capture)
            self._forward = fuse(model.forward) if model.placement.tables_on_host else None
            self.compiled = True
        self._step = step
        if wanted(GRAPH_ENV, model):
            self._capture()
        elif host_pieces_wanted(model):
            from gemmactl.runtime.engine.graph_host import HostPiecesDecode

            self.graph = HostPiecesDecode(model)  # graphs between the layers on the host
        elif moe_table_wanted(model):
            from gemmactl.runtime.engine.graph_moe import TableDecode

            self.graph = TableDecode(model)  # one graph, the experts found through a device table
        elif moe_pieces_wanted(model):
            from gemmactl.runtime.engine.graph_moe import PiecewiseDecode

            # replayed piece by piece, the experts between: read in their rows, or copied (to measure)
            fused = moe_fused_wanted(model)
            if fused and cache_dir is not None:
                os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
            self.graph = PiecewiseDecode(model, addressed=os.environ.get(MOE_ENV, "pieces").lower() != "copies",
                                         fused=fused, autotune=_setting(COMPILE_ENV) == "max")
            self.compiled = fused
        self.setup_s = time.perf_counter() - start

    def compiled_step(self):
        """The model's step as this decoder runs it (fused by torch.compile where it is): the
        verify step reuses it, so its code is compiled for one more shape, not built again."""
        return self._step

    def fused_forward(self):
        """model.forward as compiled for a capture that starts from gathered rows (the tables in
        host memory, compile asked for), else None: the verify step captures it too."""
        return self._forward

    def _capture(self) -> None:
        self.graph, self.logits, self.x, self.per_layer = capture(self.model, self._step, self.token, self.position,
                                                                   forward=self._forward)

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [V] after token (a 0-dim or [1] tensor on the device) at position."""
        if self.graph is None:
            with torch.inference_mode():
                return self._step(token.reshape(1), torch.tensor([position], device=self.model.device), position + 1)
        if not isinstance(self.graph, torch.cuda.CUDAGraph):
            return self.graph(token, position)
        self.token.copy_(token.reshape(1))
        self.position.fill_(position)
        if self.model.placement.tables_on_host:
            fill_rows(self.model, self.token, self.x, self.per_layer)
        self.graph.replay()
        return self.logits


def capture(model, step, tokens: torch.Tensor, positions: torch.Tensor, all_logits: bool = False, forward=None,
            rows_alone: bool = False, rows_as_decode: bool = False):
    """(graph, logits, x, per_layer): model's step over the static tokens and positions captured in a
    CUDA graph, its logits a static output buffer. Where the embedding tables are in host memory the
    host's row gather stays outside: the graph starts from the gathered rows (x, per_layer, static
    buffers the caller fills before each replay; forward, fused or not, runs from them: model.forward
    by default); else x and per_layer are None. rows_alone: each row runs alone through the device's
    layers and the head (GemmaModel.forward), as a one-token step does; rows_as_decode: each row
    attends as a one-token step does (GemmaModel._attention)."""
    x = per_layer = None
    alone = {"rows_alone": True} if rows_alone else {}
    if rows_as_decode:
        alone["rows_as_decode"] = True
    if model.placement.tables_on_host:
        with torch.inference_mode():
            x, per_layer = model.embed_tokens(tokens, rows_alone)
        run = forward or model.forward
        body = lambda: run(x, per_layer, positions, all_logits=all_logits, **alone)  # noqa: E731
    else:
        body = lambda: step(tokens, positions, all_logits=all_logits, **alone)  # noqa: E731
    graph, logits = capture_body(body, warmups=3)
    model.reset()  # the warm-up and capture wrote the first positions of the caches
    return graph, logits, x, per_layer


def rows_alone_wanted(decoder) -> bool:
    """Whether the verify step beside this DecodeStep runs its rows alone: on a GPU, where the
    decode step is captured (whole, or in pieces around host layers: every slot read) and not
    fused, and the model has no MoE experts (whose per-row routing is not measured)."""
    from gemmactl.runtime.engine.graph_host import HostPiecesDecode

    model = decoder.model
    captured = isinstance(decoder.graph, (torch.cuda.CUDAGraph, HostPiecesDecode))
    return model.device.type == "cuda" and captured and not decoder.compiled and model.experts is None


class VerifyStep:
    """Speculation's verify step: the target runs the pending token and k drafts at once and
    returns every position's logits.

    Where the decode step is captured, so is this, once, for k_max + 1 tokens (fused by the same
    compiled function where the decode step is fused): a round with fewer drafts fills the rest with
    copies of its last token. Their keys land past the round's positions, where attention hides
    them (every slot records its position) and the next round overwrites them; a sliding layer's
    ring keeps k_max spare slots, so they never overwrite a key its window still needs. Eager where
    there is no graph, and for a round whose padded tokens would run past the context.

    Greedy speculation must give plain decoding's tokens, so each row must get the logits a
    one-token step gives it, bit for bit. The rows attend as one-token steps do (rows_as_decode),
    and the matrix kernels give a row in a batch its one-token result: torch's CPU int4 and int8
    kernels and tinygemm (measured with benchmarks/batch_invariance.py, on an H100 for tinygemm),
    the int8 GEMV run once per token (int8_gemv.py), and on CUDA a dense matrix (cuBLAS)
    takes a few rows one by one (kernels.few_rows); unfused, the norms run in a kernel of their own
    (row_norm.py). Where the decode step is captured unfused, as a model with streamed or host
    layers has it, the rows also run alone through each GPU layer (rows_alone), measured exact on
    an H100 (and so were the rows together, once the norms ran in their kernel); the host's layers
    run the rows together, on the host, as the decode step runs them; a streamed layer still
    crosses the link once a round. Where the decode step is fused by torch.compile (every layer
    resident) the rows run together through the fused step, whose norms torch.compile writes for
    several rows: not exact there (measured on an H100; with the norms' kernel asked for inside it,
    exact on tiny models and still not at the E4B shape; docs/speculation.md).
    Beside a decode step cut around host layers (graph_host.py) the verify step is cut the same
    way: graphs for its GPU stretches, the host's layers eager between them."""

    def __init__(self, model, width: int, step=None, captured: bool | None = None, pad: bool = False,
                 forward=None, rows_alone: bool = False, pieces: bool | None = None):
        """captured: one graph for the whole step (None: where the decode step would be one).
        pieces: graphs between the host's layers (graph_host.py; None: where captured is None and
        the decode step would be cut so). pad: run the padded rounds eagerly where nothing is
        captured (the CPU tests check the padding's rollback this way, with the arithmetic the
        graph replays). rows_alone: the rows alone through the device's layers, reading every slot
        as a captured decode step does (rows_alone_wanted says where)."""
        self.model, self.width, self.pad = model, width, pad
        self.rows_alone = rows_alone
        device = model.device
        self.tokens = torch.zeros(width, dtype=torch.long, device=device)
        self.offsets = torch.arange(width, device=device)
        self.positions = self.offsets.clone()
        self.graph = None
        self.setup_s = 0.0
        start = time.perf_counter()
        if captured if captured is not None else wanted(GRAPH_ENV, model):
            self.graph, self.logits, self.x, self.per_layer = capture(model, step or model.step, self.tokens,
                                                                       self.positions, all_logits=True,
                                                                       forward=forward, rows_alone=rows_alone,
                                                                       rows_as_decode=True)
        elif pieces if pieces is not None else captured is None and host_pieces_wanted(model):
            from gemmactl.runtime.engine.graph_host import HostPiecesDecode

            # graphs between the host's layers, as the decode step beside it has them
            self.graph = HostPiecesDecode(model, width=width, rows_alone=rows_alone)
        self.setup_s = time.perf_counter() - start

    def __call__(self, tokens: list[int], position: int) -> torch.Tensor:
        """Logits [len(tokens), V] of tokens at position, position + 1, ..."""
        model, n = self.model, len(tokens)
        device = model.device
        # Each row attends as its one-token step does (model._attention: rows_as_decode). Alone, the
        # rows read the caches as the captured decode step does: every slot (end None).
        exact = {"rows_alone": True} if self.rows_alone else {}
        if (self.graph is None and not self.pad) or n > self.width or position + self.width > model.context:
            with torch.inference_mode():
                return model.step(torch.tensor(tokens, dtype=torch.long, device=device),
                                  torch.arange(position, position + n, device=device),
                                  None if self.rows_alone else position + n, all_logits=True,
                                  rows_as_decode=True, **exact)
        padded = tokens + tokens[-1:] * (self.width - n)
        self.tokens.copy_(torch.tensor(padded, dtype=torch.long))
        torch.add(self.offsets, position, out=self.positions)
        if self.graph is None:
            with torch.inference_mode():
                return model.step(self.tokens, self.positions, all_logits=True, rows_as_decode=True, **exact)[:n]
        if not isinstance(self.graph, torch.cuda.CUDAGraph):
            return self.graph(self.tokens, position)[:n]  # in pieces around the host's layers
        if model.placement.tables_on_host:
            fill_rows(model, self.tokens, self.x, self.per_layer, self.rows_alone)
        self.graph.replay()
        return self.logits[:n]
