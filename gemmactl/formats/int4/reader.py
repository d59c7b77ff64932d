"""Int4Artifact: a zero-copy mmap reader of int4-stream artifacts (one tensor, layer or expert at a time).

Shard files are mapped copy-on-write (private): tensors handed out are views of the mapping,
so nothing is read until it is touched and nothing a caller does reaches the file.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gemmactl.errors import ArtifactCorruptError, ArtifactVersionError, NotAnArtifactError
from gemmactl.formats.int4.spec import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_SIZE,
    INDEX_NAME,
    PARTIAL_MARKER,
    TensorRecord,
    padded_cols,
    unpack_header,
)
from gemmactl.formats.int4.writer import crc32_of

DEVICE_BLOCK_VALUES = 1 << 22  # values decoded at once on an accelerator (about 20 MB of temporaries)
_PART_DTYPES = {"int4": {"qweight": "uint8", "scales": "float16", "zeros": "float16"}, "int8": {"qweight": "int8", "scales": "float16"}}


@dataclass(frozen=True)
class Mismatch:
    """A record whose bytes do not match the index: which shard, which tensor, what is wrong."""

    shard: str
    tensor: str
    reason: str


@dataclass(frozen=True)
class PackedTensor:
    """A record's stored parts as tensors (still quantized), e.g. to dequantize on a device later."""

    record: TensorRecord
    parts: dict  # part name → tensor: qweight [R, Cp/2] uint8, scales/zeros [R, G] fp16; or data


def read_index(path: Path) -> dict:
    """Load and check an artifact's index.json: ours, and a version this reader understands."""
    path = Path(path).expanduser()
    index_file = path / INDEX_NAME
    if not path.is_dir():
        raise NotAnArtifactError(f"{path} is not an int4-stream artifact directory")
    if not index_file.is_file():
        if (path / PARTIAL_MARKER).exists():
            raise NotAnArtifactError(
                f"{path} is an unfinished int4-stream artifact (no index.json yet)",
                hint="Rerun the same `gemmactl quantize` command: it resumes from the finished shards.",
            )
        raise NotAnArtifactError(f"{path} has no index.json, so it is not an int4-stream artifact")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NotAnArtifactError(f"{index_file} is not valid JSON ({exc})") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        found = index.get("format") if isinstance(index, dict) else None
        raise NotAnArtifactError(f"{index_file} is a {found or 'foreign'} index, not {FORMAT_NAME}")
    version = index.get("version")
    if not isinstance(version, int) or version < 1:
        raise NotAnArtifactError(f"{index_file} has no valid format version")
    if version > FORMAT_VERSION:
        raise ArtifactVersionError(
            f"{path} is int4-stream version {version}, newer than this gemmactl reads ({FORMAT_VERSION})"
        )
    return index


