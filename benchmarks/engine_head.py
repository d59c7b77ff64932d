"""The engine's decode step with a tied int8 head against an int4 head of its own, side by side.

    python benchmarks/engine_head.py TIED_ARTIFACT INT4_HEAD_ARTIFACT [--device cpu] [--steps 60] [--repeats 3]

Both artifacts of one checkpoint (`gemmactl quantize CKPT --int4-stream` and the same with
`--head int4`). One process, bfloat16, every layer resident on --device; each repeat times
--steps one-token steps (positions 0 to steps, eager, as the CPU runs them; on CUDA the step as
DecodeStep captures it) for both artifacts in turn; medians in ms and tok/s, and the head's own
product timed alone. JSON to stdout.
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
from gemmactl.runtime.engine.graph import DecodeStep
from gemmactl.runtime.engine.model import GemmaModel


def step_seconds(engine, decoder, steps: int) -> float:
    token = torch.tensor([2], device=engine.device)
    cuda = engine.device.type == "cuda"
    with torch.inference_mode():
        engine.reset()
        for position in range(3):
            decoder(token, position)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for position in range(3, 3 + steps):
            decoder(token, position)
        if cuda:
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def head_seconds(engine, repeats: int = 20) -> float:
    x = torch.randn(1, engine.spec.hidden, dtype=engine.dtype, device=engine.device)
    with torch.inference_mode():
        engine.head(x)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            engine.head(x)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tied", type=Path)
    parser.add_argument("int4_head", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sides = {}
    for name, path in (("tied int8 head", args.tied), ("int4 head", args.int4_head)):
        engine = GemmaModel(open_artifact(path), device=args.device, dtype=torch.bfloat16, context=1024)
        if engine.device.type == "cuda":
            decoder = DecodeStep(engine)
        else:
            def decoder(token, position, engine=engine):
                return engine.step(token, torch.tensor([position]), position + 1)
        sides[name] = {"engine": engine, "decoder": decoder, "steps": [], "head_ms": 1e3 * head_seconds(engine),
                       "head_kind": type(engine.head).__name__}
    for _ in range(args.repeats):
        for side in sides.values():
            side["steps"].append(step_seconds(side["engine"], side["decoder"], args.steps))
    report = {"command": "python " + " ".join(sys.argv),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "results": {}}
    for name, side in sides.items():
        ms = 1e3 * statistics.median(side["steps"])
        report["results"][name] = {"step_ms": round(ms, 2), "tok_s": round(1e3 / ms, 2),
                                   "steps_ms": [round(1e3 * s, 2) for s in side["steps"]],
                                   "head_ms": round(side["head_ms"], 2), "head": side["head_kind"]}
    tied, int4 = (report["results"][k]["step_ms"] for k in ("tied int8 head", "int4 head"))
    report["int4_head_speedup"] = round(tied / int4, 3)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
