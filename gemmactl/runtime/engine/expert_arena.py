"""MoE experts ready to copy: every expert in the device kernel's layout, in pinned host memory.

An expert's miss used to make its Linears from the artifact's codes: read the mapped shards
(pageable memory), cross the link, reorder into tinygemm's layout and allocate, one expert at a
time with the host waiting. On an H200 that held a 26B-A4B-shaped model to 2 tok/s while its
copies alone would allow 60 (docs/benchmarks.md). The arena does that work once, at load: each
expert's tensors, as the device kernel takes them, are laid end to end in one row of pinned host
memory (rows kept in chunks, CHUNK_BYTES). A device slot is a row of the same layout on the device, with Linears viewing it, made
once; a miss is one asynchronous copy of a row on a side stream, and the compute stream waits for
that copy's event only when it reaches that expert, so the copies of a layer's missed experts run
while the experts before them compute. A slot is not refilled before the compute that last read it
has run (an event recorded after each use).

`SCRATCH` extra rows serve misses the cache does not keep (the cache off, or every slot held by
the layer's own experts), in turn. `staging` rows (top_k of them) serve a decode step captured in
CUDA graphs (runtime/engine/graph_moe.py). Addressed (`addressed`, the default where the experts
are in the grouped kernel's layout), the host writes the rows of the token's k experts into a
small device tensor before each MoE layer's graph and the graph's grouped kernel reads each expert
in its row, a cache slot or, for a miss the cache does not keep, a staging row: a hit is no copy
at all, a miss one copy over the link into its slot. Otherwise (tinygemm's layout, or
`GEMMACTL_ENGINE_MOE=copies`) a graph cannot follow an expert from row to row, so the host copies
the token's experts into the staging rows, in ascending order, and the graph computes them there:
a hit is a copy within the device (about 2 µs for a 26B-A4B expert on an H200, 35 µs at a 4 GB
card's 200 GB/s), a miss a copy over the link and, where the cache keeps it, one more into its
slot. The addressed step makes fewer copies, each from the host between pieces the GPU waits for:
460 copy calls a token against 672 on an H100 with a uniform router (docs/benchmarks.md).
With prefetch, `ahead` rows (two sets of top_k, taken from the cache's room) receive the next MoE
layer's guessed experts while the graph computes, one set for one MoE layer, the other for the
next, in turn. Addressed, the next piece reads a guessed miss in its ahead row, and its copy into
its cache slot is queued after the copies that piece waits for, so it runs beside the piece; the
next layer's guesses go to the other set meanwhile, and this set is written again only two layers
on, after the host has seen that piece end. Otherwise a guessed miss is copied from its ahead row
within the device into its staging row (and slot) before the piece.

Experts homed on the host (ExpertStore.set_homes) have no row here: they are computed on the host
and never copied. A captured step takes their outputs instead: the host writes each into its
place among the token's k (`host_out_pinned`, flagged in `host_flags_pinned`), one copy of each
crosses before the next piece, and staged_sum takes a flagged output in place of that staging row.

On a machine without a GPU the arena is off by default (the host stands in for the device, and a
copy of a row would be the same memory twice); tests turn it on there to check its layout, slots
and bookkeeping with the host's tensors.
"""

from __future__ import annotations

import torch

from gemmactl.runtime.engine.device_copies import CopyError, driver_copies
from gemmactl.runtime.engine.expert_settings import EXPERT_SCRATCH_ROWS as SCRATCH
from gemmactl.runtime.engine.ops import expert_forward, gated

ALIGN = 256  # bytes: every tensor in a row starts at a multiple of this
# Pinned host memory comes from torch's host allocator, which rounds a request up to a power of
# two: one 12.8 GB buffer would pin 16 GiB. Chunks of whole rows just under a power of two waste
# at most about a row each.
CHUNK_BYTES = 256 << 20
assert SCRATCH >= 2, "a scratch miss is filled one ahead: it needs a row the current one is not reading"


def _layout(linears: tuple) -> tuple[list, int]:
    """[(linear index, tensor name, dtype, shape, offset)] of an expert's tensors and the row's bytes."""
    entries, offset = [], 0
    for index, linear in enumerate(linears):
        for name, tensor in linear.tensors().items():
            entries.append((index, name, tensor.dtype, tuple(tensor.shape), offset))
            offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return entries, offset


