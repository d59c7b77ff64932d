"""The engine's bfloat16 logits against transformers' float32 ones, at E2B width, on the CPU.

    python benchmarks/engine_fidelity.py WORKDIR [--layers 10] [--vocab 32768]

A random-weight model with the E2B configuration (hidden 1536, head dims 256/512, per-layer
inputs, the last half of its layers reading shared KV, double-wide MLPs, final softcap) cut to
--layers layers and a --vocab vocabulary so that it runs in float32 on a laptop; one int4-stream
artifact; then transformers (the same dequantized weights) and the engine, each in float32 and
bfloat16, teacher-forced over 38 positions. Prints mean KL(float32 transformers ‖ x) and top-1
agreement for each, and KL(transformers bf16 ‖ engine bf16): the engine in bfloat16 should be as
far from float32 as transformers in bfloat16 is, and in float32 it should be exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQUENCE = [2, 818, 5279, 529, 7001, 563, 496, 1401] + list(range(1000, 1030))


def kld(reference, other) -> float:
    import torch

    ref_logp, other_logp = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
    return float((ref_logp.exp() * (ref_logp - other_logp)).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    import helpers.random_gemma as rg
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.runtime.engine.model import GemmaModel
    from gemmactl.runtime.int4_model import build_model

    pattern = ([rg.SLIDING] * 4 + [rg.FULL]) * (args.layers // 5)
    rg.FULL_SIZE["e2b-cut"] = ("gemma4", dict(rg.E2B, num_hidden_layers=len(pattern), num_kv_shared_layers=len(pattern) // 2,
                                              layer_types=pattern, vocab_size=args.vocab, vocab_size_per_layer_input=args.vocab))
    artifact_dir = args.work / f"e2b-cut-{len(pattern)}-{args.vocab}"
    if not (artifact_dir / "artifact" / "index.json").is_file():
        rg.build_random_gemma("e2b-cut", artifact_dir / "checkpoint")
        quantize_checkpoint(artifact_dir / "checkpoint", artifact_dir / "artifact", QuantizeOptions(group_size=32))
    artifact = open_artifact(artifact_dir / "artifact")
    logits = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            reference = build_model(artifact, dtype)
            logits[f"transformers {name}"] = reference(input_ids=torch.tensor([SEQUENCE])).logits[0].float()
            del reference
            engine = GemmaModel(artifact, device="cpu", dtype=dtype, context=1024)
            engine.reset()
            steps = [engine.step(torch.tensor([t]), torch.tensor([p]), p + 1).float() for p, t in enumerate(SEQUENCE)]
            logits[f"engine {name}"] = torch.stack(steps)
            del engine
    exact = logits["transformers float32"]
    result = {"command": " ".join(sys.argv), "layers": len(pattern), "vocab": args.vocab, "positions": len(SEQUENCE),
              "logit_scale": float(exact.abs().max())}
    for name, values in logits.items():
        result[name] = {"kld_vs_transformers_float32": kld(exact, values),
                        "top1_agreement": float((exact.argmax(-1) == values.argmax(-1)).float().mean())}
    result["engine bfloat16 vs transformers bfloat16"] = {"kld": kld(logits["transformers bfloat16"], logits["engine bfloat16"])}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
