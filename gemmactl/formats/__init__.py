"""On-disk model formats gemmactl reads and writes, and how to tell them apart cheaply."""

from __future__ import annotations

import json
from pathlib import Path

# format name (as the store records it) → package that implements it; imported on use.
FORMATS = {
    "int4-stream": "gemmactl.formats.int4",
}

GGUF_MAGIC = b"GGUF"
INT4_STREAM_FORMAT = "gemmactl-int4-stream"  # the `format` field of an int4-stream index.json


def is_int4_stream_dir(path: Path) -> bool:
    """True when path is a directory holding an int4-stream index.json (any version)."""
    index = Path(path) / "index.json"
    if not index.is_file():
        return False
    try:
        with open(index, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    # The writer puts "format" first, so the head is enough; fall back to a full parse.
    if INT4_STREAM_FORMAT.encode() in head:
        return True
    try:
        return json.loads(index.read_text(encoding="utf-8")).get("format") == INT4_STREAM_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def detect_format(path: Path) -> str | None:
    """"gguf", "int4-stream" or None, judged from magic bytes and index files only."""
    path = Path(path)
    if path.is_dir():
        return "int4-stream" if is_int4_stream_dir(path) else None
    try:
        with open(path, "rb") as handle:
            return "gguf" if handle.read(4) == GGUF_MAGIC else None
    except OSError:
        return None
