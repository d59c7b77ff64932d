"""Speculative decoding with a smaller draft: an E4B-shaped target, an E2B-shaped draft, acceptance set on purpose.

    python benchmarks/speculation_gpu.py --work DIR --vocab ggml-vocab-gemma-4.gguf
        [--alpha 0 0.02 0.05 0.1 0.2 1] [--k 1 2 4] [--tokens 128] [--repeats 3] [--vram 4G] [--out FILE]
    (--kinds e4b-tiny e2b-tiny runs the same on tiny shapes, e.g. on a CPU, to try the script)

Random weights make any draft disagree with its target, so the two are built to agree by an
amount set on purpose:
- the draft: `tests/helpers/random_gemma.py e2b` written straight to int4-stream (seed 1);
- the target: `e4b` written the same way (seed 0), except its token embedding, which is also its
  tied output head: its rows are the draft's, padded with zeros to the target's width;
- alpha: every branch that adds to a layer's residual (attention, MLP, per-layer input) ends in a
  norm, and its weight is set to alpha in both models (in memory, before each alpha's runs). At
  alpha 0 both models are their embeddings alone and choose the same token (the logits of either
  are e_t · e_j, t the last token); as alpha grows, each model's own random layers take over and
  the two disagree. The synthetic text is a repeated token at small alpha, which changes nothing a
  step costs: the same kernels run on the same shapes at every alpha.

One target is loaded with the draft (k_max = max(--k): the verify step is captured once for
k_max + 1 tokens). Unless --alpha names them, the alphas are chosen by a scan (k_max drafts, 64
tokens, alpha doubling every two steps from 0.001 until acceptance falls below 5%, then 7 steps
between there and the last alpha at 90% or more) as the nearest to each --acceptance. For each alpha, plain decoding and then each mode (each fixed k, and tuned)
are run in pairs, plain just before speculative, greedy, --tokens tokens; the table gives medians
of the pairs' ratios, decode-only (tokens after the first ÷ time after it) and wall (with
prefill), the acceptance, and whether the text equals plain decoding's. Each mode gets a fresh
tuner, warmed by one run before the pairs, as a loaded tier keeps what it learned.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parent)]

import engine_cpu  # noqa: E402  benchmarks/engine_cpu.py: one generation, measured
import speculation  # noqa: E402  benchmarks/speculation.py: a run with its rounds, and a mode's row

PROMPT = "The old lighthouse keeper climbed the stairs every evening. He lit the lamp, watched the ships, and"
BRANCH_NORMS = ("post_attention", "post_feedforward", "post_per_layer_input")


def build(work: Path, vocab: Path | None, kinds: tuple[str, str]) -> tuple[Path, Path]:
    from helpers.random_gemma import write_random_int4

    target_kind, draft_kind = kinds
    draft, target = work / f"draft-{draft_kind}", work / f"target-{target_kind}"
    if not (draft / "index.json").exists():
        write_random_int4(draft_kind, draft, seed=1, vocab=vocab)
    if not (target / "index.json").exists():
        write_random_int4(target_kind, target, seed=0, vocab=vocab, embed_from=draft)
    return target, draft


class Branches:
    """The branch norms of a model's layers, scaled together from their loaded values."""

    def __init__(self, model):
        import torch

        layers = list(model.layers) + [copy for pair in model.staged_layers.values() for copy in pair]
        seen = {}
        for layer in layers:
            for key in BRANCH_NORMS:
                norm = layer.norms.get(key)
                if norm is not None:
                    seen.setdefault(id(norm), norm)
        self.norms = list(seen.values())
        self.base = [torch.clone(n) for n in self.norms]

    def scale(self, alpha: float) -> None:
        import torch

        with torch.inference_mode():
            for norm, base in zip(self.norms, self.base):
                norm.copy_(base * alpha)


