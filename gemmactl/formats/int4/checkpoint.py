"""Source checkpoints: a Hugging Face directory of config.json + safetensors, read a block of rows at a time."""

from __future__ import annotations

import math

import hashlib
import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import NotACheckpointError, UnsupportedCheckpointError
from gemmactl.formats.int4.spec import SAFETENSORS_DTYPES

# What a tokenizer needs to load from a directory, plus the generation defaults (stop tokens).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_SNAPSHOT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the checkpoint, as its safetensors header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name: bfloat16, float16 or float32
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory: its config, its tensors and a fingerprint of its files."""

    path: Path
    config: dict
    tensors: tuple[SourceTensor, ...]
    fingerprint: str  # sha256 of every safetensors header and file size: changes when the weights do

    @property
    def revision(self) -> str | None:
        """The commit a Hugging Face cache snapshot directory is named after, if it is one."""
        return self.path.name if _SNAPSHOT.match(self.path.name) and self.path.parent.name == "snapshots" else None


def read_safetensors_header(file: Path) -> tuple[dict, bytes]:
    """(parsed header, raw header bytes) of a safetensors file."""
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ValueError("header too large")
            raw = handle.read(length)
        return json.loads(raw), raw
    except (OSError, ValueError, struct.error) as exc:
        raise NotACheckpointError(f"{file} is not a readable safetensors file ({exc})") from exc


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise NotACheckpointError(f"{index} is not a valid safetensors index ({exc})") from exc
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def open_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint's config and tensor headers (no weights); refuse what cannot be quantized."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise NotACheckpointError(f"{path} is not a checkpoint directory")
    config_file = path / "config.json"
    files = safetensors_files(path)
    if not config_file.is_file() or not files:
        has_bin = any(path.glob("*.bin"))
        what = "no config.json" if not config_file.is_file() else "no .safetensors weights"
        raise NotACheckpointError(
            f"{path} is not a Hugging Face checkpoint ({what})"
            + ("; PyTorch .bin weights are not supported, only safetensors" if has_bin else "")
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NotACheckpointError(f"{config_file} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise NotACheckpointError(f"{config_file} has no model_type")
    digest = hashlib.sha256()
    tensors: list[SourceTensor] = []
    seen: set[str] = set()
    for file in files:
        if not file.is_file():
            raise NotACheckpointError(f"the checkpoint index lists {file.name}, which is missing")
        header, raw = read_safetensors_header(file)
        digest.update(file.name.encode() + b"\0" + str(file.stat().st_size).encode() + b"\0" + raw)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise UnsupportedCheckpointError(
                    f"tensor {name} in {file.name} has dtype {info.get('dtype')}; "
                    f"int4-stream quantizes {', '.join(SAFETENSORS_DTYPES)} checkpoints only"
                )
            if name in seen:
                raise NotACheckpointError(f"tensor {name} appears in more than one safetensors file")
            seen.add(name)
            tensors.append(SourceTensor(name, tuple(int(d) for d in info["shape"]), dtype, file))
    return Checkpoint(path.absolute(), config, tuple(tensors), digest.hexdigest())


class TensorSource:
    """Reads rows of checkpoint tensors through safetensors' safe_open, one handle per file.

    safe_open maps the file, and every page read stays in this process's resident set until the
    mapping goes; the handle is reopened after REOPEN_BYTES so memory stays bounded on any model.
    """

    REOPEN_BYTES = 128 << 20

    def __init__(self):
        self._handles: dict[Path, object] = {}
        self._read: dict[Path, int] = {}

    def rows(self, tensor: SourceTensor, start: int, stop: int, expert: int | None = None):
        """Rows start:stop of the tensor (of one expert of a stack) as a torch tensor."""
        from safetensors import safe_open

        handle = self._handles.get(tensor.file)
        if handle is None or self._read.get(tensor.file, 0) > self.REOPEN_BYTES:
            self._handles.pop(tensor.file, None)  # drop the old mapping first
            handle = self._handles[tensor.file] = safe_open(str(tensor.file), framework="pt")
            self._read[tensor.file] = 0
        view = handle.get_slice(tensor.name)
        if not tensor.shape:
            block = view[:]
        else:
            block = view[expert, start:stop] if expert is not None else view[start:stop]
        self._read[tensor.file] += block.numel() * block.element_size()
        return block

    def close(self) -> None:
        self._handles.clear()
        self._read.clear()


def copy_tokenizer(source: Path, target: Path) -> list[str]:
    """Copy the tokenizer and generation files a checkpoint has into target; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied
