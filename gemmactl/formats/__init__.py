"""On-disk model formats gemmactl reads and writes, and how to tell them apart cheaply.

Formats produce and read files; they never touch the store (the command that made a file
registers it).
"""

from __future__ import annotations

import json
from pathlib import Path

from gemmactl.formats.gguf_header import is_gguf

INT4_STREAM_FORMAT = "gemmactl-int4-stream"  # the `format` field of an int4-stream index.json
# The names detect_format gives, as the store records them.
GGUF, INT4_STREAM, CHECKPOINT = "gguf", "int4-stream", "hf"


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
    """"gguf", "int4-stream", "hf" (a folder with a config.json) or None, from magic bytes and file names only."""
    path = Path(path)
    if path.is_dir():
        if is_int4_stream_dir(path):
            return INT4_STREAM
        return CHECKPOINT if (path / "config.json").is_file() else None
    return GGUF if is_gguf(path) else None
