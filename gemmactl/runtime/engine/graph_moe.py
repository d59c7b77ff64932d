"""The decode step of an MoE model captured in CUDA graphs, one for each stretch between two routing
decisions.

Which experts a token runs, and whether each is cached, is decided on the host, so by default an
MoE step is not one graph (TableDecode, below, makes it one, at a price in link speed). Eager, its dense part and its experts pay the host's launches: on an H200 an
eager step of a 26B-A4B-shaped model ran 6.4–9.4 tok/s, and with only the dense parts captured (the
experts eager between the graphs) 20.1, its 240 experts a token still launched one by one
(docs/benchmarks.md). Here the step is cut after each MoE layer's router: graph i runs from the
previous layer's experts (their sum included) to this layer's router and top-k; then the host
reads the router's choice, copies the misses over the link (MoEBlock.stage) and writes the rows
each chosen expert lies in (a cache slot, or a staging row for a miss the cache does not keep)
into a small device tensor; graph i+1 begins by computing the k experts in one grouped launch
that reads each in its row (MoEBlock.staged_sum, ExpertArena.rows_forward). Between two graphs the
host does one read of k integers, a copy for each miss and one of k row numbers. Where the
experts are in tinygemm's layout, or with `GEMMACTL_ENGINE_MOE=copies` (to measure), the host
copies every chosen expert into the arena's staging rows instead (a hit within the device), and
graph i+1 computes them there one by one. With prefetch (`--expert-prefetch`), graph i also
applies the next MoE layer's router to this layer's residual stream, and the host copies the
uncached experts it picks into the arena's ahead rows right after this layer's copies: they cross
the link while graph i+1 computes, and the next layer's guessed misses are then copies within the
device (MoEBlock.stage_ahead). The graphs share one memory pool and are replayed in the order they
were captured, as torch requires for sharing.

Captured the way graph.DecodeStep captures a dense step: static token and position, the rows of
the embedding tables gathered outside the graphs, every cache slot read with the unwritten ones
masked. Only where every layer is resident on the GPU and the experts live in an arena (the
default on CUDA; graph.moe_pieces_wanted).

Fused (GEMMACTL_ENGINE_COMPILE=on; not the default until its speed is measured), the forward is
compiled by torch.compile first and the hook each MoE layer hands its experts to is one Dynamo
does not trace (cut_here): the compiled forward breaks there, so each piece is one compiled
stretch (its norms, rope, attention glue, router and top-k fused into a few kernels instead of the
~20 small ones a layer launches unfused), and the experts' sum between is compiled on its own.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from gemmactl.runtime.engine.capture import capture_body, fill_rows, warm_up


class PiecewiseDecode:
    """One token's step of an MoE model: graphs between routing decisions, the experts eager."""

    def __init__(self, model, addressed: bool = True, fused: bool = False, autotune: bool = False):
        self.model = model
        device = model.device
        arena = model.experts.store.arena
        # What the graphs read is fixed at capture: set again at every replay (stage follows it).
        self.addressed = arena.addressed = addressed and arena.addressable()
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        with torch.inference_mode():
            self.x, self.per_layer = model.embed_tokens(self.token)  # the graphs' static inputs
        self.graphs: list = []
        self.calls: list = []  # the ExpertCall each graph but the last ends with (its static tensors)
        # Queue the next layer's guessed copies after the next graph's launch rather than before
        # it, so the host's work for them runs while the GPU computes (its set of ahead rows is not
        # the one that graph reads). Off until measured on a GPU
        # (benchmarks/engine_moe_step_profile.py --ahead-after off,on).
        self.ahead_after_launch = False
        # fused: the stretches between the routers fused by torch.compile before capture, as a
        # dense step is (graph.py): one compiled forward, cut by a hook Dynamo does not trace (a
        # graph break at each MoE layer), so each piece is one compiled stretch. The hook is one
        # callable whose work is swapped (staged in the warm-up, cut in the capture), so the
        # capture finds the code the warm-up compiled rather than compiling again inside it.
        self.fused = fused
        self._work = [None]
        work = lambda call: self._work[0](call)  # noqa: E731
        self._hook = cut_here(work) if fused else work
        self._forward = fused_forward(model, autotune=autotune) if fused else model.forward
        # The experts' sum between the pieces (their addresses, the grouped launches, the gate and
        # the weighted adds in order, some 35 small kernels a layer unfused) compiled on its own:
        # the hook runs untraced, but a compiled function called from it is compiled.
        self._sum = _compiled(_staged_sum, autotune) if fused else _staged_sum
        self.compiled_in_capture = 0  # graphs Dynamo compiled during the capture (0: all in the warm-up)
        self._capture()

    def _capture(self) -> None:
        model = self.model
        # Warm up (cuBLAS handles, kernels, the allocator), eagerly, experts included, and once as
        # the pieces will run them (staged), so no kernel is first compiled or loaded inside a capture.
        warm_up(lambda: model.forward(self.x, self.per_layer, self.position), 2)

        def staged(call):
            call.block.stage(call.experts, None, call.x)
            return self._sum(call.block, call.x, call.weights, call.experts)

        model.experts.store.arena.ahead_keys = {}  # no guess of an earlier step is read in the warm-up
        self._work[0] = staged
        with recompiles_allowed(self.fused):  # compiled here where fused: once, then run once as compiled
            warm_up(lambda: self._forward(self.x, self.per_layer, self.position, experts_of=self._hook),
                    2 if self.fused else 1)
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

        def cut(call):  # an MoE layer's router has chosen: end this graph, begin the next with its experts
            block = call.block
            if block.prefetch and block.next is not None and block.store.arena.ahead_count:
                call.guess = block.next.route(call.residual)[1]  # the next layer's guess, in this graph
                call.choice = torch.cat((call.experts, call.guess), dim=1)  # so the host reads both at once
            end()
            self.calls.append(call)
            begin()
            return self._sum(call.block, call.x, call.weights, call.experts)

        self._work[0] = cut
        compiled_before = _graphs_compiled() if self.fused else 0  # unfused: nothing to count
        with torch.inference_mode(), recompiles_allowed(self.fused):
            begin()
            try:
                self.logits = self._forward(self.x, self.per_layer, self.position, experts_of=self._hook)  # [V]
            except BaseException:
                if open_capture:  # close the capture with the error, so the error is the one raised
                    try:
                        open_capture.pop().__exit__(*sys.exc_info())
                    except Exception:  # noqa: BLE001 - the first error is the one to report
                        pass
                raise
            end()
        self.compiled_in_capture = _graphs_compiled() - compiled_before if self.fused else 0
        model.reset()  # the warm-up and capture wrote position 0 of the caches
        experts = model.experts  # the warm-up's expert uses are not the caller's
        experts.counters.__init__()
        experts.cache.hits = experts.cache.misses = 0

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [V] after token (a 0-dim or [1] tensor on the device) at position."""
        self.token.copy_(token.reshape(1))
        self.position.fill_(position)
        arena = self.model.experts.store.arena
        arena.addressed = self.addressed
        arena.ahead_keys = {}  # an eager step may have run since the last guess
        fill_rows(self.model, self.token, self.x, self.per_layer)
        arena.compute = torch.cuda.current_stream(self.model.device)
        try:
            with torch.inference_mode():
                pending = None  # (block, guess) whose copies wait for the next launch (ahead_after_launch)
                for i, graph in enumerate(self.graphs):
                    graph.replay()
                    if i:
                        arena.release_staging()  # graph i read the staging rows
                    if pending is not None:
                        pending[0].stage_ahead(pending[1])
                        pending = None
                    if i < len(self.calls):
                        call = self.calls[i]
                        guessed = call.block.stage(call.experts, call.guess, call.x, call.choice)
                        if guessed is not None and self.ahead_after_launch:
                            pending = (call.block.next, guessed)
                        elif guessed is not None:  # behind this layer's copies, which graph i+1 waits for
                            call.block.next.stage_ahead(guessed)
        finally:
            arena.compute = None
        return self.logits


def _staged_sum(block, x, weights, experts):
    return block.staged_sum(x, weights, experts)


def cut_here(work):
    """work (an ExpertCall → the experts' sum) as the hook a fused forward hands each MoE layer to:
    Dynamo does not trace it, so the compiled forward breaks there and runs it as it is."""
    return torch.compiler.disable(work)


def _compiled(function, autotune: bool = False, backend: str = "inductor"):
    if autotune:  # inductor's autotuning too (GEMMACTL_ENGINE_COMPILE=max), as graph.DecodeStep asks it
        return torch.compile(function, mode="max-autotune-no-cudagraphs", dynamic=False, backend=backend)
    return torch.compile(function, dynamic=False, backend=backend)


def fused_forward(model, backend: str = "inductor", autotune: bool = False):
    """model.forward compiled (static shapes) for a capture in pieces: call it with a cut_here
    hook, under recompiles_allowed, as the warm-up and the capture do."""
    return _compiled(model.forward, autotune, backend)


def _graphs_compiled() -> int:
    """How many graphs Dynamo has compiled in this process so far (0 where it does not count them)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))


