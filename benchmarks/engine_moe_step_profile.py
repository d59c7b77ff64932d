"""Where a captured MoE decode step's host time goes (the step in pieces, graph_moe.PiecewiseDecode),
at each share of every MoE layer's experts homed on the CPU, for each way of handing the pieces
their experts.

    python benchmarks/engine_moe_step_profile.py ARTIFACT --cache BYTES --shares 0,0.5 --modes pieces,copies

For each mode (GEMMACTL_ENGINE_MOE: pieces reads each expert in its row, copies copies every expert
into staging rows) and share: the model built on the GPU with every layer resident and an expert cache of BYTES
(the 4 GiB plan's room for a 26B-A4B shape, for instance), the step captured, 20 steps of random
tokens to warm the cache, 60 timed, then 40 under cProfile (the host's functions by their own
time: the router reads, the copies queued, the CPU kernel's products). Prints the step time, the
cache's counters and the profile's top rows. With `--timeline N`, N more steps under torch's
profiler with the device's activity: how long a step the link carried copies to the device, the
device copied within itself, and kernels ran, each as the union of its intervals (so a step's
share of each: is the step bound by the link, the GPU, or neither, i.e. the host), and with
`--kernels N` the top N kernels and copies by device time. `--copies
driver,torch` runs each mode with the arena's copies queued either way (device_copies.py), and
`--read-ahead on,off` with a guessed miss read in its ahead row or copied into its row first,
`--ahead-after off,on` with the next layer's guessed copies queued before the next piece's launch
or after it, `--fused off,on` with the pieces unfused or fused by torch.compile before capture
(GEMMACTL_ENGINE_COMPILE; the setup time, compile included, is printed);
`--zipf S` skews the routers (benchmarks/skewed_router.py, synthetic).
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
    parser.add_argument("--copies", default="driver", help="GEMMACTL_ENGINE_COPIES values, comma-separated")
    parser.add_argument("--read-ahead", default="on", help="on,off: whether a piece reads a guessed miss in its "
                                                             "ahead row (off: copied into its row first)")
    parser.add_argument("--ahead-after", default="off", help="off,on: the next layer's guessed copies queued "
                                                              "before the next piece's launch, or after it")
    parser.add_argument("--fused", default="off", help="off,on: the pieces fused by torch.compile before capture "
                        "(GEMMACTL_ENGINE_COMPILE=on) or not")
    parser.add_argument("--timeline", type=int, default=0, help="steps under torch's profiler (0: none)")
    parser.add_argument("--kernels", type=int, default=0,
                        help="with --timeline: print the device's top N kernels and copies by time (0: none)")
    parser.add_argument("--zipf", type=float, help="skew the routers: Zipf S over each layer's experts "
                                                   "(benchmarks/skewed_router.py, synthetic)")
    args = parser.parse_args()

    import torch

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.expert_settings import ExpertSettings
    from gemmactl.runtime.engine.device_copies import driver_copies
    from gemmactl.runtime.engine.graph import COMPILE_ENV, MOE_ENV, DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel

    if args.zipf is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from skewed_router import install

        install(args.zipf)
    artifact = open_artifact(args.artifact)
    ids = torch.randint(0, 200000, (200,), generator=torch.Generator().manual_seed(0))
    for share in (float(s) for s in args.shares.split(",")):
        torch.cuda.empty_cache()
        with torch.inference_mode():
            model = GemmaModel(artifact, device="cuda", dtype=torch.bfloat16, context=1024,
                               experts=ExpertSettings(cache_bytes=args.cache, cpu_share=share))
        arena = model.experts.store.arena
        driver = driver_copies()
        variants = [(m, c, r, a, f) for m in args.modes.split(",") for c in args.copies.split(",")
                    for r in args.read_ahead.split(",") for a in args.ahead_after.split(",")
                    for f in args.fused.split(",") if m != "table" or f == "off"]  # fusing is the pieces'
        for mode, copies, read_ahead, after, fused in variants:
            os.environ[MOE_ENV] = mode  # one model, a step captured for each variant in turn
            os.environ[COMPILE_ENV] = fused
            arena.driver = driver if copies == "driver" else None
            arena.read_ahead = read_ahead == "on"
            step = DecodeStep(model)
            if hasattr(step.graph, "ahead_after_launch"):
                step.graph.ahead_after_launch = after == "on"
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
                timeline = device_timeline(step, ids, 120, args.timeline, args.kernels) if args.timeline else None
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
            lookups = (stats["hits"] + stats["misses"]) - (before["hits"] + before["misses"])
            hits = stats["hits"] - before["hits"]
            print(f"mode {mode} copies {stats['copies']} read-ahead {read_ahead} ahead-after {after} "
                  f"fused {step.compiled} (setup {step.setup_s:.1f} s) share {share}: expert_bytes {model.experts.store.expert_bytes} step "
                  f"{seconds * 1e3:.2f} ms ({1 / seconds:.1f} tok/s) hit {hits / max(lookups, 1):.3f} (timed steps) "
                  f"host {stats['host_share']} cap {stats['capacity_experts']} "
                  f"addressed {model.experts.store.arena.addressed}")
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))
            if timeline:
                table = timeline.pop("table", None)
                print("timeline a step, ms: " + " ".join(f"{name} {value:.2f}" for name, value in timeline.items()))
                if table:
                    print(table)
            del step
        del model


def _union(intervals: list) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def device_timeline(step, ids, first: int, count: int, kernels: int = 0) -> dict:
    """count steps (tokens ids[first:]) under torch's profiler; per step, in ms: the wall time, and
    the union of the device's intervals of each kind (copies host → device, within the device,
    kernels) and of all of them (the device busy at all); with kernels, also "table": the top
    `kernels` kernels and copies by device time over the count steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(first, first + count):
            step(ids[i:i + 1].cuda(), i)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kinds: dict = {"link": [], "within": [], "kernels": []}
    for event in prof.events():
        if str(getattr(event, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        span = (event.time_range.start, event.time_range.end)  # µs
        name = event.name.lower()
        if "memcpy" in name and "htod" in name:
            kinds["link"].append(span)
        elif "memcpy" in name or "memset" in name:
            kinds["within"].append(span)
        else:
            kinds["kernels"].append(span)
    every = [span for spans in kinds.values() for span in spans]
    out = {"wall": wall * 1e3 / count}
    out.update({name: _union(spans) / 1e3 / count for name, spans in kinds.items()})
    out["busy"] = _union(every) / 1e3 / count
    out["copies"] = len(kinds["link"]) / count
    if kernels:
        out["table"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=kernels,
                                                 max_name_column_width=70)
    return out


if __name__ == "__main__":
    main()
