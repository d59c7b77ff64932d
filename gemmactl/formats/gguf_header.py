"""The one GGUF header reader: metadata and tensor descriptions, never tensor data.

gemmactl's llama.cpp path runs without gguf-py, so this reads the header itself: magic,
version, key/value pairs, then one record per tensor (name, dims, ggml type, offset). The
planner, the server's prompt building and the Gemma 4 tokenizer builder all read GGUF files
through it. Large arrays (the tokenizer's 262,144 strings) are skipped unless asked for by key.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import NotAGGUFError

# ggml type id → (name, elements per block, bytes per block); see ggml.h / gguf-py constants.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}

# GGUF value type id → struct format of a scalar (8 = string, 9 = array are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_KEEP_ARRAY = 4096  # arrays longer than this are skipped (tokenizer vocabularies) unless asked for
GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """True when path is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    type_name: str
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict
    tensors: tuple[GGUFTensor, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_key(self, key: str, default=None):
        """A key of the architecture's namespace, e.g. arch_key("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def tensor_nbytes(type_id: int, shape: tuple[int, ...], name: str = "") -> int:
    if type_id not in GGML_TYPES:
        raise NotAGGUFError(f"tensor {name} has ggml type {type_id}, which this reader does not know")
    _, block, size = GGML_TYPES[type_id]
    return math.prod(shape) // block * size


class _Cursor:
    def __init__(self, data, keep_arrays: bool = False):
        self.data, self.pos = data, 0
        self.keep_arrays = keep_arrays  # keep the next value's array whatever its length

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value[0]

    def string(self) -> str:
        length = self.take("<Q")
        text = self.data[self.pos:self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def skip_string(self) -> None:
        length = self.take("<Q")  # read first: `pos += take()` would add to the old pos
        self.pos += length

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            item_kind, count = self.take("<I"), self.take("<Q")
            if count > _KEEP_ARRAY and not self.keep_arrays:
                if item_kind in _SCALARS:
                    self.pos += count * struct.calcsize(_SCALARS[item_kind])
                else:
                    for _ in range(count):
                        self._skip(item_kind)
                return None
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {kind}")

    def _skip(self, kind: int) -> None:
        if kind == 8:
            self.skip_string()
        else:
            self.value(kind)


def read_gguf_header(path: Path, *, arrays: tuple[str, ...] = (), tensors: bool = True) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (memory-mapped; no tensor data is touched).

    arrays: keys whose arrays are kept whatever their length (e.g. "tokenizer.ggml.tokens");
    tensors: False stops after the metadata.
    """
    import mmap

    path = Path(path)
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return _parse(path, mapped, set(arrays), tensors)
    except (OSError, ValueError) as exc:
        raise NotAGGUFError(f"{path} is not a readable GGUF file ({exc})") from exc


def _parse(path: Path, data, arrays: set[str], with_tensors: bool) -> GGUFHeader:
    cursor = _Cursor(data)
    try:
        if data[:4] != GGUF_MAGIC:
            raise NotAGGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
        cursor.pos = 4
        version = cursor.take("<I")
        if version < 2:
            raise NotAGGUFError(f"{path} is GGUF version {version}; version 2 or later is needed")
        n_tensors, n_kv = cursor.take("<Q"), cursor.take("<Q")
        metadata: dict = {}
        for _ in range(n_kv):
            key = cursor.string()
            cursor.keep_arrays = key in arrays
            metadata[key] = cursor.value(cursor.take("<I"))
        cursor.keep_arrays = False
        tensors = []
        data_end = 0  # where the last tensor's bytes end, from the start of the data section
        for _ in range(n_tensors if with_tensors else 0):
            name = cursor.string()
            dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
            type_id = cursor.take("<I")
            offset = cursor.take("<Q")  # into the data section
            name_of = GGML_TYPES.get(type_id, (str(type_id),))[0]
            tensors.append(GGUFTensor(name, dims, name_of, tensor_nbytes(type_id, dims, name)))
            data_end = max(data_end, offset + tensors[-1].nbytes)
    except struct.error as exc:
        raise NotAGGUFError(f"{path} ends inside its header (truncated GGUF)") from exc
    if with_tensors and tensors:
        alignment = int(metadata.get("general.alignment") or 32)
        needed = -(-cursor.pos // alignment) * alignment + data_end
        if needed > len(data):
            raise NotAGGUFError(f"{path} is truncated: its tensors need {needed:,} bytes, the file has {len(data):,}",
                                hint="The file is incomplete (an interrupted download or copy): fetch or make it again.")
    return GGUFHeader(path, metadata, tuple(tensors))
