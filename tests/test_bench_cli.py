"""`gemmactl bench` end to end on the embedded model, small numbers; bad input; a server that fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import invoke

RUN_KEYS = {"load_s", "ttft_s", "prefill_tok_s", "decode_tok_s", "wall_tok_s", "wall_s", "prompt_tokens",
            "generated_tokens", "peak_rss_bytes", "target", "prompt_set", "prompt", "repeat", "text"}
MANIFEST_KEYS = {"gemmactl_version", "created", "command", "flags", "settings", "model", "llama_cpp", "machine"}


def bench_json(runner, args: list[str]) -> dict:
    result = invoke(runner, ["bench", "--json", *args])
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return json.loads(result.stdout)


def one_line_error(result, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.real_model
def test_bench_builtin_prompts_json(runner, model_home):
    data = bench_json(runner, ["--max-tokens", "8", "--repeat", "2"])
    runs = data["runs"]
    assert {row["target"] for row in runs} == {"gemmactl"}
    assert {row["prompt_set"] for row in runs} == {"short", "long-prefix", "code", "prose"}
    assert len(runs) == 2 * 7
    for row in runs:
        assert RUN_KEYS <= set(row), RUN_KEYS - set(row)
        assert 1 <= row["generated_tokens"] <= 8 and row["ttft_s"] > 0 and row["wall_s"] >= row["ttft_s"]
    assert min(r["prompt_tokens"] for r in runs if r["prompt_set"] == "long-prefix") >= 2048
    assert "Paris" in next(r["text"] for r in runs if r["prompt"] == "short-1")
    manifest = data["manifest"]
    assert MANIFEST_KEYS <= set(manifest)
    assert manifest["model"]["quantization"] == "Q4_K_M" and len(manifest["model"]["sha256"]) == 64
    assert manifest["machine"]["cpu_cores"] >= 1 and manifest["machine"]["ram_bytes"] > 0
    assert manifest["llama_cpp"]["bindings_version"] == "0.3.36"
    assert manifest["flags"]["max_tokens"] == 8 and "--repeat 2" in manifest["command"]
    assert manifest["settings"]["context"] >= 2048 + 8
    assert data["checks"]["wall_identity_max_error_s"] < 1e-6
    summary = {(s["target"], s["prompt_set"]) for s in data["summary"]}
    assert ("gemmactl", "all") in summary and ("gemmactl", "code") in summary
    assert data["comparisons"] == [] and data["concurrency"] == [] and data["warm_prefix"] == []


@pytest.mark.real_model
def test_bench_compare_llama_cpp_python_interleaved(runner, model_home, tmp_path):
    data = bench_json(runner, ["--prompts", "short", "--max-tokens", "8", "--repeat", "2",
                               "--compare", "llama-cpp-python", "--out", str(tmp_path / "out")])
    order = [(row["target"], row["prompt"], row["repeat"]) for row in data["runs"]]
    assert order[:4] == [("gemmactl", "short-1", 1), ("llama-cpp-python", "short-1", 1),
                         ("gemmactl", "short-2", 1), ("llama-cpp-python", "short-2", 1)]
    overall = next(c for c in data["comparisons"] if c["prompt_set"] == "all")
    assert overall["target"] == "llama-cpp-python" and overall["pairs"] == 4
    # Same GGUF, same settings, greedy: the same text and the same token counts in every pair.
    assert overall["same_text"] and overall["same_tokens"]
    for metric in ("wall_tok_s", "decode_tok_s", "ttft_s"):
        ratio = overall["ratio_gemmactl_over_target"][metric]
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and len(ratio["pairs"]) == 4
    assert json.loads((tmp_path / "out" / "result.json").read_text())["runs"] == data["runs"]


@pytest.mark.real_model
def test_bench_table_output(runner, model_home):
    result = invoke(runner, ["bench", "--prompts", "short", "--max-tokens", "4", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    for heading in ("Setup", "Speed per target", "decode tok/s", "wall tok/s", "TTFT", "Q4_K_M"):
        assert heading in result.stdout


@pytest.mark.real_model
def test_bench_against_llama_server_concurrency_and_warm_prefix(runner, built_home, embedded_gguf, tmp_path):
    out = tmp_path / "out"
    data = bench_json(runner, [
        "--model", str(embedded_gguf), "--prompts", "short", "--max-tokens", "8", "--repeat", "1",
        "--compare", "llama-server", "--concurrency", "1,4", "--warm-prefix", "--timeout", "300", "--out", str(out),
    ])
    overall = next(c for c in data["comparisons"] if c["prompt_set"] == "all")
    assert overall["target"] == "llama-server" and overall["pairs"] == 2
    assert overall["same_text"] and overall["same_tokens"]
    assert data["manifest"]["llama_cpp"]["build"]["build_id"]

    warm = {w["target"]: w for w in data["warm_prefix_summary"]}
    assert warm["gemmactl"]["prefix_reuse"] is False and "warm = cold" in warm["gemmactl"]["note"]
    assert warm["gemmactl"]["cached_tokens"]["max"] == 0
    server = warm["llama-server"]
    assert server["prompt_tokens"] >= 2048
    # The server's prompt cache really skipped the shared prefix, and the warm greedy text is the cold one.
    assert server["cached_tokens"]["min"] > 0.9 * server["prompt_tokens"]
    # Both TTFTs are measured once per repeat (how much the cache saves is a benchmark's figure, not a test's).
    for ttft in (server["cold_ttft_s"], server["warm_ttft_s"]):
        assert ttft["n"] == server["repeats"] == 1 and 0 < ttft["min"] <= ttft["median"] <= ttft["max"]
    assert server["warm_over_cold"]["median"] == pytest.approx(server["warm_ttft_s"]["median"] / server["cold_ttft_s"]["median"])
    # Whether the warm greedy text equals the cold one is measured, not assumed: a near tie can flip
    # when the last prompt token is evaluated alone instead of inside a batch.
    row = next(w for w in data["warm_prefix"] if w["target"] == "llama-server")
    assert row["same_text"] == (row["cold_text"] == row["warm_text"])
    assert row["same_text"] or row["first_difference"] is not None

    levels = {c["concurrency"]: c for c in data["concurrency"]}
    assert set(levels) == {1, 4}
    assert levels[1]["requests"] == 1 and levels[4]["requests"] == 4
    for level in levels.values():
        assert set(level["latency_s"]) == {"p50", "p90", "p99"} and level["aggregate_tok_s"]["median"] > 0
        assert level["server"]["command"][level["server"]["command"].index("-np") + 1] == str(level["concurrency"])
    # Without --draft nothing speculates and nothing reports it.
    assert not any("draft_tokens" in row for row in data["runs"] + data["summary"] + data["concurrency"])
    assert "-md" not in data["targets"]["llama-server"]["command"] and "speculative" not in data["manifest"]["settings"]
    # Every server this run started is gone.
    pids = [data["targets"]["llama-server"]["pid"]] + [c["server"]["pid"] for c in data["concurrency"]]
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert list((out / "logs").glob("llama-server-np4-*.log"))


@pytest.mark.real_model
def test_bench_speculative_llama_server_reports_acceptance(runner, built_home, embedded_gguf, tmp_path):
    # The model is its own draft here (the only pair at hand); how many drafted tokens are accepted is a
    # benchmark's figure: the test checks the counts add up.
    out = tmp_path / "out"
    result = invoke(runner, [
        "bench", "--model", str(embedded_gguf), "--prompts", "short", "--max-tokens", "8", "--repeat", "1",
        "--compare", "llama-server", "--concurrency", "2", "--draft", str(embedded_gguf), "--draft-max", "4",
        "--timeout", "300", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output + (result.stderr or "")
    data = json.loads((out / "result.json").read_text())

    spec = data["manifest"]["settings"]["speculative"]
    assert spec["draft"] == str(embedded_gguf) and spec["draft_max"] == 4 and spec["draft_max_from"] == "--draft-max"
    servers = [data["targets"]["llama-server"]["command"]] + [c["server"]["command"] for c in data["concurrency"]]
    for command in servers:
        assert command[command.index("-md") + 1] == str(embedded_gguf)
        assert command[command.index("--spec-draft-n-max") + 1] == "4"
        assert command[command.index("--spec-type") + 1] == "draft-simple"

    server_runs = [row for row in data["runs"] if row["target"] == "llama-server"]
    assert len(server_runs) == 2
    for row in server_runs:
        assert 0 <= row["draft_accepted"] <= row["draft_tokens"] and row["draft_tokens"] > 0
        assert 0.0 <= row["acceptance_rate"] <= 1.0
        assert row["acceptance_rate"] == row["draft_accepted"] / row["draft_tokens"]
    assert not any("draft_tokens" in row for row in data["runs"] if row["target"] == "gemmactl")

    overall = next(s for s in data["summary"] if s["target"] == "llama-server" and s["prompt_set"] == "all")
    assert overall["draft_tokens"] == sum(row["draft_tokens"] for row in server_runs)
    assert overall["draft_accepted"] == sum(row["draft_accepted"] for row in server_runs)
    assert overall["acceptance_rate"] == pytest.approx(overall["draft_accepted"] / overall["draft_tokens"])
    assert not any("acceptance_rate" in s for s in data["summary"] if s["target"] == "gemmactl")

    # Whether the speculative greedy text equals gemmactl's plain one is reported, not required.
    pair = next(c for c in data["comparisons"] if c["prompt_set"] == "all")
    assert pair["target_speculative"] is True and 0 <= pair["same_text_pairs"] <= pair["pairs"] == 2
    assert pair["same_text"] == (pair["same_text_pairs"] == pair["pairs"])
    assert len(pair["first_differences"]) == 2

    (level,) = data["concurrency"]
    assert level["concurrency"] == 2 and 0 <= level["draft_accepted"] <= level["draft_tokens"]
    assert level["draft_tokens"] > 0 and 0.0 <= level["acceptance_rate"] <= 1.0

    table = result.stdout
    assert "Speculative decoding in llama-server" in table
    line = next(line for line in table.splitlines() if line.strip().startswith("llama-server") and "%" in line)
    assert f"{overall['acceptance_rate']:.1%}" in line and str(overall["draft_tokens"]) in line
    assert "llama-server, 2 clients" in table and "depends on the model and draft pair" in table


@pytest.mark.real_model
def test_bench_missing_draft_file_is_not_found(runner, model_home, tmp_path):
    result = invoke(runner, ["bench", "--prompts", "short", "--compare", "llama-server",
                             "--draft", str(tmp_path / "no-such-draft.gguf")])
    one_line_error(result, 2, "no such model file", "no-such-draft.gguf")


@pytest.mark.real_model
def test_bench_plot(runner, model_home, tmp_path):
    pytest.importorskip("matplotlib")
    result = invoke(runner, ["bench", "--prompts", "short", "--max-tokens", "4", "--repeat", "1",
                             "--out", str(tmp_path), "--plot"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.real_model
def test_unavailable_targets_are_skipped_with_the_reason(runner, model_home):
    pytest.importorskip("torch")
    import torch

    data = bench_json(runner, ["--prompts", "short", "--max-tokens", "4", "--repeat", "1",
                               "--compare", "hf-generate,accelerate"])
    reasons = {s["target"]: s["reason"] for s in data["skipped"]}
    assert "--hf-model" in reasons["hf-generate"]
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in reasons["accelerate"]
    assert {row["target"] for row in data["runs"]} == {"gemmactl"}


@pytest.mark.real_model
def test_bench_compare_hf_generate(runner, model_home, gemma3_hf_checkpoint):
    data = bench_json(runner, ["--prompts", "short", "--max-tokens", "4", "--repeat", "1",
                               "--compare", "hf-generate", "--hf-model", str(gemma3_hf_checkpoint)])
    rows = {(r["target"], r["prompt"]): r for r in data["runs"]}
    for prompt in ("short-1", "short-2"):
        ours, theirs = rows[("gemmactl", prompt)], rows[("hf-generate", prompt)]
        assert ours["prompt_tokens"] == theirs["prompt_tokens"]  # the same tokenizer
        assert 1 <= theirs["generated_tokens"] <= 4 and theirs["ttft_s"] > 0
    assert "Paris" in rows[("hf-generate", "short-1")]["text"]
    # transformers runs in a worker process of its own (torch and a CUDA llama.cpp may not share one).
    assert data["targets"]["hf-generate"]["process"] == "worker"
    assert "worker" in rows[("hf-generate", "short-1")]["memory_scope"]
    assert rows[("hf-generate", "short-1")]["peak_rss_bytes"] != rows[("gemmactl", "short-1")]["peak_rss_bytes"]


@pytest.mark.parametrize("args, words", [
    (["--compare", "ollama"], ["unknown --compare target 'ollama'", "llama-server"]),
    (["--concurrency", "0,4"], ["--concurrency", "1,16,64"]),
    (["--concurrency", "four"], ["--concurrency"]),
    (["--plot"], ["--out"]),
    (["--prompts", "no-such-set"], ["neither a built-in set nor a file"]),
    (["--draft", "draft.gguf"], ["--draft", "llama-server", "--compare llama-server"]),
    (["--draft", "draft.gguf", "--compare", "llama-cpp-python"], ["--draft", "--compare llama-server"]),
    (["--draft-max", "4"], ["--draft-max", "--draft GGUF"]),
])
def test_bad_input_is_one_line_exit_2(runner, args, words):
    one_line_error(invoke(runner, ["bench", *args]), 2, *words)


def test_empty_prompts_file_is_exit_2(runner, tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    one_line_error(invoke(runner, ["bench", "--prompts", str(empty)]), 2, "holds no prompts")


@pytest.mark.real_model
def test_concurrency_without_a_build_says_how_to_get_one(runner, model_home):
    one_line_error(invoke(runner, ["bench", "--concurrency", "1,4", "--prompts", "short"]), 2, "gemmactl build")


def _fake_build(home: Path, server_script: str) -> None:
    """A store whose active build's llama-server is a script (its bindings version differs, so run ignores it)."""
    bin_dir = home / "builds" / "fakebuild0000" / "bin"
    bin_dir.mkdir(parents=True)
    server = bin_dir / "llama-server"
    server.write_text(server_script)
    server.chmod(0o755)
    manifest = {
        "build_id": "fakebuild0000", "path": str(bin_dir.parent), "backend": "cpu", "gpu_archs": [],
        "source": {"version": "test", "commit": None, "bindings_version": "0.0.0"}, "compiler": "none",
        "cmake_flags": [], "targets": ["llama-server"], "created": "2026-01-01T00:00:00Z", "build_seconds": 0,
        "lib_dir": str(bin_dir), "binaries": {"llama-server": {"path": str(server), "sha256": "", "size": 0}},
        "libraries": {}, "format": "gemmactl-llama-build", "version": 1,
    }
    (bin_dir.parent / "manifest.json").write_text(json.dumps(manifest))
    (home / "builds" / "ACTIVE").write_text("fakebuild0000\n")


