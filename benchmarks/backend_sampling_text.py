"""Does llama-server's --backend-sampling give the same greedy text as its CPU sampler?

    python benchmarks/backend_sampling_text.py --model GGUF|NAME [--home STORE] [--flash-attn on] [--parallel 16]
        [--max-tokens 64] [--log-dir DIR] [--json OUT]

Starts the same llama-server twice (with and without --backend-sampling), sends the same greedy
prompts one at a time and then all at once, and compares the texts token for token. llama-server
is the active build of the store (--home, else $GEMMACTL_HOME, else gemmactl's default store);
--model is a GGUF path or a store name (`embedded`: the embedded Gemma 3 270M); llama-server's
logs go to --log-dir (default: a new temporary folder). The summary goes to stdout; --json
writes it with every text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    "The history of the printing press", "def fibonacci(n):", "Dear team, the meeting on Friday",
    "A recipe for bread:", "The mitochondria is", "In 1905, Albert Einstein", "SELECT name FROM",
    "Once upon a time, in a village", "The three laws of motion are", "import numpy as np\n",
    "Paris is the capital of", "The quick brown fox", "Water boils at", "To be or not to be,",
    "The stock market today", "Photosynthesis converts",
]


def texts(server, concurrent: bool, max_tokens: int) -> list[str]:
    def one(prompt: str) -> str:
        # Greedy as gemmactl sends it to this server (LlamaServer.sampling_fields).
        body = {"prompt": prompt, "n_predict": max_tokens, "cache_prompt": False, "ignore_eos": True,
                **server.sampling_fields(0, 0, 1.0, 0.0, 1.0)}
        reply = server.post_json("/completion", body, timeout=600)
        return reply["content"]

    if not concurrent:
        return [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF path or store name (e.g. embedded)")
    parser.add_argument("--home", help="store with the llama.cpp build (default: $GEMMACTL_HOME)")
    parser.add_argument("--flash-attn", default="on")
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--log-dir", type=Path, help="llama-server logs (default: a new temporary folder)")
    parser.add_argument("--json", help="write the summary and every text here")
    args = parser.parse_args()
    from gemmactl.llamacpp.build import active_build
    from gemmactl.llamacpp.server import LlamaServer
    from gemmactl.store import Store
    from gemmactl.store.refs import resolve_model

    store = Store(Path(args.home)) if args.home else Store()
    build = active_build(store)
    if build is None or "llama-server" not in build.binaries:
        sys.exit(f"no llama.cpp build with llama-server in {store.home}: run `gemmactl build` (or pass --home)")
    model = str(resolve_model(args.model, store, accept=("gguf",)).path)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="backend-sampling-"))
    results = {}
    for label, extra in (("cpu-sampling", ()), ("backend-sampling", ("--backend-sampling",))):
        with LlamaServer(build.binary("llama-server"), model, threads=os.cpu_count() or 1, context=512,
                         parallel=args.parallel, log_dir=log_dir, flash_attn=args.flash_attn,
                         extra_args=extra, label=label) as server:
            results[label] = {"one_at_a_time": texts(server, False, args.max_tokens),
                              "all_at_once": texts(server, True, args.max_tokens)}
    report = {"prompts": len(PROMPTS), "max_tokens": args.max_tokens, "flash_attn": args.flash_attn,
              "parallel": args.parallel}
    for mode in ("one_at_a_time", "all_at_once"):
        a, b = results["cpu-sampling"][mode], results["backend-sampling"][mode]
        report[f"same_text_{mode}"] = sum(x == y for x, y in zip(a, b))
    a, b = results["cpu-sampling"]["one_at_a_time"], results["cpu-sampling"]["all_at_once"]
    report["cpu_sampling_same_text_alone_vs_batched"] = sum(x == y for x, y in zip(a, b))
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report | {"texts": results}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
