"""The int4 backend on the CPU: the engine against the transformers path it replaced.

    python benchmarks/engine_cpu.py ARTIFACT [--tokens 128] [--repeats 3]

Both backends load the same int4-stream artifact in one process (dense bfloat16 weights, the
transformers path with GEMMACTL_INT4_ENGINE=off and GEMMACTL_INT4_WEIGHTS=dense) and generate
--tokens tokens greedily from the same raw prompt, interleaved A B A B after one untimed warm-up
each. Reported per backend: load seconds, TTFT, decode-only tok/s (tokens after the first ÷ the
time after the first) and wall tok/s, as gemmactl's streaming core measures them, median of
--repeats; and whether both produced the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace


def open_backend(artifact: str, engine: bool):
    os.environ["GEMMACTL_INT4_ENGINE"] = "auto" if engine else "off"
    os.environ["GEMMACTL_INT4_WEIGHTS"] = "dense"
    from gemmactl.runtime import backend_class

    start = time.perf_counter()
    backend = backend_class("int4")(artifact, context_size=1024)
    return backend, time.perf_counter() - start


def measure(backend, request) -> dict:
    from gemmactl.runtime.base import GenerationStats, stream_generate

    text, stats = [], None
    for event in stream_generate(backend, request):
        if isinstance(event, GenerationStats):
            stats = event
        else:
            text.append(event.text)
    return {"text": "".join(text), "ttft_s": stats.ttft_s, "decode_tok_s": stats.decode_tok_s,
            "wall_tok_s": stats.wall_tok_s, "tokens": stats.generated_tokens, "prompt_tokens": stats.prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from gemmactl.runtime.base import GenerationRequest

    request = GenerationRequest(prompt="Once upon a time, in a land far away,", temperature=0, max_tokens=args.tokens,
                                raw=True, repeat_penalty=1.0)
    backends = {}
    for name, engine in (("engine", True), ("transformers dense", False)):
        backend, load_s = open_backend(args.artifact, engine)
        measure(backend, replace(request, max_tokens=4))  # warm-up
        backends[name] = (backend, load_s, [])
    for _ in range(args.repeats):
        for name, (backend, _, runs) in backends.items():
            runs.append(measure(backend, request))
    result = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(), "tokens": args.tokens,
              "load_average": os.getloadavg()}
    for name, (backend, load_s, runs) in backends.items():
        result[name] = {"load_s": load_s, **{key: statistics.median(r[key] for r in runs)
                                             for key in ("ttft_s", "decode_tok_s", "wall_tok_s")},
                        "decode_tok_s_all": [r["decode_tok_s"] for r in runs]}
    texts = {name: runs[0]["text"] for name, (_, _, runs) in backends.items()}
    result["same_text"] = len(set(texts.values())) == 1
    result["engine ÷ transformers dense"] = {key: result["engine"][key] / result["transformers dense"][key]
                                             for key in ("decode_tok_s", "wall_tok_s")}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
