"""Where a captured MoE decode step's host time goes (the step in pieces, graph_moe.PiecewiseDecode),
at each share of every MoE layer's experts homed on the CPU, for each way of handing the pieces
their experts.

    python benchmarks/engine_moe_step_profile.py ARTIFACT --cache BYTES --shares 0,0.5 --modes pieces,copies

For each mode (GEMMACTL_ENGINE_MOE: pieces reads each expert in its row, copies copies every expert
into staging rows) and share: the model built on the GPU with every layer resident and an expert cache of BYTES
(the 4 GiB plan's room for a 26B-A4B shape, for instance), the step captured, 20 steps of random
tokens to warm the cache, 60 timed, then 40 under cProfile (the host's functions by their own
time: the router reads, the copies queued, the CPU kernel's products). Prints the step time, the
cache's counters and the profile's top rows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--cache", type=int, required=True, help="device bytes for cached experts")
    parser.add_argument("--shares", default="0,0.5", help="--expert-cpu-share values, comma-separated")
    parser.add_argument("--modes", default="pieces", help="GEMMACTL_ENGINE_MOE values, comma-separated")
    parser.add_argument("--rows", type=int, default=18, help="profile rows printed")
    args = parser.parse_args()

    import torch

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.expert_settings import ExpertSettings
    from gemmactl.runtime.engine.graph import MOE_ENV, DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel

    artifact = open_artifact(args.artifact)
    ids = torch.randint(0, 200000, (200,), generator=torch.Generator().manual_seed(0))
    for share in (float(s) for s in args.shares.split(",")):
        torch.cuda.empty_cache()
        with torch.inference_mode():
            model = GemmaModel(artifact, device="cuda", dtype=torch.bfloat16, context=1024,
                               experts=ExpertSettings(cache_bytes=args.cache, cpu_share=share))
        for mode in args.modes.split(","):  # one model, a step captured for each mode in turn
            os.environ[MOE_ENV] = mode
            step = DecodeStep(model)
            with torch.inference_mode():
                for i in range(20):
                    step(ids[i:i + 1].cuda(), i)
                torch.cuda.synchronize()
                before = model.experts.stats()
                start = time.perf_counter()
                for i in range(20, 80):
                    step(ids[i:i + 1].cuda(), i)
                torch.cuda.synchronize()
                seconds = (time.perf_counter() - start) / 60
                stats = model.experts.stats()
                profiler = cProfile.Profile()
                profiler.enable()
                for i in range(80, 120):
                    step(ids[i:i + 1].cuda(), i)
                torch.cuda.synchronize()
                profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
            lookups = (stats["hits"] + stats["misses"]) - (before["hits"] + before["misses"])
            hits = stats["hits"] - before["hits"]
            print(f"mode {mode} share {share}: expert_bytes {model.experts.store.expert_bytes} step "
                  f"{seconds * 1e3:.2f} ms ({1 / seconds:.1f} tok/s) hit {hits / max(lookups, 1):.3f} (timed steps) "
                  f"host {stats['host_share']} cap {stats['capacity_experts']} "
                  f"addressed {model.experts.store.arena.addressed}")
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))
            del step
        del model

if __name__ == "__main__":
    main()
