"""Summaries, pair-by-pair comparisons and the report, from recorded rows (no model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gemmactl.bench import runner
from gemmactl.bench.report import render_markdown, render_text, sections, write_plot, write_result


def run_row(target, prompt, repeat, wall, decode, ttft, text="same"):
    return {"target": target, "prompt_set": prompt.split("-")[0], "prompt": prompt, "repeat": repeat, "load_s": 0.5,
            "ttft_s": ttft, "wall_s": 8 / wall, "prompt_tokens": 12, "generated_tokens": 8, "prefill_tok_s": 12 / ttft,
            "decode_tok_s": decode, "wall_tok_s": wall, "engine_decode_tok_s": None, "peak_rss_bytes": 4e8,
            "memory_scope": "process", "text": text}


def recorded_result() -> dict:
    runs = []
    for repeat, (ours, theirs) in enumerate([(40.0, 38.0), (39.0, 40.0)], start=1):
        for prompt in ("short-1", "code-1"):
            runs.append(run_row("gemmactl", prompt, repeat, ours, ours + 1, 0.05))
            runs.append(run_row("llama-server", prompt, repeat, theirs, theirs + 1, 0.04,
                                text="same" if prompt == "short-1" else "other"))
    warm_rows = [
        {"target": "gemmactl", "repeat": 1, "prompt_tokens": 2254, "cold_ttft_s": 3.0, "warm_ttft_s": 3.1,
         "warm_over_cold": 3.1 / 3.0, "cached_tokens": 0, "same_text": True},
        {"target": "llama-server", "repeat": 1, "prompt_tokens": 2254, "cold_ttft_s": 2.9, "warm_ttft_s": 0.05,
         "warm_over_cold": 0.05 / 2.9, "cached_tokens": 2253, "same_text": False},
    ]
    targets = {"gemmactl": SimpleNamespace(prefix_reuse=False, note="warm = cold by design"),
               "llama-server": SimpleNamespace(prefix_reuse=True, note="prompt cache")}
    concurrency = [
        {"concurrency": n, "requests": n * 2, "aggregate_tok_s": {"min": r * 0.9, "median": r, "max": r * 1.1, "n": 2},
         "latency_s": {"p50": 0.2 * n, "p90": 0.25 * n, "p99": 0.3 * n},
         "ttft_s": {"p50": 0.05, "p90": 0.06, "p99": 0.07}, "decode_tok_s": {"p50": r / n, "p90": r / n, "p99": r / n},
         "peak_rss_bytes": 3.5e8, "speedup_vs_1": r / 35.0}
        for n, r in ((1, 35.0), (4, 60.0), (16, 90.0))
    ]
    manifest = {
        "gemmactl_version": "0.1.0", "load_average_at_start": [0.5, 0.6, 0.7],
        "model": {"path": "/m/gemma.gguf", "quantization": "Q4_K_M", "sha256": "ab" * 32, "format": "gguf"},
        "settings": {"tier": "fast", "backend": "llamacpp", "context": 2560, "threads": 2, "max_tokens": 8,
                     "repeat": 2, "context_note": None},
        "machine": {"cpu_model": "Xeon", "cpu_cores": 2, "ram_bytes": 24 * 2**30, "gpus": [], "cuda_toolkit": None},
        "llama_cpp": {"library_in_process": "build x", "bindings_version": "0.3.36", "build": {"build_id": "x", "backend": "cpu"}},
    }
    return {
        "manifest": manifest, "runs": runs, "summary": runner._summaries(runs),
        "comparisons": runner._comparisons(runs, ["llama-server"]),
        "warm_prefix": warm_rows, "warm_prefix_summary": runner._warm_summaries(warm_rows, targets),
        "concurrency": concurrency, "skipped": [{"target": "accelerate", "reason": "needs a CUDA GPU"}],
        "checks": runner._checks(runs),
    }


def test_comparisons_pair_by_pair_per_set_and_overall():
    result = recorded_result()
    by_set = {c["prompt_set"]: c for c in result["comparisons"]}
    assert set(by_set) == {"all", "short", "code"}
    overall = by_set["all"]["ratio_gemmactl_over_target"]["wall_tok_s"]
    assert overall["pairs"] == pytest.approx([40 / 38, 40 / 38, 39 / 40, 39 / 40])
    assert (overall["min"], overall["max"]) == (pytest.approx(39 / 40), pytest.approx(40 / 38))
    assert by_set["short"]["same_text"] and not by_set["code"]["same_text"] and not by_set["all"]["same_text"]
    assert by_set["all"]["same_tokens"]


def test_summaries_group_by_target_and_set_with_all_last():
    summary = runner._summaries(recorded_result()["runs"])
    keys = [(s["target"], s["prompt_set"]) for s in summary]
    assert keys[-2:] == [("gemmactl", "all"), ("llama-server", "all")]
    short = next(s for s in summary if s["target"] == "gemmactl" and s["prompt_set"] == "short")
    assert short["wall_tok_s"] == {"min": 39.0, "median": 39.5, "max": 40.0, "n": 2}


def test_report_tables_name_every_figure(tmp_path):
    result = recorded_result()
    text = render_text(sections(result))
    for expected in ("Q4_K_M", "accelerate skipped: needs a CUDA GPU", "gemmactl ÷ llama-server", "decode_tok_s",
                     "cold TTFT", "0 of 1", "aggregate tok/s", "2.57×", "3.20 / 4.00 / 4.80 s"):
        assert expected in text, expected
    markdown = render_markdown(sections(result))
    assert "| target | prompts |" in markdown and "| 16 | 32 |" in markdown
    path = write_result(result, tmp_path)
    assert json.loads(path.read_text())["concurrency"][2]["concurrency"] == 16


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_plot(recorded_result(), tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speculative_counts_per_set_pair_and_table_line():
    result = recorded_result()
    drafted = {("short-1", 1): (10, 9), ("code-1", 1): (12, 3), ("short-1", 2): (10, 10), ("code-1", 2): (8, 2)}
    for row in result["runs"]:
        if row["target"] == "llama-server":
            row["draft_tokens"], row["draft_accepted"] = drafted[(row["prompt"], row["repeat"])]
    result["summary"] = runner._summaries(result["runs"])
    result["comparisons"] = runner._comparisons(result["runs"], ["llama-server"])
    result["manifest"]["settings"]["speculative"] = {"draft": "/m/draft.gguf", "draft_max": 8, "draft_min": 0,
                                                     "draft_max_from": "the recipe default"}
    summary = {(s["target"], s["prompt_set"]): s for s in result["summary"]}
    assert summary[("llama-server", "short")]["acceptance_rate"] == pytest.approx(19 / 20)
    assert summary[("llama-server", "all")]["draft_tokens"] == 40
    assert summary[("llama-server", "all")]["acceptance_rate"] == pytest.approx(24 / 40)
    assert "acceptance_rate" not in summary[("gemmactl", "all")]
    by_set = {c["prompt_set"]: c for c in result["comparisons"]}
    assert by_set["short"]["target_speculative"] and by_set["short"]["same_text_pairs"] == 2
    assert by_set["code"]["same_text_pairs"] == 0 and by_set["code"]["first_differences"] == [0, 0]

    text = render_text(sections(result))
    assert "Speculative decoding in llama-server" in text and "/m/draft.gguf" in text
    lines = {line.split()[1]: line for line in text.splitlines() if line.strip().startswith("llama-server") and "%" in line}
    assert "95.0%" in lines["short"] and "yes" in lines["short"]
    assert "25.0%" in lines["code"] and "0 of 2 pairs" in lines["code"]
    assert "60.0%" in lines["all"]


def test_no_speculative_table_without_a_draft():
    text = render_text(sections(recorded_result()))
    assert "Speculative" not in text and "acceptance" not in text
