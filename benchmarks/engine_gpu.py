"""The int4 engine on a GPU: kernels, fidelity, cold and warm start.

    python benchmarks/engine_gpu.py kernels  --artifact ART [--tokens 128] [--variants ...]
    python benchmarks/engine_gpu.py fidelity --artifact ART [--steps 64]
    python benchmarks/engine_gpu.py start    --artifact ART --checkpoint CKPT
    python benchmarks/engine_gpu.py profile  --artifact ART [--steps 32]
    python benchmarks/engine_gpu.py prompts  OUT.txt

kernels: one process per variant (kernel × compile × CUDA graph), each loading the artifact,
  decoding --tokens tokens greedily after an 8-token prompt and reporting the engine's own
  decode tok/s (synchronized), setup time (compile + capture) and peak GPU memory.
fidelity: the engine (bfloat16, its kernels, the captured decode step) against transformers
  holding the same dequantized weights in bfloat16: teacher-forced logits over --steps
  positions (KL divergence reference ‖ engine, top-1 agreement) and free greedy decoding
  (tokens equal before the first difference). The same for the engine with dense weights,
  which isolates the int4 kernels' rounding (bfloat16 scales and zeros) from the rest; and
  transformers and the engine each against transformers in float32 (bfloat16's own distance).
start: time to the first token of a new `gemmactl run` process (load, repack, compile,
  capture, one token): cold (no engine cache, no compiled code on disk), then warm; beside
  transformers `from_pretrained` of the bf16 checkpoint onto the GPU and one generated token.
profile: where a decode step's GPU time goes: the compiled step run uncaptured under
  torch.profiler (the kernels a graph replays are the same), summed per kernel and per step; and
  the captured step replayed back to back without the host reading tokens (the GPU's own rate)
  beside the same with the host reading each token (what generation does).
prompts: a prompt file for `gemmactl bench --prompts`: one short prompt and one of about 512
  tokens.

Each prints one JSON object. gemmactl runs from this tree (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name → environment of the engine
    "int4 tinygemm + int8 rows, compiled, graph": {"GEMMACTL_ENGINE_KERNEL": "auto", "GEMMACTL_ENGINE_INT8": "rows",
                                                   "GEMMACTL_ENGINE_COMPILE": "on", "GEMMACTL_ENGINE_GRAPH": "on"},
    "int4 tinygemm + int8 rows, compiled, graph, matrices apart": {"GEMMACTL_ENGINE_KERNEL": "auto",
                                                                  "GEMMACTL_ENGINE_INT8": "rows",
                                                                  "GEMMACTL_ENGINE_COMPILE": "on",
                                                                  "GEMMACTL_ENGINE_GRAPH": "on",
                                                                  "GEMMACTL_ENGINE_JOIN": "off"},
    "int4 tinygemm + int8 rows, compiled, graph, row-stable": {"GEMMACTL_ENGINE_KERNEL": "auto",
                                                              "GEMMACTL_ENGINE_INT8": "rows",
                                                              "GEMMACTL_ENGINE_COMPILE": "on",
                                                              "GEMMACTL_ENGINE_GRAPH": "on",
                                                              "GEMMACTL_ENGINE_NORM": "kernel"},
    "int4 tinygemm + int8 as bf16, compiled, graph": {"GEMMACTL_ENGINE_KERNEL": "auto",
                                                      "GEMMACTL_ENGINE_INT8": "dense",
                                                      "GEMMACTL_ENGINE_COMPILE": "on", "GEMMACTL_ENGINE_GRAPH": "on"},
    "int4 tinygemm, compiled (autotuned), graph": {"GEMMACTL_ENGINE_KERNEL": "auto", "GEMMACTL_ENGINE_COMPILE": "max",
                                                   "GEMMACTL_ENGINE_GRAPH": "on"},
    "int4 tinygemm, graph": {"GEMMACTL_ENGINE_KERNEL": "auto", "GEMMACTL_ENGINE_COMPILE": "off",
                             "GEMMACTL_ENGINE_GRAPH": "on"},
    "int4 tinygemm, eager": {"GEMMACTL_ENGINE_KERNEL": "auto", "GEMMACTL_ENGINE_COMPILE": "off",
                             "GEMMACTL_ENGINE_GRAPH": "off"},
    "dense bf16, compiled, graph": {"GEMMACTL_ENGINE_KERNEL": "dense", "GEMMACTL_ENGINE_COMPILE": "on",
                                    "GEMMACTL_ENGINE_GRAPH": "on"},
}
PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 1401]


def _one_variant(artifact: str, tokens: int) -> dict:
    """In a fresh process: load, decode, measure (the environment picks the variant)."""
    import torch

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    art = open_artifact(Path(artifact))
    with torch.inference_mode():
        model = GemmaModel(art, device="cuda", dtype=torch.bfloat16, context=1024)
    load_s = time.perf_counter() - start
    step = DecodeStep(model, cache_dir=Path(artifact) / "engine-cache" / "inductor")
    rates = []
    with torch.inference_mode():
        for _ in range(3):
            model.reset()
            logits = model.step(torch.tensor(PROMPT, device="cuda"), torch.arange(len(PROMPT), device="cuda"), len(PROMPT))
            token = torch.argmax(logits)
            torch.cuda.synchronize()
            begin = time.perf_counter()
            for i in range(tokens):
                token = torch.argmax(step(token, len(PROMPT) + i))
                int(token)  # the host learns each token, as generation does
            rates.append(tokens / (time.perf_counter() - begin))
    kernels = sorted({lin.kernel for layer in model.layers for lin in layer.linears().values()})
    return {"decode_tok_s": sorted(rates)[1], "decode_tok_s_all": rates, "load_s": load_s, "setup_s": step.setup_s,
            "kernels": kernels, "head": model.head.kernel, "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            **model.memory()}


def kernels(args) -> dict:
    rows = {}
    for name in args.variants or list(VARIANTS):
        env = dict(os.environ, **VARIANTS[name])
        proc = subprocess.run([sys.executable, __file__, "_variant", "--artifact", args.artifact,
                               "--tokens", str(args.tokens)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            rows[name] = {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
            print(proc.stderr[-4000:], file=sys.stderr)
            continue
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: {rows[name]['decode_tok_s']:.1f} tok/s", file=sys.stderr)
    return {"command": " ".join(sys.argv), "tokens": args.tokens, "variants": rows}


def _logits_by_step(engine_step, model, sequence) -> list:
    """The engine's logits after each token of `sequence`, fed one at a time (the decode path)."""
    import torch

    model.reset()
    out = []
    with torch.inference_mode():
        for position, token in enumerate(sequence):
            out.append(engine_step(torch.tensor(token, device="cuda"), position).float().clone())
    return out


