"""Planning an int4-stream artifact: which scheme each tensor gets, its order, shard and offset.

The whole layout is decided from the checkpoint's headers before any weight is read, so a run
that was killed can check that finished shards belong to the same plan and keep them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from gemmactl.errors import InvalidOptionError
from gemmactl.formats.int4.calibrate import Calibration
from gemmactl.formats.int4.checkpoint import Checkpoint, SourceTensor
from gemmactl.formats.int4.spec import (
    ALIGNMENT,
    EMBEDDING_POLICIES,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUP_SIZES,
    HEAD_NAME,
    HEAD_POLICIES,
    HEADER_SIZE,
    SENSITIVE_POLICIES,
    TensorRecord,
    align_up,
    layout_parts,
    part_sizes,
    shard_name,
)

# Token and per-layer embedding tables are gathered row by row, never multiplied.
EMBEDDING = re.compile(r"(?:^|\.)embed_tokens(?:_per_layer)?\.weight$")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXPERTS = ".experts."
# The tensors a 4-bit error hurts most, kept at int8 by `--sensitive int8`: the attention value
# projection and the MLP down projection (llama.cpp's Q4_K_M gives these two 6 bits in about half the layers).
SENSITIVE = re.compile(r"(?:^|\.)(?:v_proj|down_proj)\.weight$")
SMALL_NUMEL = 1024  # 2-D tensors (or experts) smaller than this are kept as they are
# The text model's token table: a tied model's head (not the per-layer table, not a tower's).
TOKEN_TABLE = re.compile(r"(?:^|\.)embed_tokens\.weight$")
MIN_SHARD_SIZE = 1 << 20


@dataclass(frozen=True)
class QuantizeOptions:
    """How to quantize: int4 group size, shard size, embeddings and sensitive-tensor policies, fit, calibration.

    search: fit each int4 group's (scale, zero) by a squared-error search (False: plain min/max).
    calibration: weigh that error by activation importance measured on this text (calibrate.py).
    """

    group_size: int = 32
    shard_size: int = 1 << 30
    embeddings: str = "int8"
    sensitive: str = "int8"
    search: bool = True
    calibration: Calibration | None = None
    head: str = "tied"

    def check(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise InvalidOptionError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")
        if self.embeddings not in EMBEDDING_POLICIES:
            raise InvalidOptionError(f"--embeddings must be one of {', '.join(EMBEDDING_POLICIES)}, got {self.embeddings}")
        if self.sensitive not in SENSITIVE_POLICIES:
            raise InvalidOptionError(f"--sensitive must be one of {', '.join(SENSITIVE_POLICIES)}, got {self.sensitive}")
        if self.head not in HEAD_POLICIES:
            raise InvalidOptionError(f"--head must be one of {', '.join(HEAD_POLICIES)}, got {self.head}")
        if self.head == "int4" and self.embeddings == "int4":
            raise InvalidOptionError("--head int4 adds nothing to --embeddings int4: the tied head is int4 already")
        if self.calibration is not None and not self.search:
            raise InvalidOptionError("calibration weighs the int4 search; it needs search=True")
        if self.shard_size < MIN_SHARD_SIZE:
            raise InvalidOptionError(f"--shard-size must be at least 1MiB, got {self.shard_size} bytes")

    def scheme(self) -> dict:
        """The scheme as index.json records it."""
        return {
            "name": f"int4.g{self.group_size}",
            "weights": "int4",
            "group_size": self.group_size,
            "embeddings": self.embeddings,
            "sensitive": self.sensitive,
            "fit": "mse-search" if self.search else "minmax",
            "calibration": self.calibration.describe() if self.calibration else None,
            "scale_dtype": "float16",
            "zero_dtype": "float16",
            "int8": "row-wise symmetric, float16 scale",
            "alignment": ALIGNMENT,
            "shard_size": self.shard_size,
        }


@dataclass
class Layout:
    """Every record placed in its shard, plus the shard files and the plan's fingerprint."""

    records: list[TensorRecord]
    shards: list[tuple[str, int]]  # (file name, size in bytes) in order
    fingerprint: bytes  # sha256 of the plan; written into each shard header
    scheme: dict
    sources: dict[str, str] = field(default_factory=dict)  # a record made from another tensor → that tensor

    def source_of(self, record: TensorRecord) -> str:
        """The checkpoint tensor a record is quantized from."""
        return self.sources.get(record.name, record.name)

    def shard_records(self, shard: str) -> list[TensorRecord]:
        return [record for record in self.records if record.shard == shard]


def tensor_layer(name: str) -> int | None:
    """The decoder layer a tensor belongs to (vision/audio towers count as global)."""
    if "vision" in name or "audio" in name:
        return None
    match = LAYER.search(name)
    return int(match.group(1)) if match else None


