"""The CLI shell: lazy commands, help, the error table, exit codes."""

from __future__ import annotations

import errno
import subprocess
import sys

import click
import pytest

from conftest import invoke, run_gemmactl
from gemmactl.cli import COMMANDS, cli
from gemmactl.cli.errors import describe_error, format_error_line
from gemmactl.errors import ModelNotFoundError, UnknownTierError


def test_help_lists_every_registered_command(runner):
    result = invoke(runner, ["--help"])
    assert result.exit_code == 0
    for name, (_, _, short) in COMMANDS.items():
        assert name in result.output
        assert short in result.output


def test_registered_commands_import_and_match_their_help():
    """The short help in the table is the first line of the command's own docstring."""
    for name in COMMANDS:
        command = cli.get_command(None, name)
        assert command is not None, name
        assert command.name == name
        assert command.help.splitlines()[0].rstrip(".") in COMMANDS[name][2]


def test_help_imports_no_heavy_module():
    code = (
        "import sys\n"
        "from gemmactl.cli import cli\n"
        "try:\n"
        "    cli.main(['--help'], standalone_mode=False)\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('llama_cpp', 'torch', 'transformers', 'yaml', 'jinja2', 'tqdm') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out


def test_version(runner):
    result = invoke(runner, ["--version"])
    assert result.exit_code == 0
    assert "gemmactl" in result.output


def test_unknown_command_is_one_line_exit_2(isolated_home):
    proc = run_gemmactl(["frobnicate"])
    assert proc.returncode == 2 and proc.stdout == "" and not isolated_home.exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "No such command 'frobnicate'" in lines[0]
    assert "gemmactl --help" in lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_option_value_is_one_line_exit_2(runner, isolated_home):
    result = invoke(runner, ["run", "--max-tokens", "0", "hello"])
    assert result.exit_code == 2 and result.stdout == "" and not isolated_home.exists()
    assert result.stderr.count("\n") == 1
    assert "--max-tokens" in result.stderr
    assert "gemmactl run --help" in result.stderr


def test_error_table_maps_library_errors():
    assert describe_error(UnknownTierError("unknown tier 'x'", hint="Pick one."))[2] == 2
    message, hint, code = describe_error(ModelNotFoundError("no such model file: x"))
    assert code == 2 and "gemmactl list" in hint


def test_error_table_maps_os_errors():
    message, hint, code = describe_error(OSError(errno.ENOSPC, "No space left on device"))
    assert (message, code) == ("no space left on device", 1)
    assert "GEMMACTL_HOME" in hint
    message, hint, code = describe_error(PermissionError(errno.EACCES, "denied", "/x/manifest.json"))
    assert "/x/manifest.json" in message and code == 1


def test_unexpected_errors_point_at_debug():
    message, hint, code = describe_error(ZeroDivisionError("division by zero"))
    assert code == 1 and "ZeroDivisionError" in message and "--debug" in hint


def test_usage_error_names_the_command_help():
    @click.command("demo")
    def demo():
        pass

    ctx = click.Context(demo, info_name="demo")
    message, hint, code = describe_error(click.UsageError("bad", ctx=ctx))
    assert code == 2 and "demo --help" in hint


@pytest.mark.parametrize(
    "message, hint, expected",
    [
        ("unknown tier 'x'", "Pick one.", "Error: unknown tier 'x'. Pick one."),
        ("already ends.", None, "Error: already ends."),
        ("spans\ntwo lines", None, "Error: spans two lines."),
    ],
)
def test_format_error_line(message, hint, expected):
    assert format_error_line(message, hint) == expected


def test_debug_shows_traceback_and_plain_run_does_not(tmp_path):
    missing = tmp_path / "nope.gguf"
    plain = run_gemmactl(["run", "--model", str(missing), "hello"])
    assert plain.returncode == 2
    assert "Traceback" not in plain.stderr
    debug = run_gemmactl(["--debug", "run", "--model", str(missing), "hello"])
    assert debug.returncode == 2
    assert "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("Error: no such model file")


def _doc_sections() -> dict[str, str]:
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    sections = {}
    for chunk in text.split("\n## gemmactl ")[1:]:
        name, _, body = chunk.partition("\n")
        sections[name.strip()] = body
    return sections


def test_cli_reference_documents_every_command_and_option_and_nothing_else():
    import re

    sections = _doc_sections()
    assert set(sections) == set(COMMANDS)
    for name, body in sections.items():
        command = cli.get_command(None, name)
        options = {opt for param in command.params for opt in param.opts if opt.startswith("--")}
        documented = set(re.findall(r"`(--[a-z0-9-]+)", body))
        table_rows = {opt for opt in documented if f"| `{opt}" in body or f", `{opt}`" in body}
        assert options <= documented, f"{name}: undocumented {options - documented}"
        assert table_rows <= options, f"{name}: documented but missing {table_rows - options}"


def test_stream_printer_hides_or_marks_thinking(capsys):
    from gemmactl.cli.output import StreamPrinter as _StreamPrinter

    events = [("thinking", "let me see"), ("answer", "  The answer"), ("answer", " is 4.")]
    hidden = _StreamPrinter(show_thinking=False)
    for channel, text in events:
        hidden.write(channel, text)
    hidden.finish()
    assert capsys.readouterr().out == "The answer is 4.\n"

    shown = _StreamPrinter(show_thinking=True)
    for channel, text in events:
        shown.write(channel, text)
    shown.finish()
    assert capsys.readouterr().out == "Thinking...\nlet me see\n...done thinking.\n\nThe answer is 4.\n"


def test_every_package_directory_is_listed_in_setup_cfg():
    """A package missing from setup.cfg works in a checkout but is absent from a real install."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    listed = (root / "setup.cfg").read_text()
    for init in (root / "gemmactl").rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(root).parts)
        assert f"    {package}\n" in listed, f"{package} is not in setup.cfg's packages"


def test_shell_completion_offers_tiers_recipes_and_store_names(isolated_home):
    from gemmactl.store import Artifact, Store

    Store(isolated_home).add(Artifact(name="my-model", path=str(isolated_home / "x.gguf"), format="gguf",
                                      source="test", revision=None, size=1))

    def complete(words: str) -> list[str]:
        env = {"_GEMMACTL_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split(" ")) - 1)}
        proc = run_gemmactl([], env=env)
        return [line.split(",", 1)[1] for line in proc.stdout.splitlines() if line.startswith("plain,")]

    assert complete("gemmactl run --tier ") == ["deep", "fast"]
    assert "gemma4-4gb" in complete("gemmactl serve --recipe ")
    assert complete("gemmactl show my") == ["my-model"]
    assert complete("gemmactl rm ") == ["my-model"]
    assert {"show", "serve", "stop"} <= set(complete("gemmactl s"))
