"""`gemmactl serve` measured side by side in one run: prefix cache, escalation, concurrency, speculation, overhead.

Starts one gemmactl server (in this process, real HTTP on 127.0.0.1) whose recipe has:
  fast, deep   the model, each with its own llama-server (deep has a different context), 4 slots;
  bulk         the model with 64 slots of 512 tokens, for aggregate tok/s at 1/16/64 clients;
  spec, plain  --spec-target with and without --spec-draft as a draft model (optional);
  ngram        --spec-target with n-gram speculation (no draft model).
Every measurement is interleaved A B A B and reported as medians and median ratios.

    python benchmarks/serve_bench.py [--model GGUF] [--spec-target GGUF --spec-draft GGUF] [--repeat 5]
        [--rounds 2] [--max-tokens 64] [--levels 1,16,64] [--only prefix,escalation,overhead,concurrency,speculative]
        [--home STORE] [--json OUT]

Needs a store with a llama.cpp build (`gemmactl build`): --home, else $GEMMACTL_HOME, else
gemmactl's default store; --model defaults to that store's embedded Gemma 3 270M. Prints a
markdown table; --json writes every figure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CODE = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "# Print the numbers from 1 to 20, one per line.\nfor i in range(1, 21):\n")
PROSE = ("Once upon a time, in a small village by the sea, there lived",
         "The history of the city of Paris begins")


def stream(url: str, path: str, body: dict, key: str | None = None) -> dict:
    """One streamed request: TTFT, wall, tokens, text, and the gemmactl/llama-server counters."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=900)
    start = time.perf_counter()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    connection.request("POST", path, json.dumps(dict(body, stream=True)), headers)
    response = connection.getresponse()
    assert response.status == 200, response.read()[:300]
    first = last = None
    text, tokens, extra = [], 0, {}
    for raw in response:
        if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
            continue
        event = json.loads(raw[6:])
        now = time.perf_counter()
        if "choices" in event:  # the gemmactl front (OpenAI chunks)
            if event.get("usage"):
                tokens, extra = event["usage"]["completion_tokens"], event.get("gemmactl", {})
                continue
            piece = event["choices"][0].get("text") or ""
            if event["choices"][0].get("finish_reason") is None:
                first = first or now
                last = now
            text.append(piece)
        else:  # llama-server /completion
            if event.get("stop"):
                tokens = event["tokens_predicted"]
                extra = {"cached_tokens": event["timings"].get("cache_n", 0)}
                break
            first = first or now
            last = now
            text.append(event.get("content", ""))
    connection.close()
    wall = (last or start) - start
    return {"ttft_s": (first or start) - start, "wall_s": wall, "tokens": tokens, "text": "".join(text),
            "wall_tok_s": tokens / wall if wall > 0 else 0.0, **extra}


def complete(url: str, tier: str, prompt: str, max_tokens: int) -> dict:
    return stream(url, "/v1/completions", {"model": tier, "prompt": prompt, "max_tokens": max_tokens,
                                           "temperature": 0, "stream_options": {"include_usage": True}})


def median(values):
    return statistics.median(values) if values else None


def recipe_yaml(args) -> str:
    tiers = {
        "fast": {"model": args.model, "context": 3072, "parallel": 4},
        "deep": {"model": args.model, "context": 3584, "parallel": 4},
        "bulk": {"model": args.model, "context": 512, "parallel": 64},
    }
    if args.spec_target:
        tiers["plain"] = {"model": args.spec_target, "context": 1024, "parallel": 1}
        tiers["ngram"] = {"model": args.spec_target, "context": 1024, "parallel": 1,
                          "speculative": {"type": "ngram"}}
        if args.spec_draft:
            tiers["spec"] = {"model": args.spec_target, "context": 1024, "parallel": 1,
                             "speculative": {"type": "draft", "draft_model": args.spec_draft, "draft_max": 8}}
    for tier in tiers.values():
        tier["sampling"] = {"temperature": 0.0, "repeat_penalty": 1.0, "max_tokens": 64}
    return json.dumps({"name": "serve-bench", "tiers": tiers})  # JSON is YAML


def warm_prefix(url: str, repeat: int) -> dict:
    from gemmactl.bench.prompts import long_conversation

    cold, warm, cached = [], [], []
    for r in range(repeat):
        prefix = long_conversation(variant=1000 + r)  # a conversation no cache has seen
        first = complete(url, "fast", prefix, 8)
        follow = prefix + first["text"] + "\nReader: And in which year was it published?\nAssistant:"
        second = complete(url, "fast", follow, 8)
        cold.append(first["ttft_s"])
        warm.append(second["ttft_s"])
        cached.append(second.get("cached_tokens", 0))
    return {"cold_ttft_s": median(cold), "warm_ttft_s": median(warm),
            "warm_over_cold": median([w / c for w, c in zip(warm, cold)]), "cached_tokens": median(cached),
            "runs": list(zip(cold, warm, cached))}


