"""How well the next MoE layer's experts can be guessed a layer ahead: the share of a layer's top-k
that its router, applied to the previous MoE layer's input (the residual stream one layer earlier),
already picks. That guess is what prefetch copies in ahead (runtime/engine/experts.py), so this
share bounds the misses prefetch can take off the critical path.

    python benchmarks/expert_guess.py --artifact ART [--tokens 256] [--seed 0] [--out FILE]

The engine runs --tokens token ids (drawn at random with --seed: the router's statistics, not the
text, are what is measured) through the model in one pass on the CPU, every layer's routing read
from the forward's expert hook. Reported per layer and overall: the guess's share of the top-k,
the same for the previous token's choice at the same layer (a history guess), and the share a
uniform guess would reach (k / experts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _overlap(a, b) -> list:
    """Per token, the share of b's experts that a also holds (a, b: [T, k] integer tensors)."""
    return [len(set(x) & set(y)) / len(y) for x, y in zip(a.tolist(), b.tolist())]


def measure(artifact: Path, tokens: int, seed: int) -> dict:
    import torch

    from gemmactl.runtime import backend_class

    start = time.perf_counter()
    backend = backend_class("int4")(str(artifact), context_size=max(tokens + 8, 256))
    model = backend.model
    load_s = time.perf_counter() - start
    if model.experts is None:
        raise SystemExit(f"{artifact}: not an MoE model")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.spec.vocab, (tokens,), generator=generator)
    chosen, guessed = {}, {}

    def hook(call):
        block = call.block
        chosen[block.layer] = call.experts.clone()
        if block.next is not None:
            guessed[block.next.layer] = block.next.route(call.residual)[1].clone()
        return call.run()

    start = time.perf_counter()
    with torch.inference_mode():
        x, per_layer = model.embed_tokens(ids)
        model.forward(x, per_layer, torch.arange(tokens), end=tokens, experts_of=hook)
    model.reset()
    run_s = time.perf_counter() - start
    layers, ahead_all, history_all = [], [], []
    for layer in sorted(guessed):
        ahead = _overlap(guessed[layer], chosen[layer])
        history = _overlap(chosen[layer][:-1], chosen[layer][1:])
        ahead_all += ahead
        history_all += history
        layers.append({"layer": layer, "ahead": round(statistics.mean(ahead), 4),
                       "history": round(statistics.mean(history), 4)})
    top_k = model.experts.top_k
    experts = len(model.experts.store.records) // len(model.experts.blocks)
    return {"artifact": str(artifact), "tokens": tokens, "seed": seed, "top_k": top_k, "experts": experts,
            "uniform_guess": round(top_k / experts, 4), "ahead": round(statistics.mean(ahead_all), 4),
            "history": round(statistics.mean(history_all), 4), "layers": layers,
            "load_s": round(load_s, 1), "run_s": round(run_s, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = measure(args.artifact, args.tokens, args.seed)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
