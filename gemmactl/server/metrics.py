"""What the server says about itself: /health, /v1/models and /metrics (Prometheus text or JSON)."""

from __future__ import annotations

import time


def health(service) -> dict:
    """ok: every tier ready; degraded: some; down: none."""
    tiers = {name: lane.snapshot() for name, lane in service.lanes.items()}
    ready = [lane.ready for lane in service.lanes.values()]
    status = "ok" if all(ready) else "degraded" if any(ready) else "down"
    return {"status": status, "recipe": service.recipe.name, "default_tier": service.recipe.default_tier,
            "tiers": tiers, "peers": service.peers.snapshot()}


def models(service) -> dict:
    """The tiers, and `auto`: the router picks a tier per request, as `gemmactl run` does."""
    auto = {"state": "ready" if any(lane.ready for lane in service.lanes.values()) else "unavailable",
            "description": f"routes each request by its prefix or the heuristic; default tier {service.recipe.default_tier}",
            "tiers": list(service.lanes)}
    data = [{"id": "auto", "object": "model", "created": 0, "owned_by": "gemmactl", "gemmactl": auto}]
    for name, lane in service.lanes.items():
        snap = lane.snapshot()
        data.append({"id": name, "object": "model", "created": 0, "owned_by": "gemmactl",
                     "gemmactl": {k: snap.get(k) for k in ("state", "backend", "model", "parallel", "context",
                                                             "speculative", "placement")}
                     | {"description": lane.tier.description}})
    return {"object": "list", "data": data}


def metrics_json(service) -> dict:
    return {"time": time.time(), "tiers": {name: lane.snapshot() for name, lane in service.lanes.items()},
            "peers": service.peers.snapshot()}


# metric name → (type, help, snapshot key)
_METRICS = (
    ("gemmactl_queue_depth", "gauge", "Requests waiting for a slot", "queue"),
    ("gemmactl_queue_bound", "gauge", "Most requests that may wait before 503", "queue_bound"),
    ("gemmactl_running", "gauge", "Requests holding a slot", "running"),
    ("gemmactl_requests_total", "counter", "Requests admitted", "requests"),
    ("gemmactl_completed_total", "counter", "Requests answered", "completed"),
    ("gemmactl_errors_total", "counter", "Requests that failed in the backend", "errors"),
    ("gemmactl_rejected_total", "counter", "Requests refused with 503 (queue full)", "rejected"),
    ("gemmactl_forwarded_total", "counter", "Requests handed to a peer", "forwarded"),
    ("gemmactl_prompt_tokens_total", "counter", "Prompt tokens of answered requests", "prompt_tokens"),
    ("gemmactl_cached_prompt_tokens_total", "counter", "Prompt tokens reused from the prompt cache", "cached_tokens"),
    ("gemmactl_cache_hits_total", "counter", "Requests that reused cached prompt tokens", "cache_hits"),
    ("gemmactl_generated_tokens_total", "counter", "Tokens generated", "generated_tokens"),
    ("gemmactl_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s", "tok_s"),
    ("gemmactl_draft_tokens_total", "counter", "Tokens drafted by speculative decoding", "draft_tokens"),
    ("gemmactl_draft_accepted_total", "counter", "Drafted tokens accepted", "draft_accepted"),
    ("gemmactl_backend_restarts_total", "counter", "Times the tier's backend was restarted", "restarts"),
)


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def metrics_text(service) -> str:
    """Prometheus text exposition: one series per tier."""
    snaps = {name: lane.snapshot() for name, lane in service.lanes.items()}
    lines = []
    for metric, kind, help_text, key in _METRICS:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
        for name, snap in snaps.items():
            lines.append(f'{metric}{{tier="{name}"}} {snap.get(key) or 0}')
    lines += ["# HELP gemmactl_backend_up 1 when the tier's backend is ready", "# TYPE gemmactl_backend_up gauge"]
    for name, snap in snaps.items():
        lines.append(f'gemmactl_backend_up{{tier="{name}"}} {1 if snap["state"] == "ready" else 0}')
    lines += ["# HELP gemmactl_backend_info The tier's backend, placement and speculative decoding",
              "# TYPE gemmactl_backend_info gauge"]
    for name, snap in snaps.items():
        labels = ",".join(f'{k}="{_label(snap.get(k) or "")}"' for k in ("backend", "model", "placement", "speculative"))
        lines.append(f'gemmactl_backend_info{{tier="{name}",{labels}}} 1')
    # The engine's speculation tuner (int4 tiers with a draft): its decision and what it bases it on.
    tuned = {name: snap["speculation"] for name, snap in snaps.items() if snap.get("speculation")}
    for metric, help_text, value in (
        ("gemmactl_speculation_on", "1 while the tuner speculates, 0 while it decodes plainly",
         lambda t: 1 if t["speculating"] else 0),
        ("gemmactl_speculation_draft_length", "Tokens the tuner drafts a round (0: not chosen yet)",
         lambda t: t["k"] or 0),
        ("gemmactl_speculation_acceptance", "The tuner's estimate of the draft's acceptance rate",
         lambda t: t["acceptance_estimate"]),
        ("gemmactl_speculation_predicted_speedup", "The tuner's predicted speed over plain decoding",
         lambda t: t["predicted_speedup"]),
    ):
        if not tuned:
            break
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
        for name, tuner in tuned.items():
            if value(tuner) is not None:
                lines.append(f'{metric}{{tier="{name}"}} {value(tuner)}')
    lines += ["# HELP gemmactl_peer_up 1 when the peer answered its last health check", "# TYPE gemmactl_peer_up gauge"]
    for peer in service.peers.snapshot():
        lines.append(f'gemmactl_peer_up{{peer="{_label(peer["url"])}"}} {1 if peer["healthy"] else 0}')
    return "\n".join(lines) + "\n"
