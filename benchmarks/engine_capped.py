"""The engine under a VRAM cap, beside llama.cpp and accelerate at the same cap.

One model in three forms (an int4-stream artifact, a Q4_K_M GGUF and the bfloat16 checkpoint they
came from), one cap, one prompt:

1. The cap: unless --cap is given, the smallest multiple of 64 MiB whose engine map keeps at least
   --share of the layers resident on the GPU (so about half of them stream or run on the CPU).
2. The engine: `plan --backend int4 --verify` (measured decode against the map's prediction), then
   `gemmactl run` on a recipe tier with that cap (decode, wall clock and TTFT on the prompt).
3. llama.cpp: the GGUF's plan at the same cap; llama-bench with the plan's -ngl/-ot (decode-only
   tg and pp), then `gemmactl run` on a llama.cpp tier with that cap (its wall clock and TTFT).
4. accelerate: transformers `from_pretrained(device_map="auto", max_memory={0: cap})` in bfloat16,
   greedy `generate` on the same prompt (TTFT, decode, wall).

Every run is its own process; the GPU memory it used (nvidia-smi, the device's used memory above
the idle baseline, sampled every 50 ms) is recorded against the cap. Prints a markdown table and
writes OUT/engine_capped.json. `--runs` picks among verify, run, bench and accelerate (default: all),
and two runs for MoE models: `sweep`, llama-bench over `--n-cpu-moe` from every layer's experts on
the CPU down until a point overruns the cap (the best point that fits is named), and `fit`,
llama-bench with llama.cpp's own fitting (`--fit-target`: the device's memory less the cap kept free).
`--zipf S` skews the engine's routers on purpose (benchmarks/skewed_router.py: Zipf S over each
layer's experts, synthetic), and `--runs policies` runs the engine once per expert cache policy and
once with the cache off (hit rate, bytes over the link per token, decode and wall tok/s);
`--runs shares` runs the engine once per `--shares` value of `--expert-cpu-share` (the share of
each MoE layer's experts computed on the CPU beside the GPU's cache; "auto" is the plan's);
`--runs modes` runs it once per `--modes` value of GEMMACTL_ENGINE_MOE (pieces: the captured step
reading each expert in its row, the default; copies: every expert copied into staging rows; a
mode with `/torch`, e.g. `pieces/torch`, has the arena's copies queued by torch's copy_ rather
than the driver's calls, GEMMACTL_ENGINE_COPIES=torch; `/fused` and `/unfused` fuse the pieces by
torch.compile before capture or not, GEMMACTL_ENGINE_COMPILE=on or off; `table/admitN` is the whole
step admitting at most N of a token's misses, GEMMACTL_ENGINE_TABLE_ADMIT=N);
`--runs prefetch` runs the engine again without prefetch (`--no-expert-prefetch`), and
`--runs no-host` runs it again with no layer on the CPU (GEMMACTL_PLAN_HOST_LAYERS=off: the layers
that do not fit all stream), beside the plan's own split between the link and the CPU.
`--runs rounds` alternates the engine's `run` and llama-bench's tg at the plan's -ngl --rounds
times (3) and reports each round's ratio and the medians: llama.cpp's CPU layers make its rate
move with the host's cores (31–64 tok/s at one cap on three machines of one kind), the engine's
far less, so a ratio is only fair between runs side by side in time.

    python benchmarks/engine_capped.py --artifact DIR --gguf FILE --hf-model DIR --bench llama-bench --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_plan import _smi_mib, bench_tg, run_sampled  # noqa: E402

STEP = 64 << 20
ACCELERATE = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, cap, tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), open(sys.argv[4]).read()
start = time.perf_counter()
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
                                             max_memory={0: cap, "cpu": 1 << 40}).eval()
load_s = time.perf_counter() - start
ids = tok(prompt, return_tensors="pt").to(model.device)
times = []
class Clock:
    seen = False
    def put(self, value):
        if not self.seen:
            self.seen = True
            return
        times.extend([time.perf_counter()] * int(value.numel()))
    def end(self):
        pass
with torch.inference_mode():
    model.generate(**ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=Clock())
placed = {}
# A map of one device (everything where the first module fit) is not recorded as a map.
for device in getattr(model, "hf_device_map", {"": str(model.device)}).values():
    placed[str(device)] = placed.get(str(device), 0) + 1
print(json.dumps({"load_s": load_s, "prompt_tokens": int(ids["input_ids"].shape[1]), "generated_tokens": len(times),
                  "ttft_s": times[0] - start, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
                  "wall_tok_s": len(times) / (times[-1] - start), "modules_per_device": placed,
                  "torch_peak_allocated_bytes": torch.cuda.max_memory_allocated()}))
"""


