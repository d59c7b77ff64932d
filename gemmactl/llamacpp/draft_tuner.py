"""How a served llama.cpp tier drafts: measured on its own answers, switched by a restart.

A tier's speculative decoding (a draft model, Gemma 4's MTP assistant, n-grams) is a set of
llama-server flags, and this llama-server takes no per-request draft settings (its request schema
has them compiled out), so the only way to change the draft length, or to turn the draft off or
on again, is to restart the server. The tuner therefore chooses among a few configurations of the
server, not a length per round as the engine's tuner does (runtime/engine/speculative.py): the
recipe's longest draft (`--spec-draft-n-max`), half of it, and no draft. Within a round
llama-server already stops a draft early when the draft is unsure (`--spec-draft-p-min`). An
n-gram tier, which has no draft length, chooses between on and off.

It measures the decode rate a caller waits for (tokens after the first over the time after the
first) on the tier's answers of at least MIN_TOKENS: MEASURE_ANSWERS answers in each
configuration in turn, and keeps the fastest. After FIRST_PROBE answers it measures the
runner-up again, twice as long after each probe that changed nothing (up to MAX_PROBE) and
FIRST_PROBE again after one that did, as the engine's tuner probes. Each switch costs a restart
of the server (its load time), which is why a probe waits for many answers. (The engine's tuner
has the same decayed average; it is not imported from there, which would load torch into every
llama.cpp tier.)
"""

from __future__ import annotations

MEASURE_ANSWERS = 4  # answers measured in a configuration before moving on
MIN_TOKENS = 8  # shorter answers say little about the decode rate
FIRST_PROBE = 32  # answers in the chosen configuration before the runner-up is measured again
MAX_PROBE = 1024
DECAY = 0.5  # weight of the older measurement when a new one comes in
PLAIN = 0  # the configuration without a draft
N_MAX = "--spec-draft-n-max"
N_MIN = "--spec-draft-n-min"


def _decayed(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1 - DECAY) * new


def draft_lengths(k_max: int | None) -> list[int | None]:
    """The configurations tried, the recipe's first: its longest draft, half of it, none (PLAIN).
    None: drafting as the recipe says, with no length to choose (n-grams)."""
    if k_max is None:
        return [None, PLAIN]
    return list(dict.fromkeys([k_max, max(1, k_max // 2), PLAIN]))


def server_args(draft_args: tuple[str, ...], length: int | None) -> tuple[str, ...]:
    """The tier's speculative flags for a configuration: none for PLAIN, else with its draft length."""
    if length == PLAIN:
        return ()
    args = list(draft_args)
    if length is not None and N_MAX in args:
        args[args.index(N_MAX) + 1] = str(length)
        if N_MIN in args and int(args[args.index(N_MIN) + 1]) > length:
            args[args.index(N_MIN) + 1] = str(length)
    return tuple(args)


class ServerDraftTuner:
    """The draft configuration of one llama-server tier (see the module's docstring)."""

    def __init__(self, k_max: int | None, measure: int = MEASURE_ANSWERS, first_probe: int = FIRST_PROBE):
        self.k_max = k_max
        self.lengths = draft_lengths(k_max)
        self.length = self.lengths[0]  # the server starts as the recipe says
        self.rates: dict = {length: None for length in self.lengths}  # decode tok/s by configuration
        self.acceptance: float | None = None
        self.measure = measure
        self.first_probe = self.probe_every = first_probe
        self.settled = False  # False: measuring configurations in turn
        self.answers = 0  # answers in the current configuration since it began
        self.switches = 0
        self._before_probe = None  # the configuration a probe left

    @property
    def drafting(self) -> bool:
        return self.length != PLAIN

    def record(self, tokens: int, decode_tok_s: float | None, drafted: int = 0, accepted: int = 0) -> bool:
        """One answer of the current configuration: its generated tokens, its decode rate and its
        drafts. True when the server should now be restarted in another configuration (`length`
        already says which)."""
        if decode_tok_s is None or decode_tok_s <= 0 or tokens < MIN_TOKENS:
            return False
        self.rates[self.length] = _decayed(self.rates[self.length], decode_tok_s)
        if self.drafting and drafted:
            self.acceptance = _decayed(self.acceptance, accepted / drafted)
        self.answers += 1
        if self.settled:
            if self.answers < self.probe_every:
                return False
            runner_up = max((c for c in self.lengths if c != self.length and self.rates[c] is not None),
                            key=lambda c: self.rates[c])
            self._before_probe, self.settled = self.length, False
            self.rates[runner_up] = None  # measured afresh
            return self._switch(runner_up)
        if self.answers < self.measure:
            return False
        unmeasured = [c for c in self.lengths if self.rates[c] is None]
        if unmeasured:
            return self._switch(unmeasured[0])
        best = max(self.lengths, key=lambda c: self.rates[c])
        self.settled = True
        if self._before_probe is not None:  # a probe: twice as far apart if it changed nothing, else afresh
            self.probe_every = min(MAX_PROBE, 2 * self.probe_every) if best == self._before_probe else self.first_probe
        self._before_probe = None
        if best != self.length:
            return self._switch(best)
        self.answers = 0
        return False

    def _switch(self, length) -> bool:
        self.length = length
        self.answers = 0
        self.switches += 1
        return True

    def predicted_speedup(self) -> float | None:
        """The best drafting configuration's decode rate over plain decoding's, once both were measured."""
        drafting = [self.rates[c] for c in self.lengths if c != PLAIN and self.rates[c] is not None]
        if not drafting or self.rates[PLAIN] is None:
            return None
        return round(max(drafting) / self.rates[PLAIN], 3)

    def summary(self) -> dict:
        rate = lambda value: None if value is None else round(value, 2)  # noqa: E731
        return {"mode": "tuned", "speculating": self.drafting, "k": self.length if self.drafting else None,
                "k_max": self.k_max, "settled": self.settled,
                "decode_tok_s": {("plain" if c == PLAIN else f"k={c}" if c else "on"): rate(r)
                                 for c, r in self.rates.items()},
                "acceptance_estimate": None if self.acceptance is None else round(self.acceptance, 3),
                "predicted_speedup": self.predicted_speedup(), "switches": self.switches,
                "probe_every": self.probe_every}
