"""Where a decode step's GPU time goes with a long KV cache: the step as decode runs it (fused by
torch.compile and captured, every layer resident), kernel by kernel, per KV cache mode.

    python benchmarks/kv_step_profile.py ARTIFACT --kv-cache tq4 [--context 32768] [--steps 20] [--out FILE]

The model is built with every layer on the GPU (no budget) at the context, so every read covers
the context's slots (a captured step reads every slot of its cache, written or not, as
`plan --verify` measures it). The compiled step is profiled without its graph (torch.profiler's
CUDA kernels, summed by name; the kernels of the quantized read, kv_attention_kernel.py, also
together, and the read's custom ops by the shapes of their inputs: a global layer's cache apart
from a sliding layer's window). The captured step is then replayed for its rate. Prints one JSON
object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import kernel_times  # noqa: E402

READ_KERNELS = ("quantized_attention", "key_scores", "weighted_values")
READ_OPS = "gemmactl::"  # the read's custom ops (kv_attention.py), by the shapes they are called with


def profile(artifact: Path, mode: str, context: int, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel

    art = open_artifact(artifact)
    start = time.perf_counter()
    with torch.inference_mode():
        model = GemmaModel(art, device="cuda", dtype=torch.bfloat16, context=context, kv_mode=mode)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    decoder = DecodeStep(model, cache_dir=artifact / "engine-cache" / "inductor")
    setup_s = time.perf_counter() - start
    step = decoder.compiled_step()
    tokens = torch.tensor([818], device="cuda")
    position = torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for i in range(3):
            position.fill_(i)
            step(tokens, position)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for i in range(steps):
                position.fill_(3 + i)
                step(tokens, position)
            torch.cuda.synchronize()
    per_kernel = kernel_times(prof)
    gpu_us = sum(t for t, _ in per_kernel.values()) / steps
    read_us = sum(t for name, (t, _) in per_kernel.items() if any(k in name for k in READ_KERNELS)) / steps
    read_launches = sum(c for name, (_, c) in per_kernel.items() if any(k in name for k in READ_KERNELS)) / steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    # The read's ops by their inputs' shapes (the first two: the queries and the keys' codes), so a
    # global layer's long cache and a sliding layer's window are told apart.
    by_shape = {f"{event.key} {event.input_shapes[:2]}": [round(event.device_time_total / steps, 1),
                                                          event.count // steps]
                for event in prof.key_averages(group_by_input_shape=True) if event.key.startswith(READ_OPS)}
    rate = None
    if decoder.graph is not None:
        with torch.inference_mode():
            model.reset()
            for i in range(3):
                decoder(tokens, i)
            torch.cuda.synchronize()
            begin = time.perf_counter()
            for i in range(steps * 5):
                decoder(tokens, 3 + i)
            torch.cuda.synchronize()
            rate = steps * 5 / (time.perf_counter() - begin)
    return {"command": " ".join(sys.argv), "mode": mode, "context": context, "device": torch.cuda.get_device_name(),
            "load_s": round(load_s, 1), "setup_s": round(setup_s, 1), "compiled": decoder.compiled,
            "captured": decoder.graph is not None, "replay_tok_s": rate and round(rate, 1),
            "gpu_us_per_step": round(gpu_us, 1), "kernels_per_step": sum(c for _, c in per_kernel.values()) / steps,
            "read_kernels_us_per_step": round(read_us, 1), "read_launches_per_step": read_launches,
            "read_ops_by_shape_us_per_step": by_shape,
            "top_kernels_us_per_step": {name: [round(t / steps, 1), c // steps] for name, (t, c) in top}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--kv-cache", default="bf16")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = profile(args.artifact, args.kv_cache, args.context, args.steps)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
