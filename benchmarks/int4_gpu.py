"""int4-stream on a GPU machine: quantize a random E2B-shaped Gemma 4, then cached reload onto the GPU.

    python benchmarks/int4_gpu.py build OUT [--shape e2b|tiny] [--device cuda]
    python benchmarks/int4_gpu.py quantize --checkpoint CKPT --artifact ART [--group-size 32]
    python benchmarks/int4_gpu.py reload --checkpoint CKPT --artifact ART [--device cuda] [--repeats 3]
    python benchmarks/int4_gpu.py table RESULTS.json ...

`build` saves a random bf16 Gemma 4 with tests/helpers/random_gemma.py (`e2b`: the published E2B
text shapes; `tiny`: its `shared-kv` kind, the same arrangement at toy size, to test this script
on a CPU), no tokenizer. `quantize` runs `gemmactl quantize
--int4-stream` in a child process: wall time, the command's own seconds, peak RSS (wait4) and the
peak RSS of a child that only imports the same modules. `reload` times, in fresh child
processes interleaved across variants (page cache warmed by one untimed run of each), from the
call to every weight on the device (synchronized):

  int4 -> device (tensors)   the reader copies each record's packed parts to the device and
                             dequantizes there: every tensor of every layer, dense, bf16
  int4 -> HF model           the same, assigned into a transformers model built on the meta device
  HF bf16 -> device          AutoModelForCausalLM.from_pretrained(CKPT, dtype=bf16, device_map=DEVICE)

Every child imports torch, transformers and the Gemma 4 modeling module and initializes the
device before the clock starts, so all variants start from the same state. `table` prints the
markdown tables for docs/benchmarks.md. Every path is an argument; each command prints its JSON
report on stdout. benchmarks/gpu_int4.sh runs build → quantize → reload → table in one go.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository root: tests.helpers

# --shape → the kind of tests/helpers/random_gemma.py it builds.
SHAPES = {"e2b": "e2b", "tiny": "shared-kv"}

PREAMBLE = """
import time, torch, transformers, accelerate
import transformers.models.gemma4.modeling_gemma4
from transformers import AutoModelForCausalLM
from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.int4_model import build_model
from gemmactl.runtime.int4_packed import build_packed_model
DEVICE = {device!r}
def sync():
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
if DEVICE.startswith("cuda"):
    torch.empty(1, device=DEVICE); sync(); torch.cuda.reset_peak_memory_stats()
"""

LOADERS = {
    "int4 -> device (tensors)": """
start = time.perf_counter()
artifact = open_artifact(ART)
state = artifact.state_dict(device=DEVICE, dtype=torch.bfloat16)
sync()
params = sum(t.numel() for t in state.values())
""",
    "int4 packed -> HF model": """
start = time.perf_counter()
model = build_packed_model(open_artifact(ART), torch.bfloat16, device=DEVICE)
sync()
params = sum(p.numel() for p in model.parameters())
""",
    "int4 -> HF model": """
start = time.perf_counter()
model = build_model(open_artifact(ART), torch.bfloat16, device=DEVICE)
sync()
params = sum(p.numel() for p in model.parameters())
""",
    "HF bf16 -> device": """
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.bfloat16, device_map=DEVICE)
sync()
params = sum(p.numel() for p in model.parameters())
""",
}

# After loading: a first forward pass of 8 tokens (ready = load + it), then greedy decoding of
# DECODE_TOKENS tokens one at a time over the model's cache (what the int4 backend runs).
DECODE_TOKENS = 32
DECODE = f"""
import inspect
arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
ids = torch.tensor([[t % model.config.vocab_size for t in (2, 651, 6037, 576, 573, 3413, 603, 235248)]], device=DEVICE)
with torch.inference_mode():
    out = model(input_ids=ids, use_cache=True)
    sync()
    ready = time.perf_counter() - start
    tokens = []
    began = time.perf_counter()
    for _ in range({DECODE_TOKENS}):
        cache = out[arg] if arg in out else out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=DEVICE), use_cache=True, **{{arg: cache}})
    sync()
    decode_tok_s = {DECODE_TOKENS} / (time.perf_counter() - began)
