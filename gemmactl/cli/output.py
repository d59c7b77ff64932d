"""One place for what the CLI writes: results, JSON, warnings and progress bars."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import click


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


def warn(message: str) -> None:
    click.echo(f"Warning: {message}", err=True)


def progress_enabled(json_mode: bool = False) -> bool:
    """Bars only for a person at a terminal; off with --json or GEMMACTL_NO_PROGRESS=1."""
    if json_mode or os.environ.get("GEMMACTL_NO_PROGRESS") or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
        return False
    return sys.stderr.isatty()


@contextmanager
def byte_progress(description: str, enabled: bool) -> Iterator:
    """A callback(done, total) that drives a tqdm bar on stderr (or does nothing)."""
    if not enabled:
        yield lambda done, total: None
        return
    from tqdm import tqdm

    bar = tqdm(desc=description, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [headers, *rows]]
    return "\n".join(lines)
