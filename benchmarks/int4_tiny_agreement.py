"""Tiny random Gemma 4 models: how close the int4-stream model stays to the original, and why it drifts.

For dense+PLE and MoE tiny models (tests/helpers/random_gemma.py), quantized with int4-stream at group
32/64/128, it reports the greedy-token agreement over 32 generated tokens, the top-1 agreement
and the smallest cosine similarity of the logits at every prompt position, and, for scale, the
same figures for the original model with 1% Gaussian noise added to every 2-D weight: random
tiny models are chaotic, so small weight changes move their logits a lot.

    python benchmarks/int4_tiny_agreement.py [--out FILE]

Needs torch, transformers and gemmactl only: the models are built in a temporary folder. The report
is printed as JSON and, with --out, written to FILE.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.helpers


def compare(reference, candidate, ids) -> dict:
    """Greedy tokens and logits of two models on the same prompt."""
    with torch.inference_mode():
        want, got = reference(ids).logits[0], candidate(ids).logits[0]  # [T, V]
        tokens_want = reference.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
        tokens_got = candidate.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    return {
        "greedy_tokens_equal": float((tokens_want == tokens_got).float().mean()),
        "greedy_prefix_equal": int((tokens_want != tokens_got).int().argmax()) if (tokens_want != tokens_got).any() else 32,
        "top1_agree": float((want.argmax(-1) == got.argmax(-1)).float().mean()),
        "logits_cos_min": float(torch.nn.functional.cosine_similarity(want, got, dim=-1).min()),
        "logits_max_abs_diff": float((want - got).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()

    import copy

    from transformers import AutoModelForCausalLM

    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.int4_model import build_model
    from tests.helpers.random_gemma import build_random_gemma

    ids = torch.randint(0, 262_144, (1, 24), generator=torch.Generator().manual_seed(0))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dense-ple", "moe"):
            source = build_random_gemma(kind, Path(tmp) / kind)
            reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
            noisy = copy.deepcopy(reference)
            torch.manual_seed(1)
            with torch.no_grad():
                for param in noisy.parameters():
                    if param.ndim == 2:
                        param.add_(torch.randn_like(param) * param.std() * 0.01)
            results[f"{kind} 1% noise"] = compare(reference, noisy, ids)
            for group in (32, 64, 128):
                out = Path(tmp) / f"{kind}-g{group}"
                quantize_checkpoint(source, out, QuantizeOptions(group_size=group))
                results[f"{kind} int4 g{group}"] = compare(reference, build_model(open_artifact(out), torch.float32), ids)
            for name in [n for n in results if n.startswith(kind)]:
                print(name, json.dumps(results[name]), file=sys.stderr)
    report = {"command": " ".join(sys.argv), "results": results}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