def _records_for(tensor: SourceTensor, options: QuantizeOptions) -> list[TensorRecord]:
    """The record(s) one source tensor becomes: one, or one per expert for an MoE stack."""
    layer = tensor_layer(tensor.name)
    shape = tensor.shape
    if len(shape) == 2 and EMBEDDING.search(tensor.name):
        policy = options.embeddings
        if policy == "int4":
            return [TensorRecord(tensor.name, shape, tensor.dtype, "int4", options.group_size, layer)]
        if policy == "int8":
            return [TensorRecord(tensor.name, shape, tensor.dtype, "int8", None, layer)]
        return [TensorRecord(tensor.name, shape, "bfloat16", "raw", None, layer)]
    if len(shape) == 3 and EXPERTS in tensor.name:
        per_expert = shape[1:]
        int4 = per_expert[0] * per_expert[1] >= SMALL_NUMEL
        return [
            TensorRecord(
                tensor.name,
                per_expert,
                tensor.dtype,
                "int4" if int4 else "raw",
                options.group_size if int4 else None,
                layer,
                expert,
                stack_shape=shape,
            )
            for expert in range(shape[0])
        ]
    if len(shape) == 2 and tensor.numel >= SMALL_NUMEL and "router" not in tensor.name:
        if options.sensitive == "int8" and SENSITIVE.search(tensor.name):
            return [TensorRecord(tensor.name, shape, tensor.dtype, "int8", None, layer)]
        return [TensorRecord(tensor.name, shape, tensor.dtype, "int4", options.group_size, layer)]
    return [TensorRecord(tensor.name, shape, tensor.dtype, "raw", None, layer)]


def _units(records: list[TensorRecord]) -> list[list[TensorRecord]]:
    """Records in file order, grouped into units that never straddle shards.

    Global tensors first (embeddings leading), one unit each; then per layer, its dense tensors
    as one unit followed by one unit per expert holding that expert's slice of every stack.
    """
    globals_ = sorted((r for r in records if r.layer is None), key=lambda r: (not EMBEDDING.search(r.name), r.name))
    units = [[record] for record in globals_]
    for layer in sorted({r.layer for r in records if r.layer is not None}):
        dense = sorted((r for r in records if r.layer == layer and r.expert is None), key=lambda r: r.name)
        if dense:
            units.append(dense)
        experts = [r for r in records if r.layer == layer and r.expert is not None]
        for expert in sorted({r.expert for r in experts}):
            units.append(sorted((r for r in experts if r.expert == expert), key=lambda r: r.name))
    return units


def plan_layout(checkpoint: Checkpoint, options: QuantizeOptions) -> Layout:
    """Decide scheme, order, shard and offsets of every record; reads no weights."""
    options.check()
    records = [record for tensor in checkpoint.tensors for record in _records_for(tensor, options)]
    sources = {}
    table = _tied_table(checkpoint) if options.head == "int4" else None
    if table is not None:
        records.append(TensorRecord(HEAD_NAME, table.shape, table.dtype, "int4", options.group_size, None))
        sources[HEAD_NAME] = table.name
    shards: list[list[TensorRecord]] = [[]]
    cursor = HEADER_SIZE
    for unit in _units(records):
        sizes = [sum(size for _, size in part_sizes(r.scheme, r.shape, r.dtype, r.group_size)) for r in unit]
        unit_bytes = sum(align_up(size, ALIGNMENT) + ALIGNMENT for size in sizes)  # upper bound
        if shards[-1] and cursor + unit_bytes > options.shard_size:
            shards.append([])
            cursor = HEADER_SIZE
        for record in unit:
            record.offset = align_up(cursor, ALIGNMENT)
            record.parts, record.nbytes = layout_parts(
                record.offset, part_sizes(record.scheme, record.shape, record.dtype, record.group_size)
            )
            cursor = record.offset + record.nbytes
            shards[-1].append(record)
    files = []
    for number, members in enumerate(shards, start=1):
        name = shard_name(number, len(shards))
        for record in members:
            record.shard = name
        files.append((name, max(HEADER_SIZE, max(r.offset + r.nbytes for r in members))))
    ordered = [record for members in shards for record in members]
    scheme = options.scheme() | ({"head": "int4"} if sources else {})  # absent: the head is the table, as before the option
    plan = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "source": checkpoint.fingerprint,
        "scheme": scheme,
        "records": [{**r.to_json(), "checksum": None} for r in ordered],
    }
    fingerprint = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).digest()
    return Layout(ordered, files, fingerprint, scheme, sources)


def _tied_table(checkpoint: Checkpoint) -> SourceTensor | None:
    """The token table a tied model's head reads, or None where the model has a head of its own or
    says it is not tied (`--head int4` then adds nothing: that head is an int4 matrix already)."""
    if any(tensor.name.endswith(HEAD_NAME) for tensor in checkpoint.tensors):
        return None
    config = checkpoint.config
    text = config.get("text_config") or {}
    if not text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)):
        return None
    tables = [t for t in checkpoint.tensors if TOKEN_TABLE.search(t.name) and tensor_layer(t.name) is None
              and "vision" not in t.name and "audio" not in t.name and len(t.shape) == 2]
    if len(tables) != 1:
        found = ", ".join(t.name for t in tables) or "none"
        raise InvalidOptionError(f"--head int4 needs the one token table a tied head reads; found {found}",
                                 hint="Quantize without --head.")
    return tables[0]
