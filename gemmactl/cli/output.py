"""One place for what the CLI writes: results, JSON, warnings and progress bars."""

from __future__ import annotations

import json
import os
import sys
import time
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
def byte_progress(description: str, enabled: bool, lazy: bool = False) -> Iterator:
    """A callback(done, total) that drives a tqdm bar on stderr (or does nothing). lazy: the bar
    appears at the first call, for work that usually does not happen (a first load's layouts)."""
    if not enabled:
        yield lambda done, total: None
        return
    from tqdm import tqdm

    bars: list = []

    def bar():
        if not bars:
            bars.append(tqdm(desc=description, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                             file=sys.stderr))
        return bars[0]

    if not lazy:
        bar()

    def update(done: int, total: int) -> None:
        shown = bar()
        shown.total = total
        shown.n = done
        shown.refresh()

    try:
        yield update
    finally:
        if bars:
            bars[0].close()


@contextmanager
def work_progress(description: str, enabled: bool) -> Iterator:
    """A callback(done, total) that drives a percentage bar with an ETA (or does nothing).

    Work done before the first call (a resumed run's finished part) counts as done but not toward
    the rate, so the time left is estimated from work this run did.
    """
    if not enabled:
        yield lambda done, total: None
        return
    from tqdm import tqdm

    bars: list = []

    def update(done: float, total: float) -> None:
        if not bars:
            bars.append(tqdm(desc=description, total=total, initial=done, leave=False, file=sys.stderr,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]"))
        else:
            bars[0].update(done - bars[0].n)

    try:
        yield update
    finally:
        for bar in bars:
            bar.close()


@contextmanager
def step_progress(enabled: bool, quiet: bool = False) -> Iterator:
    """A callback(step, done, total) for work in named steps: a bar per step (a counter with the
    elapsed time when its total is unknown); without a terminal, one line as each step starts."""
    bars: dict = {}
    started = time.monotonic()

    def update(step: str, done: float, total: float | None) -> None:
        if quiet:
            return
        if not enabled:
            if step not in bars:
                bars[step] = None
                elapsed = int(time.monotonic() - started)
                click.echo(f"[{step} {elapsed // 60:02d}:{elapsed % 60:02d}]", err=True)
            return
        from tqdm import tqdm

        if step not in bars:
            for bar in bars.values():
                bar.close()
            bars.clear()
            fmt = "{desc}: {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}]" if total else "{desc} [{elapsed}]"
            bars[step] = tqdm(desc=step, total=total, leave=False, file=sys.stderr, bar_format=fmt)
        bar = bars[step]
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        for bar in bars.values():
            if bar is not None:
                bar.close()


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [headers, *rows]]
    return "\n".join(lines)


class StreamPrinter:
    """Writes answer pieces to stdout as they come; thinking only when asked, marked off."""

    def __init__(self, show_thinking: bool):
        self.show_thinking = show_thinking
        self.in_thinking = False
        self.answer_started = False
        self.wrote = ""

    def write(self, channel: str, text: str) -> None:
        if channel == "thinking":
            if not self.show_thinking:
                return
            if not self.in_thinking:
                self._out("Thinking...\n")
                self.in_thinking = True
        else:
            if self.in_thinking:
                self._out("\n...done thinking.\n\n")
                self.in_thinking = False
            if not self.answer_started:
                # Completions start with the space that followed the prompt: not part of the answer.
                text = text.lstrip()
                self.answer_started = bool(text)
        self._out(text)

    def finish(self) -> None:
        if self.in_thinking:
            self._out("\n...done thinking.\n")
        if self.wrote and not self.wrote.endswith("\n"):
            self._out("\n")

    def _out(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.wrote = text