"""

QUANTIZE_BASELINE = "import torch, safetensors.torch, gemmactl.cli.quantize, gemmactl.store.quantize, gemmactl.formats.int4.quantize"


def run_child(args: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of one child process; its stderr passes through."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE)
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed ({os.waitstatus_to_exitcode(status)}): {' '.join(args)[:300]}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024, out


def build(out: Path, shape: str, device: str) -> dict:
    from gemmactl.formats.int4.checkpoint import open_checkpoint
    from tests.helpers.random_gemma import build_random_gemma

    start = time.perf_counter()
    build_random_gemma(SHAPES[shape], out, seed=0, dtype="bfloat16", device=device)
    params = sum(t.numel for t in open_checkpoint(out).tensors)
    return {"shape": shape, "kind": SHAPES[shape], "params": params, "seconds": time.perf_counter() - start}


def quantize(checkpoint: Path, artifact: Path, group_size: int) -> dict:
    from gemmactl.formats.int4.checkpoint import open_checkpoint
    from gemmactl.formats.int4.layout import tensor_layer

    source = open_checkpoint(checkpoint)
    layers: dict = {}
    for t in source.tensors:
        layers[tensor_layer(t.name)] = layers.get(tensor_layer(t.name), 0) + t.numel * 2
    baseline = min(run_child([sys.executable, "-c", QUANTIZE_BASELINE])[1] for _ in range(2))
    cmd = [sys.executable, "-m", "gemmactl", "quantize", str(checkpoint), "--int4-stream", "--group-size",
           str(group_size), "--out", str(artifact), "--force", "--json"]
    wall, rss, stdout = run_child(cmd)
    report = json.loads(stdout)
    source_bytes = sum(t.numel * 2 for t in source.tensors)
    return {
        "wall_s": wall,
        "seconds": report["seconds"],
        "source_bytes": source_bytes,
        "params": report["params"],
        "size_bytes": report["size_bytes"],
        "MB_per_s": source_bytes / report["seconds"] / 1e6,
        "params_per_s": report["params"] / report["seconds"],
        "peak_rss": rss,
        "baseline_rss": baseline,
        "peak_rss_above_baseline": rss - baseline,
        "largest_layer_bf16_bytes": max(v for k, v in layers.items() if k is not None),
        "largest_tensor_bf16_bytes": max(t.numel * 2 for t in source.tensors),
        "cpus": len(os.sched_getaffinity(0)),
    }


def reload(checkpoint: Path, artifact: Path, device: str, repeats: int) -> dict:
    def child(name: str) -> list[str]:
        code = PREAMBLE.format(device=device) + f"ART = {str(artifact)!r}\nCKPT = {str(checkpoint)!r}\n"
        code += LOADERS[name] + "\nloaded = time.perf_counter() - start\n"
        code += DECODE if name != "int4 -> device (tensors)" else "ready = None; decode_tok_s = None; tokens = []\n"
        code += "peak = torch.cuda.max_memory_allocated() if DEVICE.startswith('cuda') else 0\n"
        code += ("print(json.dumps({'load_s': loaded, 'ready_s': ready, 'decode_tok_s': decode_tok_s, "
                 "'tokens': tokens, 'params': params, 'peak_device_bytes': peak}))\n")
        return [sys.executable, "-c", "import json\n" + code]

    for name in LOADERS:  # warm the page cache for both files
        run_child(child(name))
    runs: dict[str, list] = {name: [] for name in LOADERS}
    for _ in range(repeats):
        for name in LOADERS:
            wall, rss, stdout = run_child(child(name))
            runs[name].append(json.loads(stdout.strip().splitlines()[-1]) | {"wall_s": wall, "peak_rss": rss})
    def median_of(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    result = {
        name: {
            "load_s_median": statistics.median(r["load_s"] for r in rows),
            "ready_s_median": median_of(rows, "ready_s"),
            "decode_tok_s_median": median_of(rows, "decode_tok_s"),
            "tokens": rows[0]["tokens"],
            "load_s_min": min(r["load_s"] for r in rows),
            "load_s_max": max(r["load_s"] for r in rows),
            "params": rows[0]["params"],
            "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
            "peak_rss_median": statistics.median(r["peak_rss"] for r in rows),
            "runs": rows,
        }
        for name, rows in runs.items()
    }
    hf = result["HF bf16 -> device"]["load_s_median"]
    for row in result.values():
        row["speedup_vs_hf_bf16"] = hf / row["load_s_median"]
    packed, dense = result["int4 packed -> HF model"]["tokens"], result["int4 -> HF model"]["tokens"]
    return {"device": device, "repeats": repeats, "variants": result, "packed_tokens_equal_dense": packed == dense}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def table(reports: list[dict]) -> str:
    lines = []
    for report in reports:
        if "quantize" in report:
            q = report["quantize"]
            lines += [
                f"Quantize ({q['params'] / 1e9:.2f} B params, {q['source_bytes'] / 1e9:.2f} GB bf16 → "
                f"{q['size_bytes'] / 1e9:.2f} GB, {q['cpus']} CPUs):",
                "",
                "| time | throughput | peak RSS | above baseline | largest layer / tensor (bf16) |",
                "| --- | --- | --- | --- | --- |",
                f"| {q['seconds']:.1f} s | {q['MB_per_s']:.0f} MB/s, {q['params_per_s'] / 1e6:.0f} M params/s | "
                f"{gib(q['peak_rss'])} | {gib(q['peak_rss_above_baseline'])} | "
                f"{gib(q['largest_layer_bf16_bytes'])} / {gib(q['largest_tensor_bf16_bytes'])} |",
                "",
            ]
        if "reload" in report:
            r = report["reload"]
            lines += [
                f"Cached reload onto {r['device']} (median of {r['repeats']}, fresh process each, interleaved):",
                "",
                "| variant | load (median, min–max) | vs HF bf16 | ready (+ 8-token forward) | decode tok/s "
                "| peak device memory | peak RSS |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for name, v in r["variants"].items():
                ready = f"{v['ready_s_median']:.2f} s" if v.get("ready_s_median") is not None else "—"
                decode = f"{v['decode_tok_s_median']:.1f}" if v.get("decode_tok_s_median") is not None else "—"
                lines.append(
                    f"| {name} | {v['load_s_median']:.2f} s ({v['load_s_min']:.2f}–{v['load_s_max']:.2f}) | "
                    f"{v['speedup_vs_hf_bf16']:.2f}× | {ready} | {decode} | {gib(v['peak_device_bytes'])} | "
                    f"{gib(v['peak_rss_median'])} |"
                )
            lines += ["", f"Packed greedy tokens equal the dense int4 model's: {r.get('packed_tokens_equal_dense')}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--shape", choices=list(SHAPES), default="e2b")
    b.add_argument("--device", default="cuda")
    q = sub.add_parser("quantize")
    q.add_argument("--checkpoint", type=Path, required=True)
    q.add_argument("--artifact", type=Path, required=True)
    q.add_argument("--group-size", type=int, default=32)
    r = sub.add_parser("reload")
    r.add_argument("--checkpoint", type=Path, required=True)
    r.add_argument("--artifact", type=Path, required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--repeats", type=int, default=3)
    t = sub.add_parser("table")
    t.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args()

    meta = {"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine()}
    if args.command == "build":
        report = meta | {"build": build(args.out, args.shape, args.device)}
    elif args.command == "quantize":
        report = meta | {"quantize": quantize(args.checkpoint, args.artifact, args.group_size)}
    elif args.command == "reload":
        report = meta | {"reload": reload(args.checkpoint, args.artifact, args.device, args.repeats)}
    else:
        print(table([json.loads(path.read_text()) for path in args.results]))
        return
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
