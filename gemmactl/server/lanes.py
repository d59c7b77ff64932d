"""Per-tier admission: a bounded queue in front of the backend's slots, and the tier's counters.

A request takes a free slot of its backend at once, or waits in its tier's queue; when the
queue already holds `bound` requests it is refused (the front answers 503 with Retry-After, or
hands it to a peer). Tiers that share a backend share its slots but keep their own queue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from gemmactl.errors import GemmactlError
from gemmactl.recipes import Tier
from gemmactl.server.backends import READY

RATE_WINDOW_S = 10.0  # tok/s in /metrics is over this trailing window


class Saturated(GemmactlError):
    """The tier's queue is full."""


class Unavailable(GemmactlError):
    """The tier's backend is not ready (starting, restarting, failed) or could not be made."""


@dataclass
class TierCounters:
    requests: int = 0  # admitted (ran or queued)
    completed: int = 0
    errors: int = 0
    rejected: int = 0  # 503: queue full or backend down
    forwarded: int = 0  # handed to a peer
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the server's prompt cache
    cache_hits: int = 0  # requests that reused at least one cached token
    generated_tokens: int = 0
    draft_tokens: int = 0
    draft_accepted: int = 0
    ttft_s_total: float = 0.0
    recent: deque = field(default_factory=deque)  # (finish time, generated tokens)


class Lane:
    """One tier: its recipe settings, its backend (or why it has none), its queue and counters."""

    def __init__(self, tier: Tier, backend, bound: int, *, unavailable: str | None = None):
        self.tier = tier
        self.name = tier.name
        self.backend = backend
        self.bound = bound
        self.unavailable = unavailable
        self.waiting = 0
        self.running = 0
        self.counters = TierCounters()
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        if self.backend is None:
            return "unavailable"
        return self.backend.state

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.state == READY

    @property
    def saturated(self) -> bool:
        return self.waiting >= self.bound

    @contextmanager
    def slot(self, timeout: float) -> Iterator[None]:
        """Hold one of the backend's slots for a request; wait in the queue or refuse."""
        if not self.ready:
            raise Unavailable(self.unavailable or f"tier '{self.name}' is {self.state}")
        slots = self.backend.slots
        with self._lock:
            if slots.acquire(blocking=False):
                got = True
            elif self.waiting >= self.bound:
                self.counters.rejected += 1
                raise Saturated(f"tier '{self.name}' is saturated: {self.waiting} requests queued (--queue {self.bound})")
            else:
                got = False
                self.waiting += 1
            self.counters.requests += 1
        if not got:
            try:
                got = slots.acquire(timeout=timeout)
            finally:
                with self._lock:
                    self.waiting -= 1
            if not got:
                with self._lock:
                    self.counters.errors += 1
                raise Saturated(f"tier '{self.name}' did not get a slot within {timeout:.0f} s")
        with self._lock:
            self.running += 1
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1
            slots.release()

    def record(self, stats, counters: dict | None) -> None:
        """Add a finished generation to the counters."""
        now = time.monotonic()
        with self._lock:
            c = self.counters
            c.completed += 1
            c.prompt_tokens += stats.prompt_tokens
            c.generated_tokens += stats.generated_tokens
            c.ttft_s_total += stats.ttft_s
            if counters:
                c.cached_tokens += counters["cached_tokens"]
                c.cache_hits += counters["cached_tokens"] > 0
                c.draft_tokens += counters["draft_tokens"]
                c.draft_accepted += counters["draft_accepted"]
            c.recent.append((now, stats.generated_tokens))
            self._trim(now)
        answered = getattr(self.backend, "answered", None)  # a llama-server tier's draft tuner measures it
        if answered is not None:
            answered(stats, counters)

    def count(self, what: str) -> None:
        with self._lock:
            setattr(self.counters, what, getattr(self.counters, what) + 1)

    def tok_s(self) -> float:
        """Generated tokens per second over the trailing window."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self.counters.recent) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        recent = self.counters.recent
        while recent and recent[0][0] < now - RATE_WINDOW_S:
            recent.popleft()

    def snapshot(self) -> dict:
        """The tier as /health, /metrics and `ps` show it."""
        c = self.counters
        backend = self.backend
        data = {
            "state": self.state, "queue": self.waiting, "queue_bound": self.bound, "running": self.running,
            "requests": c.requests, "completed": c.completed, "errors": c.errors, "rejected": c.rejected,
            "forwarded": c.forwarded, "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
            "cache_hits": c.cache_hits, "generated_tokens": c.generated_tokens, "tok_s": round(self.tok_s(), 2),
            "mean_ttft_s": round(c.ttft_s_total / c.completed, 4) if c.completed else None,
            "draft_tokens": c.draft_tokens, "draft_accepted": c.draft_accepted,
            "draft_acceptance": round(c.draft_accepted / c.draft_tokens, 4) if c.draft_tokens else None,
        }
        if backend is None:
            data["reason"] = self.unavailable
        else:
            info = backend.info
            data.update({
                "backend": info.kind, "model": info.model_path, "parallel": info.parallel, "context": info.context,
                "shared_with": [t for t in info.tiers if t != self.name], "placement": info.placement,
                "speculative": info.speculative, "pid": backend.pid, "restarts": backend.restarts,
            })
            tuner = getattr(backend, "speculation", None)  # a tier's speculation tuner, if it has a draft
            if tuner is not None:
                data["speculation"] = tuner()
        return data
