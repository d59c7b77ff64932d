"""The `gemmactl` command: a root group that imports each subcommand only when it runs."""

from __future__ import annotations

import os
import sys
import traceback
from importlib import import_module

import click

from gemmactl import __version__
from gemmactl.cli.errors import describe_error, format_error_line

# name → (module, attribute, one-line help). The help lives here so `gemmactl --help`
# lists every command without importing any of them (or torch, or llama_cpp).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("gemmactl.cli.run", "run", "Answer a prompt with a local model, routed to a tier."),
    "chat": ("gemmactl.cli.chat", "chat", "Talk with a local model, turn by turn, keeping the conversation."),
    "build": ("gemmactl.cli.build", "build", "Build llama.cpp from source with the right kernels for this machine."),
    "doctor": ("gemmactl.cli.doctor", "doctor", "Check the machine, the llama.cpp build, and where layers really run."),
    "pull": ("gemmactl.cli.pull", "pull_cmd", "Download a model from the Hugging Face hub, verified and resumable."),
    "quantize": ("gemmactl.cli.quantize", "quantize", "Quantize a checkpoint into an artifact a gemmactl backend runs."),
    "show": ("gemmactl.cli.show", "show", "Show a model's shape, size, quantization, template and origin."),
    "inspect": ("gemmactl.cli.inspect_cmd", "inspect_cmd", "Show the size and layers of an int4-stream artifact, and verify it."),
    "list": ("gemmactl.cli.store_cmds", "list_cmd", "List the models and artifacts in the store."),
    "rm": ("gemmactl.cli.store_cmds", "rm_cmd", "Remove a model or artifact from the store."),
    "bench": ("gemmactl.cli.bench", "bench", "Measure decode-only and wall-clock speed, optionally side by side."),
    "plan": ("gemmactl.cli.plan", "plan", "Place a model's layers under a VRAM budget and predict its speed."),
    "serve": ("gemmactl.cli.serve", "serve", "Serve every tier of a recipe behind one OpenAI-compatible endpoint."),
    "worker": ("gemmactl.cli.worker", "worker", "Lend this machine to a head's model over llama.cpp RPC."),
    "ps": ("gemmactl.cli.ps", "ps", "List running gemmactl servers and workers."),
    "stop": ("gemmactl.cli.ps", "stop", "Stop a running gemmactl server (and its llama-server children)."),
    "logs": ("gemmactl.cli.ps", "logs", "Print a running gemmactl server's log."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, attr, _ = COMMANDS[name]
        return getattr(import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, short) for name, (_, _, short) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the CLI; every error ends as one line on stderr and an exit code."""
        args = list(sys.argv[1:] if args is None else args)
        debug = _debug_requested(args)
        try:
            result = super().main(args, prog_name or "gemmactl", complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as stop:
            code = stop.exit_code
        except BrokenPipeError:
            # Output piped into something that stopped reading (e.g. `| head`): not an error.
            _silence_stdout()
            code = 0
        except (Exception, KeyboardInterrupt, click.Abort) as exc:  # noqa: BLE001 - the one error exit
            if debug:
                traceback.print_exc()
            message, hint, code = describe_error(exc)
            click.echo(format_error_line(message, hint), err=True)
        else:
            code = result if isinstance(result, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _debug_requested(args: list[str]) -> bool:
    if os.environ.get("GEMMACTL_DEBUG", "") not in ("", "0"):
        return True
    # Only options before the subcommand or before "--" count.
    head = args[: args.index("--")] if "--" in args else args
    return "--debug" in head


def _silence_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gemmactl")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors (or set GEMMACTL_DEBUG=1).")
def cli(debug: bool) -> None:
    """Prepare and run Gemma models locally.

    Prompts go to a tier: `quick:`/`fast:` to the small fast model, `deep:` to the larger one,
    `reason:`/`think:` to a reason tier (else the larger one) with thinking on. With no recipe,
    the embedded Gemma 3 270M model serves every tier, offline.
    """


def main() -> None:
    # torch's CUDA allocator maps memory as it grows instead of in rounded segments it keeps: on an
    # H200 the engine's peak under a cap fell 28 MiB and its blocks lost their 2 MiB rounding
    # (docs/benchmarks.md). Read when CUDA first allocates; a caller's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cli.main()
