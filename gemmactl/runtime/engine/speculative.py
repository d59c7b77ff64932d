"""Exact speculative decoding on the engine: a draft model proposes, the target verifies.

A round: the draft (a smaller model of the same vocabulary, its own GemmaModel) decodes k tokens
one at a time; the target runs the pending token and the k drafts in one step with every
position's logits; the drafts are kept up to the first one the target would not have chosen,
and the target's own choice at that position (or after the last draft, when all are kept) comes
with them, so a round yields 1 to k + 1 tokens for one target step.

- Greedy: a draft is kept when it is the target's argmax (after the repeat penalty over the
  tokens before it), so the tokens are plain decoding's. (The rule is exact; a k+1-token step may
  round differently from k+1 one-token steps, other kernels or another summation order, which
  could move a near-tie: graph.VerifyStep says how the verify step keeps each row's numbers.)
- Sampled: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): a draft x drawn
  from q is kept with probability min(1, p(x)/q(x)); at the first rejection a token is drawn from
  max(0, p − q) renormalized; so every token is distributed as p, the target's own distribution
  after penalty, temperature, top-k, top-p and min-p (runtime/engine/sampler.py).

Rolling back costs nothing: every KV slot records the position it holds, attention hides keys
past the query, and the next round's writes replace the rejected ones. A sliding layer's ring
gets `k_max` spare slots so the rejected keys never overwrite ones its window still needs.

`Tuner` picks k each round from measurements: the acceptance rate (decayed counts), the time of a
round (its drafts, its verify step and the caller's handling of its tokens) as a line in k fitted
to the rounds it made, and the time of a plain target step (with the caller's handling of its
token: what a caller waits for, both ways); speculation turns itself off when its predicted rate is
below plain decoding's and probes again after PROBE_EVERY tokens, twice as many after each probe
that did not pay, and never so often that probes (the draft first reads what was decoded without
it) cost more than PROBE_SHARE of the time. Where the draft must first read tokens it has not seen
(a new prompt, tokens decoded plainly) and the caller says how many tokens it still wants, a round
is made only if what speculation is predicted to save over them pays for that reading.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gemmactl.runtime.base import REPEAT_LAST_N
from gemmactl.runtime.engine.graph import VerifyStep
from gemmactl.runtime.engine.sampler import penalized, probabilities

PROBE_EVERY = 32  # plain tokens before the first probe while speculation is off; doubles after each failed probe
PROBE_EVERY_MAX = 1024
PROBE_SHARE = 0.02  # a failed probe waits at least until its cost is this share of the plain decoding since
PROBE_K = 2  # drafts in a probing round (a bad draft costs least at a short length)
DECAY = 0.9  # weight of the past in the acceptance counts and step times, per round
K_SPREAD = 0.1  # the weighted variance of the rounds' draft lengths past which round_line fits a line
PLAIN_FIRST = 2  # plain steps that measure the target's own rate before the first round
REFRESH_EVERY = 64  # rounds between plain steps that keep the plain rate current while speculating
REPLAY_MAX = 16  # pending tokens the draft reads one replay of its decode step each (more: a chunked step)


def _decayed(old: float | None, new: float) -> float:
    """A time's running estimate: the past weighed DECAY, the new measurement the rest."""
    return new if old is None else DECAY * old + (1 - DECAY) * new


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round yields when each draft is kept with probability alpha: 1 + α + … + α^k."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class Tuner:
    """How many tokens to draft next: fixed (k), or chosen from what was measured (k=None)."""

    k_max: int
    fixed: int | None = None
    accepted: float = 0.0  # decayed count of drafts kept
    rejected: float = 0.0  # decayed count of rounds that stopped at a rejection
    t_plain: float | None = None  # s per plain target step
    t_draft: float | None = None  # s per draft step
    t_verify: float | None = None  # s per verify step
    t_after: float | None = None  # s per round the caller takes with its tokens before asking for more
    # Decayed sums over rounds of (k, seconds of the round's drafts and verify step): the line
    # seconds = a + b·k through them (round_line).
    sums: list = field(default_factory=lambda: [0.0] * 5)  # Σw, Σw·k, Σw·k², Σw·t, Σw·k·t
    plain_since: int = 0  # plain tokens since speculation was last tried
    rounds_since_plain: int = 0  # rounds since the last plain step
    probe_every: int = PROBE_EVERY  # plain tokens between probes now (doubles after each failed one)
    probed: bool = False  # the last round was a probe whose verdict is still to be drawn
    t_probe: float = 0.0  # s the last round took, the draft's catching up included (what a probe costs)
    t_catch_up: float | None = None  # s per token the draft reads before it drafts (a prompt, plain tokens)
    decisions: dict = field(default_factory=lambda: {"on": 0, "off": 0, "not_worth_catching_up": 0})

    @property
    def alpha(self) -> float | None:
        seen = self.accepted + self.rejected
        return self.accepted / seen if seen else None

    def next_k(self, room: int, left: int | None = None, behind: int = 0) -> int:
        """Drafts for the next round (0: a plain step). room: positions left in the context. left:
        tokens the caller still wants (None: not known); behind: tokens the draft must read before
        it drafts."""
        cap = min(self.k_max, room)
        if cap <= 0:
            return 0
        if self.fixed is not None:
            return min(self.fixed, cap)
        if self.t_plain is None or self.plain_since < PLAIN_FIRST and self.t_draft is None:
            return 0  # measure the target's own step first
        if self.t_draft is None or self.alpha is None:
            return self._probe(cap)  # the first round: measures the draft, the verify step and acceptance
        k, rate = self.best(cap)
        if rate > 1.0 / self.t_plain and not self.worth_catching_up(rate, left, behind):
            # Speculation would pay per token, but not over the tokens still wanted once the draft
            # has read what it has not seen: a short answer after a long prompt, an answer's tail.
            self.decisions["not_worth_catching_up"] += 1
            return 0
        if rate > 1.0 / self.t_plain:
            self.decisions["on"] += 1
            self.probed, self.probe_every = False, PROBE_EVERY
            if self.rounds_since_plain >= REFRESH_EVERY:
                return 0  # one plain step: the plain rate the decision compares with stays measured
            return k
        self.decisions["off"] += 1
        if self.probed:  # a probe that did not pay: wait twice as long before the next, and long
            # enough that probing costs at most PROBE_SHARE of the time (the draft reads every
            # token decoded since its last round before it drafts: a probe costs more than a round)
            affordable = int(self.t_probe / (PROBE_SHARE * self.t_plain)) if self.t_plain else 0
            self.probed = False
            self.probe_every = min(max(2 * self.probe_every, affordable), PROBE_EVERY_MAX)
        if self.plain_since >= self.probe_every:
            return self._probe(cap)  # try again: the text may have become easier to draft
        return 0

    def worth_catching_up(self, rate: float, left: int | None, behind: int) -> bool:
        """Whether speculating at `rate` tokens a second over `left` more tokens saves more than
        the draft's reading of `behind` tokens first costs (measured per token; unknown, or
        nothing to read, or `left` unknown: it is)."""
        if left is None or behind <= 0 or self.t_catch_up is None or self.t_plain is None:
            return True
        saved = left * (self.t_plain - 1.0 / rate)
        return saved > behind * self.t_catch_up

    def _probe(self, cap: int) -> int:
        self.probed = True
        return min(PROBE_K, cap)

    def round_line(self) -> tuple[float, float]:
        """(a, b): a round of k drafts takes a + b·k seconds. The least-squares line through the
        rounds measured (decayed) once they span two draft lengths; before that (or where the fit
        is not a cost, b ≤ 0 or a ≤ 0) the drafts scale with k and the verify step (with the
        caller's handling of the round's tokens) does not.

        A verify step's cost is rarely proportional to its drafts: bound by the bytes it reads
        (streamed layers, a GPU's GEMVs) it costs about one plain step whatever k, and run
        eagerly where the plain step is a replayed graph it carries a fixed overhead; the draft's
        round starts by reading the tokens the last verify kept. An E4B-shaped target streamed
        under 4 GiB on an H100 took 45 ms a plain step and about 70 a verify step at k=2 and k=4
        alike. Priced per draft, the tuner drafted 2 tokens a round and decoded half its tokens
        plainly: 1.03× plain, where 4 drafts every round measured 1.51× (docs/benchmarks.md)."""
        w, wk, wkk, wt, wkt = self.sums
        if w > 0 and wkk / w - (wk / w) ** 2 >= K_SPREAD:  # the draft lengths measured, still weighed, differ
            det = w * wkk - wk * wk
            b = (w * wkt - wk * wt) / det
            a = (wt - b * wk) / w
            if a > 0 and b > 0:
                return a, b
        return (self.t_verify or 0.0) + (self.t_after or 0.0), self.t_draft or 0.0

    def best(self, cap: int) -> tuple[int, float]:
        """(k, predicted tokens per second) of the best draft length up to cap."""
        alpha = min(self.alpha or 0.0, 0.999)
        a, b = self.round_line()
        rates = [(expected_tokens(alpha, k) / max(a + b * k, 1e-9), k) for k in range(1, cap + 1)]
        rate, k = max(rates)
        return k, rate

    def record_plain(self, seconds: float) -> None:
        self.t_plain = _decayed(self.t_plain, seconds)
        self.plain_since += 1
        self.rounds_since_plain = 0

    def record_round(self, k: int, kept: int, draft_s: float, verify_s: float, catch_up_s: float = 0.0,
                     caught_up: int = 0, after_s: float = 0.0) -> None:
        """A round of k drafts, kept of them kept: its drafts' and verify step's seconds, the
        draft's reading of caught_up tokens first (catch_up_s), and the caller's handling of the
        round's tokens before it asked for more (after_s: part of what a round costs it)."""
        self.t_probe = catch_up_s + draft_s + verify_s
        self.accepted = DECAY * self.accepted + kept
        self.rejected = DECAY * self.rejected + (1 if kept < k else 0)
        self.t_draft = _decayed(self.t_draft, draft_s / k)
        self.t_verify = _decayed(self.t_verify, verify_s)
        self.t_after = _decayed(self.t_after, after_s)
        if caught_up:
            self.t_catch_up = _decayed(self.t_catch_up, catch_up_s / caught_up)
        seconds = draft_s + verify_s + after_s
        self.sums = [DECAY * total + value for total, value in zip(self.sums, (1.0, k, k * k, seconds, k * seconds))]
        self.plain_since = 0
        self.rounds_since_plain += 1

    def summary(self) -> dict:
        speculating = self.fixed is not None or (self.t_plain is not None and self.t_draft is not None
                                                 and self.alpha is not None and self.best(self.k_max)[1] > 1 / self.t_plain)
        predicted = None
        if self.t_plain and self.t_draft is not None and self.alpha is not None:
            predicted = round(self.best(self.k_max)[1] * self.t_plain, 3)
        ms = lambda s: None if s is None else round(1000 * s, 3)  # noqa: E731
        a, b = self.round_line() if self.t_draft is not None else (None, None)
        return {"mode": "fixed" if self.fixed is not None else "tuned", "speculating": speculating,
                "k": self.fixed if self.fixed is not None else (self.best(self.k_max)[0] if predicted else None),
                "acceptance_estimate": None if self.alpha is None else round(self.alpha, 3),
                "plain_step_ms": ms(self.t_plain), "draft_step_ms": ms(self.t_draft),
                "verify_step_ms": ms(self.t_verify), "round_fixed_ms": ms(a), "round_ms_per_draft": ms(b),
                "catch_up_ms_per_token": ms(self.t_catch_up), "predicted_speedup": predicted,
                "rounds_on": self.decisions["on"], "rounds_off": self.decisions["off"],
                "not_worth_catching_up": self.decisions["not_worth_catching_up"], "probe_every": self.probe_every}


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafted: list[int], generator) -> tuple[int, int]:
    """The rejection rule: p [k+1, V] the target's distributions, q [k, V] the draft's, drafted
    the k drafts (each drawn from its q row). Returns (drafts kept, the token that follows them)."""
    for i, x in enumerate(drafted):
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[i, x] < p[i, x]:  # u < p/q, without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = residual.sum()
        token = torch.multinomial(residual / total if total > 0 else p[i], 1, generator=generator)[0]
        return i, int(token)
    return len(drafted), int(torch.multinomial(p[len(drafted)], 1, generator=generator)[0])


