"""`gemmactl chat`: a conversation at the terminal, turn by turn, through the tier router."""

from __future__ import annotations

import sys

import click

from gemmactl.cli import complete
from gemmactl.cli.output import StreamPrinter, warn
from gemmactl.cli.types import NON_NEGATIVE

MULTILINE = '"""'


@click.command("chat")
@click.option("--tier", "tier", metavar="NAME", shell_complete=complete.tiers, help="Answer every turn on this tier (default: route each turn).")
@click.option("--recipe", "recipe", metavar="FILE|NAME", shell_complete=complete.recipes, help="Recipe of tiers (default: built-in 'default', or $GEMMACTL_RECIPE).")
@click.option("--system", "system", metavar="TEXT", help="System text for the whole conversation.")
@click.option("--max-tokens", type=click.IntRange(min=1), metavar="N", help="Most tokens per answer (default: the tier's).")
@click.option("--temperature", type=NON_NEGATIVE, metavar="T", help="Sampling temperature; 0 is greedy (default: the tier's).")
@click.option("--seed", type=int, metavar="N", help="Seed for sampling, for repeatable answers.")
@click.option("--show-thinking", is_flag=True, help="Also print what the model thinks before answering.")
@click.option("--stats", is_flag=True, help="After each answer, print its tier and speed to stderr.")
def chat(tier, recipe, system, max_tokens, temperature, seed, show_thinking, stats):
    """Talk with a local model, turn by turn, keeping the conversation.

    Each message is routed like a `gemmactl run` prompt (a `quick:`/`deep:`/`think:` prefix, or
    the heuristic) unless /tier pins a tier, and the model sees the whole conversation so far.
    Commands: /tier NAME|auto, /system TEXT, /clear, /help, /exit (or Ctrl-D). A line of three
    double quotes starts and ends a message of several lines.

    \b
    Examples:
      gemmactl chat
      gemmactl chat --recipe gemma4-4gb --tier deep --system "Answer in one sentence."
    """
    from gemmactl.chat import COMMANDS, ChatSession, Turn, parse_command
    from gemmactl.errors import GemmactlError
    from gemmactl.recipes import resolve_recipe
    from gemmactl.runtime.base import GenerationStats
    from gemmactl.store import Store

    session = ChatSession(resolve_recipe(recipe), Store(), system=system, max_tokens=max_tokens,
                          temperature=temperature, seed=seed)
    session.set_tier(tier)
    interactive = sys.stdin.isatty()
    if interactive:
        _enable_line_editing()
        click.echo(f"gemmactl chat: recipe {session.recipe.name}, tiers {', '.join(session.recipe.tiers)}. "
                   "/help for commands, /exit or Ctrl-D to leave.", err=True)
    try:
        while True:
            text = _read_message(interactive)
            if text is None:
                break
            if not text.strip():
                continue
            try:
                command = parse_command(text)
                if command is not None:
                    name, argument = command
                    if name == "/exit":
                        break
                    if name == "/help":
                        click.echo("\n".join(COMMANDS.values()), err=True)
                    elif name == "/tier":
                        session.set_tier(argument or None)
                        click.echo(f"tier: {session.tier or 'auto (routed each turn)'}", err=True)
                    elif name == "/system":
                        session.system = argument or None
                        click.echo(f"system: {session.system or '(none)'}", err=True)
                    elif name == "/clear":
                        session.clear()
                        click.echo("conversation cleared", err=True)
                    continue
                turn = Turn("", "")
                printer = StreamPrinter(show_thinking)
                for event in session.ask(text, turn):
                    if isinstance(event, GenerationStats):
                        turn.stats = event
                    else:
                        if event.channel == "answer":
                            turn.answer += event.text
                        printer.write(event.channel, event.text)
                printer.finish()
                if turn.stats is not None and not turn.answer.strip():
                    warn(f"the answer is empty: {turn.stats.why_empty()}")
                if stats and turn.stats is not None:
                    s = turn.stats
                    click.echo(f"[{turn.tier}: {turn.reason}; {s.generated_tokens} tokens, "
                               f"ttft {s.ttft_s:.2f} s, wall {s.wall_tok_s:.1f} tok/s]", err=True)
            except GemmactlError as exc:  # a bad turn or command: say so and carry on
                warn(f"{exc.message}. {exc.hint or ''}".strip())
    finally:
        session.close()


def _read_message(interactive: bool) -> str | None:
    """One message: a line, or the lines between two lines of three double quotes; None at the end."""
    prompt = ">>> " if interactive else ""
    try:
        line = input(prompt) if interactive else sys.stdin.readline()
    except EOFError:
        return None
    except UnicodeDecodeError as exc:
        warn(f"that line is not UTF-8 text ({exc.reason}); it was skipped")
        return ""
    if not interactive and line == "":
        return None
    line = line.rstrip("\n")
    if line.strip() != MULTILINE:
        return line
    lines = []
    while True:
        try:
            more = input("... ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and more == "":
            break
        more = more.rstrip("\n")
        if more.strip() == MULTILINE:
            break
        lines.append(more)
    return "\n".join(lines)


def _enable_line_editing() -> None:
    """Arrow keys and history for input() where Python has readline."""
    try:
        import readline  # noqa: F401 - importing it is what turns line editing on
    except ImportError:
        pass