def _kld(reference, other) -> float:
    """Mean KL(reference ‖ other) over positions, from logits [T, V]."""
    import torch

    ref_logp, other_logp = torch.log_softmax(reference.float(), -1), torch.log_softmax(other.float(), -1)
    return float((ref_logp.exp() * (ref_logp - other_logp)).sum(-1).mean())


def fidelity(args) -> dict:
    import torch

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.int4_model import build_model

    art = open_artifact(Path(args.artifact))
    reference = build_model(art, torch.bfloat16, device="cuda")
    seq, greedy_ref = list(PROMPT), []
    with torch.inference_mode():
        for _ in range(args.steps):
            logits = reference(input_ids=torch.tensor([seq], device="cuda")).logits[0, -1]
            greedy_ref.append(int(logits.argmax()))
            seq.append(greedy_ref[-1])
        forced = reference(input_ids=torch.tensor([seq[:-1]], device="cuda")).logits[0].float()  # [T, V]
    del reference
    torch.cuda.empty_cache()
    # The float32 reference: how far bfloat16 alone moves transformers' own logits, the yardstick
    # for the engine's distance (random-weight models amplify rounding through their layers).
    with torch.inference_mode():
        exact = build_model(art, torch.float32, device="cuda")(input_ids=torch.tensor([seq[:-1]], device="cuda")).logits[0]
    torch.cuda.empty_cache()
    result = {"command": " ".join(sys.argv), "positions": len(seq) - 1, "greedy_steps": args.steps,
              "transformers bf16 vs float32": {"kld_mean": _kld(exact, forced), "top1_agreement":
                                               float((exact.argmax(-1) == forced.argmax(-1)).float().mean())}}
    for kernel in ("auto", "dense"):
        os.environ["GEMMACTL_ENGINE_KERNEL"] = kernel
        # The int4 kernels run as `run` runs them (compiled, captured); dense weights captured only.
        os.environ["GEMMACTL_ENGINE_COMPILE"] = "auto" if kernel == "auto" else "off"
        with torch.inference_mode():
            model = GemmaModel(art, device="cuda", dtype=torch.bfloat16, context=1024)
        step = DecodeStep(model, cache_dir=Path(args.artifact) / "engine-cache" / "inductor")
        engine = torch.stack(_logits_by_step(step, model, seq[:-1]))  # [T, V]
        ref_logp, eng_logp = torch.log_softmax(forced, -1), torch.log_softmax(engine, -1)
        kld = (ref_logp.exp() * (ref_logp - eng_logp)).sum(-1)  # [T]
        top1 = (forced.argmax(-1) == engine.argmax(-1)).float().mean()
        # Free greedy decoding from the prompt: how far the engine's own choices follow the reference's.
        model.reset()
        with torch.inference_mode():
            logits = model.step(torch.tensor(PROMPT, device="cuda"), torch.arange(len(PROMPT), device="cuda"), len(PROMPT))
            mine = []
            for i in range(args.steps):
                mine.append(int(logits.argmax()))
                logits = step(torch.tensor(mine[-1], device="cuda"), len(PROMPT) + i)
        same = next((i for i, (a, b) in enumerate(zip(mine, greedy_ref)) if a != b), args.steps)
        label = "int4 kernels" if kernel == "auto" else "dense weights"
        result[label + " vs float32"] = {"kld_mean": _kld(exact, engine),
                                         "top1_agreement": float((exact.argmax(-1) == engine.argmax(-1)).float().mean())}
        result[label] = {
            "kernels": sorted({lin.kernel for layer in model.layers for lin in layer.linears().values()}),
            "kld_mean": float(kld.mean()), "kld_max": float(kld.max()), "top1_agreement": float(top1),
            "greedy_equal_prefix": same, "max_abs_logit_diff": float((engine - forced).abs().max()),
            "logit_scale": float(forced.abs().max()), "cuda_graph": step.graph is not None, "compiled": step.compiled,
        }
        del model, step
        torch.cuda.empty_cache()
    return result