@dataclass
class RoundStats:
    """Counters of one generation's speculation."""

    rounds: int = 0
    drafted: int = 0
    kept: int = 0
    plain_steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    catch_up_s: float = 0.0  # the draft reading the prompt and plainly decoded tokens
    plain_because: str | None = None  # why this generation decoded plainly without asking the tuner

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "kept": self.kept, "plain_because": self.plain_because,
                "acceptance": round(self.kept / self.drafted, 4) if self.drafted else None,
                "tokens_per_round": round((self.kept + self.rounds) / self.rounds, 3) if self.rounds else None,
                "plain_steps": self.plain_steps, "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
                "catch_up_s": round(self.catch_up_s, 4)}


class Speculator:
    """Speculative decoding of one target with one draft (GemmaModels of the same vocabulary)."""

    def __init__(self, target, draft, tuner: Tuner, draft_decoder=None, verifier=None):
        self.target, self.draft, self.tuner = target, draft, tuner
        self.draft_decoder = draft_decoder  # the draft's DecodeStep (a captured graph on a GPU), if any
        # The target's VerifyStep (a captured graph on a GPU); by default an eager one.
        self.verifier = verifier or VerifyStep(target, tuner.k_max + 1, captured=False)
        self.stats = RoundStats()
        self.draft_path: str | None = None
        # Why the verify step would not give greedy decoding plain decoding's tokens bit for bit, or
        # None (draft.greedy_inexact: a fused step or MoE on a GPU). Where so, greedy requests
        # decode plainly; sampled ones, exact in distribution by the rejection rule, still speculate.
        self.greedy_inexact: str | None = None

    def speculates(self, request) -> bool:
        """Whether this request goes through the speculator (else the caller decodes plainly, and
        the generation's stats say why)."""
        if request.temperature > 0 or self.greedy_inexact is None:
            return True
        self.stats.plain_because = f"greedy, and {self.greedy_inexact}"
        return False

    def begin(self, prompt: list[int], chunk: int) -> None:
        """A new sequence: the draft forgets the last one and will read this prompt when the tuner
        first asks it to draft (never, if speculation stays off: no prefill is spent on it)."""
        self.draft.reset()
        self._draft_len = 0
        self._pending = list(prompt)
        self._chunk = chunk
        self.stats = RoundStats()  # a generation that ends on its first token made no rounds

    def tokens(self, token: int, position: int, history: list[int], request, generator, plain_step, context: int,
               budget: int | None = None):
        """Token ids after `token` (the first generated, at `position`), without end.

        history: the prompt's and generated tokens so far (for the repeat penalty; extended here).
        plain_step(token, position) → logits [V]: the target's own decode step.
        budget: how many tokens the caller will take at most (None: not known).

        A step's or round's time, as the tuner gets it, runs until the caller asks for the next
        token: what the caller does with the tokens is part of what it waits for either way.
        """
        self.stats = RoundStats()
        self._pending.append(token)
        device = self.target.device
        plain_greedy = request.temperature == 0 and request.repeat_penalty == 1.0
        on_device = None  # the last token as a device tensor, where a plain step made it
        measured = None  # the last step's or round's record, made when the caller comes back
        taken = 0
        while True:
            now = time.perf_counter()
            if measured is not None:
                measured(now)
                measured = None
            behind = len(self._pending) - 1 if len(self._pending) > 2 else 0  # what _draft reads first
            left = None if budget is None else budget - taken
            k = self.tuner.next_k(context - position - 1, left, behind)
            if k == 0:
                start = now
                step_input = on_device if on_device is not None else torch.tensor(token, device=device)
                logits = plain_step(step_input, position)
                if plain_greedy:  # no history to send: the choice stays on the device until read
                    on_device = torch.argmax(logits)
                    token = int(on_device)
                else:
                    recent = torch.tensor(history[-REPEAT_LAST_N:], dtype=torch.long, device=device)
                    token = self._choose(logits, recent, request, generator)
                measured = lambda end, start=start: self.tuner.record_plain(end - start)  # noqa: E731
                self.stats.plain_steps += 1
                self._pending.append(token)
                position += 1
                history.append(token)
                taken += 1
                yield token
                continue
            on_device = None
            start, caught_up = now, self.stats.catch_up_s
            drafted, q_rows = self._draft(k, history, request, generator)
            catch_up_s = self.stats.catch_up_s - caught_up
            draft_s = time.perf_counter() - start - catch_up_s
            start = time.perf_counter()
            logits = self.verifier([token] + drafted, position)  # [k+1, V]
            kept, final = self._verify(logits, drafted, q_rows, history, request, generator)
            verify_s = time.perf_counter() - start
            done = time.perf_counter()
            measured = lambda end, k=k, kept=kept, d=draft_s, v=verify_s, c=catch_up_s, n=behind, done=done: \
                self.tuner.record_round(k, kept, d, v, c, n, end - done)  # noqa: E731
            s = self.stats
            s.rounds, s.drafted, s.kept = s.rounds + 1, s.drafted + k, s.kept + kept
            s.draft_s, s.verify_s = s.draft_s + draft_s, s.verify_s + verify_s
            # The draft read its pending tokens and drafts 1..k-1; what it holds past the kept
            # ones is rolled back by position, like the target's.
            self._draft_len = min(self._draft_len, position + kept + 1)
            self._pending = ([drafted[-1]] if kept == k else []) + [final]
            out = drafted[:kept] + [final]
            position += kept + 1
            token = final
            for value in out:
                history.append(value)
                taken += 1
                yield value

    def _choose(self, logits, recent, request, generator) -> int:
        if request.temperature == 0:
            return int(torch.argmax(penalized(logits, recent, request)))
        return int(torch.multinomial(probabilities(logits, recent, request), 1, generator=generator)[0])

    def _draft(self, k: int, history: list[int], request, generator) -> tuple[list[int], torch.Tensor | None]:
        """k drafts (and their distributions when sampling), after the draft reads its pending tokens."""
        device = self.draft.device
        draft_history = history[-REPEAT_LAST_N:]
        drafted, q_rows = [], []
        if len(self._pending) > 2:  # catching up (the prompt, plain steps): timed apart from drafting
            start = time.perf_counter()
            behind = self._pending[:-1]
            if self.draft_decoder is not None and len(behind) <= REPLAY_MAX:
                self._replay(behind)
            else:
                for begin in range(0, len(behind), self._chunk):
                    part = behind[begin:begin + self._chunk]
                    at = self._draft_len
                    self.draft.step(torch.tensor(part, dtype=torch.long, device=device),
                                    torch.arange(at, at + len(part), device=device), at + len(part))
                    self._draft_len = at + len(part)
            self._pending = self._pending[-1:]
            self.stats.catch_up_s += time.perf_counter() - start
        feed = self._pending
        for _ in range(k):
            if self.draft_decoder is not None:
                # One token a replay of the draft's captured step: after a round that kept every
                # draft two tokens are pending, and an eager two-token step would cost more than
                # two replays (on an H200, an E2B-shaped eager step took ~15 ms, a replay ~2.3).
                self._replay(feed[:-1])
                logits = self.draft_decoder(torch.tensor(feed[-1], device=device), self._draft_len)
                self._draft_len += 1
            else:
                start = self._draft_len
                logits = self.draft.step(torch.tensor(feed, dtype=torch.long, device=device),
                                         torch.arange(start, start + len(feed), device=device), start + len(feed))
                self._draft_len = start + len(feed)
            recent = torch.tensor(draft_history[-REPEAT_LAST_N:], dtype=torch.long, device=device)
            if request.temperature == 0:
                value = int(torch.argmax(penalized(logits, recent, request)))
            else:
                q = probabilities(logits, recent, request)
                q_rows.append(q)
                value = int(torch.multinomial(q, 1, generator=generator)[0])
            drafted.append(value)
            draft_history.append(value)
            feed = [value]
        self._pending = []
        return drafted, (torch.stack(q_rows) if q_rows else None)

    def _replay(self, tokens: list[int]) -> None:
        """The draft reads tokens one replay of its decode step each (their logits are not needed)."""
        for value in tokens:
            self.draft_decoder(torch.tensor(value, device=self.draft.device), self._draft_len)
            self._draft_len += 1

    def _verify(self, logits, drafted, q_rows, history, request, generator) -> tuple[int, int]:
        """(drafts kept, the token after them) from the target's logits [k+1, V]."""
        device = logits.device
        if request.temperature == 0 and request.repeat_penalty == 1.0:  # every row's choice in one transfer
            choices = logits.argmax(-1).tolist()
            for i, choice in enumerate(choices):
                if i == len(drafted) or choice != drafted[i]:
                    return i, choice
        rows = []
        for i in range(len(drafted) + 1):
            recent = torch.tensor((history[-REPEAT_LAST_N:] + drafted[:i])[-REPEAT_LAST_N:], dtype=torch.long,
                                  device=device)
            if request.temperature == 0:
                choice = int(torch.argmax(penalized(logits[i], recent, request)))
                if i == len(drafted) or choice != drafted[i]:
                    return i, choice
            else:
                rows.append(probabilities(logits[i], recent, request))
        return accept_sampled(torch.stack(rows), q_rows, drafted, generator)
