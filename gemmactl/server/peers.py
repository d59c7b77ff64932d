"""Other gemmactl servers to hand requests to when a local tier is down or saturated.

Each peer's /health is polled in the background; a peer is picked only if it answered its last
check and reports the tier ready with room in its queue. A forwarded request carries a header
that stops the peer from forwarding it again, so two servers that name each other never loop.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from gemmactl.errors import InvalidOptionError
from gemmactl.server.registry import fetch_health

FORWARDED_HEADER = "X-Gemmactl-Forwarded"
CHECK_INTERVAL_S = 1.0


@dataclass
class Peer:
    url: str
    healthy: bool = False
    health: dict = field(default_factory=dict)
    checked_at: float = 0.0
    forwarded: int = 0

    def can_take(self, tier: str | None) -> bool:
        if not self.healthy:
            return False
        tiers = self.health.get("tiers", {})
        candidates = [tiers[tier]] if tier in tiers else list(tiers.values())
        return any(t.get("state") == "ready" and t.get("queue", 0) < t.get("queue_bound", 1) for t in candidates)


def normalize_peer(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    if url.startswith("https://"):
        raise InvalidOptionError(f"--peer {url}: only http:// peers are supported")
    return url


class PeerSet:
    """The peers of one server and the thread that health-checks them."""

    def __init__(self, urls: list[str], interval: float = CHECK_INTERVAL_S):
        self.peers = [Peer(normalize_peer(url)) for url in urls]
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.peers:
            return
        self.check_all()
        self._thread = threading.Thread(target=self._loop, name="peer-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check_all(self) -> None:
        for peer in self.peers:
            health = fetch_health(peer.url, timeout=min(2.0, self.interval * 2))
            peer.healthy = health is not None and health.get("status") in ("ok", "degraded")
            peer.health = health or {}
            peer.checked_at = time.time()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.check_all()

    def pick(self, tier: str | None) -> Peer | None:
        """The first peer that can take a request for tier now."""
        return next((peer for peer in self.peers if peer.can_take(tier)), None)

    def snapshot(self) -> list[dict]:
        return [{"url": p.url, "healthy": p.healthy, "forwarded": p.forwarded} for p in self.peers]