@pytest.mark.real_model
def test_server_that_fails_to_start_is_exit_1_naming_its_log(runner, isolated_home, embedded_gguf, tmp_path):
    _fake_build(isolated_home, "#!/bin/sh\necho 'error: cannot bind the moon' >&2\nexit 3\n")
    result = invoke(runner, ["bench", "--model", str(embedded_gguf), "--prompts", "short", "--max-tokens", "2",
                             "--repeat", "1", "--compare", "llama-server", "--out", str(tmp_path)])
    one_line_error(result, 1, "exited with code 3", "cannot bind the moon", "See its log:")
    log = result.stderr.split("See its log: ")[1].strip().rstrip(".")
    assert os.path.isfile(log) and "cannot bind the moon" in Path(log).read_text()


@pytest.mark.real_model
def test_context_too_small_for_the_prompts_is_exit_2_with_the_numbers(runner, model_home):
    result = invoke(runner, ["bench", "--prompts", "long-prefix", "--context", "512", "--max-tokens", "8"])
    one_line_error(result, 2, "needs a context of", "--context is 512")


@pytest.mark.real_model
def test_bench_runs_the_engine_beside_llama_server_on_its_gguf(runner, built_home, embedded_gguf, gemma3_hf_checkpoint,
                                                              tmp_path):
    """--model an int4-stream artifact, --gguf the same model as GGUF: the engine and llama-server side by side."""
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint

    artifact = tmp_path / "art"
    quantize_checkpoint(gemma3_hf_checkpoint, artifact, QuantizeOptions(group_size=32))
    data = bench_json(runner, ["--model", str(artifact), "--gguf", str(embedded_gguf), "--prompts", "short",
                               "--max-tokens", "8", "--repeat", "1", "--compare", "llama-server"])
    assert data["manifest"]["settings"]["backend"] == "int4"
    assert data["targets"]["gemmactl"]["backend"] == "int4"
    assert str(embedded_gguf) in data["targets"]["llama-server"]["command"]
    overall = next(c for c in data["comparisons"] if c["prompt_set"] == "all")
    assert overall["target"] == "llama-server" and overall["pairs"] == 2
    assert all(row["generated_tokens"] > 0 for row in data["runs"])


@pytest.mark.real_model
def test_bench_gguf_beside_a_gguf_model_is_refused(runner, built_home, embedded_gguf):
    result = invoke(runner, ["bench", "--model", str(embedded_gguf), "--gguf", str(embedded_gguf)])
    one_line_error(result, 2, "--gguf", "already")
