"""Bench arithmetic on a fake clock, percentiles against numpy, parsing of bench inputs."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from gemmactl.bench import stats
from gemmactl.bench.prompts import builtin_sets, load_prompts, long_conversation
from gemmactl.bench.runner import parse_compare, parse_concurrency
from gemmactl.bench.stats import RequestTiming, request_metrics
from gemmactl.errors import InvalidOptionError
from gemmactl.runtime.base import GenerationRequest, GenerationStats, PreparedPrompt, stream_generate


class FakeClock:
    def __init__(self, start: float = 100.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def timing_from_gaps(prefill: float, gaps: list[float], prompt_tokens: int = 10, start: float = 5.0) -> RequestTiming:
    """A request whose first token came `prefill` s after the start and each next one `gaps[i]` s later."""
    first = start + prefill
    return RequestTiming(start, first, first + sum(gaps), prompt_tokens, len(gaps) + 1)


def test_metrics_on_a_known_request():
    m = request_metrics(timing_from_gaps(0.5, [0.1] * 10, prompt_tokens=100))
    assert m["ttft_s"] == pytest.approx(0.5)
    assert m["wall_s"] == pytest.approx(1.5)
    assert m["prefill_tok_s"] == pytest.approx(200)
    assert m["decode_tok_s"] == pytest.approx(10)  # 10 tokens after the first in 1.0 s
    assert m["wall_tok_s"] == pytest.approx(11 / 1.5)


def test_wall_time_is_ttft_plus_decode_time_exactly():
    rng = random.Random(7)
    for _ in range(500):
        gaps = [rng.uniform(0.001, 0.2) for _ in range(rng.randint(1, 200))]
        m = request_metrics(timing_from_gaps(rng.uniform(0.0001, 3.0), gaps))
        assert stats.wall_identity_error(m) < 1e-9
        assert m["wall_tok_s"] == pytest.approx(m["generated_tokens"] / (m["ttft_s"] + (m["generated_tokens"] - 1) / m["decode_tok_s"]))


def test_wall_never_exceeds_decode_when_the_first_token_costs_a_decode_step():
    """The exact condition: wall tok/s <= decode tok/s  ⇔  ttft_s >= 1 / decode tok/s."""
    rng = random.Random(11)
    for _ in range(2000):
        gaps = [rng.uniform(0.005, 0.1) for _ in range(rng.randint(1, 64))]
        m = request_metrics(timing_from_gaps(rng.uniform(0.0001, 0.3), gaps))
        step = 1 / m["decode_tok_s"]
        if abs(m["ttft_s"] - step) < 1e-6:
            continue  # on the boundary rounding decides
        assert (m["wall_tok_s"] <= m["decode_tok_s"]) == (m["ttft_s"] >= step)
        assert stats.wall_exceeds_decode(m) == (m["ttft_s"] < step)


def test_wall_can_exceed_decode_when_the_first_token_is_quicker_than_a_step():
    """Why the naive 'wall never exceeds decode' is not asserted: a 1-token prompt can beat a decode step."""
    m = request_metrics(timing_from_gaps(0.01, [0.05] * 4))
    assert m["wall_tok_s"] > m["decode_tok_s"]
    assert stats.wall_exceeds_decode(m)


def test_single_token_and_empty_requests_do_not_divide_by_zero():
    one = request_metrics(RequestTiming(1.0, 1.2, 1.2, 5, 1))
    assert one["decode_tok_s"] == 0.0 and one["wall_tok_s"] == pytest.approx(5.0)
    none = request_metrics(RequestTiming(1.0, None, None, 5, 0))
    assert none["wall_tok_s"] == 0.0 and none["ttft_s"] == 0.0


class FakeBackend:
    name = "fake"
    model_path = "fake.gguf"
    load_s = 0.25
    context_size = 4096

    def __init__(self, clock: FakeClock, prefill: float, gaps: list[float], prompt_tokens: int):
        self.clock, self.prefill, self.gaps, self.prompt_tokens = clock, prefill, gaps, prompt_tokens

    def prepare(self, request):
        return PreparedPrompt(tokens=[1] * self.prompt_tokens, mode="completion")

    def generate(self, prompt, request):
        self.clock.advance(self.prefill)
        yield "a"
        for gap in self.gaps:
            self.clock.advance(gap)
            yield "b"

    def engine_timings(self):
        return None

    def close(self):
        pass


def test_bench_arithmetic_equals_the_streaming_core_on_a_fake_clock(monkeypatch):
    """gemmactl's row comes from the core's stats, the others' from stats.py: both must agree exactly."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    gaps = [0.02, 0.03, 0.025, 0.04, 0.02]
    backend = FakeBackend(clock, prefill=0.3, gaps=gaps, prompt_tokens=40)
    start = clock.now
    events = list(stream_generate(backend, GenerationRequest(prompt="x", max_tokens=6, raw=True)))
    core = events[-1]
    assert isinstance(core, GenerationStats)
    ours = request_metrics(RequestTiming(start, start + 0.3, start + 0.3 + sum(gaps), 40, 6))
    for key in ("ttft_s", "wall_s", "prefill_tok_s", "decode_tok_s", "wall_tok_s", "generated_tokens", "prompt_tokens"):
        assert getattr(core, key) == pytest.approx(ours[key]), key


