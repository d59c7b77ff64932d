"""The expert cache's policies on synthetic routing traces: hit rate and bytes over the link per token.

What a policy keeps depends only on the order of lookups, not on the device, so this replays
routing traces through the engine's own `ExpertCache` (runtime/engine/experts.py) in the order the
engine looks experts up (per token, layer by layer, a layer's experts ascending, the layer's own
experts kept from eviction) — no model, no GPU. The traces are synthetic, and say so:

  uniform   each token picks top_k distinct experts per layer uniformly (a random router's
            traffic, the worst case for any cache);
  zipf S    each layer ranks its experts in a random order and picks top_k distinct ones with
            probability ∝ 1/rank^S (S = 0.8, 1.2: moderately and strongly skewed; trained MoE
            models put most of their traffic on a small share of experts).

The first --warmup tokens fill the cache and are not counted. Defaults: the 26B-A4B shape (30 MoE
layers, 128 experts, 8 per token) and the cache the 4 GiB plan gives it on an H200 (369 experts);
a miss crosses the link with the expert's stored bytes (3.35 MB).

    python benchmarks/expert_policies.py [--capacity 369] [--tokens 600] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from gemmactl.runtime.engine.expert_settings import POLICIES
from gemmactl.runtime.engine.experts import ExpertCache


def trace(router: str, skew: float, layers: int, experts: int, top_k: int, tokens: int, seed: int) -> torch.Tensor:
    """[tokens, layers, top_k] expert ids, distinct within a (token, layer)."""
    generator = torch.Generator().manual_seed(seed)
    if router == "uniform":
        weights = torch.ones(layers, experts)
    else:
        ranks = torch.stack([torch.randperm(experts, generator=generator) for _ in range(layers)]) + 1
        weights = ranks.double() ** -skew
    picks = torch.multinomial(weights.repeat(tokens, 1), top_k, replacement=False, generator=generator)
    return picks.reshape(tokens, layers, top_k)


def replay(picks: torch.Tensor, capacity: int, policy: str, warmup: int) -> dict:
    cache = ExpertCache(capacity, policy)
    hits = misses = 0
    for token, per_layer in enumerate(picks.tolist()):
        for layer, chosen in enumerate(per_layer):
            held = set()
            for expert in sorted(chosen):
                key = (layer, expert)
                slot = cache.lookup(key)
                if slot is None:
                    cache.admit(key, keep=held)
                held.add(key)
                if token >= warmup:
                    hits += slot is not None
                    misses += slot is None
    return {"hit_rate": round(hits / max(hits + misses, 1), 4), "misses_per_token": round(misses / max(len(picks) - warmup, 1), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=369)
    parser.add_argument("--expert-mb", type=float, default=3.35, help="stored bytes of one expert (MB)")
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    routers = [("uniform", 0.0), ("zipf", 0.8), ("zipf", 1.2)]
    rows = []
    for router, skew in routers:
        picks = trace(router, skew, args.layers, args.experts, args.top_k, args.tokens, args.seed)
        for policy in POLICIES:
            start = time.perf_counter()
            result = replay(picks, args.capacity, policy, args.warmup)
            rows.append({"router": router if router == "uniform" else f"zipf {skew}", "policy": policy, **result,
                         "link_MB_per_token": round(result["misses_per_token"] * args.expert_mb, 1),
                         "replay_s": round(time.perf_counter() - start, 1)})
    out = {"command": " ".join(["python", *sys.argv]), "shape": {"layers": args.layers, "experts": args.experts,
           "top_k": args.top_k}, "capacity": args.capacity, "tokens": args.tokens, "warmup": args.warmup, "rows": rows}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=2)
    print("| router (synthetic) | policy | hit rate | misses per token | link MB per token |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['router']} | {row['policy']} | {row['hit_rate']:.1%} | {row['misses_per_token']} | "
              f"{row['link_MB_per_token']} |")


if __name__ == "__main__":
    main()