def graph_follows(model, decoder) -> float:
    """The relative gap between an eager step and the decoder's (captured) step at position 0:
    small when the graph reads the norms as they are now, not as they were when it was captured."""
    import torch

    with torch.inference_mode():
        token = torch.tensor([2], device=model.device)
        model.reset()
        eager = model.step(token, torch.tensor([0], device=model.device), 1)
        model.reset()
        replayed = decoder(token, 0).clone()
        model.reset()
    return float((eager - replayed).abs().max() / eager.abs().max().clamp_min(1e-6))


def capped(target: Path, draft: Path | None, vram: str, context: int, k_max: int):
    """The target's placement under a budget that also holds the draft, if any (this machine's
    measured profile, measured now if the store has none)."""
    from gemmactl.machine import detect_machine
    from gemmactl.plan.auto import engine_placement
    from gemmactl.plan.engine_map import DraftNeed
    from gemmactl.plan.profile import machine_profile
    from gemmactl.sizes import parse_size
    from gemmactl.store import Store

    store, machine = Store(), detect_machine()
    machine_profile(store.home / "plan", machine)
    return engine_placement(target, context, vram=parse_size(vram, option="--vram"), machine=machine, store=store,
                            draft=DraftNeed(draft, k_max) if draft is not None else None)


def whole_budget(target: Path, args, request, result: dict) -> dict:
    """Plain decoding of the target alone under the same budget (its map keeps no room for a
    draft, so more of it is resident): what a tier without speculation would run. Each mode's
    speculative rate over this plain rate, per alpha (the steps cost the same at every alpha)."""
    import statistics

    from gemmactl.runtime.engine.backend import EngineBackend

    placement = capped(target, None, args.vram, args.context, 0)
    backend = EngineBackend(str(target), context_size=args.context, placement=placement)
    engine_cpu.measure(backend, request)  # warm-up
    runs = [engine_cpu.measure(backend, request) for _ in range(args.repeats)]
    plain = {key: statistics.median(run[key] for run in runs) for key in ("decode_tok_s", "wall_tok_s")}
    ratios = {alpha: {mode: {key.removesuffix("_tok_s") + "_vs_whole_budget": round(row[key] / plain[key], 3)
                             for key in ("decode_tok_s", "wall_tok_s")}
                      for mode, row in rows.items() if mode != "graph_gap"}
              for alpha, rows in result["alphas"].items()}
    return {"placement": placement.reason if placement is not None else "every layer resident", **plain, "ratios": ratios}