def _timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start, proc.stdout


def start(args) -> dict:
    artifact = Path(args.artifact)
    shutil.rmtree(artifact / "engine-cache", ignore_errors=True)
    run = [sys.executable, "-m", "gemmactl", "run", "--model", str(artifact), "--json", "--temperature", "0",
           "--max-tokens", "1", "--raw", "Hello"]
    result = {"command": " ".join(sys.argv)}
    for label in ("cold", "warm"):
        wall, out = _timed(run)
        stats = json.loads(out)["stats"]
        result[f"engine {label}"] = {"process_wall_s": wall, "load_s": stats["load_s"], "ttft_s": stats["ttft_s"]}
        print(f"engine {label}: {wall:.1f} s to the first token", file=sys.stderr)
    hf = ("import sys, time, torch\nfrom transformers import AutoModelForCausalLM\n"
          "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map='cuda')\n"
          "m.generate(torch.tensor([[2, 818]], device='cuda'), max_new_tokens=1, do_sample=False)\n")
    wall, _ = _timed([sys.executable, "-c", hf, args.checkpoint])
    result["transformers from_pretrained bf16"] = {"process_wall_s": wall}
    print(f"transformers: {wall:.1f} s to the first token", file=sys.stderr)
    return result


def kernel_times(prof) -> dict:
    """{kernel name (its first 90 characters): (µs in all, launches)} of a torch.profiler run's
    CUDA kernels."""
    import torch

    per_kernel: dict = {}
    for event in prof.events():
        # ranges torch.compile marks ("## Call CompiledFxGraph ... ##") land on the GPU's timeline
        # too, spanning the kernels they launch: not kernels
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("## "):
            name = event.name[:90]
            total, count = per_kernel.get(name, (0.0, 0))
            per_kernel[name] = (total + event.time_range.elapsed_us(), count + 1)
    return per_kernel


