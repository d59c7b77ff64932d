"""Tests for gemmactl.prompt: markup cleaning, stop strings, chat templates."""

from __future__ import annotations

import itertools

import pytest

from gemmactl.prompt.markup import MarkupCleaner, split_thinking
from gemmactl.prompt.stops import StopMatcher
from gemmactl.prompt.template import render_chat_template
from gemmactl.errors import BackendError

MARKERS = ("<|channel>thought", "<channel|>", "<think>", "</think>")

# (model output, expected answer, expected thinking)
CASES = [
    ("<|channel>thought\nLet me think.<channel|>\nThe answer is 4.", "The answer is 4.", "Let me think."),
    ("<think>pondering</think>Yes.", "Yes.", "pondering"),
    ("Intro. <think>mid thought</think>\n\n Outro.", "Intro. Outro.", "mid thought"),
    (
        "<|channel>thought\nfirst<channel|>A<think>second</think> B",
        "AB",
        "firstsecond",
    ),
    ("Start <|channel>thought\nnever closed <channel", "Start ", "never closed <channel"),
    ("<think>open forever", "", "open forever"),
    ("before</think>after<channel|> end", "beforeafter end", ""),
    ("a < b <c> <|x> <th </thin <|channel>x", "a < b <c> <|x> <th </thin <|channel>x", ""),
    ("<|channel>thought\n\nkeeps second newline<channel|>ok", "ok", "\nkeeps second newline"),
    ("<|channel>thoughtno header<channel|>ok", "ok", "no header"),
    ("plain text only", "plain text only", ""),
]


def run_cleaner(pieces: list[str]) -> tuple[str, str]:
    """Feed pieces through a MarkupCleaner and join each channel."""
    cleaner = MarkupCleaner()
    out: dict[str, list[str]] = {"answer": [], "thinking": []}
    emitted = []
    for piece in pieces:
        emitted += cleaner.feed(piece)
    emitted += cleaner.flush()
    for channel, text in emitted:
        assert text, "empty piece emitted"
        out[channel].append(text)
    return "".join(out["answer"]), "".join(out["thinking"])


def check(pieces: list[str], answer: str, thinking: str) -> None:
    """Assert the cleaner's output for pieces, naming the split on failure."""
    got = run_cleaner(pieces)
    assert got == (answer, thinking), f"split {pieces!r}"
    for marker in MARKERS:
        if marker not in answer:
            assert marker not in got[0]
        if marker not in thinking:
            assert marker not in got[1]


@pytest.mark.parametrize(("text", "answer", "thinking"), CASES)
def test_cleaner_every_split_point(text: str, answer: str, thinking: str) -> None:
    for i in range(len(text) + 1):
        check([text[:i], text[i:]], answer, thinking)


@pytest.mark.parametrize(("text", "answer", "thinking"), CASES)
def test_cleaner_char_by_char(text: str, answer: str, thinking: str) -> None:
    check(list(text), answer, thinking)


@pytest.mark.parametrize(("text", "answer", "thinking"), CASES)
def test_split_thinking_whole_string(text: str, answer: str, thinking: str) -> None:
    assert split_thinking(text) == (answer, thinking)


def test_cleaner_every_pair_of_split_points() -> None:
    text = "x<|channel>thought\nhm<channel|>\ny"
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        check([text[:i], text[i:j], text[j:]], "xy", "hm")


def test_no_marker_text_leaks() -> None:
    answer, thinking = split_thinking("<think>a</think>b<|channel>thought\nc<channel|>d</think>")
    assert (answer, thinking) == ("bd", "ac")


def test_holdback_is_minimal() -> None:
    cleaner = MarkupCleaner()
    assert cleaner.feed("hello <") == [("answer", "hello ")]
    assert cleaner.feed("p") == [("answer", "<p")]
    assert MarkupCleaner().feed("hello") == [("answer", "hello")]


def test_pieces_merged_and_ordered() -> None:
    cleaner = MarkupCleaner()
    pieces = cleaner.feed("a<think>b</think>c d")
    assert pieces == [("answer", "a"), ("thinking", "b"), ("answer", "c d")]


def test_in_thought_tracks_state() -> None:
    cleaner = MarkupCleaner()
    assert not cleaner.in_thought
    cleaner.feed("<|channel>thou")
    assert not cleaner.in_thought
    assert cleaner.feed("ght\n") == []
    assert cleaner.in_thought
    assert cleaner.feed("x") == [("thinking", "x")]
    cleaner.feed("<channel|>")
    assert not cleaner.in_thought