def paired(backend, speculator, make_tuner, request, repeats: int) -> dict:
    """Plain then speculative, `repeats` times, after a warm-up of the speculative mode."""
    speculator.tuner = make_tuner()
    backend.speculator = speculator
    engine_cpu.measure(backend, request)  # warm-up: the tuner learns, as a loaded tier's would
    pairs = []
    for _ in range(repeats):
        backend.speculator = None
        base = speculation.measure(backend, request)
        backend.speculator = speculator
        pairs.append((base, speculation.measure(backend, request)))
    row = speculation.summarize(pairs, speculator.tuner)
    # Where the texts part (a share of plain decoding's text): a batched verify step on a GPU can
    # round a near-tie differently from one-token steps.
    row["agreement"] = round(min(len(os.path.commonprefix([run["text"], base["text"]])) / max(len(base["text"]), 1)
                                 for base, run in pairs), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--vocab", type=Path)
    parser.add_argument("--kinds", nargs=2, default=["e4b", "e2b"], metavar=("TARGET", "DRAFT"))
    parser.add_argument("--alpha", type=float, nargs="+",
                        help="the alphas to measure (default: chosen by a scan, for each --acceptance)")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                        help="acceptances to aim at: a scan of alphas (k_max drafts, 64 tokens) picks the nearest")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--vram", help="a GPU budget for both models (e.g. 4G): the target's map is the plan's with "
                                         "the draft's room kept, as `gemmactl run --vram V --draft D` makes it "
                                         "(default: both wholly resident)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from gemmactl.runtime.base import GenerationRequest
    from gemmactl.runtime.engine.backend import EngineBackend
    from gemmactl.runtime.engine.draft import INEXACT_SPECULATION_ENV, DraftSettings
    from gemmactl.runtime.engine.speculative import Tuner

    # Greedy speculation on a fused step (every layer resident) is not bit-exact, so the engine
    # decodes greedy requests plainly there; measured anyway, with how far the texts agree.
    os.environ.setdefault(INEXACT_SPECULATION_ENV, "on")
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    target, draft = build(args.work, args.vocab, tuple(args.kinds))
    build_s = time.perf_counter() - start
    k_max = max(args.k)
    start = time.perf_counter()
    placement = capped(target, draft, args.vram, args.context, k_max) if args.vram else None
    backend = EngineBackend(str(target), context_size=args.context, draft=DraftSettings(str(draft), k_max=k_max),
                            placement=placement)
    load_s = time.perf_counter() - start
    speculator = backend.speculator
    if speculator is None:
        raise SystemExit(f"the draft did not load: {backend.notices}")
    result = {"command": " ".join(sys.argv), "device": str(backend.model.device), "kinds": args.kinds,
              "vram": args.vram, "placement": placement.reason if placement is not None else "every layer resident",
              "tokens": args.tokens, "repeats": args.repeats, "build_s": round(build_s, 1), "load_s": round(load_s, 1),
              "step_fused": backend.decoder.compiled, "verify_captured": speculator.verifier.graph is not None,
              "verify_rows_alone": speculator.verifier.rows_alone,
              "verify_setup_s": round(speculator.verifier.setup_s, 1),
              "draft_captured": speculator.draft_decoder.graph is not None, "alphas": {}}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    target_norms, draft_norms = Branches(backend.model), Branches(speculator.draft)
    request = GenerationRequest(prompt=PROMPT, temperature=0, max_tokens=args.tokens, raw=True, repeat_penalty=1.0)
    alphas = args.alpha
    if not alphas:
        scan = {}

        def accepted(alpha: float) -> float:
            target_norms.scale(alpha)
            draft_norms.scale(alpha)
            speculator.tuner = Tuner(k_max, fixed=k_max)
            backend.speculator = speculator
            engine_cpu.measure(backend, replace(request, max_tokens=64))
            scan[alpha] = speculator.stats.to_dict()["acceptance"] or 0.0
            return scan[alpha]

        high = 0.0
        for alpha in [0.0] + [round(0.001 * 2 ** (i / 2), 5) for i in range(21)]:  # 0.001 … 1.024
            if accepted(alpha) < 0.05:
                break
            if scan[alpha] >= 0.9:
                high = alpha
        for i in range(1, 8):  # acceptance falls steeply: fill in from the last alpha at 90% or more
            accepted(round(high + (alpha - high) * i / 8, 6))
        result["scan"] = {f"{a:g}": v for a, v in scan.items()}
        print(json.dumps({"scan": result["scan"]}), file=sys.stderr)
        alphas = sorted({min(scan, key=lambda a: abs(scan[a] - aim)) for aim in args.acceptance})
    for alpha in alphas:
        target_norms.scale(alpha)
        draft_norms.scale(alpha)
        rows = {"graph_gap": {"target": graph_follows(backend.model, backend.decoder),
                              "draft": graph_follows(speculator.draft, speculator.draft_decoder)}}
        for k in args.k:
            rows[f"k={k}"] = paired(backend, speculator, lambda k=k: Tuner(k_max, fixed=k), request, args.repeats)
        rows[f"tuned k≤{k_max}"] = paired(backend, speculator, lambda: Tuner(k_max), request, args.repeats)
        result["alphas"][f"{alpha:g}"] = rows
        if args.out:  # kept as it grows: a run cut short still leaves what it measured
            args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps({"alpha": alpha, **{mode: {key: row.get(key) for key in
                                                    ("acceptance", "decode_vs_plain", "wall_vs_plain", "agreement")}
                                             for mode, row in rows.items() if mode != "graph_gap"}}), file=sys.stderr)
    if torch.cuda.is_available():
        result["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    result["memory"] = backend.model.memory()
    if args.vram:
        result["plain_whole_budget"] = whole_budget(target, args, request, result)
        print(json.dumps({"plain_whole_budget": result["plain_whole_budget"]}), file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