class Int4Artifact:
    """One int4-stream artifact: its index, and its shards mapped on demand."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser().absolute()
        self.index = read_index(self.path)
        try:
            self.records = [TensorRecord.from_json(item) for item in self.index["tensors"]]
            self.shards = {item["file"]: int(item["nbytes"]) for item in self.index["shards"]}
            self.plan = bytes.fromhex(self.index["plan"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactCorruptError(f"{self.path / INDEX_NAME} is malformed ({exc})") from exc
        unknown = {r.shard for r in self.records} - set(self.shards)
        if unknown:
            raise ArtifactCorruptError(f"{self.path / INDEX_NAME} places tensors in unlisted shards {sorted(unknown)}")
        self._by_key = {record.key: record for record in self.records}
        self._by_name: dict[str, list[TensorRecord]] = {}
        for record in self.records:
            self._by_name.setdefault(record.name, []).append(record)
        self._maps: dict[str, mmap.mmap] = {}

    # -- what is inside --------------------------------------------------------------------------

    @property
    def config(self) -> dict:
        return self.index["config"]

    @property
    def scheme(self) -> dict:
        return self.index["scheme"]

    def tensor_names(self) -> list[str]:
        """Names of the original tensors, in file order (an expert stack once)."""
        return list(self._by_name)

    def records_of(self, name: str) -> list[TensorRecord]:
        """The records of one original tensor: one, or one per expert of an MoE stack."""
        members = self._by_name.get(name)
        if not members:
            raise KeyError(f"{self.path} has no tensor {name}")
        return list(members)

    def layers(self) -> list[int]:
        return sorted({r.layer for r in self.records if r.layer is not None})

    def record(self, name: str, expert: int | None = None) -> TensorRecord:
        key = name if expert is None else f"{name}#{expert}"
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {key}") from None

    def span(self, layer: int, expert: int | None = None) -> tuple[str, int, int]:
        """(shard, offset, nbytes) of one expert, or of a layer's dense tensors: one contiguous read."""
        members = [r for r in self.records if r.layer == layer and r.expert == expert]
        if not members:
            raise KeyError(f"{self.path} has no layer {layer}" + (f" expert {expert}" if expert is not None else ""))
        start = min(r.offset for r in members)
        return members[0].shard, start, max(r.offset + r.nbytes for r in members) - start

    # -- loading ---------------------------------------------------------------------------------

    def packed(self, record: TensorRecord, device="cpu") -> PackedTensor:
        """The record's parts, zero-copy views on the CPU (or copied to device), not decoded."""
        import torch

        mapped = self._mapped(record.shard)
        parts = {}
        for part, (offset, nbytes) in record.parts.items():
            dtype = getattr(torch, _PART_DTYPES.get(record.scheme, {}).get(part, record.dtype))
            view = torch.frombuffer(mapped, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
            parts[part] = view if str(device) == "cpu" else view.to(device, non_blocking=True)
        rows = record.shape[0] if record.shape else 1
        if record.scheme == "int4":
            parts["qweight"] = parts["qweight"].view(rows, padded_cols(record.shape[1], record.group_size) // 2)
            parts["scales"] = parts["scales"].view(rows, -1)
            parts["zeros"] = parts["zeros"].view(rows, -1)
        elif record.scheme == "int8":
            parts["qweight"] = parts["qweight"].view(record.shape)
        else:
            parts["data"] = parts["data"].view(record.shape)
        return PackedTensor(record, parts)

    def decode(self, record: TensorRecord, device="cpu", dtype=None):
        """The record as a dense tensor on device, dequantized there (dtype: default the record's).

        On an accelerator a block of rows at a time crosses and is decoded there, so a load's
        temporaries stay near DEVICE_BLOCK_VALUES values whatever the matrix: the engine's plan
        counts on that (a whole 262,144-row head decoded at once took 4× its own size).
        """
        import torch

        target = dtype or getattr(torch, record.dtype)
        if str(device) == "cpu" or len(record.shape) != 2:
            return _decode_parts(record, self.packed(record, device).parts, target)
        parts = self.packed(record, "cpu").parts
        rows, cols = record.shape
        out = torch.empty((rows, cols), dtype=target, device=device)
        step = max(1, min(rows, DEVICE_BLOCK_VALUES // max(cols, 1)))
        for start in range(0, rows, step):
            block = {name: part[start:start + step].to(device) for name, part in parts.items()}
            out[start:start + step] = _decode_parts(record, block, target)
        return out

    def load_tensor(self, name: str, device="cpu", dtype=None):
        """One original tensor, dense on device; an MoE stack comes back as [experts, rows, cols]."""
        import torch

        members = self.records_of(name)
        if members[0].expert is None:
            return self.decode(members[0], device, dtype)
        return torch.stack([self.decode(r, device, dtype) for r in sorted(members, key=lambda r: r.expert)])

    def load_expert(self, layer: int, expert: int, device="cpu", dtype=None) -> dict:
        """Every tensor of one expert of one layer: {stack name: [rows, cols]}."""
        members = [r for r in self.records if r.layer == layer and r.expert == expert]
        if not members:
            raise KeyError(f"{self.path} has no expert {expert} in layer {layer}")
        return {r.name: self.decode(r, device, dtype) for r in members}

    def load_layer(self, layer: int, device="cpu", dtype=None, experts: bool = True) -> dict:
        """Every tensor of one layer (expert stacks stacked, unless experts=False leaves them out)."""
        names = [name for name, members in self._by_name.items() if members[0].layer == layer]
        if not names:
            raise KeyError(f"{self.path} has no layer {layer}")
        return {
            name: self.load_tensor(name, device, dtype)
            for name in names
            if experts or self._by_name[name][0].expert is None
        }

    def state_dict(self, device="cpu", dtype=None) -> dict:
        """Every tensor, dense: what `load_state_dict(..., assign=True)` takes."""
        return {name: self.load_tensor(name, device, dtype) for name in self.tensor_names()}

    # -- checking --------------------------------------------------------------------------------

    def verify(self, progress: Callable[[int, int], None] | None = None) -> list[Mismatch]:
        """Recompute every record's checksum; returns what does not match (empty: all good)."""
        total = sum(r.nbytes for r in self.records)
        done = 0
        mismatches: list[Mismatch] = []
        for record in self.records:
            try:
                mapped = self._mapped(record.shard)
            except ArtifactCorruptError as exc:
                mismatches.append(Mismatch(record.shard, record.key, exc.message))
                continue
            actual = crc32_of(mapped, record.offset, record.nbytes)
            if actual != record.checksum:
                mismatches.append(Mismatch(record.shard, record.key, f"checksum {actual}, index says {record.checksum}"))
            done += record.nbytes
            if progress:
                progress(done, total)
        return mismatches

    def close(self) -> None:
        """Drop the mappings (tensors still referring to them keep them alive)."""
        self._maps.clear()

    def _mapped(self, shard: str) -> mmap.mmap:
        """The shard mapped copy-on-write, after checking its size and header against the index."""
        mapped = self._maps.get(shard)
        if mapped is not None:
            return mapped
        path = self.path / shard
        try:
            with open(path, "rb") as handle:
                size = handle.seek(0, 2)
                if size < self.shards[shard]:
                    raise ArtifactCorruptError(
                        f"shard {shard} of {self.path} is truncated: {size} bytes, the index says {self.shards[shard]}"
                    )
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError as exc:
            raise ArtifactCorruptError(f"shard {shard} of {self.path} is missing") from exc
        header = unpack_header(mapped[:HEADER_SIZE])
        if header is None:
            raise ArtifactCorruptError(f"shard {shard} of {self.path} does not start with the int4-stream header")
        if header["version"] > FORMAT_VERSION:
            raise ArtifactVersionError(f"shard {shard} of {self.path} is int4-stream version {header['version']}")
        if header["fingerprint"] != self.plan:
            raise ArtifactCorruptError(f"shard {shard} of {self.path} belongs to another quantization run")
        self._maps[shard] = mapped
        return mapped


def open_artifact(path: Path) -> Int4Artifact:
    """Open an int4-stream artifact directory (raises a clear error when it is not one)."""
    return Int4Artifact(path)


def _decode_parts(record: TensorRecord, parts: dict, target):
    """Dense values of a record's parts (all its rows, or a block of them) in dtype target."""
    from gemmactl.formats.int4.quant import dequantize_int4, dequantize_int8_rows

    if record.scheme == "int4":
        return dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], record.shape[1], target)
    if record.scheme == "int8":
        return dequantize_int8_rows(parts["qweight"], parts["scales"], target)
    return parts["data"] if parts["data"].dtype == target else parts["data"].to(target)