def escalation(url: str, service, repeat: int) -> dict:
    prompt = "Question: What is the capital of France?\nAnswer:"
    same, switched = [], []
    for _ in range(repeat):
        complete(url, "fast", prompt, 4)
        same.append(complete(url, "fast", prompt, 4)["ttft_s"])  # fast after fast
        complete(url, "fast", prompt, 4)
        switched.append(complete(url, "deep", prompt, 4)["ttft_s"])  # deep right after fast
    deep = service.lanes["deep"].backend
    return {"fast_after_fast_ttft_s": median(same), "deep_after_fast_ttft_s": median(switched),
            "added_latency_s": median(switched) - median(same),
            "deep_cold_load_s": deep.load_s, "separate_processes": deep is not service.lanes["fast"].backend}


def concurrency(url: str, levels, max_tokens: int, rounds: int) -> list[dict]:
    prompts = [*CODE, *PROSE, "Question: What is the capital of France?\nAnswer:"]
    out = []
    for level in levels:
        rates = []
        for _ in range(rounds):
            results = [None] * level

            def one(i):
                results[i] = complete(url, "bulk", prompts[i % len(prompts)] + f" ({i})" * 0, max_tokens)
                results[i]["end"] = time.perf_counter()

            start = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(level)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            span = max(r["end"] for r in results) - start
            rates.append(sum(r["tokens"] for r in results) / span)
        out.append({"clients": level, "aggregate_tok_s": median(rates), "rounds": rates})
    base = out[0]["aggregate_tok_s"]
    for row in out:
        row["speedup_vs_1"] = row["aggregate_tok_s"] / base
    return out


def speculative(url: str, service, tiers: list[str], repeat: int, max_tokens: int) -> dict:
    rows = {}
    for kind, prompts in (("code", CODE), ("prose", PROSE)):
        per_tier = {tier: [] for tier in ["plain", *tiers]}
        texts = {tier: [] for tier in per_tier}
        for _ in range(repeat):
            for prompt in prompts:
                for tier in per_tier:  # interleaved: plain, spec, ngram, plain, ...
                    result = complete(url, tier, prompt, max_tokens)
                    per_tier[tier].append(result["wall_tok_s"])
                    texts[tier].append(result["text"])
        rows[kind] = {tier: {"wall_tok_s": median(v),
                             "ratio_vs_off": median([a / b for a, b in zip(v, per_tier["plain"])]),
                             "same_text_as_off": texts[tier] == texts["plain"]}
                      for tier, v in per_tier.items()}
    for tier in tiers:
        c = service.lanes[tier].counters
        rows[f"{tier}_acceptance"] = {"drafted": c.draft_tokens, "accepted": c.draft_accepted,
                                      "rate": c.draft_accepted / c.draft_tokens if c.draft_tokens else None}
    return rows


