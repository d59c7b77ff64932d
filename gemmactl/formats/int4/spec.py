"""int4-stream constants, the per-tensor record, and the byte layout rules (docs/formats/int4-stream.md).

Nothing here touches torch: the planner, the writer and `inspect` share these rules, and a
reader in another language needs only what this file and the spec say.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

FORMAT_NAME = "gemmactl-int4-stream"
FORMAT_VERSION = 1  # readers refuse a larger major version; see "Versioning" in the spec
STORE_FORMAT = "int4-stream"  # how the store's manifest names the format

ALIGNMENT = 4096  # every tensor record starts on a 4096-byte boundary of its shard (mmap, O_DIRECT, DMA)
PART_ALIGNMENT = 64  # parts inside a record (qweight, scales, zeros) start on 64-byte boundaries
HEADER_SIZE = 4096  # each shard opens with a fixed header page
SHARD_MAGIC = b"GI4STRM\x00"
# magic, version, shard number (1-based), shard count, reserved, plan fingerprint (sha256)
_HEADER = struct.Struct("<8sIIII32s")

GROUP_SIZES = (32, 64, 128)
EMBEDDING_POLICIES = ("int4", "int8", "bf16")
SENSITIVE_POLICIES = ("int4", "int8")  # what v_proj and down_proj weights become
# A tied model's output head: the embedding table as stored ("tied"), or an int4 copy of its own
# (lm_head.weight, quantized from the same source weights; the table stays as --embeddings says).
HEAD_POLICIES = ("tied", "int4")
HEAD_NAME = "lm_head.weight"  # an output head of its own, tied models' with --head int4 among them
SCHEMES = ("int4", "int8", "raw")
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
INDEX_NAME = "index.json"
PARTIAL_MARKER = ".int4-stream-partial.json"  # present while a quantize run is unfinished


def shard_name(number: int, count: int) -> str:
    """File name of shard `number` (1-based) of `count`: shard-00001-of-00003.i4s."""
    return f"shard-{number:05d}-of-{count:05d}.i4s"


def align_up(value: int, alignment: int) -> int:
    """Round value up to a multiple of alignment."""
    return (value + alignment - 1) // alignment * alignment


def padded_cols(cols: int, group_size: int) -> int:
    """Columns after padding the last group of a row to a full group."""
    return align_up(cols, group_size)


def part_sizes(scheme: str, shape: tuple[int, ...], dtype: str, group_size: int | None) -> list[tuple[str, int]]:
    """The parts of a record in file order, with their byte sizes."""
    if scheme == "int4":
        rows, cols = shape
        groups = padded_cols(cols, group_size) // group_size
        # qweight [rows, padded/2] uint8, scales [rows, groups] fp16, zeros [rows, groups] fp16
        return [("qweight", rows * groups * group_size // 2), ("scales", rows * groups * 2), ("zeros", rows * groups * 2)]
    if scheme == "int8":
        rows, cols = shape
        return [("qweight", rows * cols), ("scales", rows * 2)]  # int8 [rows, cols], fp16 [rows]
    numel = 1
    for dim in shape:
        numel *= dim
    return [("data", numel * DTYPE_SIZES[dtype])]


def layout_parts(offset: int, sizes: list[tuple[str, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Place parts from `offset` on PART_ALIGNMENT boundaries: ({part: (offset, nbytes)}, record nbytes)."""
    parts: dict[str, tuple[int, int]] = {}
    cursor = offset
    for name, size in sizes:
        cursor = align_up(cursor, PART_ALIGNMENT)
        parts[name] = (cursor, size)
        cursor += size
    return parts, cursor - offset


@dataclass
class TensorRecord:
    """One stored tensor, or one expert of an MoE stack: where it lives and how to decode it."""

    name: str
    shape: tuple[int, ...]  # decoded shape; for an expert, that expert's [rows, cols]
    dtype: str  # dtype the decoded tensor takes by default
    scheme: str  # "int4", "int8" or "raw"
    group_size: int | None = None
    layer: int | None = None
    expert: int | None = None
    stack_shape: tuple[int, ...] | None = None  # [experts, rows, cols] of the stack an expert belongs to
    shard: str = ""
    offset: int = 0
    nbytes: int = 0
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)
    checksum: str | None = None

    @property
    def key(self) -> str:
        """Unique key: the tensor name, plus `#expert` for an expert slice."""
        return self.name if self.expert is None else f"{self.name}#{self.expert}"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "layer": self.layer,
            "expert": self.expert,
            "shard": self.shard,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "scheme": self.scheme,
            "group_size": self.group_size,
            "parts": {name: list(span) for name, span in self.parts.items()},
            "checksum": self.checksum,
        }
        if self.stack_shape is not None:
            data["stack_shape"] = list(self.stack_shape)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorRecord:
        """Build a record from its index form; raises ValueError/KeyError/TypeError when malformed."""
        record = cls(
            name=str(data["name"]),
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
            scheme=str(data["scheme"]),
            group_size=None if data.get("group_size") is None else int(data["group_size"]),
            layer=None if data.get("layer") is None else int(data["layer"]),
            expert=None if data.get("expert") is None else int(data["expert"]),
            stack_shape=tuple(int(d) for d in data["stack_shape"]) if data.get("stack_shape") else None,
            shard=str(data["shard"]),
            offset=int(data["offset"]),
            nbytes=int(data["nbytes"]),
            parts={str(k): (int(v[0]), int(v[1])) for k, v in data["parts"].items()},
            checksum=data.get("checksum"),
        )
        if record.scheme not in SCHEMES or record.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown scheme or dtype in {record.key}")
        if record.scheme == "int4" and record.group_size is None:
            raise ValueError(f"{record.key} has no group_size")
        expected = [name for name, _ in part_sizes(record.scheme, record.shape, record.dtype, record.group_size)]
        if list(record.parts) != expected:
            raise ValueError(f"{record.key} has parts {list(record.parts)}, expected {expected}")
        return record


def pack_header(number: int, count: int, fingerprint: bytes) -> bytes:
    """The HEADER_SIZE bytes a shard starts with."""
    head = _HEADER.pack(SHARD_MAGIC, FORMAT_VERSION, number, count, 0, fingerprint)
    return head + b"\x00" * (HEADER_SIZE - len(head))


def unpack_header(data: bytes) -> dict[str, Any] | None:
    """Read a shard header; None when the bytes are not one."""
    if len(data) < _HEADER.size:
        return None
    magic, version, number, count, _reserved, fingerprint = _HEADER.unpack_from(data)
    if magic != SHARD_MAGIC:
        return None
    return {"version": version, "number": number, "count": count, "fingerprint": fingerprint}
