"""Every MoE expert of an artifact in the CPU int4 kernel's layout, made once and kept in one file
beside the artifact, mapped.

On a machine without a GPU each expert used to be made in torch's CPU int4 layout on its first use
(runtime/engine/cpu_kernels.py; about 11 ms an expert on 2 cores, 42 s for a 26B-A4B's 3,840) and
copied into anonymous memory: a cold first prompt waited for most of them, and the process held
12.8 GB of experts that the system could not page out (docs/benchmarks.md). llama.cpp maps its
file and runs its weights as stored. Here the layouts are made once, at the first load on a CPU,
expert by expert into `engine-cache/cpu-experts-….bin` (written whole or not at all), and every
later load maps that file: the experts are pages of a file, read on first use and dropped by the
system under memory pressure, and no load makes a layout again.

The file is keyed by the artifact's plan fingerprint, the torch version and the CPU's vector
capability (the layout is torch's, and torch may tile it by capability), so a changed artifact,
torch or machine never reads a stale layout. Where the folder is read-only or the disk lacks room
(the layouts take about as much as the experts do in the artifact), nothing is written and the
experts are made on first use as before.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path

ALIGN = 4096  # every tensor starts on a page of the file
FORMAT = 1
SPARE_BYTES = 1 << 30  # room left on the disk after the file


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ExpertLayouts:
    """The mapped layouts of a store's experts: make() once, then open() and linear()."""

    def __init__(self, artifact, records: dict):
        """records: {(layer, expert): (gate_up record, down record)} (ExpertStore.records)."""
        import torch

        self.artifact, self.records = artifact, records
        capability = torch.backends.cpu.get_cpu_capability().lower()
        name = f"cpu-experts-{artifact.plan.hex()[:16]}-torch{torch.__version__}-{capability}"
        self.data = artifact.path / "engine-cache" / f"{name}.bin"
        self.index_path = self.data.with_suffix(".json")
        self.entries: dict | None = None  # record key → [(part, offset, shape, dtype)]
        self._mapped = None

    def fits(self) -> bool:
        """Whether every expert matrix runs in the CPU int4 kernel (else nothing to keep)."""
        from gemmactl.runtime.engine.cpu_kernels import cpu_int4_fits

        return bool(self.records) and all(r.scheme == "int4" and cpu_int4_fits(tuple(r.shape), r.group_size)
                                          for pair in self.records.values() for r in pair)

    def open(self) -> bool:
        """Map the file if it is there, whole and for these experts."""
        try:
            index = json.loads(self.index_path.read_text())
            size = self.data.stat().st_size
        except (OSError, ValueError):
            return False
        keys = {r.key for pair in self.records.values() for r in pair}
        if index.get("format") != FORMAT or index.get("bytes") != size or set(index.get("entries", {})) != keys:
            return False
        with open(self.data, "rb") as handle:
            self._mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self.entries = index["entries"]
        return True

    def needed_bytes(self) -> int:
        """The file's size: each matrix's codes in the kernel's layout and its scales and zeros
        (cpu_kernels.cpu_linear_bytes), each part from a page of its own."""
        total = 0
        for pair in self.records.values():
            for r in pair:
                out_features, in_features = r.shape
                groups = -(-in_features // r.group_size)
                total += _aligned(out_features * groups * r.group_size // 2) + _aligned(groups * out_features * 2 * 2)
        return total

    def make(self, progress=None) -> bool:
        """Write every expert's layout, expert by expert (never more than one in memory), then the
        index; False (nothing left behind) where the folder is read-only or the disk lacks room.
        progress: called with (bytes written, bytes in all) after each expert."""
        import torch

        from gemmactl.runtime.engine.cpu_kernels import TRIM_EVERY, cpu_int4_layout, release_freed_memory

        folder, needed = self.data.parent, self.needed_bytes()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(folder).free < needed + SPARE_BYTES:
                return False
            fd, tmp = tempfile.mkstemp(prefix=f".{self.data.name}.", suffix=".tmp", dir=folder)
        except OSError:
            return False
        entries, offset = {}, 0
        try:
            with os.fdopen(fd, "wb") as handle:
                for count, key in enumerate(sorted(self.records)):
                    for record in self.records[key]:
                        parts = self.artifact.packed(record, "cpu").parts
                        packed, sz = cpu_int4_layout(parts["qweight"], parts["scales"], parts["zeros"])
                        placed = []
                        for part, tensor in (("packed", packed), ("scales_and_zeros", sz)):
                            data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
                            handle.write(data)
                            handle.write(b"\0" * (_aligned(len(data)) - len(data)))
                            placed.append([part, offset, list(tensor.shape), str(tensor.dtype).split(".")[-1]])
                            offset += _aligned(len(data))
                        entries[record.key] = placed
                    if count % TRIM_EVERY == TRIM_EVERY - 1:
                        release_freed_memory()
                    if progress is not None:
                        progress(offset, needed)
            os.replace(tmp, self.data)
            index = {"format": FORMAT, "bytes": offset, "entries": entries}
            from gemmactl.fileio import atomic_write_text

            atomic_write_text(self.index_path, json.dumps(index))
        except BaseException as exc:  # a full disk, or an interrupt: nothing half-written is left
            for path in (tmp, self.data):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            if isinstance(exc, OSError):
                return False
            raise
        return True

    def linear(self, record):
        """The record as an Int4CpuLinear viewing the mapped file (its stored codes, for a prefill
        chunk's decode path, views of the artifact's shard)."""
        import torch

        from gemmactl.runtime.engine.cpu_kernels import Int4CpuLinear

        views = {}
        for part, offset, shape, dtype in self.entries[record.key]:
            dt = getattr(torch, dtype)
            count = 1
            for d in shape:
                count *= d
            views[part] = torch.frombuffer(self._mapped, dtype=dt, count=count, offset=offset).view(shape)
        stored = self.artifact.packed(record, "cpu").parts
        linear = Int4CpuLinear(views["packed"], views["scales_and_zeros"], record.group_size, *record.shape,
                               columns=views["scales_and_zeros"].shape[0] * record.group_size, stored=stored)
        linear.mapped = True
        return linear

    def nbytes(self) -> int:
        return len(self._mapped) if self._mapped is not None else 0


def open_or_make(artifact, records: dict, progress=None) -> ExpertLayouts | None:
    """The store's experts mapped from their layout file, made first where it is missing; None
    where they cannot be (a layout the kernel does not take, no room, a read-only folder)."""
    layouts = ExpertLayouts(artifact, records)
    if not layouts.fits():
        return None
    if layouts.open() or (layouts.make(progress) and layouts.open()):
        return layouts
    return None

