"""Speculative decoding on the engine against plain decoding, at acceptance rates set on purpose.

    python benchmarks/speculation.py --checkpoint HF_DIR --work DIR [--noise 0 0.05 0.2 0.5 1]
                                     [--k 1 2 4] [--tokens 96] [--repeats 2]

The target is the checkpoint as an int4-stream artifact (groups of 32). Each draft is the same
checkpoint with every matrix perturbed by Gaussian noise of `noise` × that matrix's own standard
deviation (seeded), quantized more coarsely (groups of 128, `--sensitive int4`): noise 0 is "a
coarser quantization drafting for a finer one", and more noise lowers acceptance on purpose. A
draft of the target's own size never pays on a machine where a step costs the same for both:
what this measures there is acceptance, the cost of speculating at fixed k, and whether the tuner
sees that and stays near plain decoding (the goal: never below 0.97× plain).

For each prompt (prose, code) and draft: speculation at each fixed k, and tuned, each run paired
with a plain run just before it (the plain model stays loaded beside), so a 2-core machine's drift
does not enter the ratio; greedy, --tokens tokens, one warm-up, then --repeats pairs; the median
of the pairs' ratios for decode-only tok/s (tokens after the first ÷ the time after it) and wall
tok/s (with prefill), the acceptance, and whether the text equals plain decoding's. The tuner
keeps what it learned across a mode's runs, as a loaded tier does. `--temperature T` samples
instead (seed 0): speculation then accepts by the rejection rule, and its text is a different
draw from the same distribution, so only the rates and the acceptance compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import engine_cpu  # benchmarks/engine_cpu.py, beside this script

PROMPTS = {
    "prose": "The old lighthouse keeper climbed the stairs every evening. He lit the lamp, watched the ships, and",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
}


def perturbed(checkpoint: Path, out: Path, noise: float, seed: int = 0) -> Path:
    """The checkpoint with noise × std added to every 2-D weight (safetensors, same config)."""
    import torch
    from safetensors.torch import load_file, save_file

    if out.exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for shard in checkpoint.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if tensor.ndim == 2 and noise > 0:
                w = tensor.float()
                w += torch.randn(w.shape, generator=generator) * (noise * w.std())
                tensors[name] = w.to(tensor.dtype)
        save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
    tmp.rename(out)
    return out


def quantized(checkpoint: Path, out: Path, group: int, sensitive: str) -> Path:
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint

    if not (out / "index.json").exists():
        quantize_checkpoint(checkpoint, out, QuantizeOptions(group_size=group, sensitive=sensitive))
    return out


def measure(backend, request) -> dict:
    """engine_cpu.py's measurement, with the run's speculation counters."""
    row = engine_cpu.measure(backend, request)
    speculator = getattr(backend, "speculator", None)
    row["speculation"] = speculator.stats.to_dict() if speculator is not None else None
    return row


def run_mode(plain, target: str, draft, request, repeats: int) -> dict:
    """The mode's runs, each after a plain run of the same request on the loaded plain backend."""
    from gemmactl.runtime.engine.backend import EngineBackend

    backend = EngineBackend(target, context_size=1024, draft=draft)
    measure(backend, replace(request, max_tokens=8))  # warm-up
    pairs = [(measure(plain, request), measure(backend, request)) for _ in range(repeats)]
    row = summarize(pairs, backend.speculator.tuner)
    backend.close()
    return row


def summarize(pairs: list, tuner) -> dict:
    """A mode's row from its (plain, speculative) pairs of runs: medians of the rates and of the
    pairs' ratios, whether every text equals plain decoding's, and the last run's speculation."""
    row = {}
    for key in ("decode_tok_s", "wall_tok_s"):
        row[key] = statistics.median(run[key] for _, run in pairs)
        row["plain_" + key] = statistics.median(base[key] for base, _ in pairs)
        row[key.removesuffix("_tok_s") + "_vs_plain"] = round(statistics.median(run[key] / base[key]
                                                                                for base, run in pairs), 3)
    row["same_text"] = all(run["text"] == base["text"] for base, run in pairs)  # greedy: must hold
    spec = pairs[-1][1]["speculation"]
    row.update(acceptance=spec["acceptance"], rounds=spec["rounds"], plain_steps=spec["plain_steps"],
               tokens_per_round=spec["tokens_per_round"], catch_up_s=spec["catch_up_s"], tuner=tuner.summary())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.05, 0.2, 0.5, 1.0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (texts must equal plain decoding's); above 0: sampled with a fixed seed, "
                             "speculation by the rejection rule (texts differ from plain's draw by draw)")
    args = parser.parse_args()
    import torch

    from gemmactl.runtime.base import GenerationRequest
    from gemmactl.runtime.engine.backend import EngineBackend
    from gemmactl.runtime.engine.draft import DraftSettings

    args.work.mkdir(parents=True, exist_ok=True)
    target = str(quantized(args.checkpoint, args.work / "target-g32", 32, "int8"))
    result = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(), "tokens": args.tokens,
              "temperature": args.temperature,
              "load_average_start": os.getloadavg(), "prompts": {}}
    for prompt_name, prompt in PROMPTS.items():
        request = GenerationRequest(prompt=prompt, temperature=args.temperature, max_tokens=args.tokens, raw=True,
                                    repeat_penalty=1.0, seed=0 if args.temperature else None)
        plain = EngineBackend(target, context_size=1024)
        measure(plain, replace(request, max_tokens=8))  # warm-up
        rows = {}
        for noise in args.noise:
            ckpt = perturbed(args.checkpoint, args.work / f"noise-{noise:g}", noise)
            draft = str(quantized(ckpt, args.work / f"draft-noise-{noise:g}-g128", 128, "int4"))
            for k in args.k:
                rows[f"noise {noise:g}, k={k}"] = run_mode(plain, target, DraftSettings(draft, k_max=k, tune=False),
                                                            request, args.repeats)
            rows[f"noise {noise:g}, tuned k≤{max(args.k)}"] = run_mode(plain, target,
                                                                       DraftSettings(draft, k_max=max(args.k)),
                                                                       request, args.repeats)
        plain.close()
        result["prompts"][prompt_name] = rows
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
