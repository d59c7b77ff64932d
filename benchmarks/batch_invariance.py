"""Does a row computed in a batch of T equal the same row computed alone? Per kernel, then the step.

    python benchmarks/batch_invariance.py ARTIFACT [--device cuda|cpu] [--rows 5] [--steps 24] [--out FILE]

Greedy speculation is exact only if the verify step's k + 1 rows give each row's one-token
logits bit for bit (runtime/engine/speculative.py): a near-tie otherwise goes the other way, and
the keys the verify step writes differ from plain decoding's, so the texts part. The attention
reads each row as a one-token step does (model._attention, rows_as_decode); the matrices, norms
and the head are the engine's own. This measures, on the engine as loaded (every layer resident,
bfloat16, the kernels it picks on this device):

1. each matrix of two layers (a layer with its own KV and, where the model shares KV, one
   without) and the head: rows 0..T-1 of one product of T random rows against T products of one,
   the largest difference relative to the row's largest value, and how many rows differ at all;
   the same for rms_norm;
2. the step: a prompt, then --steps greedy steps of plain decoding (graph.DecodeStep), against the
   same positions run as speculation's verify steps of --rows tokens (graph.VerifyStep) over the
   tokens plain decoding chose: per row the largest logit difference, whether its argmax moved,
   and the margin between the top two logits of the plain step. The verify step runs its rows
   alone through the device's layers where the engine does (rows_alone, on a GPU with the step
   unfused); --batched runs them together, as it did before; --alone runs them alone wherever
   (also through a fused step, compiled once more for the rows alone). (GEMMACTL_ENGINE_COMPILE=off
   measures the steps captured without fusion, as a streamed model's are, and saves the compile.)

Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

PROMPT = [2, 818, 5279, 529, 7001, 563, 9079, 236764, 532, 506, 5279, 529]  # token ids of Gemma's 262,144-token vocabulary


def compare_rows(fn, x: torch.Tensor) -> dict:
    """fn over x [T, H] at once against fn over each row alone."""
    with torch.inference_mode():
        batched = fn(x).float()
        alone = torch.cat([fn(x[i:i + 1]).float() for i in range(x.shape[0])])
    diff = (batched - alone).abs()
    scale = alone.abs().amax(dim=-1).clamp_min(1e-30)
    relative = diff.amax(dim=-1) / scale
    return {"rows_differing": int((diff.amax(dim=-1) > 0).sum()), "rows": x.shape[0],
            "max_relative": float(relative.max())}


def kernels(model, rows: int, generator) -> dict:
    from gemmactl.runtime.engine.ops import rms_norm

    spec, device, dtype = model.spec, model.device, model.dtype
    found = {}
    picked = [model.layers[0]]
    shared = [layer for layer in model.layers if not layer.spec.owns_kv]
    if shared:
        picked.append(shared[0])
    for layer in picked:
        for name, linear in layer.linears().items():
            x = torch.randn(rows, linear.in_features, generator=generator).to(device, dtype)
            found[f"layer {layer.spec.index} {name} ({linear.kernel}, {linear.out_features}×{linear.in_features})"] = \
                compare_rows(linear, x)
        norm = layer.norms["input"]
        x = torch.randn(rows, spec.hidden, generator=generator).to(device, dtype)
        found[f"layer {layer.spec.index} rms_norm"] = compare_rows(lambda h: rms_norm(h, norm, spec.eps), x)
    x = torch.randn(rows, spec.hidden, generator=generator).to(device, dtype)
    head = model.head
    found[f"head ({getattr(head, 'kernel', 'dense')}, {head.out_features}×{head.in_features})"] = compare_rows(head, x)
    return found


def steps(model, rows: int, count: int, alone: str = "auto") -> dict:
    """Plain decoding's steps (graph.DecodeStep: captured where the engine captures it) against
    speculation's verify steps of `rows` tokens (graph.VerifyStep, as the speculator builds it)
    over the tokens plain decoding chose, from the same prompt."""
    from gemmactl.runtime.engine.graph import DecodeStep, VerifyStep, rows_alone_wanted

    device = model.device
    prompt = torch.tensor(PROMPT, device=device)
    n = len(PROMPT)
    decoder = DecodeStep(model)
    verifier = VerifyStep(model, rows, step=decoder.compiled_step(), forward=decoder.fused_forward(),
                          rows_alone=alone == "on" or (alone == "auto" and rows_alone_wanted(decoder)))
    with torch.inference_mode():
        model.reset()
        logits = model.step(prompt, torch.arange(n, device=device), n)
        tokens, plain = [int(torch.argmax(logits))], []
        for i in range(count):
            logits = decoder(torch.tensor([tokens[-1]], device=device), n + i)
            plain.append(logits.float().clone())
            tokens.append(int(torch.argmax(logits)))
        model.reset()
        model.step(prompt, torch.arange(n, device=device), n)
        verified = []
        for start in range(0, count, rows):
            out = verifier(tokens[start:start + rows], n + start)
            verified.extend(out.float().clone().unbind(0))
    per_row = []
    for a, b in zip(plain, verified):
        top = torch.topk(a, 2).values
        per_row.append({"max_abs_diff": float((a - b).abs().max()), "argmax_moved": int(a.argmax()) != int(b.argmax()),
                        "margin": float(top[0] - top[1]), "logit_scale": float(a.abs().max())})
    return {"rows_per_verify": rows, "steps": count, "rows_alone": verifier.rows_alone,
            "plain_captured": decoder.graph is not None,
            "plain_fused": decoder.compiled, "verify_captured": verifier.graph is not None,
            "rows_differing": sum(r["max_abs_diff"] > 0 for r in per_row),
            "argmax_moved": sum(r["argmax_moved"] for r in per_row),
            "max_abs_diff": max(r["max_abs_diff"] for r in per_row),
            "smallest_margin": min(r["margin"] for r in per_row), "per_row": per_row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=5, help="rows of a verify step (k_max + 1)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batched", action="store_true", help="the verify step's rows together, not alone")
    parser.add_argument("--alone", action="store_true",
                        help="the verify step's rows alone even where the engine batches them (a fused step)")
    args = parser.parse_args()
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel

    start = time.perf_counter()
    model = GemmaModel(open_artifact(args.artifact), device=args.device, dtype=torch.bfloat16, context=args.context,
                       spare_slots=args.rows)
    result = {"command": " ".join(sys.argv), "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
              "load_s": round(time.perf_counter() - start, 1),
              "kernels": kernels(model, args.rows, torch.Generator().manual_seed(0)),
              "step": steps(model, args.rows, args.steps, "off" if args.batched else "on" if args.alone else "auto")}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    summary = {**result, "step": {k: v for k, v in result["step"].items() if k != "per_row"}}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