def test_flush_releases_partial_marker() -> None:
    cleaner = MarkupCleaner()
    assert cleaner.feed("end <|chan") == [("answer", "end ")]
    assert cleaner.flush() == [("answer", "<|chan")]
    assert cleaner.flush() == []


# -- StopMatcher ----------------------------------------------------------------------------------


def run_stops(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Feed pieces through a StopMatcher; return emitted text and whether it stopped."""
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        assert stopped == matcher.stopped
    out.append(matcher.flush())
    return "".join(out), matcher.stopped


STOP_CASES = [
    (["<end>"], "hello <end> world", "hello ", True),
    (["<end>"], "hello <en world", "hello <en world", False),
    (["STOP", "<eos>"], "abc<eos>def STOP", "abc", True),
    (["STOP", "<eos>"], "a STOP b <eos>", "a ", True),
    (["\nQ", "\n\n"], "Answer.\n\nQ: next", "Answer.", True),
    (["\nQ", "\n\n"], "line\nQ: next\n\n", "line", True),
    (["\nQ", "\n\n"], "one\ntwo\n", "one\ntwo\n", False),
    (["abcd", "c"], "xxabcd", "xxab", True),
    ([], "anything <end> goes", "anything <end> goes", False),
]


@pytest.mark.parametrize(("stops", "text", "expected", "stopped"), STOP_CASES)
def test_stop_every_split_point(stops: list[str], text: str, expected: str, stopped: bool) -> None:
    for i in range(len(text) + 1):
        assert run_stops(stops, [text[:i], text[i:]]) == (expected, stopped), f"split at {i}"
    assert run_stops(stops, list(text)) == (expected, stopped)


def test_stop_spanning_pieces() -> None:
    matcher = StopMatcher(["<end_of_turn>"])
    assert matcher.feed("done<end") == ("done", False)
    assert matcher.feed("_of_") == ("", False)
    assert matcher.feed("turn>tail") == ("", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_holds_back_minimal_and_flushes() -> None:
    matcher = StopMatcher(["\nQ", "\n\n"])
    assert matcher.feed("text\n") == ("text", False)
    assert matcher.feed("x") == ("\nx", False)
    assert matcher.feed("tail\n") == ("tail", False)
    assert matcher.flush() == "\n"
    assert not matcher.stopped


def test_no_stops_passes_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("a\n\n<") == ("a\n\n<", False)
    assert matcher.flush() == ""


# -- render_chat_template -------------------------------------------------------------------------

GEMMA_LIKE = """{{ bos_token }}{% if enable_thinking %}
<|turn>system
<|think|><turn|>
{% endif %}
{% for message in messages %}
{% if message['role'] not in ['user', 'model', 'assistant'] %}
{{ raise_exception('unknown role: ' + message['role']) }}
{% endif %}
<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}
{{ message['content'] }}<turn|>
{% endfor %}
{% if add_generation_prompt %}
<|turn>model
{% endif %}
"""


def test_render_template_thinking_toggle() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    off = render_chat_template(GEMMA_LIKE, messages, bos_token="<bos>", eos_token="<eos>")
    on = render_chat_template(
        GEMMA_LIKE, messages, bos_token="<bos>", eos_token="<eos>", enable_thinking=True
    )
    assert off == "<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\n<|turn>model\n"
    assert on == "<bos><|turn>system\n<|think|><turn|>\n" + off[len("<bos>") :]
    assert "<|think|>" not in off


def test_render_template_without_generation_prompt() -> None:
    out = render_chat_template(
        GEMMA_LIKE,
        [{"role": "user", "content": "Hi"}],
        bos_token="<bos>",
        eos_token="<eos>",
        add_generation_prompt=False,
    )
    assert out == "<bos><|turn>user\nHi<turn|>\n"


def test_render_template_raise_exception() -> None:
    with pytest.raises(BackendError, match="unknown role: tool"):
        render_chat_template(
            GEMMA_LIKE, [{"role": "tool", "content": "x"}], bos_token="", eos_token=""
        )


def test_render_template_syntax_error() -> None:
    with pytest.raises(BackendError, match="chat template failed"):
        render_chat_template("{% for m in messages %}", [], bos_token="", eos_token="")


def test_render_template_is_sandboxed() -> None:
    with pytest.raises(BackendError, match="chat template failed"):
        render_chat_template(
            "{{ messages.__class__.__mro__ }}{{ messages.append(1) }}",
            [],
            bos_token="",
            eos_token="",
        )
