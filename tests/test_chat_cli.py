"""`gemmactl chat` at a real pseudo-terminal, and the conversation it keeps (the embedded model)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from gemmactl.errors import InvalidOptionError, UnknownTierError

pytestmark = pytest.mark.real_model


class Terminal:
    """A child process on a pseudo-terminal: type lines, read until a marker."""

    def __init__(self, args: list[str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "gemmactl", *args], stdin=slave, stdout=slave,
                                     stderr=slave, close_fds=True, env=dict(os.environ, TERM="dumb"))
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {marker!r} within {timeout} s; the terminal shows:\n{self.seen[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    break
        head, _, self.seen = self.seen.partition(marker)
        return head

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


def test_a_conversation_at_the_terminal(model_home):
    term = Terminal(["chat", "--temperature", "0", "--max-tokens", "12", "--stats"])
    try:
        term.read_until("/help for commands")
        term.read_until(">>> ")
        term.type("What is the capital of France?\n")
        answer = term.read_until(">>> ")
        assert "Paris" in answer and "[fast:" in answer
        term.type("/tier deep\n")
        assert "tier: deep" in term.read_until(">>> ")
        term.type('"""\nWhat is the capital\nof Italy?\n"""\n')  # one message over several lines
        answer = term.read_until(">>> ")
        assert "[deep: --tier deep" in answer and "Rome" in answer
        term.type("/nonsense\n")
        assert "unknown command /nonsense" in term.read_until(">>> ")
        term.type("/exit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_the_session_keeps_the_conversation_and_its_settings(model_home):
    from gemmactl.chat import ChatSession, Turn, parse_command
    from gemmactl.recipes import resolve_recipe
    from gemmactl.runtime.base import GenerationStats
    from gemmactl.store import Store

    session = ChatSession(resolve_recipe("default"), Store(model_home), temperature=0.0, max_tokens=8)
    try:
        turn = Turn("", "")
        events = list(session.ask("What is the capital of France?", turn))
        assert isinstance(events[-1], GenerationStats) and turn.tier == "fast"
        assert [m["role"] for m in session.history] == ["user", "assistant"]
        assert "Paris" in session.history[1]["content"]
        list(session.ask("deep: And of Italy?"))
        assert session.history[2] == {"role": "user", "content": "And of Italy?"}  # the prefix routed, then went
        session.clear()
        assert session.history == []
        with pytest.raises(UnknownTierError):
            session.set_tier("huge")
    finally:
        session.close()
    assert parse_command("hello") is None and parse_command("/bye") == ("/exit", "")
    assert parse_command("/system Be brief.") == ("/system", "Be brief.")
    with pytest.raises(InvalidOptionError):
        parse_command("/frobnicate")


def test_run_takes_a_system_text(model_home):
    import json

    def prompt_tokens(*extra):
        proc = subprocess.run([sys.executable, "-m", "gemmactl", "run", "--json", "--temperature", "0", "--max-tokens", "2",
                               *extra, "What is 2+2?"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["stats"]["prompt_tokens"]

    # The base model's question frame gets the system text as a line above the question.
    assert prompt_tokens("--system", "Answer with one number only.") > prompt_tokens()


def test_a_system_text_goes_above_the_question_or_into_the_template():
    from gemmactl.prompt.build import ModelText, build_prompt, user_messages

    base = build_prompt(user_messages("What is 2+2?", "Be brief."), ModelText(None, "<bos>", "<eos>"))
    assert base.text == "Be brief.\nQuestion: What is 2+2?\nAnswer:"
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    templated = build_prompt(user_messages("hi", "Be brief."), ModelText(template, "<bos>", "<eos>"))
    assert templated.text == "<system>Be brief.<user>hi<assistant>"
