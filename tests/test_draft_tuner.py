"""The served llama.cpp tiers' draft tuner: its decisions (units), and a real llama-server tier
restarted without its draft when plain decoding measured faster."""

from __future__ import annotations

import json
import time

import pytest

from gemmactl.llamacpp.draft_tuner import FIRST_PROBE, MAX_PROBE, MIN_TOKENS, ServerDraftTuner
from test_serve import get, post, serve_home, start  # noqa: F401 (serve_home: the fixture, with the llama.cpp build)


def _answers(tuner, rate, n, drafted=0, accepted=0):
    """n answers at rate tok/s: the index of each that asked for a switch."""
    return [i for i in range(n) if tuner.record(32, rate, drafted, accepted)]


def test_the_tuner_measures_both_configurations_and_keeps_the_faster():
    tuner = ServerDraftTuner(4, measure=3)
    assert tuner.drafting and tuner.summary()["k"] == 4
    assert _answers(tuner, 30.0, 3, drafted=12, accepted=3) == [2]  # measured with the draft: now without
    assert not tuner.drafting and tuner.summary()["acceptance_estimate"] == pytest.approx(0.25)
    assert _answers(tuner, 40.0, 3) == []  # plain is faster: it stays plain, settled
    assert tuner.settled and not tuner.drafting and tuner.summary()["predicted_speedup"] == pytest.approx(0.75)
    assert tuner.summary()["k"] is None and tuner.switches == 1


def test_the_tuner_probes_again_later_and_backs_off_when_nothing_changed():
    tuner = ServerDraftTuner(4, measure=2, first_probe=5)
    _answers(tuner, 30.0, 2)
    _answers(tuner, 40.0, 2)  # settled on plain
    assert _answers(tuner, 40.0, 5) == [4]  # after 5 answers: the draft measured again
    assert tuner.drafting and tuner.rates[True] is None
    assert _answers(tuner, 31.0, 2) == [1]  # still slower: back to plain, probes twice as far apart
    assert not tuner.drafting and tuner.probe_every == 10
    assert _answers(tuner, 40.0, 10) == [9]
    assert _answers(tuner, 60.0, 2) == []  # now the draft wins (acceptance rose): it stays
    assert tuner.drafting and tuner.settled and tuner.probe_every == 10


def test_the_tuner_keeps_a_draft_that_pays_and_ignores_short_answers():
    tuner = ServerDraftTuner(8)
    assert not tuner.record(MIN_TOKENS - 1, 50.0) and not tuner.record(40, None)
    assert tuner.rates[True] is None and tuner.answers == 0
    _answers(tuner, 50.0, 4)
    _answers(tuner, 30.0, 4)
    assert tuner.drafting and tuner.settled and tuner.switches == 2
    assert FIRST_PROBE < MAX_PROBE


def test_a_served_tier_restarts_without_its_draft_when_plain_decoding_is_faster(serve_home, embedded_gguf):
    """The embedded 270M drafting for itself (a draft as costly as its target): the tuner measures
    an answer with the draft, restarts llama-server without it, measures one without, and keeps
    whichever decoded faster; /metrics and the lane say what it decided."""
    recipe = (f"tiers:\n  fast:\n    model: {embedded_gguf}\n    context: 1024\n    parallel: 1\n"
              f"    speculative: {{type: draft, draft_model: {embedded_gguf}, draft_max: 4}}\n"
              "    sampling: {temperature: 0.0, max_tokens: 24}\n")
    service = start(serve_home, recipe)
    try:
        backend = service.lanes["fast"].backend
        backend.draft_tuner.measure = 1  # one answer a configuration, to keep the test short
        assert "-md" in backend.server.command and service.lanes["fast"].snapshot()["speculative"].endswith(", tuned")
        first_pid = backend.pid
        status, _, body = post(f"{service.url}/v1/completions", {"prompt": "The capital of France is", "max_tokens": 24})
        assert status == 200 and body["gemmactl"]["draft_tokens"] > 0, body
        status, _, body = post(f"{service.url}/v1/completions", {"prompt": "The capital of France is", "max_tokens": 24})
        assert status == 200 and body["gemmactl"]["draft_tokens"] == 0, body  # answered by the restarted server
        assert backend.pid != first_pid and "-md" not in backend.server.command
        deadline = time.monotonic() + 60
        while backend._switching.locked() and time.monotonic() < deadline:
            time.sleep(0.1)
        decision = service.lanes["fast"].snapshot()["speculation"]
        rates = (decision["decode_tok_s_drafting"], decision["decode_tok_s_plain"])
        assert decision["settled"] and None not in rates
        assert decision["speculating"] == (rates[0] > rates[1]) == ("-md" in backend.server.command)
        metrics = get(f"{service.url}/metrics")[1]
        assert f'gemmactl_speculation_on{{tier="fast"}} {1 if decision["speculating"] else 0}' in metrics
        json.dumps(decision)
    finally:
        service.close()