@pytest.mark.parametrize("q", [0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100])
def test_percentiles_match_numpy(q):
    rng = random.Random(q)
    for size in (1, 2, 3, 7, 64, 101):
        values = [rng.expovariate(3.0) for _ in range(size)]
        assert stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentiles_keys_and_errors():
    assert set(stats.percentiles([1.0, 2.0, 3.0])) == {"p50", "p90", "p99"}
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_ratios_pair_by_pair_and_summary():
    ratios = stats.pair_ratios([10.0, 12.0, 9.0], [10.0, 8.0, 12.0])
    assert ratios == pytest.approx([1.0, 1.5, 0.75])
    assert stats.summary(ratios) == {"min": 0.75, "median": 1.0, "max": 1.5, "n": 3}
    assert stats.pair_ratios([1.0], [0.0]) == []
    with pytest.raises(ValueError):
        stats.pair_ratios([1.0, 2.0], [1.0])


def test_acceptance_rate_is_pooled_over_tokens_not_averaged_over_runs():
    assert stats.acceptance_rate(8, 6) == 0.75
    assert stats.acceptance_rate(0, 0) is None  # nothing drafted: no rate, not 0 or 1
    rows = [{"draft_tokens": 10, "draft_accepted": 10}, {"draft_tokens": 30, "draft_accepted": 6}]
    # Pooled 16 / 40 = 0.4, not the mean of the per-run rates (1.0 and 0.2 → 0.6).
    assert stats.draft_totals(rows) == {"draft_tokens": 40, "draft_accepted": 16, "acceptance_rate": 0.4}
    assert stats.draft_totals([])["acceptance_rate"] is None


def test_aggregate_throughput_spans_first_start_to_last_token():
    timings = [RequestTiming(0.0, 0.1, 1.0, 5, 10), RequestTiming(0.5, 0.7, 2.0, 5, 30)]
    assert stats.aggregate_tok_s(timings) == pytest.approx(40 / 2.0)
    assert stats.aggregate_tok_s([]) == 0.0


@pytest.mark.parametrize("text, levels", [("1", [1]), ("16,1,64", [1, 16, 64]), (" 4 , 4", [4])])
def test_parse_concurrency(text, levels):
    assert parse_concurrency(text) == levels


@pytest.mark.parametrize("text", ["", "0", "1,-2", "a,b", "1;4", "1.5"])
def test_parse_concurrency_refuses_bad_lists(text):
    with pytest.raises(InvalidOptionError):
        parse_concurrency(text)


def test_parse_compare():
    assert parse_compare(["llama-server,llama-cpp-python", "llama-server"]) == ["llama-server", "llama-cpp-python"]
    with pytest.raises(InvalidOptionError, match="ollama"):
        parse_compare(["ollama"])


def test_builtin_prompt_sets():
    sets = builtin_sets()
    assert list(sets) == ["short", "long-prefix", "code", "prose"]
    assert [p.name for p in load_prompts("code,short")] == ["code-1", "code-2", "short-1", "short-2"]
    assert len(load_prompts("builtin")) == sum(len(v) for v in sets.values())


def test_long_conversation_is_deterministic_and_variants_differ_only_at_the_top():
    assert long_conversation(3) == long_conversation(3)
    a, b = long_conversation(1).splitlines(), long_conversation(2).splitlines()
    assert a[0] != b[0] and a[1:] == b[1:]
    assert len(long_conversation(0)) > 8000  # characters; the token count is checked on the real model


def test_prompts_files(tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text("first prompt\n\nsecond\\nline\n")
    assert [p.text for p in load_prompts(str(text))] == ["first prompt", "second\nline"]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text(json.dumps({"name": "a", "prompt": "x y"}) + "\n" + json.dumps("plain") + "\n")
    assert [(p.name, p.text) for p in load_prompts(str(jsonl))] == [("a", "x y"), ("mine-2", "plain")]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(InvalidOptionError, match="holds no prompts"):
        load_prompts(str(empty))
    with pytest.raises(InvalidOptionError, match="neither a built-in set nor a file"):
        load_prompts(str(tmp_path / "missing.txt"))
