"""A bench result as tables (text or Markdown), as files (result.json, plot.png)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gemmactl.fileio import atomic_write_text
from gemmactl.sizes import format_size


@dataclass
class Section:
    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _spread(s: dict, fmt) -> str:
    return f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])})"


def sections(result: dict) -> list[Section]:
    """The tables a person reads, in order; medians with (min–max) over repeats."""
    out = [_setup(result), _speed(result)]
    for comparison in result["comparisons"]:
        if comparison["prompt_set"] == "all":
            out.append(_ratio(comparison))
    if result["manifest"]["settings"].get("speculative"):
        out.append(_speculative(result))
    if result["warm_prefix_summary"]:
        out.append(_warm(result))
    if result["concurrency"]:
        out.append(_concurrency(result))
    return out


def _setup(result: dict) -> Section:
    m = result["manifest"]
    model, settings, machine, llama = m["model"], m["settings"], m["machine"], m["llama_cpp"]
    build = llama.get("build") or {}
    gpus = ", ".join(f"{g['name']} ({g['memory_bytes'] / 2**30:.0f} GiB, driver {g['driver']})" for g in machine["gpus"]) or "none"
    rows = [
        ["model", f"{model['path']} ({model.get('quantization') or model.get('format') or 'format unknown'}, "
                  + (f"sha256 of {model['sha256_of']} " if model.get("sha256_of") else "sha256 ")
                  + (f"{model['sha256'][:12]}…)" if model.get("sha256") else "-)")],
        ["settings", f"tier {settings['tier']} on {settings['backend']}, context {settings['context']}, "
                     f"{settings['threads']} threads, greedy, max {settings['max_tokens']} tokens, {settings['repeat']} repeats"],
        ["llama.cpp", ("in process: " + (f"{llama['library_in_process']} (bindings {llama.get('bindings_version')})"
                                         if llama.get("library_in_process") else "none"))
                      + f"; build: {build.get('build_id', 'none')} {build.get('backend', '')}".rstrip()],
        ["machine", f"{machine['cpu_model']}, {machine['cpu_cores']} cores, {machine['ram_bytes'] / 2**30:.0f} GiB RAM; "
                    f"GPU: {gpus}; CUDA {machine.get('cuda_toolkit') or '-'}"],
        ["gemmactl", f"{m['gemmactl_version']}; load average (1, 5, 15 min) at start "
                     f"{', '.join(f'{x:.2f}' for x in m.get('load_average_at_start') or [])}"],
    ]
    spec = (result.get("targets", {}).get("gemmactl") or {}).get("speculation")
    if spec:  # the engine's draft and the tuner's decision at the end of the run
        decision = "speculating" if spec.get("speculating") else "decoding plainly"
        figures = [f"k {spec['k']}" if spec.get("k") else None,
                   f"acceptance ≈ {spec['acceptance_estimate']:.0%}" if spec.get("acceptance_estimate") is not None else None,
                   f"predicted {spec['predicted_speedup']:.2f}× plain" if spec.get("predicted_speedup") else None]
        rows.append(["speculation", f"draft {spec['draft']}, {spec['mode']} k≤{spec['k_max']}: {decision}"
                                    + "".join(f", {f}" for f in figures if f)])
    experts = (result.get("targets", {}).get("gemmactl") or {}).get("experts")
    if experts:  # the engine's expert cache, its counters over the whole run (warm-up included)
        from gemmactl.runtime.engine.expert_settings import describe_counters

        rows.append(["experts", describe_counters(experts)])
    notes = [f"{s['target']} skipped: {s['reason']}" for s in result["skipped"]]
    if settings.get("context_note"):
        notes.append(f"context {settings['context_note']}")
    return Section("Setup", ["", ""], rows, notes)


def _speed(result: dict) -> Section:
    rows = []
    single_set = len({s["prompt_set"] for s in result["summary"]}) <= 2  # one set, plus its copy as "all"
    for s in result["summary"]:
        if single_set and s["prompt_set"] == "all":
            continue
        rows.append([
            s["target"], s["prompt_set"], str(s["runs"]), f"{s['load_s']:.2f} s",
            f"{s['prompt_tokens']['median']:.0f}", _spread(s["ttft_s"], _ms), _rate(s["prefill_tok_s"]["median"]),
            _spread(s["decode_tok_s"], _rate), _spread(s["wall_tok_s"], _rate), format_size(s["peak_rss_bytes"] or None),
        ])
    checks = result["checks"]
    notes = ["decode tok/s = tokens after the first ÷ time after the first; wall tok/s = all tokens ÷ request → last token."]
    if checks["wall_above_decode_runs"]:
        notes.append(f"{checks['wall_above_decode_runs']} of {checks['runs']} runs had wall tok/s above decode-only: "
                     "their first token came faster than one decode step (a very short prompt).")
    return Section("Speed per target and prompt set (median, min–max)",
                   ["target", "prompts", "runs", "load", "prompt tok", "TTFT", "prefill tok/s", "decode tok/s",
                    "wall tok/s", "peak RSS"], rows, notes)


def _ratio(c: dict) -> Section:
    rows = [[metric, f"{r['min']:.3f}", f"{r['median']:.3f}", f"{r['max']:.3f}"]
            for metric, r in c["ratio_gemmactl_over_target"].items()]
    notes = [f"{c['pairs']} interleaved pairs; same greedy text in every pair: {'yes' if c['same_text'] else 'no'}; "
             f"same prompt and generated token counts: {'yes' if c['same_tokens'] else 'no'}."]
    return Section(f"gemmactl ÷ {c['target']}, pair by pair", ["metric", "min", "median", "max"], rows, notes)


def _acceptance(row: dict) -> str:
    rate = row.get("acceptance_rate")
    return "-" if rate is None else f"{rate:.1%}"


def _speculative(result: dict) -> Section:
    spec = result["manifest"]["settings"]["speculative"]
    same = {c["prompt_set"]: c for c in result["comparisons"] if c.get("target_speculative")}
    rows = []
    single_set = len({s["prompt_set"] for s in result["summary"]}) <= 2
    for s in result["summary"]:
        if "acceptance_rate" not in s or (single_set and s["prompt_set"] == "all"):
            continue
        c = same.get(s["prompt_set"])
        text = "-" if c is None else "yes" if c["same_text"] else f"{c['same_text_pairs']} of {c['pairs']} pairs"
        rows.append([s["target"], s["prompt_set"], str(s["runs"]), str(s["draft_tokens"]), str(s["draft_accepted"]),
                     _acceptance(s), text])
    for c in result["concurrency"]:
        if "acceptance_rate" in c:
            rows.append([f"{c['target']}, {c['concurrency']} clients", "-", str(c["requests"]), str(c["draft_tokens"]),
                         str(c["draft_accepted"]), _acceptance(c), "-"])
    notes = [
        f"draft {spec['draft']}, at most {spec['draft_max']} tokens per step ({spec['draft_max_from']}); "
        "acceptance = accepted ÷ drafted tokens, as llama-server counts them (draft_n_accepted ÷ draft_n).",
        "The rate depends on the model and draft pair and on the prompts. Same text: the speculative greedy "
        "text equals gemmactl's plain one (batched verification can flip a near tie).",
    ]
    refused = (result.get("targets", {}).get("llama-server") or {}).get("speculative")
    if isinstance(refused, str):
        notes.insert(0, f"The draft was {refused}; llama-server decoded without it, so nothing was drafted.")
    elif not rows:
        notes.insert(0, "llama-server did not run (see Setup), so nothing was drafted.")
    return Section("Speculative decoding in llama-server (acceptance rate)",
                   ["target", "prompts", "runs", "drafted", "accepted", "acceptance", "same text as gemmactl"], rows, notes)


def _warm(result: dict) -> Section:
    rows = []
    notes = []
    for w in result["warm_prefix_summary"]:
        rows.append([w["target"], str(w["prompt_tokens"]), _ms(w["cold_ttft_s"]["median"]), _ms(w["warm_ttft_s"]["median"]),
                     f"{w['warm_over_cold']['median']:.3f}", f"{w['cached_tokens']['median']:.0f}",
                     "yes" if w["same_text"] else f"{w['same_text_repeats']} of {w['repeats']}"])
        notes.append(f"{w['target']}: {w['note']}.")
    return Section("Warm prefix: the same long prompt cold, then warm (median TTFT)",
                   ["target", "prompt tok", "cold TTFT", "warm TTFT", "warm ÷ cold", "cached tok", "same text"], rows, notes)


def _concurrency(result: dict) -> Section:
    rows = []
    for c in result["concurrency"]:
        lat, ttft = c["latency_s"], c["ttft_s"]
        rows.append([
            str(c["concurrency"]), str(c["requests"]), _spread(c["aggregate_tok_s"], _rate),
            f"{c['speedup_vs_1']:.2f}×" if "speedup_vs_1" in c else "-",
            f"{lat['p50']:.2f} / {lat['p90']:.2f} / {lat['p99']:.2f} s",
            f"{ttft['p50'] * 1000:,.0f} / {ttft['p90'] * 1000:,.0f} / {ttft['p99'] * 1000:,.0f} ms",
            format_size(c.get("peak_rss_bytes") or None),
        ])
    return Section("Concurrency against llama-server (N slots, N clients)",
                   ["clients", "requests", "aggregate tok/s", "vs 1", "latency p50/p90/p99", "TTFT p50/p90/p99", "server RSS"],
                   rows, ["aggregate tok/s: a round's generated tokens ÷ (first request start → last token), median over rounds."])


def render_text(parts: list[Section]) -> str:
    blocks = []
    for part in parts:
        widths = [max(len(str(cell)) for cell in column) for column in zip(part.headers, *part.rows)]
        lines = [part.title]
        body = part.rows if not any(part.headers) else [part.headers, *part.rows]
        for row in body:
            lines.append("  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
        lines += [f"  {note}" for note in part.notes]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def render_markdown(parts: list[Section]) -> str:
    blocks = []
    for part in parts:
        headers = part.headers if any(part.headers) else ["what", "value"]
        lines = [f"**{part.title}**", "", "| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in part.rows]
        if part.notes:
            lines += [""] + part.notes
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def write_result(result: dict, out_dir: Path) -> Path:
    """result.json in out_dir, written whole or not at all."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "result.json"
    atomic_write_text(path, json.dumps(result, indent=2, ensure_ascii=False, default=str) + "\n")
    return path


