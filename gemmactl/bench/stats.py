"""Arithmetic on recorded timestamps: per-request rates, percentiles, ratios, summaries.

Definitions (the same as the streaming core's, runtime/base.py), for n generated tokens:
  ttft_s        = first token - request start
  wall_s        = last token - request start
  decode_tok_s  = (n - 1) / (last token - first token)     decode only: the first token is prefill's
  wall_tok_s    = n / wall_s                               what a caller waits for
  prefill_tok_s = prompt tokens / ttft_s

So wall_s = ttft_s + (n - 1) / decode_tok_s exactly, and wall_tok_s <= decode_tok_s exactly when
ttft_s >= 1 / decode_tok_s (the first token cost at least one decode step, which prefill of any
real prompt does). `wall_identity_error` and `wall_exceeds_decode` check both on measured runs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestTiming:
    """Timestamps of one streamed request, in seconds on one monotonic clock."""

    start: float
    first_token: float | None
    last_token: float | None
    prompt_tokens: int
    generated_tokens: int

    @property
    def end(self) -> float:
        return self.last_token if self.last_token is not None else self.start


def request_metrics(t: RequestTiming) -> dict:
    """ttft_s, wall_s, prefill_tok_s, decode_tok_s and wall_tok_s of one request."""
    first = t.first_token if t.first_token is not None else t.end
    ttft = first - t.start
    wall = t.end - t.start
    decode_time = t.end - first
    n = t.generated_tokens
    return {
        "ttft_s": ttft,
        "wall_s": wall,
        "prompt_tokens": t.prompt_tokens,
        "generated_tokens": n,
        "prefill_tok_s": t.prompt_tokens / ttft if ttft > 0 else 0.0,
        "decode_tok_s": (n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0,
        "wall_tok_s": n / wall if wall > 0 else 0.0,
    }


def wall_identity_error(m: dict) -> float:
    """|wall_s - (ttft_s + (n-1)/decode_tok_s)|: zero up to rounding for any consistent record."""
    n = m["generated_tokens"]
    if n < 2 or not m["decode_tok_s"]:
        return 0.0
    return abs(m["wall_s"] - (m["ttft_s"] + (n - 1) / m["decode_tok_s"]))


def wall_exceeds_decode(m: dict) -> bool:
    """True when wall tok/s beat decode-only tok/s: only possible if the first token came faster than a decode step."""
    return m["decode_tok_s"] > 0 and m["wall_tok_s"] > m["decode_tok_s"] * (1 + 1e-9)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def percentiles(values: Sequence[float], qs: Iterable[int] = PERCENTILES) -> dict:
    """{"p50": …, "p90": …, "p99": …} of the values."""
    return {f"p{q}": percentile(values, q) for q in qs}


def summary(values: Sequence[float]) -> dict:
    """min, median and max of the values (and how many there were)."""
    if not values:
        raise ValueError("summary of no values")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def pair_ratios(ours: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """ours[i] / theirs[i] for each interleaved pair; pairs with a zero denominator are left out."""
    if len(ours) != len(theirs):
        raise ValueError(f"pairs need equal counts, got {len(ours)} and {len(theirs)}")
    return [a / b for a, b in zip(ours, theirs) if b]


def aggregate_tok_s(timings: Sequence[RequestTiming]) -> float:
    """Generated tokens of all requests ÷ (first request start → last token of any request)."""
    if not timings:
        return 0.0
    span = max(t.end for t in timings) - min(t.start for t in timings)
    return sum(t.generated_tokens for t in timings) / span if span > 0 else 0.0


def acceptance_rate(drafted: int, accepted: int) -> float | None:
    """Accepted ÷ drafted tokens of speculative decoding; None when nothing was drafted."""
    return accepted / drafted if drafted > 0 else None


def draft_totals(rows: Sequence[dict]) -> dict:
    """Drafted and accepted tokens summed over the rows, and the pooled acceptance rate."""
    drafted = sum(row["draft_tokens"] for row in rows)
    accepted = sum(row["draft_accepted"] for row in rows)
    return {"draft_tokens": drafted, "draft_accepted": accepted, "acceptance_rate": acceptance_rate(drafted, accepted)}
