"""Perplexity and KL divergence of int4-stream (group 32/64/128) against the bf16 checkpoint, with torch.

The text is a fixed file (--text; the recorded figures used /usr/share/common-licenses/GPL-3 of
Debian/Ubuntu), tokenized once with the checkpoint's tokenizer; its first --tokens tokens are cut into non-overlapping windows of
--window tokens, each starting with BOS, and every position after the first of each window is
scored. Every model sees exactly the same token ids, so any logits source can be compared:

    score(reference, candidate, windows) -> {ppl, ppl_ref, kld_mean, kld_p99, top1_agree}

A candidate is any function window_ids -> [T, V] logits: `torch_logits(model)` for transformers
models, `llama_logits(gguf)` for a GGUF through llama-cpp-python (e.g. llama.cpp's Q4_K_M and
Q4_0 of the same checkpoint, made with the active build's llama-quantize).

    python benchmarks/int4_fidelity.py --checkpoint DIR --text FILE [--tokens 4096] [--window 512]
        [--variants g32 g64 g128 g32-minmax g32-calib-s8 ...] [--calibration TEXT]
        [--gguf NAME=FILE ...] [--out results.json]

A variant names its group size and options, joined by "-": `gN` (group size), `minmax` (the
plain min/max fit instead of the squared-error search), `calib` (weigh the search by activation
importance measured on --calibration, which must not be the evaluation text), `s8`/`s4`
(`--sensitive int8`/`int4`, s4 when not named), `h4` (`--head int4`: a tied head of its own in int4). The reference's logits are computed once per
window and kept on disk (a temporary folder), so each candidate costs one forward pass per window.
The JSON report goes to stdout and, with --out, to FILE.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

def text_windows(tokenizer, text_path: Path, n_tokens: int, window: int) -> list[list[int]]:
    """The first n_tokens tokens of the text, in windows of `window` tokens, each led by BOS."""
    ids = tokenizer(text_path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:n_tokens]
    body = window - 1
    return [[tokenizer.bos_token_id, *ids[i : i + body]] for i in range(0, len(ids) - body + 1, body)]


def torch_logits(model):
    """A logits source for a transformers causal LM: window ids → [T, V] float32 logits."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()  # [T, V]

    return run


def llama_logits(gguf_path: str, window: int, threads: int | None = None):
    """A logits source for a GGUF through llama-cpp-python (every position's logits kept)."""
    import llama_cpp
    import numpy as np

    from gemmactl.runtime.llamacpp import default_threads, override_model_params, use_extra_buffers

    # The same guard as the llama.cpp backend: no extra CPU weight buffers where AMX would crash.
    with override_model_params(llama_cpp, use_extra_bufts=use_extra_buffers()):
        llm = llama_cpp.Llama(
            model_path=gguf_path, n_ctx=window, logits_all=True, n_threads=threads or default_threads(), verbose=False
        )

    def run(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))  # [T, V]

    return run


