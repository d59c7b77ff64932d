"""A decode step's attention scores as one product per KV head (ops.key_scores) against the einsum
it replaced, side by side in one process, on the CPU.

    python benchmarks/key_scores.py ARTIFACT [--positions 128,1024,4000] [--steps 20] [--repeats 3]

The engine (bfloat16, every layer on the CPU) prefills a prompt of random tokens up to each
position, then times --steps one-token steps there, alternately with ops.key_scores and with
torch.einsum("tkgd,skd->tkgs") swapped in; the median of --repeats, ms a step, and whether both
gave the same logits. JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.engine import model as engine_model
from gemmactl.runtime.engine.model import GemmaModel


def einsum_scores(qg, k):
    return torch.einsum("tkgd,skd->tkgs", qg, k)


def steps_at(engine, position: int, steps: int) -> tuple[float, torch.Tensor]:
    """Seconds a step from position on, and the last step's logits."""
    with torch.inference_mode():
        logits = None
        start = time.perf_counter()
        for p in range(position, position + steps):
            logits = engine.step(torch.tensor([2]), torch.tensor([p]), p + 1)
        return (time.perf_counter() - start) / steps, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--positions", default="128,1024,4000")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    engine = GemmaModel(open_artifact(args.artifact), device="cpu", dtype=torch.bfloat16,
                        context=max(positions) + args.steps + 1)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 1000, (max(positions),), generator=generator)
    products = {"key_scores": engine_model.key_scores, "einsum": einsum_scores}
    results = {}
    for position in positions:
        times = {name: [] for name in products}
        last = {}
        for _ in range(args.repeats):
            for name, product in products.items():
                engine_model.key_scores = product
                with torch.inference_mode():
                    engine.reset()
                    for start in range(0, position, 256):
                        stop = min(position, start + 256)
                        engine.step(prompt[start:stop], torch.arange(start, stop), stop)
                seconds, last[name] = steps_at(engine, position, args.steps)
                times[name].append(seconds)
        engine_model.key_scores = products["key_scores"]
        ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
        results[position] = {"key_scores_ms": round(ms["key_scores"], 2), "einsum_ms": round(ms["einsum"], 2),
                             "speedup": round(ms["einsum"] / ms["key_scores"], 3),
                             "same_logits": bool(torch.equal(last["key_scores"], last["einsum"]))}
        print(position, results[position], file=sys.stderr, flush=True)
    print(json.dumps({"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
