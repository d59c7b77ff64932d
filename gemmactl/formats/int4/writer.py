"""Int4ShardWriter: writes a planned layout shard by shard, then index.json, as a strict state machine.

    READY ──open_shard──▶ SHARD_OPEN ──begin_record──▶ IN_RECORD ──end_record──▶ SHARD_OPEN
    SHARD_OPEN ──close_shard──▶ READY        READY ──adopt_shard──▶ READY   (a finished shard kept)
    READY (every shard done) ──finish──▶ FINISHED           any ──abort──▶ FAILED

A shard is written as `<name>.partial` and renamed when complete and fsynced, so a finished shard
file on disk is always whole. index.json is written last, through a temporary file and a rename:
a run killed at any point leaves no index or a complete one.

Test hook: GEMMACTL_INT4_SHARD_PAUSE=SECONDS makes the writer sleep after each finished shard,
so a test can kill a run deterministically between shards.
"""

from __future__ import annotations

import enum
import json
import os
import time
import zlib
from pathlib import Path

from gemmactl.fileio import atomic_write_text, fsync_dir
from gemmactl.formats.int4.layout import Layout
from gemmactl.formats.int4.spec import INDEX_NAME, PARTIAL_MARKER, TensorRecord, pack_header

PAUSE_ENV = "GEMMACTL_INT4_SHARD_PAUSE"
_CRC_BLOCK = 16 << 20


class WriterState(enum.Enum):
    READY = "ready"
    SHARD_OPEN = "shard-open"
    IN_RECORD = "in-record"
    FINISHED = "finished"
    FAILED = "failed"


class WriterStateError(RuntimeError):
    """A writer method was called out of order (a bug in the caller, not bad input)."""


def crc32_of(buffer, offset: int, nbytes: int) -> str:
    """Checksum of buffer[offset:offset+nbytes] in the index's form: "crc32:xxxxxxxx"."""
    view = memoryview(buffer)
    crc = 0
    for start in range(offset, offset + nbytes, _CRC_BLOCK):
        crc = zlib.crc32(view[start : min(offset + nbytes, start + _CRC_BLOCK)], crc)
    return f"crc32:{crc:08x}"


