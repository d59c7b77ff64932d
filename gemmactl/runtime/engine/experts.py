"""MoE experts in the engine: every expert kept in host memory as stored, a cache of them on the device.

Gemma 4 26B-A4B has 128 experts per layer and routes each token to 8: its int4 experts do not fit
a 4 GiB card, but a token reads a few of them. So the experts stay in host memory as the artifact
stores them (int4 codes, views of the mapped shards: nothing is read until an expert is used),
and an `ExpertCache` of a fixed number of slots keeps recently or frequently used ones on the
device in the kernel's layout. A miss is copied in (evicting by the cache's policy) or computed on
the host from the stored codes; `MissRule` decides per layer and batch from the machine profile.
A share of each layer's experts may be homed on the host (`--expert-cpu-share`, the plan's
choice by default): computed there always, never cached or copied (ExpertStore.set_homes).
On CUDA the experts are first laid out in the kernel's layout in pinned host memory
(runtime/engine/expert_arena.py), so a miss is one asynchronous copy overlapped with the compute
of the experts before it; int4 experts stay as stored and one token's products run in the grouped
Triton kernel, eager or captured (tinygemm, with columns padded where needed, where Triton is
missing or GEMMACTL_ENGINE_INT4=tinygemm).

The block computes exactly what transformers' Gemma 4 MoE block computes, expert by expert in
ascending order with each expert's tokens grouped (its weights read once per step), so the
answer does not depend on whether an expert was cached: greedy tokens are the same with the cache
on or off and under every policy (tests/test_engine_experts.py). One exception on a GPU: an
expert computed on the host (the miss rule's choice) runs the host's kernel, whose sums can differ
from the device's in the last bits; a homed expert is computed on the host whatever the cache, so
it changes nothing here. On a machine
without a GPU the host stands in for the device: the cache, its policy and its counters run,
and copies are memory copies.

Policies (`--expert-policy`):
  lru  evict the expert used longest ago;
  lfu  (the default) evict the least used, counts halved every AGE_EVERY lookups so old
       favourites fade;
  hot  a pinned set learned from the counts (re-learned every AGE_EVERY lookups: the most used
       experts, up to PINNED_SHARE of the slots, are never evicted), the other slots LRU.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gemmactl.runtime.engine.expert_settings import DEFAULT_POLICY, POLICIES, ExpertSettings
from gemmactl.runtime.engine.ops import expert_forward, rms_norm

AGE_EVERY = 4096  # lookups between halving the counts (lfu) or re-learning the pinned set (hot)
PINNED_SHARE = 0.75  # of the slots, at most, pinned by the hot policy


class ExpertCache:
    """Which (layer, expert) keys hold a device slot, by policy; counts every lookup.

    Pure bookkeeping: the caller keeps what each slot holds. capacity 0 is the cache turned off
    (every lookup a miss, nothing kept).
    """

    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY):
        if policy not in POLICIES:
            raise ValueError(f"unknown expert policy {policy!r} (known: {', '.join(POLICIES)})")
        self.capacity, self.policy = max(0, int(capacity)), policy
        self.slots: OrderedDict = OrderedDict()  # key → slot index, least recently used first
        self.free = list(range(self.capacity))[::-1]
        self.counts: dict = {}  # key → uses (decayed for lfu/hot)
        self.uses: dict = {}  # key → uses, never decayed (what the counters report)
        self.pinned: set = set()
        self.hits = self.misses = self.lookups = 0
        self.version = 0  # bumped whenever a slot changes hands (a device table of slots follows it)
        # lfu: a heap of (count, last use, key), entries made stale by a later use skipped, so a
        # victim costs a pop or a few rather than a scan of every slot (the engine's host time).
        self._heap: list = []
        self._last_use: dict = {}  # key → the push of its last use (ties go to the least recent)
        self._pushes = 0

    def lookup(self, key) -> int | None:
        """The key's slot on a hit (and a use counted), else None (a miss, counted)."""
        self.lookups += 1
        self.counts[key] = self.counts.get(key, 0) + 1
        self.uses[key] = self.uses.get(key, 0) + 1
        if self.lookups % AGE_EVERY == 0:
            self._age()
        slot = self.slots.get(key)
        if slot is None:
            self.misses += 1
            return None
        self.hits += 1
        self.slots.move_to_end(key)
        self._push(key)
        return slot

    def admit(self, key, keep=frozenset()) -> tuple[int | None, object]:
        """A slot for key after a miss: (slot, the key evicted from it or None); (None, None) when
        the cache keeps nothing (capacity 0, or every slot pinned or in keep)."""
        if self.capacity == 0:
            return None, None
        if self.free:
            slot, evicted = self.free.pop(), None
        else:
            evicted = self._victim(keep)
            if evicted is None:
                return None, None
            slot = self.slots.pop(evicted)
        self.slots[key] = slot
        self._push(key)
        self.version += 1
        return slot, evicted

    def _push(self, key) -> None:
        if self.policy == "lfu":
            self._pushes += 1
            self._last_use[key] = self._pushes
            heapq.heappush(self._heap, (self.counts.get(key, 0), self._pushes, key))
            if len(self._heap) > 8 * self.capacity + 1024:
                self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self.counts.get(key, 0), self._last_use[key], key) for key in self.slots]
        heapq.heapify(self._heap)

    def _victim(self, keep=frozenset()):
        if self.policy == "lfu":  # the least used; ties: the least recently used
            skipped, victim = [], None
            while self._heap:
                count, last, key = heapq.heappop(self._heap)
                if key not in self.slots or self._last_use.get(key) != last or self.counts.get(key, 0) != count:
                    continue  # stale: used again since, evicted, or aged
                if key in keep:
                    skipped.append((count, last, key))
                    continue
                victim = key
                break
            for entry in skipped:
                heapq.heappush(self._heap, entry)
            return victim
        # lru, and hot's unpinned slots: the least recently used
        return next((key for key in self.slots if key not in self.pinned and key not in keep), None)

    def _age(self) -> None:
        if self.policy == "lfu":
            self.counts = {key: count // 2 for key, count in self.counts.items() if count > 1}
            self._rebuild()
        elif self.policy == "hot":
            ranked = sorted(self.counts, key=lambda key: -self.counts[key])
            self.pinned = set(ranked[: int(self.capacity * PINNED_SHARE)]) & set(self.slots)
            self.counts = {key: count // 2 for key, count in self.counts.items() if count > 1}

    def stats(self) -> dict:
        return {"policy": self.policy, "capacity_experts": self.capacity, "hits": self.hits, "misses": self.misses,
                "hit_rate": round(self.hits / (self.hits + self.misses), 4) if self.hits + self.misses else None,
                "pinned": len(self.pinned)}




@dataclass
class MissRule:
    """Copy a missed expert to the device, or compute it on the host, by which is priced lower:
    the copy moves the expert's stored bytes over the link once; the host is still priced as it
    used to run, decoding the stored codes into a dense matrix and reading it (its dense bytes
    written and read at the host's memory bandwidth), so a GPU machine copies. The host now runs
    an expert in torch's CPU int4 kernel (ExpertStore.host_linears, runtime/engine/cpu_kernels.py),
    and the experts it always computes are chosen once, apart from this rule (ExpertStore.set_homes:
    an expert's device then never depends on the cache, so neither do the tokens), priced by the
    plan (plan/engine_map.expert_split). Without a separate device (the host standing in) there is
    nothing to choose: copy."""

    link_bytes_s: float = 0.0  # host → device
    host_bytes_s: float = 0.0  # host memory bandwidth as the host kernel reaches it
    host_latency_s: float = 0.0
    forced: str | None = None  # "copy" | "cpu" (measurements, tests)

    def choose(self, stored_bytes: int, dense_bytes: int, separate_device: bool) -> str:
        if self.forced:
            return self.forced
        if not separate_device or not self.link_bytes_s or not self.host_bytes_s:
            return "copy"
        copy = stored_bytes / self.link_bytes_s
        host = 2 * dense_bytes / self.host_bytes_s + self.host_latency_s
        return "cpu" if host < copy else "copy"


@dataclass
class ExpertCounters:
    tokens: int = 0  # tokens routed through MoE blocks (per layer, summed)
    steps: int = 0
    copied: int = 0
    copied_bytes: int = 0
    decode_tokens: int = 0  # one-token steps (per layer, summed), and the bytes they moved over the link
    decode_bytes: int = 0
    host_computed: int = 0  # expert uses computed on the host
    prefetched: int = 0  # experts copied in ahead of their layer
    prefetch_hits: int = 0  # ... and then used from the cache
    uses: int = 0  # expert uses (an expert once per step, whatever its tokens)
    per_layer_uses: dict = field(default_factory=dict)


class ExpertStore:
    """Every expert of the MoE layers as stored (host memory, views of the artifact's mapped
    shards), and the device slots the cache hands out."""

    def __init__(self, artifact, names: dict, device, dtype, make_linear, repack=None):
        """names: {layer: (gate_up stack name, down stack name)}."""
        self.artifact, self.device, self.dtype = artifact, torch.device(device), dtype
        self.make_linear, self.repack = make_linear, repack
        self.records: dict = {}  # (layer, expert) → (gate_up record, down record)
        for layer, (gate_up, down) in names.items():
            ups = {r.expert: r for r in artifact.records_of(gate_up)}
            downs = {r.expert: r for r in artifact.records_of(down)}
            for expert in sorted(ups):
                self.records[(layer, expert)] = (ups[expert], downs[expert])
        from gemmactl.runtime.engine.kernels import linear_bytes

        cuda, width = self.device.type == "cuda", torch.empty((), dtype=dtype).element_size()
        # A device slot holds an expert in the kernel's layout; a copy moves its stored bytes.
        self.expert_bytes = max((sum(linear_bytes(r.scheme, tuple(r.shape), r.group_size, cuda=cuda, dtype_bytes=width,
                                                 pad=True) for r in pair) for pair in self.records.values()), default=0)
        self.stored_bytes = max((a.nbytes + b.nbytes for a, b in self.records.values()), default=0)
        self.dense_bytes = max((sum(_count(r.shape) * width for r in pair) for pair in self.records.values()), default=0)
        self.slots: dict = {}  # slot → (gate_up Linear, down Linear) on the device (without an arena)
        self.host: dict = {}  # key → (gate_up Linear, down Linear) on the host (misses computed there)
        from gemmactl.runtime.engine.expert_arena import ExpertRows

        self.rows = ExpertRows(0)  # the slots' rows on a host standing in for the device (keep(); sized by MoEExperts)
        self.homed: frozenset = frozenset()  # experts always computed on the host (set_homes)
        self.host_rows = ExpertRows(len(self.records))  # host_linears' rows, one an expert
        self.host_row_of = {key: i for i, key in enumerate(sorted(self.records))}
        self.made = 0  # experts made in the CPU kernel's layout
        self.arena = None  # an ExpertArena, where the experts are laid out for copying (CUDA)
        self.layouts = None  # an ExpertLayouts: every expert's CPU layout mapped from a file (expert_layouts.py)

    def host_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.records.values())

    def set_homes(self, share: float) -> None:
        """Compute `share` of each MoE layer's experts on the host, always: the highest-numbered
        round(share × its experts). They are never cached or copied, so which device computes an
        expert does not depend on the cache, and the tokens do not either. Their rows in the CPU
        kernel's layout come first, so the chunks they fill are the only ones allocated."""
        homed = set()
        for layer in sorted({layer for layer, _ in self.records}):
            experts = sorted(expert for l, expert in self.records if l == layer)
            count = round(share * len(experts))
            homed.update((layer, expert) for expert in experts[len(experts) - count:])
        self.homed = frozenset(homed)
        order = sorted(self.homed) + sorted(set(self.records) - self.homed)
        self.host_row_of = {key: i for i, key in enumerate(order)}

    def keep(self, slot: int, linears: tuple) -> tuple:
        """linears as the cache's slot keeps them: on a host standing in for the device, with the
        experts in the CPU kernels, copied into the slot's row (expert_arena.ExpertRows)."""
        if self.device.type != "cpu":
            return linears
        return self._put(self.rows, slot, linears)

    def _put(self, rows, row: int, linears: tuple) -> tuple:
        """linears moved into a row where they run in the CPU int4 kernel (else as they are); every
        TRIM_EVERY experts made, the temporaries freed go back to the system
        (cpu_kernels.release_freed_memory says why)."""
        from gemmactl.runtime.engine.cpu_kernels import TRIM_EVERY, release_freed_memory

        if not all(linear.kernel == "int4-cpu" for linear in linears) or all(linear.mapped for linear in linears):
            return linears  # not in the CPU kernel, or pages of the layout file already
        self.made += 1
        if self.made % TRIM_EVERY == 0:
            release_freed_memory()
        return rows.put(row, linears)

    def host_linears(self, key) -> tuple:
        """The expert's Linears on the host, for a miss computed there: made on its first such use
        and kept (in torch's CPU int4 kernel that is its stored bytes again; runtime/engine/cpu_kernels.py)."""
        linears = self.host.get(key)
        if linears is None:
            linears = self.host[key] = self._put(self.host_rows, self.host_row_of[key],
                                                 self.linears(key, torch.device("cpu")))
        return linears

    def linears(self, key, device) -> tuple:
        """The expert's two matrices as Linears on device, made from the stored codes (on the
        host, views of the layout file where there is one)."""
        up, down = self.records[key]
        if self.layouts is not None and device.type == "cpu":
            return self.layouts.linear(up), self.layouts.linear(down)
        cuda = device.type == "cuda"
        return (self.make_linear(self.artifact, up, device, self.dtype, self.repack if cuda else None, pad=True),
                self.make_linear(self.artifact, down, device, self.dtype, self.repack if cuda else None, pad=True))


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _token_groups(experts: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(expert, positions, top-k slots)] for every expert the tokens chose, ascending, each
    expert's tokens in transformers' order (by slot, then token), from one read of the router's
    choice (experts [T, k]) and one copy of the groups back to its device. Found an expert at a
    time on the device (torch.where(experts == expert)), each would wait for the GPU, so the host
    could not queue the next expert's copy and compute while this one's ran."""
    tokens, k = experts.shape
    chosen = experts.to("cpu").reshape(-1)  # token-major: entry t·k + s
    positions = torch.arange(tokens).repeat_interleave(k)
    slots = torch.arange(k).repeat(tokens)
    order = torch.argsort(chosen * (tokens * k) + slots * tokens + positions)  # every key distinct
    ranked = chosen[order]
    names, counts = torch.unique_consecutive(ranked, return_counts=True)
    both = torch.stack([positions[order], slots[order]]).to(experts.device)  # [2, T·k]
    groups, start = [], 0
    for expert, count in zip(names.tolist(), counts.tolist()):
        groups.append((expert, both[0, start:start + count], both[1, start:start + count]))
        start += count
    return groups


class MoEBlock:
    """One layer's router and experts (Gemma 4): the part of the feed-forward that MoE layers add."""

    def __init__(self, layer: int, router: dict, store: ExpertStore, cache: ExpertCache, rule: MissRule,
                 counters: ExpertCounters, top_k: int, eps: float, hidden: int):
        self.layer, self.router, self.store, self.cache, self.rule = layer, router, store, cache, rule
        self.counters, self.top_k, self.eps, self.hidden = counters, top_k, eps, hidden
        self.next: MoEBlock | None = None  # the next MoE layer's block, for prefetch
        self.prefetch = False
        self.prefetched: set = set()  # shared by the model's blocks: keys copied in ahead, not used yet
        self.staged_rows: torch.Tensor | None = None  # [k] on the device: an addressed step's rows (stage)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, experts [T, k]) for the residual stream x [T, H]."""
        h = rms_norm(x, None, self.eps) * self.router["scale"] * self.hidden ** -0.5
        probs = torch.softmax(self.router["proj"](h), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.router["per_expert_scale"][experts], experts

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The experts' sum for x [T, H] (pre_feedforward_layernorm_2 applied), routed from the
        residual stream before the feed-forward norms, as transformers routes it."""
        weights, experts = self.route(residual)
        return self.combine(x, residual, weights, experts)

    def combine(self, x: torch.Tensor, residual: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """The experts' sum for x [T, H] with the router's choice already made (route())."""
        self.counters.tokens += x.shape[0]
        before = self.counters.copied_bytes
        out = self._combine(x, residual, weights, experts)
        if x.shape[0] == 1:
            self.counters.decode_tokens += 1
            self.counters.decode_bytes += self.counters.copied_bytes - before
        return out

    def _combine(self, x, residual, weights, experts):
        if self.store.arena is not None:
            out = self._from_arena(x, weights, experts)
            if self.prefetch and self.next is not None:
                self.next.fetch_ahead(residual)
            return out
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # one token: its k distinct experts, without grouping (the same sums)
            picked = experts[0].tolist()
            for expert in sorted(picked):  # ascending, as transformers adds them
                j = picked.index(expert)
                out.add_((self._run((self.layer, expert), x) * weights[:, j:j + 1]).to(out.dtype))
            if self.prefetch and self.next is not None:
                self.next.fetch_ahead(residual)
            return out
        for expert, positions, slots in _token_groups(experts):  # ascending, as transformers adds them
            y = self._run((self.layer, expert), x[positions])
            y = y * weights[positions, slots, None]
            out.index_add_(0, positions, y.to(out.dtype))
        if self.prefetch and self.next is not None:
            self.next.fetch_ahead(residual)
        return out

    def fetch_ahead(self, residual: torch.Tensor) -> None:
        """Copy in the experts this layer's router picks for residual (the previous MoE layer's
        input: a guess, since this layer sees that stream after one more layer's work). Only
        where the cache can keep them; lookups and hit counts are left alone."""
        store, cache = self.store, self.cache
        _, experts = self.route(residual)
        for expert in torch.unique(experts).tolist():
            key = (self.layer, expert)
            if key in cache.slots or key in store.homed:
                continue
            slot, _ = cache.admit(key)
            if slot is None:
                return
            if store.arena is not None:
                store.arena.fill(key, slot)
            else:
                store.slots[slot] = store.keep(slot, store.linears(key, store.device))
            self.prefetched.add(key)
            self.counters.prefetched += 1
            self.counters.copied_bytes += store.stored_bytes

    def _lookup(self, key) -> int | None:
        """The key's slot on a hit (uses and prefetch hits counted), else None."""
        counters = self.counters
        counters.uses += 1
        counters.per_layer_uses[self.layer] = counters.per_layer_uses.get(self.layer, 0) + 1
        if key in self.store.homed:  # computed on the host, always: the cache never sees it
            return None
        slot = self.cache.lookup(key)
        if slot is not None and key in self.prefetched:
            self.prefetched.discard(key)
            counters.prefetch_hits += 1
        return slot

    def _on_host(self, x: torch.Tensor, key) -> bool:
        """Whether a miss is computed on the host: an expert homed there (ExpertStore.set_homes),
        and every expert of a layer the plan put on the host. (Forced, the host path runs on a
        machine without a GPU as well: the same arithmetic, uncached.)"""
        store = self.store
        if key in store.homed:
            return True
        separate = store.device.type != "cpu"
        if separate and x.device.type == "cpu":
            return True
        return (self.rule.choose(store.stored_bytes, store.dense_bytes, separate) == "cpu"
                and (separate or bool(self.rule.forced)))

    def _host(self, key, x: torch.Tensor) -> torch.Tensor:
        self.counters.host_computed += 1
        return expert_forward(self.store.host_linears(key), x.to("cpu")).to(x.device)

    def _from_arena(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts' sum with every device expert read from an arena row. Where each expert
        comes from is decided before anything is launched, and this layer's experts are kept from
        eviction meanwhile, so no copy overwrites a row a later expert of the layer reads; the
        copies are queued first and each expert's compute waits only for its own."""
        store, cache, counters, arena = self.store, self.cache, self.counters, self.store.arena
        tokens = x.shape[0]
        picked = experts[0].tolist() if tokens == 1 else None  # one token: one sync, no grouping
        groups = _token_groups(experts) if picked is None else None  # several: one sync for all
        order = sorted(set(picked)) if picked is not None else [expert for expert, _, _ in groups]
        sources, held = [], {(self.layer, expert) for expert in order}  # none evicted while the layer runs
        for expert in order:  # ascending, as transformers adds them
            key = (self.layer, expert)
            slot = self._lookup(key)
            if slot is None and self._on_host(x, key):
                sources.append("host")
            elif slot is None:
                counters.copied += 1
                counters.copied_bytes += store.stored_bytes
                slot, _ = cache.admit(key, keep=held)
                if slot is not None:
                    arena.fill(key, slot)
                sources.append(slot if slot is not None else "scratch")
            else:
                sources.append(slot)
        scratch = [i for i, source in enumerate(sources) if source == "scratch"]
        rows: dict = {}

        def fill_scratch(n: int) -> None:  # the n-th scratch miss, into the row the (n-2)-th freed
            if n < len(scratch):
                rows[scratch[n]] = arena.scratch()
                arena.fill((self.layer, order[scratch[n]]), rows[scratch[n]])

        fill_scratch(0)
        out = torch.zeros_like(x)
        scratch_seen = 0
        for i, (expert, source) in enumerate(zip(order, sources)):
            key = (self.layer, expert)
            if source == "scratch":
                scratch_seen += 1
                fill_scratch(scratch_seen)  # the next one, into the row the one before this freed
                source = rows[i]
            if picked is not None:  # one token: every picked expert reads it
                y = self._host(key, x) if source == "host" else arena.row_forward(source, x)
                slot_of = picked.index(expert)
                out.add_((y * weights[:, slot_of:slot_of + 1]).to(out.dtype))
            else:
                _, positions, slots = groups[i]
                y = self._host(key, x[positions]) if source == "host" else expert_forward(arena.linears(source),
                                                                                          x[positions])
                out.index_add_(0, positions, (y * weights[positions, slots, None]).to(out.dtype))
            if source != "host":
                arena.release(source)
        return out

    def stage(self, experts: torch.Tensor, guess: torch.Tensor | None = None,
              x: torch.Tensor | None = None, choice: torch.Tensor | None = None) -> list | None:
        """For one token's step captured in graphs (runtime/engine/graph_moe.py): make the experts
        the router chose (experts [1, k]) ready for staged_sum, in ascending order. The cache is
        looked up and filled as combine() does. Addressed (arena.addressed), a hit is read where it
        lies and a miss crosses the link into its slot (or, where the cache does not keep it, its
        staging row), a miss guessed a layer ahead (stage_ahead) is read in the ahead row it
        landed in and copied on into its slot beside the next piece, not before it, and the k rows
        go to the device for staged_sum (self.staged_rows); otherwise every
        expert is copied into its staging row: a hit from its slot, a miss over the link and, where
        the cache keeps it, on into its slot. An expert homed on the host (ExpertStore.set_homes)
        is computed there from x [1, H] (the experts' input) while the copies cross, and its output
        crosses instead, into the arena's host outputs, where staged_sum takes it in place of its
        row's.

        guess [1, k]: the next MoE layer's experts as guessed in the same piece; returned as a list
        for stage_ahead, read here before the copies are queued (once they are, reading a device
        tensor would wait for them). choice [1, 2k]: experts and guess side by side, made in the
        same piece, read in one go where given (each read of a device tensor is a copy and a wait)."""
        store, cache, counters, arena = self.store, self.cache, self.counters, self.store.arena
        # Waits for the router: the copies depend on its choice.
        if choice is not None and guess is not None:
            both = choice[0].tolist()
            order, guessed = sorted(both[:self.top_k]), both[self.top_k:]
        else:
            order = sorted(experts[0].tolist())
            guessed = guess[0].tolist() if guess is not None else None
        held = {(self.layer, expert) for expert in order}
        counters.tokens += 1
        counters.decode_tokens += 1
        before = counters.copied_bytes
        addressed = arena.addressed
        moves, homed, rows = [], [], []  # rows: where the addressed step reads each expert
        later = []  # addressed: guessed misses into their slots, beside the next piece (which reads their ahead rows)
        for j, expert in enumerate(order):
            key, row = (self.layer, expert), arena.staging + j
            slot = self._lookup(key)
            if key in store.homed:
                homed.append((j, key))
                rows.append(row)  # read for nothing: staged_sum takes the host's output
                continue
            if slot is not None:
                if addressed:
                    rows.append(slot)
                else:
                    moves.append((slot, row))
                continue
            counters.copied += 1
            ahead = arena.ahead_keys.get(key)
            if ahead is not None:  # guessed a layer ahead: over the link already (counted then)
                counters.prefetch_hits += 1
                source = ahead
            else:
                counters.copied_bytes += store.stored_bytes
                source = key
            slot, _ = cache.admit(key, keep=held)
            if addressed and ahead is not None and arena.read_ahead:  # read where it landed; its slot filled off the step's path
                rows.append(ahead)
                if slot is not None:
                    later.append((ahead, slot))
            elif addressed:
                rows.append(row if slot is None else slot)
                moves.append((source, rows[-1]))
            else:
                moves.append((source, row))
                if slot is not None:
                    moves.append((row, slot))
        counters.decode_bytes += counters.copied_bytes - before
        # The homed experts' input, read before the copies are queued: the compute stream then
        # waits for them, and a read of x behind them would hold the host's work until they landed.
        host_x = None
        if homed:
            if x is None:
                raise ValueError("a staged step with experts homed on the host needs their input x")
            host_x = x.to("cpu")
        if addressed:
            arena.move(moves, rows, self.staged_rows, later)  # first, so the link works while the host computes
        else:
            arena.move(moves)
        if arena.host_out is not None:
            flags = arena.host_flags_pinned
            flags.zero_()
            for j, key in homed:
                counters.host_computed += 1
                arena.host_out_pinned[j:j + 1].copy_(expert_forward(store.host_linears(key), host_x))
                flags[j] = True
            arena.send_host_outputs(bool(homed))
        return guessed

    def stage_ahead(self, guess: list) -> None:
        """For a step captured in pieces: copy the experts this layer's router picks for the
        previous MoE layer's residual stream (guess: k experts, computed in the piece before and
        read by that layer's stage) into the arena's ahead rows, where they are not cached. The
        copies cross the link while the next piece computes; this layer's stage() then takes its
        guessed misses from the ahead rows within the device. The cache is neither looked up nor
        changed (hits, misses and admissions are those without prefetch), so where an expert
        comes from is all that differs: the same products, the same tokens. A router's choice one
        layer ahead holds about three quarters of the layer's experts on a random 26B-A4B-shaped
        model (benchmarks/expert_guess.py, docs/benchmarks.md)."""
        store, arena, counters = self.store, self.store.arena, self.counters
        keys = [(self.layer, expert) for expert in sorted(set(guess))]
        keys = [key for key in keys if key not in self.cache.slots and key not in store.homed]
        arena.prefetch(keys)
        counters.prefetched += len(arena.ahead_keys)
        counters.copied_bytes += len(arena.ahead_keys) * store.stored_bytes
        counters.decode_bytes += len(arena.ahead_keys) * store.stored_bytes

    def staged_sum(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts' sum for one token x [1, H] from the rows stage() named (addressed) or
        filled (the staging rows), with no host decision in it (so it can be captured): the same
        products, added in the same ascending order, as combine() computes."""
        arena = self.store.arena
        ranked = weights[:, torch.argsort(experts[0])]  # [1, k]: the j-th expert's weight, ascending
        # [k, H] in one grouped launch where the arena is addressable (rows_forward), else expert by expert
        every = (arena.rows_forward(self.staged_rows, x) if arena.addressed
                 else arena.rows_forward(arena.staging_ids(self.top_k), x) if arena.addressable() else None)
        out = torch.zeros_like(x)
        for j in range(self.top_k):
            y = every[j:j + 1] if every is not None else expert_forward(arena.staged(j), x)
            if arena.host_out is not None:  # the host's output where it computed the j-th expert
                y = torch.where(arena.host_flags[j], arena.host_out[j:j + 1], y)
            out.add_((y * ranked[:, j:j + 1]).to(out.dtype))
        return out

    def table_sum(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  fetched=None) -> torch.Tensor:
        """The experts' sum for one token x [1, H] with no host decision in it (graph_moe.TableDecode
        captures the whole step): each chosen expert is read where the device table says it lies,
        a cache slot or its pinned host row (read in place over the link), by the grouped int4
        kernel, one launch for the k gate_up products and one for the k down products. The chosen
        experts go to the step's record for the host's bookkeeping after the token. fetched: a
        function (order, entries) → entries, where the step fetched guessed experts into ahead rows
        (MoEExperts.fetched_entries). The same products, added in the same ascending order, as
        combine() computes."""
        table = self.table  # set by MoEExperts.enable_table: [E, 6] addresses of this layer's experts
        order, where = torch.sort(experts[0])  # ascending experts, and the top-k slot each came from
        self.record.copy_(order)
        entries = table.index_select(0, order)
        if fetched is not None:
            entries = fetched(order, entries)
        y = self.store.arena.addresses_forward(entries, x)  # [k, H]
        ranked = weights[:, where]  # [1, k]
        out = torch.zeros_like(x)
        for j in range(self.top_k):
            out.add_((y[j:j + 1] * ranked[:, j:j + 1]).to(out.dtype))
        return out

    def _run(self, key, x: torch.Tensor) -> torch.Tensor:
        store, counters = self.store, self.counters
        slot = self._lookup(key)
        if slot is not None:
            return expert_forward(store.slots[slot], x)
        if self._on_host(x, key):
            return self._host(key, x)
        linears = store.linears(key, store.device)
        counters.copied += 1
        counters.copied_bytes += store.stored_bytes
        slot, _ = self.cache.admit(key)
        if slot is not None:
            linears = store.slots[slot] = store.keep(slot, linears)
        return expert_forward(linears, x)


ADMIT_ENV = "GEMMACTL_ENGINE_TABLE_ADMIT"  # the whole step's admissions a token: a number (default: every one)


def admit_budget() -> int | None:
    """How many misses a token the whole step's cache may admit (ADMIT_ENV; None: as many as its
    policy admits). There a miss is read over the link inside the step and each admission crosses
    it again beside the next step, so with a router that spreads its experts the admissions can
    move as many bytes as the step itself (measurements: benchmarks/engine_capped.py). A
    measurement knob, like the engine's others: a value that is not a whole number is the default."""
    import os

    value = os.environ.get(ADMIT_ENV, "").strip()
    return int(value) if value.isdigit() else None


class MoEExperts:
    """A model's experts: the store, the cache and the counters its MoE blocks share."""

    def __init__(self, model, settings: ExpertSettings):
        from gemmactl.runtime.engine.kernels import make_linear
        from gemmactl.runtime.engine.spec import hf_text_config

        artifact, names = model.artifact, {}
        stored = set(artifact.tensor_names())
        for layer in model.spec.layers:
            up, down = (f"{model.prefix}layers.{layer.index}.experts.{part}" for part in ("gate_up_proj", "down_proj"))
            if up in stored and down in stored:
                names[layer.index] = (up, down)
        # No repack cache: an expert's tinygemm layout is made on each copy (the cache's slots
        # are its only device copies).
        self.store = ExpertStore(artifact, names, model.device, model.dtype, make_linear)
        if self.store.device.type == "cpu" and settings.arena is not True:
            from gemmactl.runtime.engine.cpu_kernels import cpu_kernels_kept
            from gemmactl.runtime.engine.expert_layouts import open_or_make
            from gemmactl.runtime.engine.kernels import _dense_forced

            if cpu_kernels_kept(model.dtype, dense_forced=_dense_forced()):
                self.store.layouts = open_or_make(artifact, self.store.records, settings.progress)
        self.top_k = int(hf_text_config(artifact.config).top_k_experts)
        if settings.cpu_share:
            self.store.set_homes(settings.cpu_share)
            self._make_homes(settings.progress)
        total = len(self.store.records) - len(self.store.homed)  # the experts the cache may hold
        if settings.cache_bytes is None:
            capacity = total
        else:
            capacity = min(total, settings.cache_bytes // max(self.store.expert_bytes, 1))
        self.cache = ExpertCache(capacity, settings.policy)
        self.store.rows.count = capacity
        if settings.arena if settings.arena is not None else self.store.device.type == "cuda":
            from gemmactl.runtime.engine.expert_arena import ExpertArena

            # Prefetch's ahead rows (two sets of top_k: expert_arena.py) come out of the cache's
            # room (so the plan's budget holds); with room for every expert there is nothing to fetch ahead.
            ahead = self.top_k if settings.prefetch and capacity < total else 0
            capacity = max(0, capacity - 2 * ahead)
            self.cache = ExpertCache(capacity, settings.policy)
            self.store.rows.count = capacity
            self.store.arena = ExpertArena(self.store, capacity, staging=self.top_k, ahead=ahead,
                                           hidden=model.spec.hidden)
        self.counters = ExpertCounters()
        self.rule = settings.rule if isinstance(settings.rule, MissRule) else MissRule()
        if settings.miss:
            self.rule = MissRule(self.rule.link_bytes_s, self.rule.host_bytes_s, self.rule.host_latency_s, settings.miss)
        self.prefetch, self._prefetched, self.blocks = settings.prefetch, set(), []
        self.fetching = False  # the whole step's fetch ahead (enable_table)
        self.admit_budget, self._flushes = admit_budget(), 0  # the whole step's admissions (keep_record)
        self.eps, self.hidden = model.spec.eps, model.spec.hidden

    def _make_homes(self, progress) -> None:
        """Every homed expert in the CPU kernel's layout now, not at its first use in a step."""
        store = self.store
        homed = sorted(store.homed)
        for i, key in enumerate(homed):
            store.host_linears(key)
            if progress is not None:  # in stored bytes, as the layout file's progress counts
                progress((i + 1) * store.stored_bytes, len(homed) * store.stored_bytes)

    def block(self, layer: int, router: dict) -> MoEBlock:
        """The block of the next MoE layer (layers are built in order)."""
        block = MoEBlock(layer, router, self.store, self.cache, self.rule, self.counters, self.top_k, self.eps,
                         self.hidden)
        block.prefetch, block.prefetched = self.prefetch, self._prefetched
        arena = self.store.arena
        if arena is not None:  # the rows an addressed captured step reads this layer's experts from
            block.staged_rows = torch.arange(arena.staging, arena.staging + self.top_k, device=self.store.device)
        if self.blocks:
            self.blocks[-1].next = block
        self.blocks.append(block)
        return block

    def stats(self) -> dict:
        self.flush()
        return summarize(self.cache, self.counters, self.store)

    # --- the device table of where each expert lies (graph_moe.TableDecode) ---

    def table_ready(self) -> bool:
        """Whether the experts can run from a device table: on CUDA, in an arena, every expert in
        the layout the grouped kernel reads."""
        from gemmactl.runtime.engine.kernels import Int4GroupsLinear

        arena = self.store.arena
        return (arena is not None and arena.cuda and bool(self.blocks) and not self.store.homed
                and all(isinstance(linear, Int4GroupsLinear) for linear in arena.template))

    def enable_table(self) -> None:
        """Allocate the device table ([blocks × E, 6] addresses) and the step's record of chosen
        experts ([blocks, k]), and fill the table from the cache."""
        arena, device = self.store.arena, self.store.device
        self.per_layer = max(expert for _, expert in self.store.records) + 1
        self.table = torch.zeros((len(self.blocks) * self.per_layer, 6), dtype=torch.int64, device=device)
        self.record = torch.zeros((len(self.blocks), self.top_k), dtype=torch.int64, device=device)
        # Two host copies of the record, in turn: a step's is read while the next one runs.
        self.record_host = torch.zeros((2, *self.record.shape), dtype=torch.int64).pin_memory()
        self.index = {block.layer: i for i, block in enumerate(self.blocks)}
        for i, block in enumerate(self.blocks):
            block.table = self.table[i * self.per_layer:(i + 1) * self.per_layer]
            block.record = self.record[i]
        self._host_addresses = {key: arena.addresses(arena.rows[key], on_device=False) for key in self.store.records}
        self._slot_addresses = [arena.addresses(slot, on_device=True) for slot in range(self.cache.capacity)]
        self._pending: list = []  # (the event after a replay, its host copies) whose record is not yet read
        self._replays = 0
        self._evictions_done = None  # after the last evictions' table writes (write buffer 0 free again)
        self._side_done = None  # the last admissions' copies and table writes
        # Table writes go through buffers made once (a step allocates nothing): [0] on the compute
        # stream, [1] on the arena's; at most every expert of a step evicted and admitted.
        most = 2 * len(self.blocks) * self.top_k
        self._rows_host = torch.zeros((2, most), dtype=torch.int64).pin_memory()
        self._values_host = torch.zeros((2, most, 6), dtype=torch.int64).pin_memory()
        self._rows_device = torch.zeros((2, most), dtype=torch.int64, device=device)
        self._values_device = torch.zeros((2, most, 6), dtype=torch.int64, device=device)
        self.fetching = bool(self.prefetch and arena.ahead_count >= self.top_k)
        if self.fetching:
            self._enable_fetch()
        self.rebuild_table()

    def _enable_fetch(self) -> None:
        """The state of the whole step's fetch ahead (graph_moe.TableDecode): for every table row,
        its expert's pinned host row (where a copy reads it) and that row's first address (an entry
        still equal to it is read over the link); each block's fetched experts ([blocks, k], -1
        where none), for the next block's lookups and the host's counts; the two sets of ahead rows
        the blocks fill in turn (their bases and table entries); a stream for the copies."""
        arena, device, k = self.store.arena, self.store.device, self.top_k
        keys = sorted(self.store.records, key=self._row_of)
        rows = torch.tensor([self._row_of(key) for key in keys], dtype=torch.int64)
        self.host_base = torch.zeros(len(self.table), dtype=torch.int64)
        self.host_base[rows] = torch.tensor([arena.host_ptrs[arena.rows[key]] for key in keys], dtype=torch.int64)
        self.host_first = torch.zeros(len(self.table), dtype=torch.int64)
        self.host_first[rows] = torch.tensor([self._host_addresses[key][0] for key in keys], dtype=torch.int64)
        self.host_base, self.host_first = self.host_base.to(device), self.host_first.to(device)
        self.fetched = torch.full((len(self.blocks), k), -1, dtype=torch.int64, device=device)
        self.fetched_host = torch.zeros((2, *self.fetched.shape), dtype=torch.int64).pin_memory()
        self._guess = torch.zeros_like(self.fetched)
        ahead = [[arena.ahead + s * arena.ahead_count + j for j in range(k)] for s in range(2)]
        self.ahead_base = torch.tensor([[arena.on_device[row].data_ptr() for row in rows_] for rows_ in ahead],
                                       dtype=torch.int64, device=device)  # [2, k]
        self.ahead_entries = torch.tensor([[arena.addresses(row, on_device=True) for row in rows_] for rows_ in ahead],
                                          dtype=torch.int64, device=device)  # [2, k, 6]
        self.anchor = arena.on_device.view(torch.int32)
        self.fetch_stream = torch.cuda.Stream(device)
        self._fetch_done: dict = {}  # block index → the event its fetch recorded

    def fetch(self, block: MoEBlock, guess: torch.Tensor) -> None:
        """Inside the whole step, on the fetch stream: copy the experts guess [k] (the block's router
        applied to the previous MoE layer's residual stream) whose table entries say they are read
        over the link into this block's set of ahead rows, and note them in self.fetched; the block's
        table_sum then reads them there (fetched_entries). Nothing in the cache changes: which
        experts the cache holds, and so its counts, are those without the fetch. The copies run
        beside the previous block's experts; the set they fill was last read two blocks before."""
        from gemmactl.runtime.engine.int4_gemv import copy_rows

        i = self.index[block.layer]
        compute = torch.cuda.current_stream(self.store.device)
        self._guess[i].copy_(guess)  # kept: nothing the copy stream reads is freed on the compute stream
        self.fetch_stream.wait_stream(compute)  # the guess, and the set's last reader
        with torch.cuda.stream(self.fetch_stream):
            rows = i * self.per_layer + self._guess[i]
            guess = self._guess[i]
            remote = self.table.index_select(0, rows)[:, 0] == self.host_first.index_select(0, rows)  # [k]
            self.fetched[i].copy_(torch.where(remote, guess, -1))
            copy_rows(self.host_base.index_select(0, rows), self.ahead_base[i % 2], remote,
                      self.store.arena.row_bytes, self.anchor)
            done = torch.cuda.Event()
            done.record(self.fetch_stream)
        self._fetch_done[i] = done

    def fetched_entries(self, block: MoEBlock, order: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """The table entries [k, 6] of the block's experts order [k], with the ones its fetch copied
        in pointing at their ahead rows (after waiting for the fetch's copies)."""
        i = self.index[block.layer]
        done = self._fetch_done.pop(i, None)
        if done is None:
            return entries
        torch.cuda.current_stream(self.store.device).wait_event(done)
        match = order[:, None] == self.fetched[i][None, :]  # [k, k]: order[j] fetched into ahead row m
        where = match.to(torch.int8).argmax(dim=1)
        return torch.where(match.any(dim=1, keepdim=True), self.ahead_entries[i % 2].index_select(0, where), entries)

    def _row_of(self, key) -> int:
        layer, expert = key
        return self.index[layer] * self.per_layer + expert

    def _entry(self, key) -> list:
        slot = self.cache.slots.get(key)
        return self._slot_addresses[slot] if slot is not None else self._host_addresses[key]

    def rebuild_table(self) -> None:
        """Write every entry from the cache (after eager steps changed it: a prefill, a verify
        step), once the copies into the slots have landed."""
        arena = self.store.arena
        stream = torch.cuda.current_stream(self.store.device)
        for row, event in enumerate(arena.ready):
            if event is not None:
                stream.wait_event(event)
                arena.ready[row] = None
        if self._side_done is not None:
            stream.wait_event(self._side_done)
        values = torch.tensor([self._entry(key) for key in sorted(self.store.records, key=self._row_of)],
                              dtype=torch.int64)
        rows = torch.tensor([self._row_of(key) for key in sorted(self.store.records, key=self._row_of)])
        self.table.index_copy_(0, rows.to(self.table.device), values.to(self.table.device))
        self.table_version = self.cache.version

    def replayed(self) -> None:
        """After a replay of the whole step: its record is read back, and acted on, at the next
        step (the caller has read the token by then, so the wait costs nothing)."""
        done = torch.cuda.Event()
        turn = self._replays % 2
        self._replays += 1
        self.record_host[turn].copy_(self.record, non_blocking=True)
        if self.fetching:
            self.fetched_host[turn].copy_(self.fetched, non_blocking=True)
        done.record(torch.cuda.current_stream(self.store.device))
        self.store.arena.graph_done = done
        self._pending.append((done, turn))

    def flush(self) -> None:
        """Count the last replayed step's experts, and queue what the cache decided: the evicted
        experts' entries back to their host rows (on the compute stream, before the next replay),
        then the admitted experts' copies and their entries (on the arena's stream, overlapping the
        next step: until an entry is written the step reads that expert from its host row)."""
        self.flush_behind(0)

    def flush_behind(self, keep: int) -> None:
        """flush() for every replayed step but the last `keep`: with keep 1, called right after a
        replay is launched, the step before it is counted and its admissions queued while this one
        runs, so the host's bookkeeping is off the step's path (its evictions' table writes follow
        this replay on the compute stream and the admissions' copies wait for them: nothing this
        replay reads is overwritten)."""
        pending = getattr(self, "_pending", None) or []
        while len(pending) > keep:
            with torch.inference_mode():  # the slots and the table are inference tensors
                self._flush(*pending.pop(0))

    def _flush(self, done, turn: int) -> None:
        done.synchronize()
        chosen = self.record_host[turn].tolist()
        fetched = self.fetched_host[turn].tolist() if self.fetching else [[]] * len(chosen)
        # Whether the table follows the cache before this record: an eager step (a prefill) since
        # the replay may have moved experts, and then only rebuild_table makes them agree again.
        synced = self.table_version == self.cache.version
        evicted, admitted = self.keep_record(chosen, fetched)
        cache, counters, store, arena = self.cache, self.counters, self.store, self.store.arena
        if not evicted and not admitted:
            return
        # Every key whose slot changed points at its host row first (one evicted and admitted again
        # in this flush included), so no step reads a slot while a copy overwrites it; then the
        # keys the cache holds now get their slots, each after its copy.
        touched = list(dict.fromkeys(evicted + [key for key, _ in admitted]))
        placed = [(key, cache.slots[key]) for key in dict.fromkeys(key for key, _ in admitted) if key in cache.slots]
        compute = torch.cuda.current_stream(store.device)
        if self._side_done is not None:  # the last admissions' writes land before these (and free buffer 1)
            self._side_done.synchronize()
        if self._evictions_done is not None:  # buffer 0's last writes have read it
            self._evictions_done.synchronize()
        self._write(0, touched, [self._host_addresses[key] for key in touched])
        before = self._evictions_done = torch.cuda.Event()
        before.record(compute)
        with torch.cuda.stream(arena.stream):
            arena.stream.wait_event(before)
            for key, slot in placed:
                arena.on_device[slot].copy_(arena.host_rows[arena.rows[key]], non_blocking=True)
                counters.copied_bytes += arena.row_bytes
                counters.decode_bytes += arena.row_bytes
            self._write(1, [key for key, _ in placed], [self._slot_addresses[slot] for _, slot in placed])
            self._side_done = torch.cuda.Event()
            self._side_done.record(arena.stream)
        for _, slot in placed:  # an eager step reading the slot waits for its copy
            arena.ready[slot] = self._side_done
        if synced:  # else left behind, so the next replay rebuilds the table first
            self.table_version = cache.version

    def keep_record(self, chosen: list, fetched: list) -> tuple[list, list]:
        """The host's side of a whole step's record: for each block, its chosen experts (k) and those
        its fetch copied into ahead rows (k, -1 where none). Counts the lookups, hits, misses and
        bytes over the link (a fetched expert's when fetched, another miss's as read in place) and
        admits the misses by the cache's policy, at most admit_budget a token (the blocks then
        take turns to go first): (evicted keys, [(admitted key, slot)])."""
        cache, counters, store = self.cache, self.counters, self.store
        evicted, admitted = [], []
        first = self._flushes % len(self.blocks) if self.admit_budget is not None else 0
        self._flushes += 1
        rows = list(zip(self.blocks, chosen, fetched))
        for block, experts, ahead in rows[first:] + rows[:first]:
            held = {(block.layer, expert) for expert in experts}
            ahead = {expert for expert in ahead if expert >= 0}
            counters.tokens += 1
            counters.decode_tokens += 1
            counters.prefetched += len(ahead)
            counters.copied_bytes += len(ahead) * store.stored_bytes
            counters.decode_bytes += len(ahead) * store.stored_bytes
            for expert in experts:
                key = (block.layer, expert)
                if block._lookup(key) is not None:
                    continue
                counters.copied += 1
                if expert in ahead:  # read in its ahead row, over the link already
                    counters.prefetch_hits += 1
                else:  # read over the link, in place
                    counters.copied_bytes += store.stored_bytes
                    counters.decode_bytes += store.stored_bytes
                if self.admit_budget is not None and len(admitted) >= self.admit_budget:
                    continue  # not kept: each admission crosses the link again, beside the next step
                slot, gone = cache.admit(key, keep=held)
                if slot is None:
                    continue
                if gone is not None:
                    evicted.append(gone)
                admitted.append((key, slot))
        return evicted, admitted

    def _write(self, buffer: int, keys: list, entries: list) -> None:
        """Queue table writes on the current stream through write buffer `buffer` (its last writes
        have run: buffer 0's before the replay the caller waited for, buffer 1's before _side_done)."""
        n = len(keys)
        if not n:
            return
        self._rows_host[buffer, :n] = torch.tensor([self._row_of(key) for key in keys], dtype=torch.int64)
        self._values_host[buffer, :n] = torch.tensor(entries, dtype=torch.int64)
        rows, values = self._rows_device[buffer, :n], self._values_device[buffer, :n]
        rows.copy_(self._rows_host[buffer, :n], non_blocking=True)
        values.copy_(self._values_host[buffer, :n], non_blocking=True)
        self.table.index_copy_(0, rows, values)


def summarize(cache: ExpertCache, counters: ExpertCounters, store: ExpertStore) -> dict:
    """What run --stats, --json and bench report about the experts."""
    uses = max(counters.uses, 1)
    layers = len(counters.per_layer_uses)
    per_token = counters.copied_bytes / counters.tokens * layers if counters.tokens else 0
    per_decode = counters.decode_bytes / counters.decode_tokens * layers if counters.decode_tokens else None
    return {**cache.stats(), "prefetched": counters.prefetched, "prefetch_hits": counters.prefetch_hits,
            "expert_bytes": store.expert_bytes, "experts_host_bytes": store.host_bytes(),
            "cache_bytes": cache.capacity * store.expert_bytes, "copied": counters.copied,
            "link_bytes_per_token": round(per_token),
            "link_bytes_per_decode_token": None if per_decode is None else round(per_decode),
            "host_share": round(counters.host_computed / uses, 4),
            # how the arena's copies are queued (device_copies): the driver's calls or torch's copy_
            "copies": None if store.arena is None or not store.arena.cuda else
            "driver" if store.arena.driver is not None else "torch"}
