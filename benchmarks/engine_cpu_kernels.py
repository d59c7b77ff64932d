"""The engine on the CPU with torch's int4/int8 CPU kernels, against its dense bfloat16 weights and
against llama.cpp on the same model, side by side in one process.

    python benchmarks/engine_cpu_kernels.py ARTIFACT [--gguf GGUF] [--tokens 128] [--repeats 5]
        [--long-prompt 512] [--fidelity 512] [--out FILE]

Parts, all on the same 2-core (or whatever) CPU, one process:
- kernels: each distinct int4/int8 matrix shape of the artifact (layer 0, the head, an MoE expert's
  two), one token: the CPU kernel, the dense bfloat16 product, and decoding the codes first and
  then the dense product (what a missed MoE expert on the host cost before);
- decode: `generate` through the engine with the kernels (default), the engine with dense weights
  (GEMMACTL_ENGINE_KERNEL=dense at its load) and llama.cpp on --gguf (default: the embedded Gemma 3
  270M of the store), the same raw prompt, greedy, --tokens tokens, interleaved A B C after one
  warm-up each, median of --repeats; decode-only and wall tok/s, TTFT; ratios paired per repeat;
  each side's text against the dense engine's (characters in common before they part). Then the
  TTFT of a prompt of --long-prompt tokens, once per side (prefill runs dense past 64 tokens);
- prefill: TTFT of prompts of --prefill tokens in chunks of 256 (the GPU's) and of the CPU's
  longer chunk, the CPU kernels and dense weights;
- fidelity: the engine in float32 as the reference, teacher-forced one token a step over
  --fidelity tokens of English text (the GPL 3 text): KL(float32 ‖ x), top-1 agreement and
  perplexity for bfloat16 with the kernels and with dense weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from engine_cpu import measure  # this folder is the script's path

PROMPT = "Once upon a time, in a land far away,"
TEXT = "/usr/share/common-licenses/GPL-3"


def _bench_us(fn, repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def kernels(artifact) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from gemmactl.runtime.engine.cpu_kernels import cpu_linear

    rows, seen = [], set()
    for record in artifact.records:
        if len(record.shape) != 2 or record.scheme not in ("int4", "int8"):
            continue
        layer0 = ".layers.0." in record.name or record.name.startswith("layers.0.")
        if not (layer0 or "embed_tokens.weight" in record.name) or "per_layer" in record.name:
            continue
        key = (record.scheme, tuple(record.shape), record.expert is not None)
        if key in seen:
            continue
        seen.add(key)
        linear = cpu_linear(artifact, record)
        if linear is None:
            continue
        x = torch.randn(1, record.shape[1]).to(torch.bfloat16)
        dense = artifact.decode(record, "cpu", torch.bfloat16)
        repeats = 3 if record.shape[0] > 100_000 else 20
        rows.append({"name": record.name, "scheme": record.scheme, "shape": list(record.shape),
                     "stored_mb": round(record.nbytes / 1e6, 3), "kernel": linear.kernel,
                     "kernel_us": round(_bench_us(lambda: linear(x), repeats), 1),
                     "dense_us": round(_bench_us(lambda: F.linear(x, dense), repeats), 1),
                     "decode_then_dense_us": round(_bench_us(
                         lambda: F.linear(x, artifact.decode(record, "cpu", torch.bfloat16)), 3), 1)})
    return rows


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decode(args) -> dict:
    import torch

    from gemmactl.runtime import backend_class
    from gemmactl.runtime.base import GenerationRequest
    from gemmactl.runtime.engine.kernels import KERNEL_ENV
    from gemmactl.runtime.llamacpp import LlamaCppBackend, default_threads

    gguf = args.gguf
    if gguf is None:
        from gemmactl.store import Store
        from gemmactl.store.embedded import ensure_embedded_model

        gguf = str(ensure_embedded_model(Store()).path)
    sides = {}
    for name, kernel in (("engine, CPU kernels", "auto"), ("engine, dense bfloat16", "dense")):
        os.environ[KERNEL_ENV] = kernel
        start = time.perf_counter()
        backend = backend_class("int4")(args.artifact, context_size=2048)
        sides[name] = [backend, time.perf_counter() - start, []]
        sides[name].append(backend.describe())
    os.environ.pop(KERNEL_ENV, None)
    start = time.perf_counter()
    sides["llama.cpp"] = [LlamaCppBackend(gguf, context_size=2048, n_threads=default_threads()),
                          time.perf_counter() - start, [], {"gguf": gguf}]
    request = GenerationRequest(prompt=PROMPT, temperature=0, max_tokens=args.tokens, raw=True, repeat_penalty=1.0)
    for backend, _, _, _ in sides.values():
        measure(backend, replace(request, max_tokens=4))
    for _ in range(args.repeats):
        for backend, _, runs, _ in sides.values():
            runs.append(measure(backend, request))
    words = " ".join(Path(TEXT).read_text().split())
    long_request = replace(request, max_tokens=8)
    result = {"threads": torch.get_num_threads(), "tokens": args.tokens, "repeats": args.repeats,
              "load_average": os.getloadavg(), "sides": {}}
    dense_text = sides["engine, dense bfloat16"][2][0]["text"]
    for name, (backend, load_s, runs, about) in sides.items():
        row = {"load_s": round(load_s, 2), **{key: statistics.median(r[key] for r in runs)
                                              for key in ("ttft_s", "decode_tok_s", "wall_tok_s")},
               "decode_tok_s_all": [round(r["decode_tok_s"], 2) for r in runs],
               "text_chars_equal_to_dense_engine": _common(runs[0]["text"], dense_text),
               "text_chars": len(runs[0]["text"]), "about": {k: about.get(k) for k in ("kernels", "gguf", "weights_device_bytes")
                                                             if about.get(k) is not None}}
        if args.long_prompt:
            prompt = " ".join(words.split()[: args.long_prompt])
            while len(backend.tokenize(prompt, add_bos=True, special=False)) > args.long_prompt:
                prompt = prompt.rsplit(" ", 8)[0]
            measured = measure(backend, replace(long_request, prompt=prompt))
            row["long_prompt"] = {"prompt_tokens": measured["prompt_tokens"], "ttft_s": round(measured["ttft_s"], 3)}
        result["sides"][name] = row
    base = sides["engine, CPU kernels"][2]
    for other in ("engine, dense bfloat16", "llama.cpp"):
        runs = sides[other][2]
        result[f"engine, CPU kernels ÷ {other}"] = {
            key: round(statistics.median(a[key] / b[key] for a, b in zip(base, runs)), 3)
            for key in ("decode_tok_s", "wall_tok_s")}
    return result


def prefill(args) -> dict:
    """TTFT of prompts of each --prefill length through the engine with the CPU kernels and with
    dense weights, in chunks of 256 tokens (the GPU's, which the CPU used before) and of the
    backend's CPU_CHUNK, interleaved, median of --repeats (after one warm-up each)."""
    from gemmactl.runtime import backend_class
    from gemmactl.runtime.base import GenerationRequest
    from gemmactl.runtime.engine import backend as engine_backend
    from gemmactl.runtime.engine.kernels import KERNEL_ENV

    chunks = (256, engine_backend.CPU_CHUNK)
    words = " ".join(Path(TEXT).read_text().split()).split()
    result = {"chunks": list(chunks), "rows": {}}
    for name, kernel in (("engine, CPU kernels", "auto"), ("engine, dense bfloat16", "dense")):
        os.environ[KERNEL_ENV] = kernel
        backend = backend_class("int4")(args.artifact, context_size=4096)
        for length in args.prefill:
            prompt = " ".join(words[:length])
            while len(backend.tokenize(prompt, add_bos=True, special=False)) > length:
                prompt = prompt.rsplit(" ", 8)[0]
            request = GenerationRequest(prompt=prompt, temperature=0, max_tokens=2, raw=True, repeat_penalty=1.0)
            times: dict = {chunk: [] for chunk in chunks}
            for repeat in range(args.repeats + 1):
                for chunk in chunks:
                    engine_backend.CPU_CHUNK = chunk
                    run = measure(backend, request)
                    if repeat:
                        times[chunk].append(run["ttft_s"])
            result["rows"][f"{name}, {run['prompt_tokens']} tokens"] = {
                f"chunk {chunk}": round(statistics.median(ts), 3) for chunk, ts in times.items()}
            engine_backend.CPU_CHUNK = chunks[1]
        del backend
    os.environ.pop(KERNEL_ENV, None)
    return result


def fidelity(args) -> dict:
    import torch

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.kernels import KERNEL_ENV
    from gemmactl.runtime.engine.model import GemmaModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.artifact)
    ids = [tokenizer.bos_token_id, *tokenizer(Path(TEXT).read_text(), add_special_tokens=False)["input_ids"]]
    ids = torch.tensor(ids[: args.fidelity + 1])
    artifact = open_artifact(Path(args.artifact))
    logps = {}
    for name, dtype, kernel in (("float32", torch.float32, "auto"), ("bfloat16, CPU kernels", torch.bfloat16, "auto"),
                                ("bfloat16, dense", torch.bfloat16, "dense")):
        os.environ[KERNEL_ENV] = kernel
        model = GemmaModel(artifact, device="cpu", dtype=dtype, context=len(ids) + 8)
        rows = []
        with torch.inference_mode():
            for position in range(len(ids) - 1):
                logits = model.step(ids[position:position + 1], torch.tensor([position]), position + 1)
                rows.append(torch.log_softmax(logits.float().reshape(-1), -1))
        logps[name] = torch.stack(rows)
        del model
    os.environ.pop(KERNEL_ENV, None)
    targets = ids[1:]
    reference = logps["float32"]
    result = {"positions": len(targets), "text": TEXT}
    for name, logp in logps.items():
        nll = -logp.gather(1, targets.unsqueeze(1))[:, 0]
        row = {"perplexity": round(math.exp(float(nll.mean())), 4)}
        if name != "float32":
            row["kld_vs_float32"] = float((reference.exp() * (reference - logp)).sum(-1).mean())
            row["top1_agreement_vs_float32"] = float((reference.argmax(-1) == logp.argmax(-1)).float().mean())
        result[name] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--gguf")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-prompt", type=int, default=512)
    parser.add_argument("--fidelity", type=int, default=512)
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prompt lengths of the prefill part")
    parser.add_argument("--parts", default="kernels,decode,fidelity", help="any of kernels,decode,prefill,fidelity")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from gemmactl.formats.int4.reader import open_artifact

    parts = set(args.parts.split(","))
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}
    if "kernels" in parts:
        result["kernels"] = kernels(open_artifact(Path(args.artifact)))
    if "decode" in parts:
        result["decode"] = decode(args)
    if "prefill" in parts:
        result["prefill"] = prefill(args)
    if "fidelity" in parts:
        result["fidelity"] = fidelity(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
