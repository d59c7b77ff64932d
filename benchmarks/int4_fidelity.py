"""Perplexity and KL divergence of int4-stream (group 32/64/128) against the bf16 checkpoint, with torch.

The text is a fixed file (default /usr/share/common-licenses/GPL-3), tokenized once with the
checkpoint's tokenizer; its first --tokens tokens are cut into non-overlapping windows of
--window tokens, each starting with BOS, and every position after the first of each window is
scored. Every model sees exactly the same token ids, so any logits source can be compared:

    score(reference, candidate, windows) -> {ppl, ppl_ref, kld_mean, kld_p99, top1_agree}

A candidate is any function window_ids -> [T, V] logits: `torch_logits(model)` for transformers
models, `llama_logits(gguf)` for a GGUF through llama-cpp-python (e.g. llama.cpp's Q4_K_M and
Q4_0 of the same checkpoint, made with the active build's llama-quantize).

    python benchmarks/int4_fidelity.py --checkpoint DIR [--tokens 4096] [--window 512]
        [--groups 32 64 128] [--gguf NAME=FILE ...] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

TEXT = Path("/usr/share/common-licenses/GPL-3")


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
    with override_model_params(llama_cpp, use_extra_bufts=use_extra_buffers(llama_cpp)):
        llm = llama_cpp.Llama(
            model_path=gguf_path, n_ctx=window, logits_all=True, n_threads=threads or default_threads(), verbose=False
        )

    def run(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))  # [T, V]

    return run


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
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--groups", type=int, nargs="*", default=[32, 64, 128])
    parser.add_argument("--embeddings", default="int8")
    parser.add_argument("--gguf", nargs="*", default=[], metavar="NAME=FILE", help="extra candidates through llama-cpp-python")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.int4_dequant import build_model

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    windows = text_windows(tokenizer, args.text, args.tokens, args.window)
    # float32 compute for every torch model: the only difference left is the weights.
    reference = torch_logits(AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval())
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for group in args.groups:
            out = Path(tmp) / f"g{group}"
            quantize_checkpoint(args.checkpoint, out, QuantizeOptions(group_size=group, embeddings=args.embeddings))
            artifact = open_artifact(out)
            size = sum(artifact.shards.values())
            model = build_model(artifact, torch.float32)
            start = time.perf_counter()
            results[f"int4-stream g{group}"] = score(reference, torch_logits(model), windows) | {
                "bytes": size,
                "bits_per_param": size * 8 / sum(r.numel for r in artifact.records),
                "seconds": time.perf_counter() - start,
            }
            print(f"int4-stream g{group}: {json.dumps(results[f'int4-stream g{group}'])}", file=sys.stderr)
            del model
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
        "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
