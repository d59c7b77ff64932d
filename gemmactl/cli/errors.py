"""The one table that turns exceptions into a one-line message, the next step and an exit code."""

from __future__ import annotations

import errno
from typing import Callable

import click

from gemmactl.errors import GemmactlError

DEBUG_HINT = "Rerun with --debug for the traceback."


def _usage(exc: click.UsageError) -> tuple[str, str | None, int]:
    ctx = exc.ctx
    command = ctx.command_path if ctx is not None else "gemmactl"
    return exc.format_message(), f"Run `{command} --help` for usage.", 2


def _os_error(exc: OSError) -> tuple[str, str | None, int]:
    where = str(exc.filename) if exc.filename else None
    # Advice about the store only for files in the store; otherwise about the file that failed.
    elsewhere = "write it somewhere else" if where and not _in_store(where) else "set GEMMACTL_HOME to a bigger disk"
    if exc.errno == errno.ENOSPC:
        return (f"no space left on device for {where}" if where else "no space left on device",
                f"Free some disk space there, or {elsewhere}.", 1)
    if isinstance(exc, PermissionError):
        fix = "set GEMMACTL_HOME to a writable folder" if not where or _in_store(where) else "pick a writable place"
        return f"permission denied: {where or 'a file'}", f"Check its permissions, or {fix}.", 1
    if exc.errno == errno.ENOENT and where:
        return f"no such file or folder: {where}", "Check the path (its folder must exist).", 2
    return f"{exc.strerror or exc}" + (f": {where}" if where else ""), DEBUG_HINT, 1


def _in_store(path: str) -> bool:
    from pathlib import Path

    from gemmactl.store.manifest import home_dir

    try:
        return Path(path).absolute().is_relative_to(home_dir().absolute())
    except (OSError, ValueError):
        return False


# Order matters: the first matching type wins.
ERROR_TABLE: list[tuple[type[BaseException], Callable[[BaseException], tuple[str, str | None, int]]]] = [
    (GemmactlError, lambda exc: (exc.message, exc.hint, exc.exit_code)),
    (click.UsageError, _usage),
    (click.Abort, lambda exc: ("aborted", None, 1)),
    (KeyboardInterrupt, lambda exc: ("interrupted", None, 130)),
    (MemoryError, lambda exc: ("out of memory", "Use a smaller model or a smaller `context` in the recipe.", 1)),
    (OSError, _os_error),
]


def describe_error(exc: BaseException) -> tuple[str, str | None, int]:
    """(message, next step, exit code) for any exception."""
    for kind, describe in ERROR_TABLE:
        if isinstance(exc, kind):
            return describe(exc)
    return f"unexpected {type(exc).__name__}: {exc}", DEBUG_HINT + " Please report it.", 1


def format_error_line(message: str, hint: str | None) -> str:
    """One line: `Error: <what happened>. <what to do next>`."""
    message = " ".join(message.split()).rstrip(".")
    line = f"Error: {message}."
    return f"{line} {hint}" if hint else line
