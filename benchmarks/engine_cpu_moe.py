"""A MoE model on the CPU alone: the engine (experts in torch's CPU int4 kernel, runtime/engine/
cpu_kernels.py) against llama.cpp on the same shapes, each side in its own process, one after the
other (a 26B-A4B-shaped model twice in one process would not fit a 32 GB machine).

    python benchmarks/engine_cpu_moe.py --artifact ART --gguf GGUF [--tokens 64] [--repeats 3]
        [--warm-tokens 256] [--out FILE]

Engine side: load (timed), one cold run (every expert it meets made in the kernel's layout on
first use: the cold TTFT and decode), then --warm-tokens more tokens so the cache holds what the
runs will meet, then --repeats runs. llama.cpp side (llama-cpp-python through gemmactl's backend,
the threads gemmactl picks): load, one warm-up run, --repeats runs. Both: the same raw prompt,
greedy, --tokens tokens; median decode-only and wall tok/s and TTFT; the process's resident
anonymous memory after the runs (file pages of mapped weights not counted: both sides map their
files). Ratios are of medians (the sides are not interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

PROMPTS = ("Once upon a time, in a small village by the sea, there lived",
           "The history of the city of Paris begins")


def _memory() -> dict:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon", "RssFile", "VmHWM")):
            key, value = line.split(":")
            found[key] = int(value.split()[0]) * 1024
    return found


def _measure(backend, request) -> dict:
    from gemmactl.runtime.base import GenerationStats, stream_generate

    stats = None
    for event in stream_generate(backend, request):
        if isinstance(event, GenerationStats):
            stats = event
    return {"ttft_s": stats.ttft_s, "decode_tok_s": stats.decode_tok_s, "wall_tok_s": stats.wall_tok_s,
            "tokens": stats.generated_tokens}


def _median(runs: list, key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 3)


def side(args) -> dict:
    import torch

    from gemmactl.runtime.base import GenerationRequest

    request = GenerationRequest(prompt=PROMPTS[0], temperature=0, max_tokens=args.tokens, raw=True, repeat_penalty=1.0)
    start = time.perf_counter()
    if args.side == "engine":
        from gemmactl.runtime import backend_class

        backend = backend_class("int4")(args.artifact, context_size=2048)
    else:
        from gemmactl.runtime.llamacpp import LlamaCppBackend, default_threads

        backend = LlamaCppBackend(args.gguf, context_size=2048, n_threads=default_threads())
    result = {"side": args.side, "load_s": round(time.perf_counter() - start, 2), "threads": torch.get_num_threads()}
    result["cold"] = _measure(backend, request)
    if args.side == "engine":
        result["cold"]["experts"] = backend.model.experts.stats()
        start = time.perf_counter()
        _measure(backend, replace(request, prompt=PROMPTS[1], max_tokens=args.warm_tokens))
        result["warm_up_s"] = round(time.perf_counter() - start, 1)
        result["engine"] = {k: v for k, v in backend.describe().items() if k in ("kernels", "weights_device_bytes")}
    runs = [_measure(backend, replace(request, prompt=PROMPTS[i % 2])) for i in range(args.repeats)]
    result["runs"] = runs
    for key in ("ttft_s", "decode_tok_s", "wall_tok_s"):
        result[key] = _median(runs, key)
    if args.side == "engine":
        result["experts"] = backend.model.experts.stats()
    result["memory"] = _memory()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-tokens", type=int, default=256)
    parser.add_argument("--side", choices=("engine", "llama.cpp"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args)))
        return
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()}
    for name in ("engine", "llama.cpp"):
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", name], check=True,
                              capture_output=True, text=True)
        result[name] = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("decode_tok_s", "wall_tok_s"):
        result[f"engine ÷ llama.cpp, {key}"] = round(result["engine"][key] / result["llama.cpp"][key], 3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
