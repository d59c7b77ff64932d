"""Run gemmactl with the MoE engine's routers skewed on purpose (synthetic), for cache measurements.

A random model's routers spread tokens evenly over the experts, the worst case for any expert
cache; trained MoE models put most of their traffic on a few experts. This gives a random model a
known skew without touching its weights or the engine: each MoE layer's router logits are
standardized per token (mean 0, standard deviation 1 over the experts) and become

    logits'[e] = 1.2825 * z[e] - S * log(rank_layer(e))

where rank_layer is a random order of the layer's experts (ranks 1..E, seeded by the layer) and S
the Zipf exponent. Top-k of a log-weight plus Gumbel noise is sampling k experts without
replacement with probability proportional to the weight (the Gumbel-top-k identity); here the
noise is the router's own standardized logits scaled to the Gumbel's standard deviation (π/√6),
so each token picks its k experts close to Zipf(S) over the layer's ranking, and the choice stays a
deterministic function of the hidden state (greedy decoding is still exact, cache on or off).
The top-k weights follow from the same logits, as the engine computes them.

    python benchmarks/skewed_router.py --zipf 1.0 -- run --recipe R --tier engine --json "prompt"

Everything after `--` is gemmactl's command line. S = 0 keeps the standardization only (uniform).
"""

from __future__ import annotations

import argparse
import math
import sys

GUMBEL_STD = math.pi / math.sqrt(6)


def install(zipf: float, seed: int = 0) -> None:
    """Wrap the router projection of every MoE block the engine builds from now on."""
    import torch

    from gemmactl.runtime.engine import experts

    build = experts.MoEExperts.block

    def block(self, layer: int, router: dict):
        count = sum(1 for at, _ in self.store.records if at == layer)  # the layer's experts
        generator = torch.Generator().manual_seed(seed * 100_003 + layer)
        ranks = torch.randperm(count, generator=generator).add_(1).double()
        bias = (-zipf * ranks.log()).float().to(router["scale"].device)
        proj = router["proj"]

        def skewed(h):
            logits = proj(h).float()
            z = (logits - logits.mean(dim=-1, keepdim=True)) / logits.std(dim=-1, keepdim=True).clamp_min(1e-6)
            return GUMBEL_STD * z + bias

        return build(self, layer, {**router, "proj": skewed})

    experts.MoEExperts.block = block


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zipf", type=float, required=True, help="Zipf exponent S over each layer's experts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv[:split])
    install(args.zipf, args.seed)
    from gemmactl.cli import main as gemmactl

    sys.argv = ["gemmactl", *argv[split + 1:]]
    gemmactl()


if __name__ == "__main__":
    main()
