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
    args = parser.parse_args()

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
    backend = open_backend(model, store=store, context=args.context, placement=placement_of(chosen, result.plan.profile))
    stage("loaded")

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
                      "decode_tok_s": stats.decode_tok_s, "engine": info}, indent=2, default=str))


if __name__ == "__main__":
    main()