def profile(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.graph import DecodeStep
    from gemmactl.runtime.engine.model import GemmaModel

    art = open_artifact(Path(args.artifact))
    with torch.inference_mode():
        model = GemmaModel(art, device="cuda", dtype=torch.bfloat16, context=1024)
    os.environ["GEMMACTL_ENGINE_GRAPH"] = "off"
    eager = DecodeStep(model, cache_dir=Path(args.artifact) / "engine-cache" / "inductor")
    token = torch.tensor(PROMPT[-1], device="cuda")
    # The step as the graph holds it: static shapes, every slot read (no host-known end, which a
    # compiled step would specialize on and recompile for at each position).
    tokens, position = token.reshape(1), torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for i in range(3):
            position.fill_(i)
            eager._step(tokens, position)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(args.steps):
                position.fill_(3 + i)
                eager._step(tokens, position)
            torch.cuda.synchronize()
    per_kernel = kernel_times(prof)
    gpu_us = sum(t for t, _ in per_kernel.values()) / args.steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    os.environ["GEMMACTL_ENGINE_GRAPH"] = "on"
    model.reset()
    graph = DecodeStep(model, cache_dir=Path(args.artifact) / "engine-cache" / "inductor")
    rates = {}
    with torch.inference_mode():
        for label, read in (("replay only", False), ("replay, argmax, host reads token", True)):
            model.reset()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            for i in range(args.steps * 4):
                logits = graph(token, i)
                if read:
                    token = torch.argmax(logits)
                    int(token)
            torch.cuda.synchronize()
            rates[label] = args.steps * 4 / (time.perf_counter() - begin)
    return {"command": " ".join(sys.argv), "gpu_us_per_step": gpu_us, "kernels_per_step":
            sum(c for _, c in per_kernel.values()) / args.steps, "tok_s": rates,
            "top_kernels_us_per_step": {name: round(t / args.steps, 1) for name, (t, _) in top},
            **model.memory()}


def prompts(args) -> dict:
    words = ("The harbour town kept its records in a long stone hall by the water, where clerks wrote down every "
             "ship that came and went, the weather of each morning, the price of salt and grain, and the names of "
             "the families who lived along the narrow streets above the quay. ")
    long_prompt = (words * 12).strip() + " Summarize the records in one paragraph:"
    Path(args.out).write_text("Question: What is the capital of France?\nAnswer:".replace("\n", " ") + "\n"
                              + long_prompt + "\n")
    return {"out": args.out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--artifact", required=True)
    k.add_argument("--tokens", type=int, default=128)
    k.add_argument("--variants", nargs="*", choices=list(VARIANTS))
    v = sub.add_parser("_variant")
    v.add_argument("--artifact", required=True)
    v.add_argument("--tokens", type=int, default=128)
    f = sub.add_parser("fidelity")
    f.add_argument("--artifact", required=True)
    f.add_argument("--steps", type=int, default=64)
    s = sub.add_parser("start")
    s.add_argument("--artifact", required=True)
    s.add_argument("--checkpoint", required=True)
    r = sub.add_parser("profile")
    r.add_argument("--artifact", required=True)
    r.add_argument("--steps", type=int, default=32)
    p = sub.add_parser("prompts")
    p.add_argument("out")
    args = parser.parse_args()
    if args.cmd == "_variant":
        print(json.dumps(_one_variant(args.artifact, args.tokens)))
        return
    print(json.dumps({"kernels": kernels, "fidelity": fidelity, "start": start, "profile": profile,
                      "prompts": prompts}[args.cmd](args),
                     indent=1))


if __name__ == "__main__":
    main()