def gemmactl(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemmactl", *args]


def choose_cap(artifact: str, context: int, share: float) -> tuple[int, dict]:
    """The smallest multiple of STEP whose engine map keeps share of the layers resident, walking up
    from the least budget the map works in (as the plan with the whole GPU reports it)."""
    from gemmactl.plan.report import build_plan

    whole = build_plan(artifact, context=context, backend="int4", remeasure=True).engine
    cap = -(-whole.minimum_vram_bytes // STEP) * STEP
    while True:
        engine = build_plan(artifact, vram=f"{cap >> 20}M", context=context, backend="int4").engine
        if engine.layers.count("resident") >= share * len(engine.layers) or engine.layers == whole.layers:
            return cap, engine.to_dict()
        cap += STEP


def sampled_json(cmd: list[str], log: Path) -> tuple[dict, int, int]:
    """Run cmd under the GPU memory sampler; (its JSON stdout or {}, peak MiB, exit status)."""
    proc, peak = run_sampled(cmd, log)
    try:
        data = json.loads(proc.stdout) if proc.stdout.strip() else {}
    except ValueError:
        data = {}
    return data, peak, proc.returncode


def write_recipe(path: Path, artifact: str, gguf: str, cap_mib: int, context: int, tokens: int) -> None:
    tiers = {
        "engine": {"model": artifact, "backend": "int4"},
        "llamacpp": {"model": gguf, "backend": "llamacpp"},
    }
    lines = ["name: capped", "description: one model under one VRAM cap on two back ends", "default_tier: engine",
             "tiers:"]
    for name, tier in tiers.items():
        lines += [f"  {name}:", f"    description: {tier['backend']} at {cap_mib} MiB",
                  f"    model: {json.dumps(tier['model'])}", f"    backend: {tier['backend']}",
                  f"    context: {context}", f"    vram: {cap_mib}M", "    sampling:", "      temperature: 0",
                  f"      max_tokens: {tokens}"]
    path.write_text("\n".join(lines) + "\n")


def run_row(stats: dict, peak: int, status: int) -> dict:
    keys = ("load_s", "ttft_s", "prompt_tokens", "generated_tokens", "decode_tok_s", "wall_tok_s")
    return {**{k: stats.get(k) for k in keys}, "peak_mib": peak, "exit": status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="int4-stream artifact")
    parser.add_argument("--gguf", required=True, help="Q4_K_M GGUF of the same model")
    parser.add_argument("--hf-model", help="bfloat16 checkpoint for accelerate (left out: no accelerate row)")
    parser.add_argument("--bench", required=True, help="llama-bench of the CUDA build")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cap", help="VRAM cap (default: chosen by --share)")
    parser.add_argument("--share", type=float, default=0.5, help="share of layers resident at the chosen cap")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--accelerate-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=380, help="about 512 tokens")
    parser.add_argument("--runs", default="verify,run,bench,accelerate",
                        help="which runs, comma-separated (run: `gemmactl run` on both back ends; run-engine, "
                             "run-llamacpp: on one; prefetch: the engine again with --no-expert-prefetch; no-host: "
                             "again with no layer on the CPU; rounds: the engine's run and llama-bench alternated; "
                             "sweep, fit, policies: see above)")
    parser.add_argument("--policies", help="with --runs policies: which of them, comma-separated (default: "
                                           "lru,lfu,hot,off; off is the cache turned off)")
    parser.add_argument("--shares", default="0,0.5,1",
                        help="with --runs shares: --expert-cpu-share values, comma-separated (auto: the plan's)")
    parser.add_argument("--modes", default="pieces,copies",
                        help="with --runs modes: GEMMACTL_ENGINE_MOE values, comma-separated (pieces: the captured "
                             "step reading each expert in its row; copies: every expert copied into staging rows; "
                             "table: one graph; MODE/torch: the copies queued by torch's copy_; MODE/fused, "
                             "MODE/unfused: the pieces fused by torch.compile or not; table/admitN: at most N "
                             "admissions a token)")
    parser.add_argument("--rounds", type=int, default=3, help="with --runs rounds: how many engine/llama-bench pairs")
    parser.add_argument("--zipf", type=float, help="skew the engine's MoE routers: Zipf S over each layer's experts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = set(args.runs.split(","))

    from gemmactl.plan.report import build_plan, plan_dict
    from gemmactl.sizes import parse_size

    start = time.perf_counter()
    if args.cap:
        cap = parse_size(args.cap)
        engine_map = build_plan(args.artifact, vram=args.cap, context=args.context, backend="int4").engine.to_dict()
    else:
        cap, engine_map = choose_cap(args.artifact, args.context, args.share)
    cap_mib = cap >> 20
    vram = f"{cap_mib}M"
    result: dict = {"command": " ".join(sys.argv), "cap_mib": cap_mib, "context": args.context, "tokens": args.tokens,
                    "router": "uniform (random weights)" if args.zipf is None else f"synthetic Zipf {args.zipf}",
                    "engine_map": {k: engine_map[k] for k in ("counts", "tables", "gpu_bytes", "link_bytes_per_token",
                                                              "decode_tok_s")},
                    "cap_chosen_in_s": round(time.perf_counter() - start, 1)}
    words = ("the quick brown fox jumps over the lazy dog while a careful engineer measures every step "
             "of the run and writes each figure down beside the command that made it").split()
    prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
    prompt_file = args.out / "prompt.txt"
    prompt_file.write_text(prompt)

    verify, peak, status = ({}, None, None) if "verify" not in runs else sampled_json(
        gemmactl("plan", args.artifact, "--backend", "int4", "--vram", vram, "--context", str(args.context),
                 "--verify", "--json"), args.out / "engine-verify.log")
    result["engine_verify"] = {**verify.get("verify", {}), "sampled_peak_mib": peak, "exit": status}

    recipe = args.out / "capped.yaml"
    write_recipe(recipe, args.artifact, args.gguf, cap_mib, args.context, args.tokens)
    def run_tier(tier: str, name: str, *extra: str, env: dict | None = None) -> dict:
        command = ["run", "--recipe", str(recipe), "--tier", tier, "--raw", "--json", "--max-tokens", str(args.tokens),
                   *extra, prompt]
        if tier == "engine" and args.zipf is not None:
            command = [sys.executable, str(Path(__file__).with_name("skewed_router.py")), "--zipf", str(args.zipf),
                       "--", *command]
        else:
            command = gemmactl(*command)
        saved = {key: os.environ.get(key) for key in env or {}}
        os.environ.update(env or {})
        try:
            data, peak, status = sampled_json(command, args.out / f"run-{name}.log")
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        answer = data.get("answer") or ""
        # The answer's digest: runs that should give the same greedy tokens (the MoE step's modes) are
        # compared by it.
        return {**run_row(data.get("stats", {}), peak, status), "engine": (data.get("model") or {}).get("engine"),
                "notices": data.get("notices"), "answer_sha256": hashlib.sha256(answer.encode()).hexdigest()[:16]}

    for tier in ("engine", "llamacpp"):
        if "run" in runs or f"run-{tier}" in runs:
            result[f"run_{tier}"] = run_tier(tier, tier)
        if tier == "engine" and "prefetch" in runs:  # beside the run with it (the default), in the same call
            result["run_engine_no_prefetch"] = run_tier("engine", "engine-no-prefetch", "--no-expert-prefetch")
        if tier == "engine" and "no-host" in runs:  # every layer that does not fit streamed
            from gemmactl.plan.engine_map import HOST_LAYERS_ENV

            result["run_engine_no_host"] = run_tier("engine", "engine-no-host", env={HOST_LAYERS_ENV: "off"})
    if "policies" in runs:
        from gemmactl.runtime.engine.expert_settings import POLICIES

        wanted = args.policies.split(",") if args.policies else [*POLICIES, "off"]
        result["policies"] = {policy: run_tier("engine", f"engine-{policy}", "--expert-policy", policy)
                              for policy in POLICIES if policy in wanted}
        if "off" in wanted:
            result["policies"]["off"] = run_tier("engine", "engine-cache-off", "--expert-cache", "off")

    if "shares" in runs:
        result["shares"] = {share: run_tier("engine", f"engine-share-{share}", "--expert-cpu-share", share)
                            for share in args.shares.split(",")}

    if "modes" in runs:
        from gemmactl.runtime.engine.device_copies import COPIES_ENV
        from gemmactl.runtime.engine.experts import ADMIT_ENV
        from gemmactl.runtime.engine.graph import COMPILE_ENV, MOE_ENV

        def mode_env(mode: str) -> dict:
            moe, *parts = mode.split("/")
            env = {MOE_ENV: moe, COPIES_ENV: "torch" if "torch" in parts else "driver"}
            if "fused" in parts or "unfused" in parts:
                env[COMPILE_ENV] = "on" if "fused" in parts else "off"
            for part in parts:  # table/admitN: at most N of a token's misses admitted
                if part.startswith("admit") and part[5:].isdigit():
                    env[ADMIT_ENV] = part[5:]
            return env

        result["modes"] = {mode: run_tier("engine", f"engine-moe-{mode.replace('/', '-')}", env=mode_env(mode))
                           for mode in args.modes.split(",")}

    if "bench" in runs:
        bench(args, vram, result)
    if "rounds" in runs:
        result["rounds"] = rounds(args, vram, lambda number: run_tier("engine", f"engine-round-{number}"))
    if "sweep" in runs:
        result["n_cpu_moe_sweep"] = sweep(args, cap_mib)
    if "fit" in runs:
        proc, peak = llama_bench(args, "llama-fit.log", "-fitt", str(max(0, _smi_mib("total") - cap_mib)))
        tg, pp, ngl = bench_tg(proc)
        result["llama_fit"] = {"tg_tok_s": tg, "pp_tok_s": pp, "n_gpu_layers": ngl, "peak_mib": peak,
                               "fits": peak <= cap_mib, "exit": proc.returncode}
    if args.hf_model and "accelerate" in runs:
        data, peak, status = sampled_json(
            [sys.executable, "-c", ACCELERATE, args.hf_model, str(cap), str(args.accelerate_tokens), str(prompt_file)],
            args.out / "accelerate.log")
        result["accelerate"] = {**data, "peak_mib": peak, "exit": status}

    (args.out / "engine_capped.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(table(result))
    if result.get("rounds"):
        print(rounds_table(result["rounds"]))
    if result.get("policies"):
        print(policy_table(result))
    if result.get("shares"):
        print(policy_table(result, "shares", "CPU share"))
    if result.get("modes"):
        print(policy_table(result, "modes", "MoE step"))


def policy_table(r: dict, key: str = "policies", label: str = "policy") -> str:
    """One row per expert cache policy (and the cache off), or per CPU share: what the cache did,
    the share of expert uses computed on the CPU, and what it bought."""
    rows = [f"| {label} ({r['router']}) | cached experts | hit rate | on the CPU | link MB per decoded token | "
            f"decode tok/s | wall tok/s | TTFT s | peak MiB (cap {r['cap_mib']}) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in r[key].items():
        experts = ((row.get("engine") or {}).get("experts")) or {}
        link = experts.get("link_bytes_per_decode_token", experts.get("link_bytes_per_token"))
        rows.append(f"| {name} | {experts.get('capacity_experts', '-')} | "
                    f"{'-' if experts.get('hit_rate') is None else format(experts['hit_rate'], '.1%')} | "
                    f"{'-' if experts.get('host_share') is None else format(experts['host_share'], '.0%')} | "
                    f"{'-' if link is None else format(link / 1e6, '.1f')} | {_num(row.get('decode_tok_s'))} | "
                    f"{_num(row.get('wall_tok_s'))} | {_num(row.get('ttft_s'))} | {row.get('peak_mib')} |")
    return "\n".join(rows)


def llama_bench(args, log: str, *extra: str, repeats: int = 1):
    """llama-bench on the GGUF (pp512 and tg of --tokens, JSON out) under the memory sampler:
    (the finished process, its peak MiB)."""
    return run_sampled([args.bench, "-m", args.gguf, "-p", "512", "-n", str(args.tokens), "-r", str(repeats), "-o",
                        "json", *extra], args.out / log)


def sweep(args, cap_mib: int) -> dict:
    """llama-bench with every layer on the GPU and the experts of n layers on the CPU, n from all
    of them down in steps of 2 until a point's peak overruns the cap (fewer on the CPU only needs
    more memory)."""
    from gemmactl.formats.gguf_header import read_gguf_header

    layers = int(read_gguf_header(Path(args.gguf), tensors=False).arch_key("block_count"))
    points = []
    for n in range(layers, -1, -2):
        proc, peak = llama_bench(args, f"llama-ncmoe-{n}.log", "-ngl", "99", "-ncmoe", str(n))
        tg, pp, _ = bench_tg(proc)
        points.append({"n_cpu_moe": n, "tg_tok_s": tg, "pp_tok_s": pp, "peak_mib": peak, "fits": peak <= cap_mib,
                       "exit": proc.returncode})
        if peak > cap_mib or proc.returncode != 0:
            break
    fitting = [p for p in points if p["fits"] and p["tg_tok_s"]]
    best = max(fitting, key=lambda p: p["tg_tok_s"], default=None)
    return {"points": points, "best": best}


def bench(args, vram: str, result: dict) -> None:
    """llama-bench with the GGUF's plan at the cap (decode-only tg and pp)."""
    from gemmactl.plan.report import build_plan, plan_dict

    built = build_plan(args.gguf, vram=vram, context=args.context)
    plan = plan_dict(built.plan, built)
    plan_args = ["-ngl", str(plan["llama_cpp_args"]["-ngl"])]
    if plan["llama_cpp_args"]["-ot"]:
        plan_args += ["-ot", ";".join(plan["llama_cpp_args"]["-ot"])]
    proc, peak = llama_bench(args, "llama-bench.log", *plan_args, repeats=3)
    tg, pp, ngl = bench_tg(proc)
    result["llama_bench"] = {"args": plan_args, "tg_tok_s": tg, "pp_tok_s": pp, "n_gpu_layers": ngl, "peak_mib": peak,
                             "exit": proc.returncode, "predicted_decode_tok_s": plan["predicted"]["decode_tok_s"]}


def rounds(args, vram: str, engine_run) -> dict:
    """--rounds rounds, each the engine's `run` then llama-bench's tg alone (-p 0, one repetition)
    at the GGUF's plan: side by side in time, so a machine whose host cores slow down for a while
    (llama.cpp computes its CPU layers there) weighs on both sides of a round's ratio alike. Each
    round's ratio, and the medians."""
    from gemmactl.plan.report import build_plan, plan_dict

    built = build_plan(args.gguf, vram=vram, context=args.context)
    llama_args = plan_dict(built.plan, built)["llama_cpp_args"]
    plan_args = ["-ngl", str(llama_args["-ngl"])] + (["-ot", ";".join(llama_args["-ot"])] if llama_args["-ot"] else [])
    rows = []
    for number in range(1, args.rounds + 1):
        engine = engine_run(number)
        proc, peak = run_sampled([args.bench, "-m", args.gguf, "-p", "0", "-n", str(args.tokens), "-r", "1", "-o", "json",
                                  *plan_args], args.out / f"llama-round-{number}.log")
        tg, _, _ = bench_tg(proc)
        ours = engine.get("decode_tok_s")
        rows.append({"engine_decode_tok_s": ours, "engine_wall_tok_s": engine.get("wall_tok_s"),
                     "engine_peak_mib": engine.get("peak_mib"), "llama_bench_tg_tok_s": tg, "llama_peak_mib": peak,
                     "ratio": ours / tg if ours and tg else None})
    ratios = [row["ratio"] for row in rows if row["ratio"]]
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return {"llama_bench_args": plan_args, "rounds": rows, "median_ratio": median(ratios),
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "median_engine_decode_tok_s": median([r["engine_decode_tok_s"] for r in rows if r["engine_decode_tok_s"]]),
            "median_llama_bench_tg_tok_s": median([r["llama_bench_tg_tok_s"] for r in rows if r["llama_bench_tg_tok_s"]])}


def rounds_table(r: dict) -> str:
    rows = [f"| round | engine `run` decode tok/s | llama-bench `{' '.join(r['llama_bench_args'])}` tg tok/s | engine ÷ llama.cpp |",
            "| --- | --- | --- | --- |"]
    for number, row in enumerate(r["rounds"], start=1):
        rows.append(f"| {number} | {_num(row['engine_decode_tok_s'])} | {_num(row['llama_bench_tg_tok_s'])} | "
                    f"{'-' if row['ratio'] is None else format(row['ratio'], '.2f') + '×'} |")
    median = "-" if r["median_ratio"] is None else f"**{r['median_ratio']:.2f}×**"
    rows.append(f"| median | {_num(r['median_engine_decode_tok_s'])} | {_num(r['median_llama_bench_tg_tok_s'])} | {median} |")
    return "\n".join(rows)


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a and b else "-"


def table(r: dict) -> str:
    """The markdown table of one run: rates, ratios of the engine to each, peaks against the cap."""
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    missing = {"decode_tok_s": None, "wall_tok_s": None, "ttft_s": None, "peak_mib": None}
    cap, eng, lcpp = r["cap_mib"], r.get("run_engine", missing), r.get("run_llamacpp", missing)
    v, acc = r["engine_verify"], r.get("accelerate", {})
    lb = r.get("llama_bench", {"args": ["(not run)"], "tg_tok_s": None, "peak_mib": None, "predicted_decode_tok_s": None})
    rows = [
        "| run | decode tok/s | wall tok/s | TTFT s | peak MiB (cap %d) | predicted decode |" % cap,
        "| --- | --- | --- | --- | --- | --- |",
        f"| engine, `plan --verify` | {fmt(v.get('measured_decode_tok_s'))} | | | {v.get('sampled_peak_mib')} | "
        f"{fmt(v.get('predicted_decode_tok_s'))} |",
        f"| engine, `run` | {fmt(eng['decode_tok_s'])} | {fmt(eng['wall_tok_s'])} | {fmt(eng['ttft_s'], '.3f')} | "
        f"{eng['peak_mib']} | |",
        f"| llama.cpp, llama-bench `{' '.join(lb['args'])}` | {fmt(lb['tg_tok_s'])} | | | {lb['peak_mib']} | "
        f"{fmt(lb['predicted_decode_tok_s'])} |",
        f"| llama.cpp, `run` | {fmt(lcpp['decode_tok_s'])} | {fmt(lcpp['wall_tok_s'])} | {fmt(lcpp['ttft_s'], '.3f')} | "
        f"{lcpp['peak_mib']} | |",
    ]
    plain = r.get("run_engine_no_prefetch")
    if plain:
        rows.insert(4, f"| engine, `run --no-expert-prefetch` | {fmt(plain['decode_tok_s'])} | {fmt(plain['wall_tok_s'])} | "
                       f"{fmt(plain['ttft_s'], '.3f')} | {plain['peak_mib']} | |")
    streamed = r.get("run_engine_no_host")
    if streamed:
        rows.insert(4, f"| engine, `run`, no layer on the CPU | {fmt(streamed['decode_tok_s'])} | "
                       f"{fmt(streamed['wall_tok_s'])} | {fmt(streamed['ttft_s'], '.3f')} | {streamed['peak_mib']} | |")
    best, fit = (r.get("n_cpu_moe_sweep") or {}).get("best"), r.get("llama_fit")
    if best:
        points = len(r["n_cpu_moe_sweep"]["points"])
        rows.append(f"| llama.cpp, llama-bench `-ngl 99 -ncmoe {best['n_cpu_moe']}` (best fitting of {points} points) | "
                    f"{fmt(best['tg_tok_s'])} | | | {best['peak_mib']} | |")
    if fit:
        rows.append(f"| llama.cpp, llama-bench `--fit-target` | {fmt(fit['tg_tok_s'])} | | | {fit['peak_mib']} | |")
    if acc:
        rows.append(f"| accelerate bf16 | {fmt(acc.get('decode_tok_s'), '.2f')} | {fmt(acc.get('wall_tok_s'), '.2f')} | "
                    f"{fmt(acc.get('ttft_s'), '.3f')} | {acc.get('peak_mib')} | |")
    rows += ["", "| engine ÷ | decode | wall | TTFT (theirs ÷ ours) |", "| --- | --- | --- | --- |",
             f"| llama.cpp (llama-bench tg) | {_ratio(v.get('measured_decode_tok_s'), lb['tg_tok_s'])} | | |",
             f"| llama.cpp (`run`) | {_ratio(eng['decode_tok_s'], lcpp['decode_tok_s'])} | "
             f"{_ratio(eng['wall_tok_s'], lcpp['wall_tok_s'])} | {_ratio(lcpp['ttft_s'], eng['ttft_s'])} |"]
    if best:
        rows.append(f"| llama.cpp (best `-ncmoe`) | {_ratio(eng['decode_tok_s'], best['tg_tok_s'])} | | |")
        if plain:
            rows.append(f"| llama.cpp (best `-ncmoe`), engine without prefetch | "
                        f"{_ratio(plain['decode_tok_s'], best['tg_tok_s'])} | | |")
    if acc:
        rows.append(f"| accelerate | {_ratio(eng['decode_tok_s'], acc.get('decode_tok_s'))} | "
                    f"{_ratio(eng['wall_tok_s'], acc.get('wall_tok_s'))} | {_ratio(acc.get('ttft_s'), eng['ttft_s'])} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