def plot_in_child(out_dir: Path) -> Path:
    """Draw out_dir/plot.png from out_dir/result.json in a child process.

    matplotlib and a CUDA build of llama.cpp in one process crashed it on a GPU machine (each
    loads its own native libraries), so the bench process never imports matplotlib.
    """
    done = subprocess.run([sys.executable, "-m", "gemmactl.bench.report", str(out_dir)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit status {done.returncode}"]
        raise RuntimeError(f"drawing {out_dir / 'plot.png'} failed: {lines[-1]}")
    return out_dir / "plot.png"


def write_plot(result: dict, out_dir: Path) -> Path:
    """plot.png: tok/s vs concurrency (or per target), and cold vs warm TTFT (or TTFT per target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if result["concurrency"]:
        levels = [c["concurrency"] for c in result["concurrency"]]
        left.plot(levels, [c["aggregate_tok_s"]["median"] for c in result["concurrency"]], "o-", label="aggregate")
        left.plot(levels, [c["decode_tok_s"]["p50"] for c in result["concurrency"]], "s--", label="per request (decode p50)")
        left.set_xscale("log", base=2)
        left.set_xticks(levels, [str(level) for level in levels])
        left.set_xlabel("concurrent requests (llama-server slots)")
        left.legend()
        left.set_title("tok/s vs concurrency")
    else:
        overall = [s for s in result["summary"] if s["prompt_set"] == "all"]
        names = [s["target"] for s in overall]
        x = range(len(names))
        left.bar([i - 0.2 for i in x], [s["decode_tok_s"]["median"] for s in overall], 0.4, label="decode only")
        left.bar([i + 0.2 for i in x], [s["wall_tok_s"]["median"] for s in overall], 0.4, label="wall clock")
        left.set_xticks(list(x), names, rotation=20, ha="right")
        left.legend()
        left.set_title("tok/s per target (median)")
    left.set_ylabel("tokens / s")
    if result["warm_prefix_summary"]:
        warm = result["warm_prefix_summary"]
        x = range(len(warm))
        right.bar([i - 0.2 for i in x], [w["cold_ttft_s"]["median"] * 1000 for w in warm], 0.4, label="cold")
        right.bar([i + 0.2 for i in x], [w["warm_ttft_s"]["median"] * 1000 for w in warm], 0.4, label="warm")
        right.set_xticks(list(x), [w["target"] for w in warm], rotation=20, ha="right")
        right.set_title(f"TTFT, {warm[0]['prompt_tokens']}-token prompt: cold vs warm")
        right.legend()
    else:
        overall = [s for s in result["summary"] if s["prompt_set"] == "all"]
        right.bar([s["target"] for s in overall], [s["ttft_s"]["median"] * 1000 for s in overall])
        right.tick_params(axis="x", labelrotation=20)
        right.set_title("TTFT per target (median)")
    right.set_ylabel("ms")
    model = result["manifest"]["model"]
    fig.suptitle(f"gemmactl bench: {Path(model['path']).name} ({model.get('quantization') or ''})", fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "plot.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    # python -m gemmactl.bench.report DIR: draw DIR/plot.png from DIR/result.json.
    target = Path(sys.argv[1])
    write_plot(json.loads((target / "result.json").read_text(encoding="utf-8")), target)
