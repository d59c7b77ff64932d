"""Whether a served llama.cpp tier drafts: measured on its own answers, switched by a restart.

A tier's speculative decoding (a draft model, Gemma 4's MTP assistant, n-grams) is a llama-server
flag, and this llama-server takes no per-request draft settings (its request schema has them
compiled out), so the only way to turn a draft off, or on again, is to restart the server with or
without it. The tuner therefore decides between two configurations, not per round as the
engine's tuner does (runtime/engine/speculative.py); within a round llama-server already stops a
draft early when the draft is unsure (`--spec-draft-p-min`).

It measures the decode rate a caller waits for (tokens after the first over the time after the
first) on the tier's answers: `MEASURE_ANSWERS` answers with the draft, then as many without, and
keeps the faster. It probes the other configuration again after `FIRST_PROBE` answers, twice as
long after each probe that changed nothing (up to `MAX_PROBE`), as the engine's tuner probes. Each
switch costs a restart of the server (its load time), which is why a probe waits for many answers.
"""

from __future__ import annotations

MEASURE_ANSWERS = 4  # answers measured in a configuration before comparing
MIN_TOKENS = 8  # shorter answers say little about the decode rate
FIRST_PROBE = 32  # answers in the chosen configuration before the other is measured again
MAX_PROBE = 1024
DECAY = 0.5  # weight of the older measurement when a new one comes in


def _decayed(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1 - DECAY) * new


class ServerDraftTuner:
    """The drafting/plain decision of one llama-server tier (see the module's docstring)."""

    def __init__(self, k_max: int, measure: int = MEASURE_ANSWERS, first_probe: int = FIRST_PROBE):
        self.k_max = k_max  # the tier's --spec-draft-n-max
        self.drafting = True  # the server starts with its draft
        self.rates: dict[bool, float | None] = {True: None, False: None}  # decode tok/s, with and without
        self.acceptance: float | None = None
        self.measure = measure
        self.probe_every = first_probe
        self.settled = False  # False: measuring the current configuration
        self.answers = 0  # answers in the current configuration since it began
        self.switches = 0
        self._before_probe: bool | None = None  # the configuration a probe left

    def record(self, tokens: int, decode_tok_s: float | None, drafted: int = 0, accepted: int = 0) -> bool:
        """One answer of the current configuration: its generated tokens, its decode rate and its
        drafts. True when the server should now be restarted in the other configuration
        (`drafting` already says which)."""
        if decode_tok_s is None or decode_tok_s <= 0 or tokens < MIN_TOKENS:
            return False
        self.rates[self.drafting] = _decayed(self.rates[self.drafting], decode_tok_s)
        if self.drafting and drafted:
            self.acceptance = _decayed(self.acceptance, accepted / drafted)
        self.answers += 1
        if self.settled:
            if self.answers < self.probe_every:
                return False
            self._before_probe = self.drafting
            self.settled = False
            self.rates[not self.drafting] = None  # measured afresh
            return self._switch()
        if self.answers < self.measure:
            return False
        if self.rates[not self.drafting] is None:  # the other configuration: never measured yet
            return self._switch()
        best = self.rates[True] > self.rates[False]
        self.settled = True
        if self._before_probe is not None and best == self._before_probe:
            self.probe_every = min(MAX_PROBE, 2 * self.probe_every)  # the probe changed nothing
        self._before_probe = None
        if best != self.drafting:
            return self._switch()
        self.answers = 0
        return False

    def _switch(self) -> bool:
        self.drafting = not self.drafting
        self.answers = 0
        self.switches += 1
        return True

    def predicted_speedup(self) -> float | None:
        """Drafting's decode rate over plain decoding's, once both were measured."""
        if self.rates[True] is None or self.rates[False] is None:
            return None
        return round(self.rates[True] / self.rates[False], 3)

    def summary(self) -> dict:
        rate = lambda value: None if value is None else round(value, 2)  # noqa: E731
        return {"mode": "tuned", "speculating": self.drafting, "k": self.k_max if self.drafting else None,
                "k_max": self.k_max, "settled": self.settled,
                "decode_tok_s_drafting": rate(self.rates[True]), "decode_tok_s_plain": rate(self.rates[False]),
                "acceptance_estimate": None if self.acceptance is None else round(self.acceptance, 3),
                "predicted_speedup": self.predicted_speedup(), "switches": self.switches,
                "probe_every": self.probe_every}
