"""Where a captured step with layers on the CPU spends its time (CUDA).

    python benchmarks/engine_host_step.py ARTIFACT PLAN.json [--steps 40] [--threads 16,8,4] [--start 5] [--plan-only]

PLAN.json: `gemmactl plan ARTIFACT --backend int4 ... --json`; its engine map's layers are loaded
as they are (the cap is not enforced), and:
- the step as planned (host pieces captured between the host's layers), ms a step at positions
  --start to --start + --steps (the cache before --start holds what empty held: timing only);
- one host layer alone on the CPU (the engine's own layer code, 1 token at position 100) at each
  thread count, and torch's profile of it at the first (the kernels against everything else);
- the same map with the streamed layers resident (the host's layers alone) and with the host's
  layers resident (the streamed layers alone).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.engine.graph import DecodeStep
from gemmactl.runtime.engine.graph_host import HostPiecesDecode
from gemmactl.runtime.engine.model import GemmaModel
from gemmactl.runtime.engine.placement import EnginePlacement


def timed_steps(artifact, layers: tuple, label: str, steps: int, first: int = 5):
    engine = GemmaModel(artifact, device="cuda", dtype=torch.bfloat16, context=4096,
                        placement=EnginePlacement(layers, tables_on_host=True))
    step = DecodeStep(engine)
    token = torch.tensor([2], device="cuda")
    with torch.inference_mode():
        for position in range(first - 5, first):
            step(token, position)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for position in range(first, first + steps):
            step(token, position)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
    print(f"{label}: {seconds * 1e3:.2f} ms/step at positions {first}-{first + steps - 1} ({1 / seconds:.1f} tok/s) threads {torch.get_num_threads()}",
          flush=True)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("plan", type=Path)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", default="16,8,4")
    parser.add_argument("--plan-only", action="store_true", help="only the planned step's timings")
    parser.add_argument("--start", default="5", help="first positions of the planned step's timings, comma-separated")
    args = parser.parse_args()
    artifact = open_artifact(args.artifact)
    plan = tuple(json.loads(args.plan.read_text())["engine"]["layers"])
    counts = {kind: plan.count(kind) for kind in ("host", "streamed")}
    label = f"plan ({counts['host']} host, {counts['streamed']} streamed)"
    engine = None
    for first in [int(p) for p in args.start.split(",")]:
        del engine  # one engine on the GPU at a time
        torch.cuda.empty_cache()
        engine = timed_steps(artifact, plan, label, args.steps, max(5, first))
    if args.plan_only:
        return
    layer = engine.layers[plan.index("host")]
    pieces = HostPiecesDecode(engine)
    pieces.host_x.copy_(torch.randn(pieces.host_x.shape, dtype=pieces.host_x.dtype))  # activations, not what empty held
    if pieces.host_per_layer is not None:
        pieces.host_per_layer.copy_(torch.randn(pieces.host_per_layer.shape, dtype=pieces.host_per_layer.dtype))
    threads = [int(t) for t in args.threads.split(",")]
    with torch.inference_mode():
        at, rope, _ = engine.inputs_on(engine.host, torch.tensor([100]), None)

        def once():
            engine.layer_forward(layer, pieces.host_x, at, rope, pieces.host_per_layer, end=101)

        for count in threads:
            torch.set_num_threads(count)
            for _ in range(3):
                once()
            start = time.perf_counter()
            for _ in range(30):
                once()
            print(f"one host layer alone, {count} threads: {(time.perf_counter() - start) / 30 * 1e3:.2f} ms", flush=True)
        torch.set_num_threads(threads[0])
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                once()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    del pieces, engine
    torch.cuda.empty_cache()
    timed_steps(artifact, tuple("resident" if k == "streamed" else k for k in plan),
                f"{counts['host']} host, rest resident (no copies)", args.steps)
    timed_steps(artifact, tuple("resident" if k == "host" else k for k in plan),
                f"{counts['streamed']} streamed, rest resident", args.steps)


if __name__ == "__main__":
    main()