class ExpertArena:
    """Every expert of a store in pinned host rows in the device layout; device rows for the cache's
    slots, the scratch rows and the staging rows; the copies between them, ordered by events on CUDA."""

    def __init__(self, store, capacity: int, staging: int = 0, ahead: int = 0, hidden: int = 0):
        self.store, self.device = store, store.device
        self.cuda = self.device.type == "cuda"
        keys = sorted(set(store.records) - store.homed)  # a homed expert is never copied
        first = min(store.records)
        template = store.linears(first, self.device)
        self.layout, self.row_bytes = _layout(template)
        self.template = template
        self.rows = {key: i for i, key in enumerate(keys)}
        self.per_chunk = max(1, CHUNK_BYTES // self.row_bytes)
        self.chunks = [torch.empty((min(self.per_chunk, len(keys) - start), self.row_bytes), dtype=torch.uint8,
                                   pin_memory=self.cuda) for start in range(0, len(keys), self.per_chunk)]
        for key, row in self.rows.items():  # expert by expert: never the whole model's codes at once
            self._write(row, template if key == first else store.linears(key, self.device))
        self.capacity, self.staging = capacity, capacity + SCRATCH  # the first staging row
        self.ahead = self.staging + staging  # the first of the rows a captured step's prefetch fills
        self.ahead_count = ahead  # rows in each of the two sets
        self._ahead_set = 0  # the set the last prefetch filled
        self.read_ahead = True  # addressed: a piece reads a guessed miss in its ahead row (False: copied first; measurements)
        self.ahead_keys: dict = {}  # key → ahead row: the next MoE layer's guessed experts, copies queued
        rows = capacity + SCRATCH + staging + 2 * ahead
        self.on_device = torch.empty((rows, self.row_bytes), dtype=torch.uint8, device=self.device)
        self.views = [self._linears(self.on_device[i]) for i in range(rows)]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: list = [None] * rows  # the copy into the row, not yet waited for
        self.freed: list = [None] * rows  # after the last compute that read the row
        self.staging_freed = None  # after the last captured piece that read the staging rows
        self.graph_done = None  # after the last whole-step graph, which may read any slot (graph_moe.TableDecode)
        self.device_rows = [self.on_device[i] for i in range(rows)]
        self.host_rows = [self.host_row(i) for i in range(len(keys))]
        # The copies between rows: the driver's, on addresses, where it runs (device_copies: less
        # than half the host time of torch's copy_); the rows live as long as the arena.
        self.driver = driver_copies() if self.cuda else None
        self.host_ptrs = [row.data_ptr() for row in self.host_rows]
        self.base = self.on_device.data_ptr()
        self.stream_handle = self.stream.cuda_stream if self.cuda else 0
        self._scratch = 0
        # The addressed step (module docstring): the rows the next piece reads, written from a
        # pinned buffer; each row's tensors at (the device rows' base + row · row_bytes + offset).
        from gemmactl.runtime.engine.kernels import Int4GroupsLinear

        self._addressable = self.cuda and all(isinstance(linear, Int4GroupsLinear) for linear in template)
        self.addressed = False  # set by the captured step (graph_moe.PiecewiseDecode)
        self.row_ids = torch.arange(rows, device=self.device)  # row r's number on the device: row_ids[r:r + 1]
        self.compute = None  # the compute stream of the step under way (one lookup a token, not one a copy)
        self.rows_pinned = torch.zeros(max(staging, 1), dtype=torch.int64, pin_memory=self.cuda)
        self.rows_numpy = self.rows_pinned.numpy()
        base = self.on_device.data_ptr()
        self.offsets = torch.tensor([base + offset for *_, offset in self.layout], dtype=torch.int64,
                                    device=self.device)
        self.host_out = self.host_flags = self.host_out_pinned = self.host_flags_pinned = None
        if store.homed and staging:  # a captured step's outputs of homed experts (module docstring)
            self.host_out = torch.zeros((staging, hidden), dtype=store.dtype, device=self.device)
            self.host_flags = torch.zeros(staging, dtype=torch.bool, device=self.device)
            self.host_out_pinned = torch.zeros((staging, hidden), dtype=store.dtype, pin_memory=self.cuda)
            self.host_flags_pinned = torch.zeros(staging, dtype=torch.bool, pin_memory=self.cuda)
        if self.cuda:
            torch.cuda.empty_cache()  # the layout work's temporaries: the arena's rows are all it keeps

    def host_row(self, row: int) -> torch.Tensor:
        return self.chunks[row // self.per_chunk][row % self.per_chunk]

    def _write(self, row: int, linears: tuple) -> None:
        for index, name, dtype, shape, offset in self.layout:
            tensor = linears[index].tensors()[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:  # every row has the first expert's layout
                raise ValueError(f"expert {row}'s {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"not {shape} {dtype} as the first expert's")
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            self.host_row(row)[offset:offset + flat.numel()].copy_(flat)

    def _linears(self, row: torch.Tensor) -> tuple:
        tensors: list = [dict() for _ in self.template]
        for index, name, dtype, shape, offset in self.layout:
            count = 1
            for d in shape:
                count *= d
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            tensors[index][name] = row[offset:offset + nbytes].view(dtype).view(shape)
        return tuple(linear.with_tensors(parts) for linear, parts in zip(self.template, tensors))

    def host_bytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks)

    def device_bytes(self) -> int:
        return self.on_device.numel()

    def scratch(self) -> int:
        """The next scratch row, in turn."""
        row = self.capacity + self._scratch
        self._scratch = (self._scratch + 1) % SCRATCH
        return row

    def fill(self, key, row: int) -> None:
        """Copy the expert key into device row (asynchronously on CUDA, once the row's last reader ran)."""
        if not self.cuda:
            self._copies([(key, row)])
            return
        stream = self.stream
        # After the row's last eager reader, the last whole-step graph and the last captured piece
        # (each may read any slot: graph_moe.TableDecode, the addressed step).
        for event in (self.freed[row], self.graph_done, self.staging_freed):
            if event is not None:
                stream.wait_event(event)
        self._copies([(key, row)])
        done = torch.cuda.Event()
        done.record(stream)
        self.ready[row] = done

    def addresses(self, row: int, on_device: bool) -> list:
        """The addresses of a row's tensors, in layout order (for Int4GroupsLinear experts: the
        gate_up codes, scales and zeros, then down's): device row `row`, or the host row of expert
        row `row` (pinned, so the device reads it in place over the link)."""
        base = (self.on_device[row] if on_device else self.host_row(row)).data_ptr()
        return [base + offset for _, _, _, _, offset in self.layout]

    def staged(self, j: int) -> tuple:
        """The Linears viewing staging row j (what a captured step computes; see move)."""
        return self.views[self.staging + j]

    def addressable(self) -> bool:
        """Whether a captured step can read each expert in its own row: on CUDA, the experts in
        the grouped kernel's layout (it takes a table of addresses; tinygemm takes tensors). Then
        every one-token product of an expert runs in that kernel, eager or captured (rows_forward)."""
        return self._addressable

    def row_forward(self, row: int, x: torch.Tensor) -> torch.Tensor:
        """The expert in device row `row` on x [t, H], once its copy has landed (the compute
        stream waits for it). One token where the arena is addressable runs the grouped kernel for
        that one row, as a captured step runs a layer's k (the same binary, the same products, so
        the eager and captured steps agree bit for bit); else the row's Linears."""
        linears = self.linears(row)
        if x.shape[0] == 1 and self.addressable():
            return self.rows_forward(self.row_ids[row:row + 1], x)
        return expert_forward(linears, x)

    def staging_ids(self, k: int) -> torch.Tensor:
        """The staging rows' numbers [k] on the device (what a copied step's grouped kernel reads)."""
        return self.row_ids[self.staging:self.staging + k]

    def _compute_stream(self):
        return self.compute if self.compute is not None else torch.cuda.current_stream(self.device)

    def move(self, moves: list, rows: list | None = None, target: torch.Tensor | None = None,
             later: list = ()) -> None:
        """A captured step's copies for one MoE layer, in order, in one go: (source, row) pairs, a
        source being an expert's key (its host row, over the link) or a device row; then, for the
        addressed step, rows (the k rows its experts are read from, ascending expert order) into
        target, the device tensor the next piece reads them from. Then the compute stream waits for
        all of them. later: more (device row, row) copies, queued after that wait is set, so the
        next piece does not wait for them (guessed misses into their cache slots, read by the piece
        in their ahead rows). No event per copy: the host runs this between two graphs, for every
        MoE layer of every token, so its cost is the step's (the waits a row needs, the copies, an
        event or two)."""
        if rows is not None:
            self.rows_numpy[:len(rows)] = rows  # free: the last copy from it ran before the host's wait
        numbers = (target, self.rows_pinned, len(rows)) if rows is not None else None
        if not self.cuda:
            self._copies([*moves, *later], numbers)
            return
        compute, stream = self._compute_stream(), self.stream
        if self.staging_freed is not None:  # the last graph that read the staging rows
            stream.wait_event(self.staging_freed)
        for _, row in [*moves, *later]:
            if self.freed[row] is not None:  # a cache slot an eager step read
                stream.wait_event(self.freed[row])
                self.freed[row] = None
        self._copies(moves, numbers)
        done = torch.cuda.Event()
        done.record(stream)
        compute.wait_event(done)
        for _, row in moves:
            if row < self.staging:  # a cache slot: an eager step reading it waits for this
                self.ready[row] = done
        if later:
            self._copies(later)
            landed = torch.cuda.Event()
            landed.record(stream)
            for _, row in later:  # a later piece waits for a later move's event, recorded after these
                self.ready[row] = landed

    def _copies(self, pairs: list, numbers: tuple | None = None) -> None:
        """Queue on the copy stream, in order, a copy into each device row from its source, pairs
        (source, row): an expert's key (its pinned host row, over the link) or a device row; then
        numbers (target, pinned, count): count int64s from pinned into device tensor target. The
        driver's copies take the stream as an argument; torch's run on the current stream, so for
        them the copy stream is made current meanwhile (set_stream, not `with torch.cuda.stream`,
        which asks for the current stream again). Where the host stands in for the device, plain
        copies."""
        if not self.cuda:
            self._torch_copies(pairs, numbers, non_blocking=False)
            return
        driver = self.driver
        if driver is not None:
            base, size, handle, host = self.base, self.row_bytes, self.stream_handle, self.host_ptrs
            queued = 0
            try:
                for source, row in pairs:
                    driver(base + row * size,
                           host[self.rows[source]] if isinstance(source, tuple) else base + source * size, size, handle)
                    queued += 1
                if numbers is not None:
                    target, pinned, count = numbers
                    driver(target.data_ptr(), pinned.data_ptr(), count * pinned.element_size(), handle)
                return
            except CopyError:
                # A refused call queues nothing (this thread without the device's context current,
                # say): torch's copies from here on, beginning with the refused one.
                self.driver = None
                pairs = pairs[queued:]
        compute = self._compute_stream()
        torch.cuda.set_stream(self.stream)
        try:
            self._torch_copies(pairs, numbers, non_blocking=True)
        finally:
            torch.cuda.set_stream(compute)

    def _torch_copies(self, pairs: list, numbers: tuple | None, non_blocking: bool) -> None:
        """_copies by torch's copy_, on the current stream."""
        rows = self.device_rows
        for source, row in pairs:
            rows[row].copy_(self.host_rows[self.rows[source]] if isinstance(source, tuple) else rows[source],
                            non_blocking=non_blocking)
        if numbers is not None:
            target, pinned, count = numbers
            target[:count].copy_(pinned[:count], non_blocking=non_blocking)

    def rows_forward(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The k experts read in device rows rows [k] (move's target) on one token x [1, H] → [k, H],
        with no host decision in it on CUDA (so it can be captured): the grouped kernel, one launch
        for the k gate_up products and one for the k down products, each expert's tensors at its
        row's addresses. The eager step runs the same kernel for one row at a time (row_forward), so
        the products are the same bits. Where the host stands in for the device (tests), each row's
        views, read from the host."""
        if not self.cuda:
            return torch.cat([expert_forward(self.views[row], x) for row in rows.tolist()])
        addresses = rows[:, None] * self.row_bytes + self.offsets  # [k, 6]: gate_up's three tensors, down's
        return self.addresses_forward(addresses, x)

    def addresses_forward(self, addresses: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The k experts whose tensors lie at addresses [k, 6] (gate_up's codes, scales and zeros,
        then down's: a device row or a pinned host row) on one token x [1, H] → [k, H]: the grouped
        kernel, one launch for the gate_up products and one for the down products."""
        from gemmactl.runtime.engine.int4_gemv import grouped

        gate_up, down = self.template
        # Each half in a tensor of its own: a view of one row's (k = 1, an eager step) would start 24
        # bytes in, and Triton compiles another binary for a table that is not 16-byte aligned.
        up_at, down_at = (addresses[:, part].clone(memory_format=torch.contiguous_format)
                          for part in (slice(0, 3), slice(3, 6)))
        h = grouped(x.reshape(-1), up_at, gate_up.out_features, gate_up.in_features, gate_up.group_size)  # [k, 2w]
        return grouped(gated(h), down_at, down.out_features, down.in_features, down.group_size)

    def prefetch(self, keys: list) -> None:
        """Copy the experts keys over the link into the ahead rows, after every copy queued so far
        and without making the compute stream wait: they land while the next piece computes, and
        the next layer's move() (same stream, so after them) takes those it needs from there. The
        two sets of ahead rows in turn (module docstring): the set filled here was read last by the
        piece before the one that just ended."""
        self._ahead_set ^= 1
        first = self.ahead + self._ahead_set * self.ahead_count
        self.ahead_keys = {key: first + j for j, key in enumerate(keys[:self.ahead_count])}
        if self.ahead_keys:
            self._copies(list(self.ahead_keys.items()))

    def send_host_outputs(self, outputs: bool = True) -> None:
        """Queue the flags and (outputs: some expert was homed) the homed experts' outputs to the
        device, before the next piece (the compute stream); an output whose flag is off is never
        read. The pinned buffers are written again only at the next MoE layer, after the host has
        waited for that layer's router, so after these copies ran."""
        if outputs:
            self.host_out.copy_(self.host_out_pinned, non_blocking=True)
        self.host_flags.copy_(self.host_flags_pinned, non_blocking=True)

    def release_staging(self) -> None:
        """Mark the staging rows' readers so far (a captured piece just launched): the next copies
        into them wait for it."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self._compute_stream())
            self.staging_freed = done

    def linears(self, row: int) -> tuple:
        """The Linears viewing device row, once its copy has landed (the compute stream waits for it)."""
        if self.ready[row] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[row])
            self.ready[row] = None
        return self.views[row]

    def release(self, row: int) -> None:
        """Mark the row's readers so far: a later fill waits for them."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.freed[row] = done


class ExpertRows:
    """The host's rows for experts in torch's CPU int4 kernel (runtime/engine/cpu_kernels.py): the
    cache's slots where the host stands in for the device, or the experts a GPU machine computes on
    the host. Each expert's layout, made on first use, is copied into its row of a few large
    chunks, allocated as rows are first used (the layout taken from the first expert put)."""

    def __init__(self, count: int):
        self.count = count
        self.layout = self.row_bytes = self.per_chunk = None
        self.chunks: dict = {}

    def _row(self, slot: int) -> torch.Tensor:
        index = slot // self.per_chunk
        if index not in self.chunks:
            rows = min(self.per_chunk, self.count - index * self.per_chunk)
            self.chunks[index] = torch.empty((rows, self.row_bytes), dtype=torch.uint8)
        return self.chunks[index][slot % self.per_chunk]

    def put(self, slot: int, linears: tuple) -> tuple:
        """The expert's Linears with their tensors moved into slot's row."""
        if self.layout is None:
            self.layout, self.row_bytes = _layout(linears)
            self.per_chunk = max(1, CHUNK_BYTES // self.row_bytes)
        row, parts = self._row(slot), [dict() for _ in linears]
        for index, name, dtype, shape, offset in self.layout:
            tensor = linears[index].tensors()[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"an expert's {name} is {tuple(tensor.shape)} {tensor.dtype}, not {shape} {dtype}")
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            held = row[offset:offset + flat.numel()]
            held.copy_(flat)
            parts[index][name] = held.view(dtype).view(shape)
        return tuple(linear.with_tensors(held) for linear, held in zip(linears, parts))

    def nbytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks.values())
