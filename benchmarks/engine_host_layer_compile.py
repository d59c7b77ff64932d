"""One engine layer on the CPU, eager against fused by torch.compile (inductor's C++ code), per
thread count: what a layer the plan puts on the host costs beyond its int4/int8 kernels.

    python benchmarks/engine_host_layer_compile.py ARTIFACT [--layers 0,5] [--threads 16,8] [--out FILE]
    python benchmarks/engine_host_layer_compile.py ARTIFACT --stack TEXT [--tokens 200] [--out FILE]

The engine is loaded on the CPU in bfloat16 (torch's CPU kernels, as a host layer runs); each layer
runs one token at position 100 (end=101: the slots written so far, as the host step reads them),
from the same random activations, eagerly and compiled (the compile's time is reported; inductor
keeps its code on disk, so a second run compiles faster). Prints one JSON object.

--stack: instead, the whole layer stack (a real model's artifact, its tokenizer beside it) fed
TEXT's first --tokens tokens one at a time, eagerly and compiled (dynamic shapes: the written
positions' end changes every token), each with its own cache: the compiled logits against the
eager ones (KL divergence, top-1 agreement), each call's time, and the compiles' times.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    parser.add_argument("--stack", type=Path, help="a text: the whole layer stack over its tokens instead")
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel

    start = time.perf_counter()
    engine = GemmaModel(open_artifact(args.artifact), device="cpu", dtype=torch.bfloat16, context=4096)
    result = {"artifact": str(args.artifact), "load_s": round(time.perf_counter() - start, 1),
              "threads": torch.get_num_threads()}
    if args.stack:
        result["stack"] = stack(engine, args.artifact, args.stack, args.tokens)
    else:
        result["layers"] = layers(engine, args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def stack(engine, artifact: Path, text: Path, tokens: int) -> dict:
    from tokenizers import Tokenizer

    ids = [2] + Tokenizer.from_file(str(artifact / "tokenizer.json")).encode(text.read_text()).ids[:tokens - 1]
    cpu = torch.device("cpu")

    def run_stack(x, at, rope, per_layer, end):
        for layer in engine.layers:
            x = engine.layer_forward(layer, x, at, rope, per_layer, end=end)
        return x

    def feed(function) -> tuple[torch.Tensor, list]:
        engine.reset()
        logits, seconds = [], []
        with torch.inference_mode():
            for position, token in enumerate(ids):
                x, per_layer = engine.embed_tokens(torch.tensor([token]))
                at, rope, inputs = engine.inputs_on(cpu, torch.tensor([position]), per_layer)
                start = time.perf_counter()
                y = function(x, at, rope, inputs, position + 1)
                seconds.append(time.perf_counter() - start)
                logits.append(engine.logits_of(y).float().reshape(-1))
        return torch.stack(logits), seconds

    eager, eager_s = feed(run_stack)
    fused, fused_s = feed(torch.compile(run_stack, dynamic=True))
    p, q = eager.log_softmax(-1), fused.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    later = slice(len(ids) // 4, None)  # past the compiles
    return {"tokens": len(ids), "kl_mean": round(kl.mean().item(), 5), "kl_max": round(kl.max().item(), 5),
            "top1_agreement": round((eager.argmax(-1) == fused.argmax(-1)).float().mean().item(), 4),
            "first_calls_s": [round(s, 1) for s in fused_s[:3]],
            "eager_ms": round(statistics.median(eager_s[later]) * 1e3, 2),
            "compiled_ms": round(statistics.median(fused_s[later]) * 1e3, 2)}


def layers(engine, args) -> list:
    rows = []
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
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