class Int4ShardWriter:
    """Writes the shards of one Layout into out_dir, in order, then its index."""

    def __init__(self, out_dir: Path, layout: Layout):
        self.out_dir = Path(out_dir)
        self.layout = layout
        self.state = WriterState.READY
        self._shard_index = 0  # position in layout.shards of the next shard to open
        self._fd: int | None = None
        self._pending: list[TensorRecord] = []  # records of the open shard still to write
        self._record: TensorRecord | None = None
        self._written: dict[str, int] = {}

    # -- shards ----------------------------------------------------------------------------------

    def open_shard(self, name: str) -> None:
        """Start writing the next shard of the plan."""
        self._expect(WriterState.READY)
        expected, size = self._next_shard()
        if name != expected:
            raise WriterStateError(f"shard {name} opened out of order; the next shard is {expected}")
        path = self._partial_path(name)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        number = self._shard_index + 1
        os.pwrite(self._fd, pack_header(number, len(self.layout.shards), self.layout.fingerprint), 0)
        os.ftruncate(self._fd, size)  # gaps between records read back as zeros
        self._pending = self.layout.shard_records(name)
        self.state = WriterState.SHARD_OPEN

    def begin_record(self, record: TensorRecord) -> None:
        """Start the next record of the open shard."""
        self._expect(WriterState.SHARD_OPEN)
        if not self._pending or self._pending[0] is not record:
            expected = self._pending[0].key if self._pending else "none"
            raise WriterStateError(f"record {record.key} written out of order; the next record is {expected}")
        self._record = record
        self._written = {part: 0 for part in record.parts}
        self.state = WriterState.IN_RECORD

    def write_part(self, part: str, start: int, data) -> None:
        """Write bytes of one part of the current record, `start` bytes into that part."""
        self._expect(WriterState.IN_RECORD)
        if part not in self._record.parts:
            raise WriterStateError(f"{self._record.key} has no part {part}")
        offset, nbytes = self._record.parts[part]
        view = memoryview(data).cast("B")
        if start < 0 or start + len(view) > nbytes:
            raise WriterStateError(f"{self._record.key}.{part}: bytes {start}..{start + len(view)} outside 0..{nbytes}")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + start + done)
        self._written[part] += len(view)

    def end_record(self) -> str:
        """Finish the current record (every part fully written); returns its checksum."""
        self._expect(WriterState.IN_RECORD)
        record = self._record
        short = [p for p, (_, n) in record.parts.items() if self._written[p] != n]
        if short:
            raise WriterStateError(f"{record.key} ended with parts {short} not fully written")
        # Read back what reached the file: the checksum covers the bytes a reader will see.
        crc = 0
        for start in range(record.offset, record.offset + record.nbytes, _CRC_BLOCK):
            size = min(_CRC_BLOCK, record.offset + record.nbytes - start)
            crc = zlib.crc32(os.pread(self._fd, size, start), crc)
        record.checksum = f"crc32:{crc:08x}"
        self._pending.pop(0)
        self._record = None
        self.state = WriterState.SHARD_OPEN
        return record.checksum

    def close_shard(self) -> Path:
        """Flush the open shard and give it its final name; returns its path."""
        self._expect(WriterState.SHARD_OPEN)
        if self._pending:
            raise WriterStateError(f"shard closed before record {self._pending[0].key} was written")
        name, _ = self._next_shard()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        final = self.out_dir / name
        os.replace(self._partial_path(name), final)
        fsync_dir(self.out_dir)
        self._shard_index += 1
        self.state = WriterState.READY
        pause = float(os.environ.get(PAUSE_ENV) or 0)
        if pause > 0:
            time.sleep(pause)
        return final

    def adopt_shard(self, name: str, checksums: dict[str, str]) -> None:
        """Take a finished shard from an earlier run as it is, with its records' checksums."""
        self._expect(WriterState.READY)
        expected, _ = self._next_shard()
        if name != expected:
            raise WriterStateError(f"shard {name} adopted out of order; the next shard is {expected}")
        for record in self.layout.shard_records(name):
            record.checksum = checksums[record.key]
        self._shard_index += 1

    # -- the end ---------------------------------------------------------------------------------

    def finish(self, index: dict) -> Path:
        """Write index.json atomically (all shards must be done) and drop the unfinished-run marker."""
        self._expect(WriterState.READY)
        if self._shard_index != len(self.layout.shards):
            raise WriterStateError(f"index written after {self._shard_index} of {len(self.layout.shards)} shards")
        atomic_write_text(self.out_dir / INDEX_NAME, json.dumps(index, indent=1) + "\n")
        (self.out_dir / PARTIAL_MARKER).unlink(missing_ok=True)
        fsync_dir(self.out_dir)
        self.state = WriterState.FINISHED
        return self.out_dir / INDEX_NAME

    def abort(self) -> None:
        """Stop after a failure: close and delete the unfinished shard; finished shards stay for a resume."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._shard_index < len(self.layout.shards):
                self._partial_path(self.layout.shards[self._shard_index][0]).unlink(missing_ok=True)
        self.state = WriterState.FAILED

    # -- helpers ---------------------------------------------------------------------------------

    def _expect(self, state: WriterState) -> None:
        if self.state is not state:
            raise WriterStateError(f"Int4ShardWriter is {self.state.value}, this call needs {state.value}")

    def _next_shard(self) -> tuple[str, int]:
        if self._shard_index >= len(self.layout.shards):
            raise WriterStateError("every shard of the plan is already written")
        return self.layout.shards[self._shard_index]

    def _partial_path(self, name: str) -> Path:
        return self.out_dir / f"{name}.partial"
