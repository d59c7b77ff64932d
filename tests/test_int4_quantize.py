"""`gemmactl quantize --int4-stream` and `gemmactl inspect`: store, resume after a kill, corruption, bad input."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import invoke, run_gemmactl
from gemmactl.formats.int4.writer import PAUSE_ENV, Int4ShardWriter
from helpers.int4_checkpoints import make_checkpoint, small_tensors


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("Error: ") and "Traceback" not in stderr
    return lines[0]


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "small-model", small_tensors())


def _quantize(runner, *args):
    result = invoke(runner, ["quantize", *map(str, args), "--int4-stream", "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# -- the store, inspect ---------------------------------------------------------------------------


def test_quantize_registers_the_artifact_and_inspect_describes_it(checkpoint, runner, isolated_home):
    report = _quantize(runner, checkpoint, "--group-size", "32")
    artifact = report["artifact"]
    assert artifact["name"] == "small-model-int4" and artifact["format"] == "int4-stream"
    assert Path(artifact["path"]) == isolated_home / "models" / "small-model-int4"
    assert artifact["extra"]["scheme"] == "int4.g32" and report["shards_written"] == 1
    listing = json.loads(invoke(runner, ["list", "--json"]).stdout)
    assert [entry["name"] for entry in listing] == ["small-model-int4"]

    summary = json.loads(invoke(runner, ["inspect", "small-model-int4", "--json", "--verify"]).stdout)
    assert summary["verify"] == {"ok": True, "mismatches": []}
    assert summary["tensors"] == len(small_tensors()) and summary["params"] == sum(t.numel() for t in small_tensors().values())
    assert [row["layer"] for row in summary["layers"]] == [None, 0, 1]
    assert summary["layers"][2]["experts"] == 4
    # One checksum per record of the index: a tensor each, and one per expert of an MoE stack.
    records = json.loads((Path(artifact["path"]) / "index.json").read_text())["tensors"]
    assert all(record["checksum"] for record in records) and len(records) > summary["tensors"]
    assert summary["records"] == len(records)
    text = invoke(runner, ["inspect", artifact["path"], "--verify"])
    assert text.exit_code == 0 and "LAYER" in text.stdout and f"all {len(records)} checksums match" in text.stdout


def test_quantize_human_output_and_out_option(checkpoint, runner, tmp_path):
    result = invoke(runner, ["quantize", str(checkpoint), "--int4-stream", "--out", str(tmp_path / "mine")])
    assert result.exit_code == 0, result.stderr
    assert "Quantized" in result.stdout and "gemmactl run --model mine" in result.stdout
    assert (tmp_path / "mine" / "index.json").is_file()


def test_quantize_head_int4_says_so_and_inspect_shows_the_head(checkpoint, runner, tmp_path):
    result = invoke(runner, ["quantize", str(checkpoint), "--int4-stream", "--head", "int4", "--out", str(tmp_path / "h4")])
    assert result.exit_code == 0, result.stderr
    assert "head int4" in result.stdout.splitlines()[0]
    text = invoke(runner, ["inspect", str(tmp_path / "h4")])
    assert "sensitive int8, head int4, fit" in text.stdout
    summary = json.loads(invoke(runner, ["inspect", str(tmp_path / "h4"), "--json"]).stdout)
    assert summary["records"] == len(small_tensors()) + 2 * 3 + 1  # two stacks of 4 experts, a record each, and the head


# -- resume -----------------------------------------------------------------------------------------


def test_kill_after_the_first_shard_then_resume_keeps_it(tiny_gemma4, tmp_path):
    source = tiny_gemma4("dense-ple")
    out = tmp_path / "art"
    args = [sys.executable, "-m", "gemmactl", "quantize", str(source), "--int4-stream", "--out", str(out), "--shard-size", "1MiB"]
    env = dict(os.environ, **{PAUSE_ENV: "60"})
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first is None:
        done = sorted(out.glob("shard-00001-of-*.i4s"))
        first = done[0] if done else None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first is not None, proc.stderr.read().decode()
    assert not (out / "index.json").exists()
    assert len(list(out.glob("*.i4s"))) == 1  # the writer was asleep after shard 1
    before = first.stat()

    rerun = run_gemmactl(["quantize", str(source), "--int4-stream", "--out", str(out), "--shard-size", "1MiB", "--json"])
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(rerun.stdout)
    assert report["shards_reused"] == 1 and report["shards_written"] >= 1
    after = first.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert run_gemmactl(["inspect", str(out), "--verify"]).returncode == 0


def test_disk_full_mid_shard_leaves_no_index_and_no_partial_file(checkpoint, runner, tmp_path, monkeypatch):
    tensors = small_tensors()
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.randn(3000, 1024).to(torch.bfloat16)  # 1.6 MB in int4: a shard of its own
    source = make_checkpoint(tmp_path / "bigger", tensors)
    out = tmp_path / "art"
    real_write = Int4ShardWriter.write_part

    def full_disk(self, part, start, data):
        if self._shard_index == 1:  # the second shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, part, start, data)

    monkeypatch.setattr(Int4ShardWriter, "write_part", full_disk)
    result = invoke(runner, ["quantize", str(source), "--int4-stream", "--out", str(out), "--shard-size", "1MiB"])
    assert result.exit_code == 1
    assert "no space left on device" in _one_error_line(result.stderr)
    assert str(out) in _one_error_line(result.stderr) and "GEMMACTL_HOME" not in result.stderr  # the artifact's disk
    assert not (out / "index.json").exists() and not list(out.glob("*.partial"))
    assert len(list(out.glob("*.i4s"))) == 1

    monkeypatch.setattr(Int4ShardWriter, "write_part", real_write)
    report = _quantize(runner, source, "--out", out, "--shard-size", "1MiB")
    assert report["shards_reused"] == 1


# -- damaged artifacts ------------------------------------------------------------------------------


@pytest.fixture
def artifact(checkpoint, runner, tmp_path) -> Path:
    _quantize(runner, checkpoint, "--out", tmp_path / "art", "--group-size", "32")
    return tmp_path / "art"


def test_a_flipped_byte_is_named_by_shard_and_tensor(artifact):
    index = json.loads((artifact / "index.json").read_text())
    target = next(t for t in index["tensors"] if t["name"] == "model.layers.0.self_attn.q_proj.weight")
    shard = artifact / target["shard"]
    data = bytearray(shard.read_bytes())
    data[target["offset"] + 5] ^= 0x10
    shard.write_bytes(bytes(data))
    proc = run_gemmactl(["inspect", str(artifact), "--verify"])
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert target["shard"] in line and "model.layers.0.self_attn.q_proj.weight" in line and "checksum" in line
    assert "LAYER" in proc.stdout  # the summary still printed


def test_a_truncated_shard_is_a_clear_error(artifact):
    shard = next(artifact.glob("*.i4s"))
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size - 100)
    proc = run_gemmactl(["inspect", str(artifact), "--verify"])
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert shard.name in line and "truncated" in line
    run = run_gemmactl(["run", "--model", str(artifact), "hello"])
    assert run.returncode == 1 and "truncated" in _one_error_line(run.stderr)


def test_a_newer_format_version_asks_for_an_upgrade(artifact):
    index = json.loads((artifact / "index.json").read_text())
    (artifact / "index.json").write_text(json.dumps(index | {"version": 99}))
    proc = run_gemmactl(["inspect", str(artifact)])
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert "version 99" in line and "pip install --upgrade gemmactl" in line


def test_a_foreign_index_is_not_an_artifact(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "index.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    proc = run_gemmactl(["inspect", str(folder)])
    assert proc.returncode == 2
    assert "something-else index, not gemmactl-int4-stream" in _one_error_line(proc.stderr)


# -- bad input --------------------------------------------------------------------------------------


def test_not_a_checkpoint(runner, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for ref, expected in [(empty, "no config.json"), (tmp_path / "nowhere", "no such model file or folder")]:
        result = invoke(runner, ["quantize", str(ref), "--int4-stream"])
        assert result.exit_code == 2
        assert expected in _one_error_line(result.stderr)


def test_unsupported_dtype_names_the_tensor(runner, tmp_path):
    source = make_checkpoint(tmp_path / "ints", {"model.layers.0.ids": torch.arange(10, dtype=torch.int32)})
    result = invoke(runner, ["quantize", str(source), "--int4-stream"])
    assert result.exit_code == 2
    assert "model.layers.0.ids" in _one_error_line(result.stderr) and "I32" in result.stderr


def test_existing_output_needs_force_and_a_foreign_folder_is_never_replaced(checkpoint, runner, tmp_path):
    out = tmp_path / "art"
    _quantize(runner, checkpoint, "--out", out)
    again = invoke(runner, ["quantize", str(checkpoint), "--int4-stream", "--out", str(out)])
    assert again.exit_code == 2
    assert "already holds an int4-stream artifact" in _one_error_line(again.stderr) and "--force" in again.stderr
    assert _quantize(runner, checkpoint, "--out", out, "--force", "--group-size", "128")["shards_written"] == 1
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    refused = invoke(runner, ["quantize", str(checkpoint), "--int4-stream", "--out", str(foreign), "--force"])
    assert refused.exit_code == 2 and "not an int4-stream artifact" in refused.stderr
    assert (foreign / "cat.jpg").read_bytes() == b"meow"


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "pick an output format: --int4-stream"),
        (["--int4-stream", "--group-size", "48"], "'48' is not one of"),
        (["--int4-stream", "--shard-size", "lots"], "--shard-size 'lots' is not a size"),
        (["--int4-stream", "--shard-size", "4KiB"], "--shard-size must be at least 1MiB"),
        (["--int4-stream", "--embeddings", "fp8"], "'fp8' is not one of"),
        (["--gguf", "Q4_K_M", "--head", "int4"], "--head goes with --int4-stream"),
    ],
)
def test_bad_options_are_one_line_exit_2(checkpoint, isolated_home, args, expected):
    proc = run_gemmactl(["quantize", str(checkpoint), *args])
    assert proc.returncode == 2
    assert expected in _one_error_line(proc.stderr)
    assert not isolated_home.exists()


def test_group_size_not_dividing_the_row_is_handled(runner, tmp_path):
    weight = torch.randn(16, 100) * 0.1  # 100 columns: 3 full groups of 32 and one of 4
    source = make_checkpoint(tmp_path / "odd", {"model.layers.0.mlp.up_proj.weight": weight})
    out = tmp_path / "art"
    _quantize(runner, source, "--out", out, "--group-size", "32")
    from gemmactl.formats.int4.reader import open_artifact

    artifact = open_artifact(out)
    record = artifact.record("model.layers.0.mlp.up_proj.weight")
    assert record.scheme == "int4" and record.shape == (16, 100)
    assert artifact.packed(record).parts["scales"].shape == (16, 4)
    decoded = artifact.load_tensor("model.layers.0.mlp.up_proj.weight")
    assert decoded.shape == (16, 100) and float((decoded - weight).abs().max()) < 0.05


def test_progress_counts_encoding_work_and_a_resumed_run_starts_at_what_is_done(checkpoint, tmp_path):
    from gemmactl.formats.int4.layout import QuantizeOptions, plan_layout
    from gemmactl.formats.int4.checkpoint import open_checkpoint
    from gemmactl.formats.int4.quantize import _work, quantize_checkpoint

    options = QuantizeOptions(group_size=32, shard_size=1 << 20)
    layout = plan_layout(open_checkpoint(checkpoint), options)
    seen = []
    quantize_checkpoint(checkpoint, tmp_path / "art", options, progress=lambda done, total: seen.append((done, total)))
    total = seen[0][1]
    assert seen[0][0] == 0 and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    # Each step is the work of the record just encoded: an int4 search weighs more than an int8 row.
    assert total == sum(_work(r, options.search) for r in layout.records)
    int4 = next(r for r in layout.records if r.scheme == "int4")
    int8 = next(r for r in layout.records if r.scheme == "int8")
    assert _work(int4, True) / int4.numel > 10 * _work(int8, True) / int8.numel
    # As if killed after its last shard (no index yet): a rerun's first report is the work already done.
    from gemmactl.formats.int4.spec import PARTIAL_MARKER

    (tmp_path / "art" / "index.json").unlink()
    (tmp_path / "art" / PARTIAL_MARKER).write_text(json.dumps({"plan": layout.fingerprint.hex()}))
    again = []
    quantize_checkpoint(checkpoint, tmp_path / "art", options, progress=lambda done, total: again.append(done))
    assert again[0] == total


# -- a random model written straight to int4-stream (what the 26B-A4B benchmark uses) ------------


@pytest.mark.parametrize("kind, layout, head", [("moe", "int8", "tied"), ("e2b-tiny", "int8", "int4"),
                                               ("e2b-tiny", "int4", "tied")])
def test_a_random_artifact_has_the_records_of_a_quantized_checkpoint(tiny_gemma4, tmp_path, kind, layout, head):
    """write_random_int4 writes no checkpoint, yet the same records (names, experts, shapes, schemes,
    dtypes) as quantizing a saved random checkpoint of the kind; its weights decode with
    transformers' spread (std 0.02), its norms are ones, and the engine and the plan take it."""
    from gemmactl.formats.int4.layout import QuantizeOptions
    from gemmactl.formats.int4.quantize import quantize_checkpoint
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.plan.report import build_plan
    from gemmactl.runtime.engine.model import GemmaModel
    from helpers.random_gemma import write_random_int4

    made = open_artifact(write_random_int4(kind, tmp_path / "random", group_size=32, sensitive=layout,
                                           embeddings=layout, head=head))
    quantize_checkpoint(tiny_gemma4(kind), tmp_path / "quantized",
                        QuantizeOptions(group_size=32, search=False, sensitive=layout, embeddings=layout, head=head))
    reference = open_artifact(tmp_path / "quantized")
    fields = lambda artifact: {(r.key, r.shape, r.scheme, r.group_size, r.dtype) for r in artifact.records}  # noqa: E731
    assert fields(made) == fields(reference)
    schemes = {r.scheme for r in made.records if r.key.endswith(("v_proj.weight", "down_proj.weight", "embed_tokens.weight"))}
    assert schemes == {layout}
    assert made.config["model_type"] == reference.config["model_type"]

    weight = made.decode(made.record("model.layers.0.self_attn.q_proj.weight"), "cpu", torch.float32)
    assert 0.018 < float(weight.std()) < 0.022 and abs(float(weight.mean())) < 0.002
    norm = made.load_tensor("model.layers.0.input_layernorm.weight", "cpu", torch.float32)
    assert bool((norm == 1).all())

    engine = GemmaModel(made, device="cpu", dtype=torch.float32, context=64)
    with torch.inference_mode():
        logits = engine.step(torch.tensor([2, 818, 5279]), torch.arange(3), 3)
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0
    plan = build_plan(str(tmp_path / "random"), backend="int4", hardware="desktop-4g", vram="2G", context=256)
    assert plan.engine is not None and plan.engine.gpu_total <= 2 << 30
