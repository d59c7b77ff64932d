"""Where the engine keeps each layer (no torch here: the planner writes these).

A layer is one of:
- resident: its weights live on the device for good;
- streamed: its weights (in the device kernel's layout) live in pinned host memory and are
  copied into one of two staging areas on the device just before it runs; the copy of the next
  streamed layer overlaps the compute of this one (a side CUDA stream and events);
- host: it runs on the CPU (in torch's CPU int4/int8 kernels where the CPU has them, its KV cache
  there), the activations crossing the link twice; a captured step is cut around it
  (engine/graph_host.py).

Token and per-layer embedding tables may stay in host memory: only the rows of the current
tokens cross the link. engine/streaming.py moves the streamed layers. MoE experts always live in
host memory; expert_cache_bytes is the device room the plan left for caching them
(engine/experts.py; None: no plan said, room for every expert).
"""

from __future__ import annotations

from dataclasses import dataclass

RESIDENT, STREAMED, HOST = "resident", "streamed", "host"
KINDS = (RESIDENT, STREAMED, HOST)


@dataclass(frozen=True)
class EnginePlacement:
    """One kind per decoder layer, and where the embedding tables are."""

    layers: tuple[str, ...]
    tables_on_host: bool = False
    reason: str = ""
    expert_cache_bytes: int | None = None
    link_bytes_s: float | None = None  # the machine's host → device copy rate (the plan's profile)
    host_bytes_s: float | None = None  # the host's memory bandwidth as its kernels reach it
    expert_cpu_share: float | None = None  # MoE: the share of each layer's experts computed on the CPU

    @classmethod
    def all_resident(cls, n_layers: int, reason: str = "every layer on the device") -> "EnginePlacement":
        return cls((RESIDENT,) * n_layers, False, reason)

    def __post_init__(self):
        unknown = sorted(set(self.layers) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown layer placement {unknown[0]!r} (one of {', '.join(KINDS)})")

    @property
    def resident_only(self) -> bool:
        return all(kind == RESIDENT for kind in self.layers) and not self.tables_on_host

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layers if k == kind)

    def summary(self) -> str:
        parts = [f"{self.count(kind)} {kind}" for kind in KINDS if self.count(kind)]
        return ", ".join(parts) + (", tables in host memory" if self.tables_on_host else "")


def caches_on_host(layers, kinds: tuple[str, ...]) -> set[int]:
    """The layers whose KV caches live in host memory: those whose every reader (the layer, and
    the layers sharing its cache: each layer's kv_from) runs on the host. A GPU layer reading a
    cache in host memory would copy it across the link every token, and could not be captured;
    the plan makes no such placement, and a hand-made one keeps that cache on the device, where the
    host layer writes it (eagerly, across the link) and reads it back."""
    readers: dict[int, set[str]] = {}
    for layer in layers:
        readers.setdefault(layer.kv_from, set()).add(kinds[layer.index])
    return {owner for owner, where in readers.items() if where == {HOST}}
