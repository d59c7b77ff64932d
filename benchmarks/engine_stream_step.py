"""Where a streamed decode step's time goes, on a GPU: the step with every layer resident (eager),
half the layers streamed (the upper half, or every other layer), half on the host; the streamed
layers' copies alone; and a raw 1 GiB pinned-host → device copy for the link's own rate.

    python benchmarks/engine_stream_step.py ARTIFACT [--steps 24] [--context 4096]

Every placement keeps the embedding tables in host memory (as the plan does under a small cap)
and decodes one token a step after four warm-up steps: eagerly, then (where no layer is on the
host) replayed from a CUDA graph without compile fusion. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def step_ms(model, steps: int) -> float:
    """Milliseconds per eager decode step (the host waits for each token, as decoding does)."""
    model.reset()
    device = model.device
    token = torch.tensor([2], device=device)
    with torch.inference_mode():
        for i in range(4):
            model.step(token, torch.tensor([i], device=device), i + 1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(4, 4 + steps):
            model.step(token, torch.tensor([i], device=device), i + 1).argmax().item()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def captured_ms(model, steps: int) -> float | None:
    """Milliseconds per step replayed from a CUDA graph (unfused); None where the engine declines
    to capture it."""
    from gemmactl.runtime.engine.graph import COMPILE_ENV, GRAPH_ENV, DecodeStep

    os.environ[GRAPH_ENV], os.environ[COMPILE_ENV] = "on", "off"
    decoder = DecodeStep(model)
    if decoder.graph is None:
        return None
    model.reset()
    token = torch.tensor([2], device=model.device)
    for i in range(4):
        decoder(token, i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(4, 4 + steps):
        decoder(token, i).argmax().item()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / steps * 1e3, 2)


def copies(streamer, rounds: int = 10) -> dict:
    """The streamed layers' copies of one step, with no compute between them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        streamer.begin()
        for index in streamer.order:
            streamer.fetch(index)
            streamer.release(index)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / rounds
    return {"bytes_per_step": streamer.bytes_per_step, "copy_only_ms": round(seconds * 1e3, 2),
            "copy_GBps": round(streamer.bytes_per_step / seconds / 1e9, 1)}


def raw_link_GBps(size: int = 1 << 30, rounds: int = 5) -> float:
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return round(rounds * size / (time.perf_counter() - start) / 1e9, 1)


def model_layers(artifact) -> int:
    from gemmactl.runtime.engine.spec import artifact_spec

    return artifact_spec(artifact).n_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.engine.placement import HOST, RESIDENT, STREAMED, EnginePlacement

    artifact = open_artifact(args.artifact)
    result = {"command": "python benchmarks/engine_stream_step.py " + args.artifact, "raw_link_GBps": raw_link_GBps()}
    n = model_layers(artifact)
    half = n // 2
    placements = {
        "all resident": (RESIDENT,) * n,
        "half streamed": (RESIDENT,) * half + (STREAMED,) * (n - half),
        "half streamed, alternating": tuple(STREAMED if i % 2 else RESIDENT for i in range(n)),
        "half on the host": (RESIDENT,) * half + (HOST,) * (n - half),
    }
    for name, layers in placements.items():
        start = time.perf_counter()
        model = GemmaModel(artifact, device="cuda", dtype=torch.bfloat16, context=args.context,
                           placement=EnginePlacement(layers, tables_on_host=True))
        row = {"load_s": round(time.perf_counter() - start, 1), "step_ms": round(step_ms(model, args.steps), 2)}
        if model.streamer is not None:
            row.update(copies(model.streamer))
        if HOST not in layers:
            row["captured_step_ms"] = captured_ms(model, args.steps)
        result[name] = row
        del model
        torch.cuda.empty_cache()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