def recompiles_allowed(fused: bool = True):
    """Dynamo's settings while the pieces compile: each layer's stretch is the same code over
    another layer's weights (and another model's, for each model captured in a process), which
    Dynamo compiles once for each; its default limit (8 per code object) would leave the rest
    eager. Only the warm-up and the capture run under it: a replay calls no compiled code.
    Nothing where the pieces are not fused."""
    if not fused:
        return contextlib.nullcontext()
    import torch._dynamo

    config = torch._dynamo.config
    # The names since torch 2.7; before, cache_size_limit and accumulated_cache_size_limit.
    limit, total = (("recompile_limit", "accumulated_recompile_limit") if hasattr(config, "recompile_limit")
                    else ("cache_size_limit", "accumulated_cache_size_limit"))
    return config.patch(**{limit: max(4096, getattr(config, limit)), total: max(1 << 16, getattr(config, total))})


class TableDecode:
    """One token's step of an MoE model in one CUDA graph: no host decision inside it.

    Where the pieces above stop at every router for the host to read its choice and copy the
    experts, here the device finds each chosen expert in a table of addresses (MoEExperts.table:
    for each expert, its cache slot or its pinned host row) and the grouped int4 kernel reads it
    there, in place (MoEBlock.table_sum). A miss is read over the link once, inside the step; the
    host keeps the cache from the step's record of chosen experts while the next step runs:
    counts, hits, and the policy's admissions, whose copies run on a side stream and whose table
    entries are written when their copies land (MoEExperts.flush_behind). The token's sync is the
    step's only wait for the host. Only where the experts are in the grouped kernel's layout
    (runtime/engine/kernels.py), on CUDA, every layer resident, and asked for
    (`GEMMACTL_ENGINE_MOE=table`): a miss read in place crosses the link at about half the copy
    engine's rate, so with a uniform router (26B-A4B shape, 4 GiB, H200) it decoded 22.2 tok/s
    against the pieces' 28.3; with a skewed one, 35.2 against 33.5 (docs/benchmarks.md; measured
    before the grouped kernel read its codes in vectors and without the fetch below).

    With prefetch (the arena then has two sets of ahead rows), each MoE layer also applies the next
    MoE layer's router to its residual stream, as the pieces do, and a copy kernel on a second
    stream fetches the guessed experts that the table says are on the host into that layer's set of
    ahead rows while this layer's experts compute (MoEExperts.fetch); the next layer reads a
    fetched expert there and any other where the table says (fetched_entries). So most misses
    cross the link beside the compute rather than in the experts' own kernel, still with no host
    decision in the step.
    """

    def __init__(self, model):
        self.model = model
        device = model.device
        experts = model.experts
        experts.enable_table()
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        with torch.inference_mode():
            self.x, self.per_layer = model.embed_tokens(self.token)  # the graph's static inputs

        def table(call):
            block = call.block
            if not experts.fetching:
                return block.table_sum(call.x, call.weights, call.experts)
            if block.next is not None:  # the next layer's guessed misses cross while these experts compute
                experts.fetch(block.next, block.next.route(call.residual)[1][0])
            return block.table_sum(call.x, call.weights, call.experts,
                                   fetched=lambda order, entries: experts.fetched_entries(block, order, entries))

        body = lambda: model.forward(self.x, self.per_layer, self.position, experts_of=table)  # noqa: E731
        self.graph, self.logits = capture_body(body, warmups=2)  # logits [V]
        model.reset()  # the warm-up and capture wrote position 0 of the caches
        experts.counters.__init__()  # the warm-up's experts are not the caller's (it never called replayed())
        experts.cache.hits = experts.cache.misses = 0

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [V] after token (a 0-dim or [1] tensor on the device) at position."""
        experts = self.model.experts
        if experts.table_version != experts.cache.version:  # an eager step (prefill) moved experts
            experts.flush()
            experts.rebuild_table()
        self.token.copy_(token.reshape(1))
        self.position.fill_(position)
        fill_rows(self.model, self.token, self.x, self.per_layer)
        self.graph.replay()
        experts.replayed()
        experts.flush_behind(1)  # the previous step's bookkeeping, while this one runs
        return self.logits

