"""Where the engine's GPU memory goes under a cap, beside what the plan set aside for each part.

Loads an int4-stream artifact with the plan's map for --cap (in this process, through the same
generation path as `gemmactl run`), and at each stage records what nvidia-smi sees for this
process (the CUDA context included), what torch's caching allocator has reserved from the driver,
what its tensors occupy (allocated) and what they asked for (requested; the gap is the allocator's
rounding). The growth of nvidia-smi less reserved is the context's own (kernels loaded on first
use, cuBLAS, graph executables); reserved less allocated is memory the allocator keeps cached.

    python benchmarks/engine_memory.py --artifact DIR --cap 3136M --context 4096 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--cap", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=380)
    parser.add_argument("--sites", type=int, default=0, metavar="N",
                        help="also record allocations while loading and name the N sites holding the most")
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the CLI sets it

    import torch

    from gemmactl.generate import open_backend
    from gemmactl.machine import process_gpu_bytes
    from gemmactl.plan.auto import placement_of
    from gemmactl.plan.report import build_plan
    from gemmactl.runtime.base import GenerationRequest, GenerationStats, stream_generate
    from gemmactl.store import Store
    from gemmactl.store.refs import INT4_STREAM, resolve_model

    stages = []

    def stage(name: str) -> None:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        stages.append({"stage": name, "smi_mib": process_gpu_bytes() / MIB,
                       "reserved_mib": torch.cuda.memory_reserved() / MIB,
                       "allocated_mib": torch.cuda.memory_allocated() / MIB,
                       "peak_reserved_mib": stats.get("reserved_bytes.all.peak", 0) / MIB,
                       "peak_allocated_mib": stats.get("allocated_bytes.all.peak", 0) / MIB,
                       "peak_requested_mib": stats.get("requested_bytes.all.peak", 0) / MIB,
                       "segments": stats.get("segment.all.current", 0)})
        stages[-1]["outside_allocator_mib"] = stages[-1]["smi_mib"] - stages[-1]["reserved_mib"]

    result = build_plan(args.artifact, vram=args.cap, context=args.context, backend="int4")
    chosen = result.engine
    plan = {"gpu_bytes_mib": {k: round(v / MIB, 1) for k, v in chosen.gpu_bytes.items()},
            "gpu_total_mib": round(chosen.gpu_total / MIB, 1), "layers": chosen.layers.count("resident"),
            "reason": chosen.reason}
    torch.zeros(1, device="cuda")
    stage("context")
    store = Store()
    model = resolve_model(args.artifact, store, accept=(INT4_STREAM,))
    if args.sites:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    backend = open_backend(model, store=store, context=args.context, placement=placement_of(chosen, result.plan.profile))
    stage("loaded")
    sites = allocation_sites(torch, args.sites) if args.sites else None

    peak = {"smi": 0, "reserved": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["smi"] = max(peak["smi"], process_gpu_bytes())
            peak["reserved"] = max(peak["reserved"], torch.cuda.memory_reserved())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    words = ("the quick brown fox jumps over the lazy dog while a careful engineer measures every step "
             "of the run and writes each figure down beside the command that made it").split()
    prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
    for run in ("first", "second"):
        request = GenerationRequest(prompt=prompt, max_tokens=args.tokens, temperature=0.0, raw=True)
        stats = [e for e in stream_generate(backend, request) if isinstance(e, GenerationStats)][-1]
        stage(f"generated ({run})")
    done.set()
    sampler.join()
    info = backend.describe()
    backend.close()
    print(json.dumps({"cap_mib": round(result.plan.budget.vram_bytes / MIB), "plan": plan, "stages": stages,
                      "sampled_peak_smi_mib": peak["smi"] / MIB, "sampled_peak_reserved_mib": peak["reserved"] / MIB,
                      "decode_tok_s": stats.decode_tok_s, "engine": info, "load_sites": sites}, indent=2, default=str))


def allocation_sites(torch, n: int) -> list:
    """The live blocks after loading, grouped by the innermost gemmactl frame that allocated them:
    the n sites holding the most, with their bytes and block counts."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    sites: dict = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if "gemmactl" in f.get("filename", "")]
            where = f"{ours[0]['filename'].split('gemmactl/')[-1]}:{ours[0]['line']} {ours[0]['name']}" if ours else "?"
            entry = sites.setdefault(where, {"site": where, "mib": 0.0, "requested_mib": 0.0, "blocks": 0})
            entry["mib"] += block["size"] / MIB
            entry["requested_mib"] += block.get("requested_size", block["size"]) / MIB
            entry["blocks"] += 1
    return sorted(sites.values(), key=lambda e: -e["mib"])[:n]


if __name__ == "__main__":
    main()