def cached(source, folder: Path):
    """A logits source that computes each window once and keeps it as a file in folder."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(ids: list[int]) -> torch.Tensor:
        path = folder / f"{hashlib.sha256(str(ids).encode()).hexdigest()[:16]}.pt"
        if not path.exists():
            torch.save(source(ids), path)
        return torch.load(path, mmap=True)

    return run


def parse_variant(spec: str, calibration: Path | None):
    """QuantizeOptions for a variant name like g32, g64-minmax or g32-calib-s8."""
    from gemmactl.formats.int4.calibrate import Calibration
    from gemmactl.formats.int4.layout import QuantizeOptions

    parts = spec.split("-")
    unknown = [p for p in parts[1:] if p not in ("minmax", "calib", "s8", "s4", "h4")]
    if not parts[0].startswith("g") or unknown:
        raise SystemExit(f"cannot read variant {spec!r}")
    if "calib" in parts and calibration is None:
        raise SystemExit(f"variant {spec} needs --calibration")
    return QuantizeOptions(
        group_size=int(parts[0][1:]),
        sensitive="int8" if "s8" in parts else "int4",
        search="minmax" not in parts,
        calibration=Calibration.from_file(calibration) if "calib" in parts else None,
        head="int4" if "h4" in parts else "tied",
    )


def score(reference, candidate, windows: list[list[int]], chunk: int = 128) -> dict:
    """PPL of both and KL(reference ‖ candidate) per scored position, over all windows."""
    nll_ref = nll = 0.0
    agree = count = 0
    klds: list[torch.Tensor] = []
    for ids in windows:
        ref_logits, cand_logits = reference(ids), candidate(ids)  # [T, V]
        targets = torch.tensor(ids[1:])  # position t predicts token t+1
        for start in range(0, len(ids) - 1, chunk):
            stop = min(len(ids) - 1, start + chunk)
            p_log = torch.log_softmax(ref_logits[start:stop], dim=-1)  # [c, V]
            q_log = torch.log_softmax(cand_logits[start:stop], dim=-1)  # [c, V]
            t = targets[start:stop]
            nll_ref -= float(p_log.gather(1, t[:, None]).sum())
            nll -= float(q_log.gather(1, t[:, None]).sum())
            klds.append((p_log.exp() * (p_log - q_log)).sum(dim=-1))  # [c]
            agree += int((p_log.argmax(-1) == q_log.argmax(-1)).sum())
            count += stop - start
    kld = torch.cat(klds)
    return {
        "ppl_ref": math.exp(nll_ref / count),
        "ppl": math.exp(nll / count),
        "kld_mean": float(kld.mean()),
        "kld_p99": float(torch.quantile(kld, 0.99)),
        "kld_max": float(kld.max()),
        "top1_agree": agree / count,
        "positions": count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="bf16 Hugging Face checkpoint (the reference)")
    parser.add_argument("--text", type=Path, required=True, help="evaluation text (plain UTF-8 file)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--variants", nargs="*", default=["g32", "g64", "g128"])
    parser.add_argument("--calibration", type=Path, help="text for the activation importance of `calib` variants")
    parser.add_argument("--embeddings", default="int8")
    parser.add_argument("--gguf", nargs="*", default=[], metavar="NAME=FILE", help="extra candidates through llama-cpp-python")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gemmactl.formats.int4.quantize import quantize_checkpoint
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.int4_model import build_model

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    windows = text_windows(tokenizer, args.text, args.tokens, args.window)
    # float32 compute for every torch model: the only difference left is the weights.
    if args.calibration and args.calibration.resolve() == args.text.resolve():
        raise SystemExit("--calibration must not be the evaluation text")
    options = {spec: parse_variant(spec, args.calibration) for spec in args.variants}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        reference_model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
        reference = cached(torch_logits(reference_model), Path(tmp) / "reference")
        for spec, option in options.items():
            out = Path(tmp) / spec
            option = dataclasses.replace(option, embeddings=args.embeddings)
            start = time.perf_counter()
            quantize_checkpoint(args.checkpoint, out, option)
            quantize_s = time.perf_counter() - start
            artifact = open_artifact(out)
            size = sum(artifact.shards.values())
            model = build_model(artifact, torch.float32)
            start = time.perf_counter()
            results[f"int4-stream {spec}"] = score(reference, torch_logits(model), windows) | {
                "bytes": size,
                "bits_per_param": size * 8 / artifact.index["totals"]["params"],  # a copied head is no parameter
                "layer_bytes": sum(r.nbytes for r in artifact.records if r.layer is not None),
                "layer_params": sum(r.numel for r in artifact.records if r.layer is not None),
                "quantize_s": quantize_s,
                "seconds": time.perf_counter() - start,
            }
            print(f"int4-stream {spec}: {json.dumps(results[f'int4-stream {spec}'])}", file=sys.stderr)
            del model, artifact
            shutil.rmtree(out)
        for spec in args.gguf:
            name, _, path = spec.partition("=")
            results[name] = score(reference, llama_logits(path, args.window), windows) | {"bytes": Path(path).stat().st_size}
            print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)

    report = {
        "command": " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "text": str(args.text),
        "tokens_scored": results[next(iter(results))]["positions"] if results else 0,
        "window": args.window,
        "calibration": str(args.calibration) if args.calibration else None,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
