"""The streaming core: stops, markup, limits and stats, on a scripted backend and the real model."""

from __future__ import annotations

import pytest

from gemmactl.errors import EmptyPromptError, InvalidOptionError, PromptTooLongError
from gemmactl.runtime.base import (
    Chunk,
    EngineTimings,
    GenerationRequest,
    GenerationStats,
    Piece,
    PreparedPrompt,
    stream_generate,
)


class ScriptedBackend:
    """Replays fixed token texts, to check the core's bookkeeping exactly."""

    name = "scripted"
    model_path = "scripted"
    load_s = 0.5

    def __init__(self, pieces, *, stops=(), context_size=64, prompt_tokens=5):
        self.pieces = pieces
        self.stops = stops
        self.context_size = context_size
        self.prompt_tokens = prompt_tokens
        self.consumed = 0

    def prepare(self, request):
        return PreparedPrompt(tokens=list(range(self.prompt_tokens)), mode="completion", stops=self.stops)

    def generate(self, prompt, request):
        for piece in self.pieces:
            self.consumed += 1
            yield piece

    def engine_timings(self):
        return EngineTimings(prefill_s=0.1, prefill_tokens=5, decode_s=0.5, decode_tokens=10)

    def close(self):
        pass


def collect(backend, **request):
    events = list(stream_generate(backend, GenerationRequest(prompt="hi", **request)))
    stats = events[-1]
    assert isinstance(stats, GenerationStats)
    pieces = events[:-1]
    assert all(isinstance(p, Piece) for p in pieces)
    answer = "".join(p.text for p in pieces if p.channel == "answer")
    thinking = "".join(p.text for p in pieces if p.channel == "thinking")
    return answer, thinking, stats


def test_markup_split_across_tokens_is_removed():
    pieces = ["<|chan", "nel>thou", "ght\nlet me", " see<chan", "nel|>", "The answer", " is 4."]
    answer, thinking, stats = collect(ScriptedBackend(pieces), max_tokens=50)
    assert answer == "The answer is 4."
    assert thinking == "let me see"
    assert stats.generated_tokens == len(pieces)
    assert stats.stop_reason == "eos"


def test_stop_string_across_tokens_ends_generation():
    backend = ScriptedBackend([" Paris", ".", "\n", "Question", ":", " What", " else"], stops=("\nQuestion:",))
    answer, _, stats = collect(backend, max_tokens=50)
    assert answer == " Paris."
    assert stats.stop_reason == "stop"
    assert backend.consumed == 5  # nothing generated past the stop


def test_max_tokens_is_a_hard_limit():
    backend = ScriptedBackend(["a"] * 20)
    answer, _, stats = collect(backend, max_tokens=7)
    assert answer == "a" * 7
    assert stats.generated_tokens == 7 and stats.stop_reason == "length"
    assert backend.consumed == 7


def test_max_tokens_is_clipped_to_the_context():
    backend = ScriptedBackend(["a"] * 100, context_size=16, prompt_tokens=10)
    _, _, stats = collect(backend, max_tokens=50)
    assert stats.generated_tokens == 6


def test_stats_arithmetic():
    _, _, stats = collect(ScriptedBackend(["x"] * 10), max_tokens=50)
    assert stats.load_s == 0.5
    assert stats.prompt_tokens == 5
    assert stats.wall_s >= stats.ttft_s > 0
    assert stats.wall_tok_s == pytest.approx(10 / stats.wall_s)
    assert stats.engine_decode_tok_s == pytest.approx(20.0)
    assert stats.prompt_mode == "completion"


def test_a_chunk_counts_its_tokens_and_carries_the_engines_stop():
    # A whole answer stopped by the engine at a stop string: the text (markup cleaned) once, its
    # token count, reason "stop", and the engine's decode rate (no per-token timing exists).
    answer, thinking, stats = collect(ScriptedBackend([Chunk("<|channel>thought\nhm<channel|>Paris", 7, "stop")]),
                                      max_tokens=50)
    assert (answer, thinking) == ("Paris", "hm")
    assert stats.generated_tokens == 7 and stats.stop_reason == "stop"
    assert stats.decode_tok_s == pytest.approx(10 / 0.5) == stats.engine_decode_tok_s
    # Ended by its length or by end of generation, as for single tokens.
    assert collect(ScriptedBackend([Chunk("a b c", 5)]), max_tokens=5)[2].stop_reason == "length"
    _, _, stats = collect(ScriptedBackend([Chunk("a b", 2)]), max_tokens=5)
    assert stats.stop_reason == "eos" and stats.generated_tokens == 2


def test_prompt_longer_than_context():
    with pytest.raises(PromptTooLongError, match="prompt is 70 tokens but the context holds 64"):
        collect(ScriptedBackend(["x"], prompt_tokens=70))


@pytest.mark.parametrize(
    "request_args, error",
    [({"max_tokens": 0}, InvalidOptionError), ({"temperature": -0.5}, InvalidOptionError)],
)
def test_invalid_requests_are_refused(request_args, error):
    with pytest.raises(error):
        collect(ScriptedBackend(["x"]), **request_args)


def test_empty_prompt_is_refused():
    with pytest.raises(EmptyPromptError):
        list(stream_generate(ScriptedBackend(["x"]), GenerationRequest(prompt="   ")))