def overhead(url: str, service, repeat: int, max_tokens: int) -> dict:
    backend = service.lanes["fast"].backend
    direct_url = backend.url
    front, direct, same = [], [], []
    for r in range(repeat + 1):
        for prompt in PROSE:
            via_front = complete(url, "fast", prompt, max_tokens)
            # The same prompt straight to the tier's llama-server, with the settings the front sends
            # (greedy: llama-server's filters as no-ops, LlamaServer.sampling_fields).
            tokens = backend.server.post_json("/tokenize", {"content": prompt, "add_special": True})["tokens"]
            raw = stream(direct_url, "/completion", {"prompt": tokens, "n_predict": max_tokens,
                                                     **backend.server.sampling_fields(0, 0, 1.0, 0.0, 1.0),
                                                     "cache_prompt": True}, key=backend.server.api_key)
            if r == 0:
                continue  # the first pass fills the prompt cache for both sides
            # Greedy text can still differ in a near tie: a cold prefill batch rounds unlike a warm one.
            same.append(raw["text"] == via_front["text"])
            front.append(via_front["wall_tok_s"])
            direct.append(raw["wall_tok_s"])
    return {"front_wall_tok_s": median(front), "direct_wall_tok_s": median(direct),
            "ratio_front_over_direct": median([a / b for a, b in zip(front, direct)]),
            "same_text": f"{sum(same)} of {len(same)}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF for fast/deep/bulk (default: the embedded model)")
    parser.add_argument("--spec-target", help="GGUF served with and without speculation")
    parser.add_argument("--spec-draft", help="draft GGUF for --spec-target (same vocabulary)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--home", help="store folder (default: $GEMMACTL_HOME)")
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--only", default="prefix,escalation,overhead,concurrency,speculative")
    args = parser.parse_args()

    from gemmactl.recipes import parse_recipe
    from gemmactl.server.service import ServeConfig, Service
    from gemmactl.store import Store

    store = Store(Path(args.home)) if args.home else Store()
    if not args.model:
        from gemmactl.store.embedded import ensure_embedded_model

        args.model = ensure_embedded_model(store).path
    recipe = parse_recipe(recipe_yaml(args), source="serve-bench")
    started = time.perf_counter()
    service = Service(ServeConfig(recipe=recipe, port=0), store).start()
    result = {"model": str(args.model), "spec_target": args.spec_target, "spec_draft": args.spec_draft,
              "start_s": time.perf_counter() - started, "repeat": args.repeat}
    only = set(args.only.split(","))
    try:
        url = service.url
        complete(url, "fast", "Hello", 2)  # warm-up
        if "prefix" in only:
            result["warm_prefix"] = warm_prefix(url, min(args.repeat, 3))
            print(json.dumps({"warm_prefix": result["warm_prefix"]}), flush=True)
        if "escalation" in only:
            result["escalation"] = escalation(url, service, args.repeat)
            print(json.dumps({"escalation": result["escalation"]}), flush=True)
        if "overhead" in only:
            result["overhead"] = overhead(url, service, args.repeat, args.max_tokens)
            print(json.dumps({"overhead": result["overhead"]}), flush=True)
        if "concurrency" in only:
            levels = [int(x) for x in args.levels.split(",")]
            result["concurrency"] = concurrency(url, levels, args.max_tokens, args.rounds)
            print(json.dumps({"concurrency": result["concurrency"]}), flush=True)
        if "speculative" in only and args.spec_target:
            tiers = [t for t in ("spec", "ngram") if t in service.lanes]
            result["speculative"] = speculative(url, service, tiers, args.repeat, args.max_tokens)
            print(json.dumps({"speculative": result["speculative"]}), flush=True)
        result["metrics"] = {name: lane.snapshot() for name, lane in service.lanes.items()}
    finally:
        service.close()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(report(result))


def report(r: dict) -> str:
    """Lines ready for docs/benchmarks.md."""
    lines = []
    if "warm_prefix" in r:
        w = r["warm_prefix"]
        lines.append(f"| warm vs cold TTFT, {w['cached_tokens']:.0f}-token cached prefix | cold {w['cold_ttft_s'] * 1000:,.0f} ms, "
                     f"warm {w['warm_ttft_s'] * 1000:,.0f} ms | **{w['warm_over_cold']:.3f}×** (goal ≤ 0.1×) |")
    if "escalation" in r:
        e = r["escalation"]
        lines.append(f"| fast→deep escalation (separate warm llama-servers: {e['separate_processes']}) | TTFT fast after fast "
                     f"{e['fast_after_fast_ttft_s'] * 1000:.0f} ms, deep after fast {e['deep_after_fast_ttft_s'] * 1000:.0f} ms "
                     f"(a cold start of deep: {e['deep_cold_load_s']:.2f} s) | **{e['added_latency_s'] * 1000:+.0f} ms** (goal ≤ 50 ms) |")
    if "overhead" in r:
        o = r["overhead"]
        lines.append(f"| front vs llama-server direct, wall tok/s | {o['front_wall_tok_s']:.1f} vs {o['direct_wall_tok_s']:.1f} "
                     f"(same text {o['same_text']}) | **{o['ratio_front_over_direct']:.3f}×** (goal ≥ 0.97×) |")
    for row in r.get("concurrency", []):
        lines.append(f"| aggregate tok/s at {row['clients']} clients | {row['aggregate_tok_s']:.1f} "
                     f"(rounds {', '.join(f'{x:.1f}' for x in row['rounds'])}) | **{row['speedup_vs_1']:.2f}×** vs 1 |")
    spec = r.get("speculative", {})
    for kind in ("code", "prose"):
        for tier, row in spec.get(kind, {}).items():
            if tier == "plain":
                continue
            lines.append(f"| speculative {tier} on {kind} | {row['wall_tok_s']:.1f} tok/s vs off {spec[kind]['plain']['wall_tok_s']:.1f}, "
                         f"same text: {row['same_text_as_off']} | **{row['ratio_vs_off']:.2f}×** |")
    for key, row in spec.items():
        if key.endswith("_acceptance"):
            rate = f"{row['rate']:.1%}" if row["rate"] is not None else "n/a"
            lines.append(f"| {key.replace('_', ' ')} | {row['accepted']} of {row['drafted']} drafted tokens | {rate} |")
    return "\n".join(["| measurement | figures | result |", "| --- | --- | --- |", *lines])


if __name__ == "__main__":
    main()
