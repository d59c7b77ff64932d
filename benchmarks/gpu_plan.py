"""`gemmactl plan` against reality on a GPU: verify at a VRAM cap, and the plan vs llama.cpp's own --fit.

For each GGUF: the plan at the cap (with this machine's measured profile), `plan --verify` in its
own process (measured vs predicted decode tok/s, peak GPU memory of that process vs the cap), then
llama-bench twice side by side: with the plan's -ngl/-ot, and with llama.cpp's --fit targeting
the same cap (fit margin = free memory − cap). Peak GPU memory of each llama-bench run is sampled
with nvidia-smi (device used memory minus the idle baseline). Prints a markdown table and JSON.

    python benchmarks/gpu_plan.py --gguf NAME=PATH [--gguf ...] --vram 4G --context 4096 --bench llama-bench --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _smi_mib(field: str) -> int:
    """One memory figure of GPU 0 in MiB from nvidia-smi (0 without it)."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "--id=0", f"--query-gpu=memory.{field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.strip()
    return int(float(out.splitlines()[0])) if out else 0


def used_mib() -> int:
    return _smi_mib("used")


def free_mib() -> int:
    return _smi_mib("free")


def run_sampled(cmd: list[str], log: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run cmd, sampling device memory every 50 ms with one looping nvidia-smi (machine.SmiPeak:
    a new nvidia-smi each sample slowed work on every core); (result, peak MiB above the idle
    baseline)."""
    from gemmactl.machine import SmiPeak

    baseline = used_mib()
    with SmiPeak(["--id=0", "--query-gpu=memory.used"], lambda parts: int(float(parts[0]))) as watch:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text("$ " + " ".join(cmd) + "\n" + proc.stderr)
    return proc, max(0, max(watch.peak, used_mib()) - baseline)


def bench_tg(proc: subprocess.CompletedProcess) -> tuple[float | None, float | None, int | None]:
    """(tg tok/s, pp tok/s, n_gpu_layers) from llama-bench -o json."""
    try:
        rows = json.loads(proc.stdout)
    except ValueError:
        return None, None, None
    tg = next((r for r in rows if r.get("n_gen")), {})
    pp = next((r for r in rows if r.get("n_prompt") and not r.get("n_gen")), {})
    return tg.get("avg_ts"), pp.get("avg_ts"), tg.get("n_gpu_layers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="append", required=True, help="NAME=PATH")
    parser.add_argument("--vram", default="4G")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--bench", required=True, help="llama-bench of the CUDA build")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from gemmactl.plan.report import build_plan, plan_dict
    from gemmactl.sizes import parse_size

    cap_mib = parse_size(args.vram) // (1 << 20)
    results = []
    first = True
    for item in args.gguf:
        name, _, path = item.partition("=")
        start = time.perf_counter()
        built = build_plan(path, vram=args.vram, context=args.context, remeasure=first)
        plan_s = time.perf_counter() - start
        first = False
        plan = plan_dict(built.plan, built)
        (args.out / f"plan-{name}.json").write_text(json.dumps(plan, indent=2))
        verify_proc = subprocess.run(
            [sys.executable, "-m", "gemmactl", "plan", path, "--vram", args.vram, "--context", str(args.context), "--verify", "--json"],
            capture_output=True, text=True,
        )
        (args.out / f"verify-{name}.log").write_text(verify_proc.stderr)
        verify = json.loads(verify_proc.stdout).get("verify", {}) if verify_proc.stdout.strip() else {}
        common = [args.bench, "-m", path, "-p", "512", "-n", "128", "-r", str(args.repeats), "-o", "json"]
        plan_args = ["-ngl", str(plan["llama_cpp_args"]["-ngl"])]
        if plan["llama_cpp_args"]["-ot"]:
            plan_args += ["-ot", ";".join(plan["llama_cpp_args"]["-ot"])]
        planned, planned_peak = run_sampled(common + plan_args, args.out / f"bench-plan-{name}.log")
        margin = max(free_mib() - cap_mib, 0)
        fitted, fitted_peak = run_sampled(common + ["-fitt", str(margin), "-fitc", str(args.context)],
                                          args.out / f"bench-fit-{name}.log")
        fit_lines = [line.strip() for line in fitted.stderr.splitlines() if re.search(r"fit|offload|layers", line, re.I)]
        plan_tg, plan_pp, _ = bench_tg(planned)
        fit_tg, fit_pp, fit_ngl = bench_tg(fitted)
        results.append({
            "model": name, "path": path, "plan_seconds": round(plan_s, 3), "cap_mib": cap_mib,
            "plan_args": plan["llama_cpp_args"]["argv"], "plan_gpu_mib": plan["totals"]["gpu_bytes"] >> 20,
            "predicted_decode_tok_s": plan["predicted"]["decode_tok_s"], "predicted_ttft_s": plan["predicted"]["ttft_s"],
            "verify": verify, "verify_exit": verify_proc.returncode,
            "bench_plan": {"tg_tok_s": plan_tg, "pp_tok_s": plan_pp, "peak_mib": planned_peak, "exit": planned.returncode},
            "bench_fit": {"tg_tok_s": fit_tg, "pp_tok_s": fit_pp, "peak_mib": fitted_peak, "n_gpu_layers": fit_ngl,
                          "margin_mib": margin, "exit": fitted.returncode, "log": fit_lines[-12:]},
            "profile": {k: plan["hardware"][k] for k in ("gpu_bandwidth", "cpu_bandwidth", "host_to_device", "gpu_flops", "source")},
        })
    (args.out / "gpu_plan.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print()
    print("| model (Q4_K_M) | cap | plan args | plan GPU (predicted) | predicted tok/s | verify: measured tok/s | verify peak GPU | llama-bench tg128, plan | peak | llama-bench tg128, --fit | peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    for r in results:
        v = r["verify"]
        print(f"| {r['model']} | {r['cap_mib']} MiB | `{' '.join(r['plan_args'][:4])}` | {r['plan_gpu_mib']} MiB | "
              f"{fmt(r['predicted_decode_tok_s'])} | {fmt(v.get('measured_decode_tok_s'))} | "
              f"{fmt((v.get('peak_gpu_bytes') or 0) / 2**20, '.0f')} MiB{' (over)' if v and not v.get('within_budget') else ''} | "
              f"{fmt(r['bench_plan']['tg_tok_s'])} | {r['bench_plan']['peak_mib']} MiB | "
              f"{fmt(r['bench_fit']['tg_tok_s'])} (ngl {r['bench_fit']['n_gpu_layers']}) | {r['bench_fit']['peak_mib']} MiB |")


if __name__ == "__main__":
    main()
