"""The served llama.cpp tiers' draft tuner: its decisions (units), and a real llama-server tier
restarted without its draft when plain decoding measured faster."""

from __future__ import annotations

import json
import time

import pytest

from gemmactl.llamacpp.draft_tuner import (FIRST_PROBE, MAX_PROBE, MIN_TOKENS, ServerDraftTuner, draft_lengths,
                                           server_args)
from test_serve import get, post, serve_home, start  # noqa: F401 (serve_home: the fixture, with the llama.cpp build)


def _answers(tuner, rate, n, drafted=0, accepted=0):
    """n answers at rate tok/s: the index of each that asked for a switch."""
    return [i for i in range(n) if tuner.record(32, rate, drafted, accepted)]


def test_the_configurations_are_the_recipes_draft_half_of_it_and_none():
    assert draft_lengths(8) == [8, 4, 0] and draft_lengths(1) == [1, 0] and draft_lengths(None) == [None, 0]
    args = ("--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-max", "8", "--spec-draft-n-min", "6")
    assert server_args(args, 4) == ("--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-max", "4",
                                    "--spec-draft-n-min", "4")
    assert server_args(args, 8) == args and server_args(args, 0) == ()
    assert server_args(("--spec-type", "ngram-simple"), None) == ("--spec-type", "ngram-simple")


def test_the_tuner_measures_each_configuration_and_keeps_the_fastest():
    tuner = ServerDraftTuner(4, measure=3)
    assert tuner.length == 4 and tuner.summary()["k"] == 4
    assert _answers(tuner, 30.0, 3, drafted=12, accepted=3) == [2]  # measured k=4: now k=2
    assert tuner.length == 2 and tuner.summary()["acceptance_estimate"] == pytest.approx(0.25)
    assert _answers(tuner, 35.0, 3, drafted=6, accepted=3) == [2] and tuner.length == 0  # then no draft
    assert _answers(tuner, 40.0, 3) == []  # plain is the fastest: it stays plain, settled
    assert tuner.settled and not tuner.drafting and tuner.summary()["predicted_speedup"] == pytest.approx(0.875)
    assert tuner.summary()["k"] is None and tuner.switches == 2
    assert tuner.summary()["decode_tok_s"] == {"k=4": 30.0, "k=2": 35.0, "plain": 40.0}


def test_the_tuner_probes_the_runner_up_later_and_backs_off_when_nothing_changed():
    tuner = ServerDraftTuner(1, measure=2, first_probe=5)
    _answers(tuner, 30.0, 2)
    _answers(tuner, 40.0, 2)  # settled on plain
    assert _answers(tuner, 40.0, 5) == [4]  # after 5 answers: the draft measured again
    assert tuner.drafting and tuner.rates[1] is None
    assert _answers(tuner, 31.0, 2) == [1]  # still slower: back to plain, probes twice as far apart
    assert not tuner.drafting and tuner.probe_every == 10
    assert _answers(tuner, 40.0, 10) == [9]
    assert _answers(tuner, 60.0, 2) == []  # now the draft wins (acceptance rose): it stays
    assert tuner.drafting and tuner.settled and tuner.probe_every == 5  # and probes as often as at first


def test_the_tuner_keeps_a_draft_that_pays_and_ignores_short_answers():
    tuner = ServerDraftTuner(None)  # n-grams: on or off
    assert not tuner.record(MIN_TOKENS - 1, 50.0) and not tuner.record(40, None)
    assert tuner.rates[None] is None and tuner.answers == 0
    _answers(tuner, 50.0, 4)
    _answers(tuner, 30.0, 4)
    assert tuner.drafting and tuner.settled and tuner.switches == 2 and tuner.summary()["k"] is None
    assert FIRST_PROBE < MAX_PROBE


def test_a_served_tier_restarts_in_the_draft_configuration_that_decodes_fastest(serve_home, embedded_gguf):
    """The embedded 270M drafting for itself (a draft as costly as its target): the tuner measures
    an answer with drafts of up to 4, restarts llama-server with drafts of up to 2, then without a
    draft, and keeps whichever decoded fastest; /metrics and the lane say what it decided."""
    recipe = (f"tiers:\n  fast:\n    model: {embedded_gguf}\n    context: 1024\n    parallel: 1\n"
              f"    speculative: {{type: draft, draft_model: {embedded_gguf}, draft_max: 4}}\n"
              "    sampling: {temperature: 0.0, max_tokens: 24}\n")
    service = start(serve_home, recipe)
    try:
        backend = service.lanes["fast"].backend
        backend.draft_tuner.measure = 1  # one answer a configuration, to keep the test short
        assert service.lanes["fast"].snapshot()["speculative"].endswith(", tuned")
        def switched():  # a switch is asked for before the answer is sent; wait until the server is back
            deadline = time.monotonic() + 60
            while backend._switching.locked() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not backend._switching.locked(), "llama-server did not come back within 60 s"
            return list(backend.server.command)

        commands, drafted = [switched()], []
        for _ in range(3):
            status, _, body = post(f"{service.url}/v1/completions", {"prompt": "The capital of France is",
                                                                     "max_tokens": 24})
            assert status == 200 and body["usage"]["completion_tokens"] >= MIN_TOKENS, body  # long enough to count
            drafted.append(body["gemmactl"]["draft_tokens"])
            commands.append(switched())
        assert [c[c.index("--spec-draft-n-max") + 1] if "-md" in c else None for c in commands[:3]] == ["4", "2", None]
        assert drafted[0] > 0 and drafted[1] > 0 and drafted[2] == 0
        decision = service.lanes["fast"].snapshot()["speculation"]
        rates = decision["decode_tok_s"]
        assert decision["settled"] and None not in rates.values()
        fastest = max(rates, key=rates.get)
        command = backend.server.command
        assert fastest == ("plain" if "-md" not in command else f"k={command[command.index('--spec-draft-n-max') + 1]}")
        assert decision["speculating"] == (fastest != "plain")
        metrics = get(f"{service.url}/metrics")[1]
        assert f'gemmactl_speculation_on{{tier="fast"}} {1 if decision["speculating"] else 0}' in metrics
        json.dumps(decision)
    finally:
        service.close()
