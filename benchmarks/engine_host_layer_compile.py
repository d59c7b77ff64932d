"""One engine layer on the CPU, eager against fused by torch.compile (inductor's C++ code), per
thread count: what a layer the plan puts on the host costs beyond its int4/int8 kernels.

    python benchmarks/engine_host_layer_compile.py ARTIFACT [--layers 0,5] [--threads 16,8] [--out FILE]

The engine is loaded on the CPU in bfloat16 (torch's CPU kernels, as a host layer runs); each layer
runs one token at position 100 (end=101: the slots written so far, as the host step reads them),
from the same random activations, eagerly and compiled (the compile's time is reported; inductor
keeps its code on disk, so a second run compiles faster). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def timed_ms(function, repeats: int = 40) -> float:
    for _ in range(3):
        function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--layers", default="0,5")
    parser.add_argument("--threads", default="16,8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel

    start = time.perf_counter()
    engine = GemmaModel(open_artifact(args.artifact), device="cpu", dtype=torch.bfloat16, context=4096)
    result = {"artifact": str(args.artifact), "load_s": round(time.perf_counter() - start, 1), "layers": []}
    torch.manual_seed(0)
    with torch.inference_mode():
        at, rope, _ = engine.inputs_on(torch.device("cpu"), torch.tensor([100]), None)
        for index in [int(n) for n in args.layers.split(",")]:
            layer = engine.layers[index]
            x = torch.randn(1, layer.norms["input"].shape[0], dtype=torch.bfloat16)
            per_layer = None
            if layer.per_layer is not None:
                width = layer.per_layer["gate"](x).shape[-1]
                per_layer = torch.randn(1, len(engine.layers), width, dtype=torch.bfloat16)

            def eager(layer=layer, x=x, per_layer=per_layer):
                return engine.layer_forward(layer, x, at, rope, per_layer, end=101)

            fused = torch.compile(eager)
            start = time.perf_counter()
            fused()
            row = {"layer": index, "kind": layer.spec.kind, "compile_s": round(time.perf_counter() - start, 1)}
            a, b = eager().float(), fused().float()
            row["relative_difference"] = round(((a - b).norm() / a.norm()).item(), 5)
            for count in [int(n) for n in args.threads.split(",")]:
                torch.set_num_threads(count)
                row[f"eager_ms_{count}"] = round(timed_ms(eager), 3)
                row[f"compiled_ms_{count}"] = round(timed_ms(fused), 3)
            result["layers"].append(row)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
