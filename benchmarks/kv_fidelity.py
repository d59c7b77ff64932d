"""KV cache modes against the uncompressed cache on a long English text: the engine's modes and
llama.cpp's cache types, each against its own backend's full-precision cache.

    python benchmarks/kv_fidelity.py --artifact ART [--gguf GGUF] [--text FILE] [--window 8192]
                                     [--windows 2] [--modes int8 tq4 tq3] [--out results/kv_fidelity-cpu.json]

Engine: the artifact in bfloat16, every mode run side by side with the bf16 cache over the same
windows (BOS + `--window` − 1 tokens each), prefilled in chunks of 256 tokens, every position's
logits compared: mean KL divergence (bf16 cache ‖ mode), top-1 agreement, and the perplexity of
the text under each, over every position and (`modes_second_half`) over the second half of each
window, the positions llama-perplexity scores. llama.cpp (with --gguf and a build in the store): `llama-perplexity` over
the same text and context, f16 K/V first (its logits kept as the KL base), then q8_0 and q4_0
K and V (flash attention on, which llama.cpp needs for a quantized V): perplexity, mean KL
divergence and "same top" from its own report. The text: --text, else the GNU GPL 3, GFDL 1.3
and GPL 2 texts from /usr/share/common-licenses, one after another.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3",
                 "/usr/share/common-licenses/GPL-2")
CHUNK = 256


def _text(args) -> str:
    if args.text:
        return Path(args.text).read_text()
    return "\n\n".join(Path(p).read_text() for p in DEFAULT_TEXTS)


def engine_modes(args, text: str) -> dict:
    import torch

    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.kv_modes import WINDOWS_SEP, compression
    from gemmactl.runtime.engine.model import GemmaModel
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.artifact)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    span = args.window - 1
    windows = [ids[i * span:(i + 1) * span] for i in range(args.windows)]
    if len(windows[-1]) < span:
        raise SystemExit(f"the text has {len(ids)} tokens: too few for {args.windows} windows of {args.window}")
    artifact = open_artifact(Path(args.artifact))
    modes = ["bf16", *args.modes]
    with torch.inference_mode():
        models = {mode: GemmaModel(artifact, device="cpu", dtype=torch.bfloat16, context=args.window, kv_mode=mode)
                  for mode in modes}
    # Every position, and (as llama-perplexity scores) the second half of each window only.
    scopes = {"all": 0, "second_half": args.window // 2}
    sums = {scope: {mode: {"kld": 0.0, "top1": 0, "nll": 0.0} for mode in modes} for scope in scopes}
    counts = {scope: 0 for scope in scopes}
    count, start = 0, time.perf_counter()
    for window in windows:
        tokens = torch.tensor([tokenizer.bos_token_id, *window])
        for model in models.values():
            model.reset()
        for begin in range(0, len(tokens), CHUNK):
            stop = min(len(tokens), begin + CHUNK)
            chunk, positions = tokens[begin:stop], torch.arange(begin, stop)
            targets = tokens[begin + 1:stop + 1]  # the next token of each position (none after the last)
            with torch.inference_mode():
                reference = None
                for mode, model in models.items():
                    logp = torch.log_softmax(model.step(chunk, positions, stop, all_logits=True), -1)[:len(targets)]
                    nll = -logp.gather(1, targets.unsqueeze(1))[:, 0]  # [n]
                    if reference is None:
                        reference = logp
                        kld = top1 = None
                    else:
                        kld = (reference.exp() * (reference - logp)).sum(-1)  # [n]
                        top1 = reference.argmax(-1) == logp.argmax(-1)
                    for scope, first in scopes.items():
                        keep = positions[:len(targets)] >= first
                        sums[scope][mode]["nll"] += float(nll[keep].sum())
                        if kld is not None:
                            sums[scope][mode]["kld"] += float(kld[keep].sum())
                            sums[scope][mode]["top1"] += int(top1[keep].sum())
            for scope, first in scopes.items():
                counts[scope] += int((positions[:len(targets)] >= first).sum())
            count += len(targets)
        print(f"window done: {count} positions, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    head_dims = sorted({cache.head_dim for cache in models["bf16"].caches.values()})
    result = {"positions": count, "windows": len(windows), "window": args.window,
              "seconds": time.perf_counter() - start}
    for scope in scopes:
        rows, n = {}, counts[scope]
        for mode in modes:
            s = sums[scope][mode]
            kv_bytes = sum(c.nbytes() for c in models[mode].caches.values())
            # a GLOBAL/WINDOWS mode's: the caches' bytes at this window against bf16's, windows included
            shrink = min(compression(mode, d) for d in head_dims) if WINDOWS_SEP not in mode else \
                sum(c.nbytes() for c in models["bf16"].caches.values()) / kv_bytes
            rows[mode] = {"perplexity": math.exp(s["nll"] / n), "compression": round(shrink, 2), "kv_bytes": kv_bytes}
            if mode != "bf16":
                rows[mode].update(kld_mean=s["kld"] / n, top1_agreement=s["top1"] / n)
        base = rows["bf16"]["perplexity"]
        for row in rows.values():
            row["perplexity_delta_pct"] = round(100 * (row["perplexity"] / base - 1), 3)
        # "modes": every position (as before); "modes_second_half": the positions llama-perplexity scores
        result["modes" if scope == "all" else "modes_second_half"] = rows
        result["positions" if scope == "all" else "positions_second_half"] = n
    return result


def llama_cpp_types(args, text: str) -> dict:
    from gemmactl.llamacpp.build import active_build
    from gemmactl.store import Store

    build = active_build(Store())
    if build is None or "llama-perplexity" not in build.binaries:
        return {"skipped": "no llama.cpp build with llama-perplexity in the store (gemmactl build)"}
    binary = build.binary("llama-perplexity")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        text_file, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        text_file.write_text(text)
        common = [str(binary), "-m", args.gguf, "-f", str(text_file), "-c", str(args.window), "--chunks",
                  str(args.windows), "-t", str(args.threads), "-fa", "on", "-b", "2048"]
        for kind in ("f16", "q8_0", "q4_0"):
            kld = ["--kl-divergence-base", str(base)] if kind == "f16" else ["--kl-divergence-base", str(base),
                                                                             "--kl-divergence"]
            proc = subprocess.run(common + ["-ctk", kind, "-ctv", kind, *kld], capture_output=True, text=True)
            if proc.returncode != 0:
                rows[kind] = {"error": proc.stderr.strip().splitlines()[-1:]}
                continue
            rows[kind] = _perplexity_report(proc.stdout + proc.stderr)
    base_ppl = rows.get("f16", {}).get("perplexity")
    for row in rows.values():
        if base_ppl and row.get("perplexity"):
            row["perplexity_delta_pct"] = round(100 * (row["perplexity"] / base_ppl - 1), 3)
    return {"gguf": args.gguf, "types": rows}


def _perplexity_report(log: str) -> dict:
    """Perplexity, mean KLD and same-top share from llama-perplexity's output."""
    found = {}
    if match := re.search(r"Final estimate: PPL = ([\d.]+)", log):
        found["perplexity"] = float(match.group(1))
    if match := re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log):
        found["perplexity"] = float(match.group(1))
    if match := re.search(r"Mean\s+KLD:\s*([-\d.]+)", log):
        found["kld_mean"] = float(match.group(1))
    if match := re.search(r"Same top p:\s*([\d.]+)", log):
        found["top1_agreement"] = float(match.group(1)) / 100
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, help="int4-stream artifact (with its tokenizer)")
    parser.add_argument("--gguf", help="a GGUF of the same model for llama.cpp's cache types")
    parser.add_argument("--text", help="the text (default: three GNU license texts)")
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--modes", nargs="*", default=["int8", "tq4", "tq3"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    text = _text(args)
    result = {"command": " ".join(sys.argv), "engine": engine_modes(args, text)}
    if args.gguf:
        result["llama.cpp"] = llama_cpp_types(args, text)
    out = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(out + "\n")
    print(out)


if __name__ == "__main__":
    main()
