"""int4-stream on this machine: quantize throughput and peak RSS, and reload time against bf16 safetensors.

Every measurement runs in a fresh process (peak RSS from wait4, timing inside the process after
its imports), interleaved across variants, with the page cache warm (one untimed run first):

  quantize          `gemmactl quantize CKPT --int4-stream` as a user runs it: wall time, peak RSS,
                    against the peak RSS of a process that only imports the same modules
  int4 packed       open the artifact and map every record's packed parts, touching every page:
                    what a packed-weight runtime needs before its first token
  int4 packed → HF bf16  the `int4` backend with weights="packed": a transformers model whose
                    linear layers and embedding tables keep the mapped parts, dequantized per call
  int4 → HF f32/bf16  open, dequantize and assign into a transformers model (weights="dense")
  HF bf16/f32       AutoModelForCausalLM.from_pretrained(CKPT) of the bf16 safetensors checkpoint

For the transformers variants it also times the first forward pass (8 tokens) after loading:
from_pretrained maps the safetensors file and reads weights lazily, on first use, so load time
alone flatters it; load + first forward is "ready and computing". Then greedy decoding of
--decode-tokens tokens over the model's cache gives decode tok/s, and the tokens themselves (the
packed and dense int4 models must agree).

Every child imports torch, transformers, accelerate and the model's transformers module before
the clock starts (--cold-imports leaves the model module inside the timed part, as a fresh
`gemmactl run` pays it).

    python benchmarks/int4_load.py --checkpoint DIR [--group-size 32] [--repeats 5] [--threads N] [--out FILE]

--threads sets OMP_NUM_THREADS for every child alike: on a machine shared with other work, two
threads per op wait on each other at every barrier, and one thread is the fairer measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = "import torch, safetensors.torch, gemmactl.cli.quantize, gemmactl.store.quantize, gemmactl.formats.int4.quantize"

LOADERS = {
    "int4 packed": """
import mmap, time
from gemmactl.formats.int4.reader import open_artifact
start = time.perf_counter()
artifact = open_artifact(PATH)
touched = 0
for record in artifact.records:
    for part in artifact.packed(record).parts.values():
        flat = part.reshape(-1).view(torch.uint8)
        touched += int(flat[:: mmap.PAGESIZE].sum())  # read one byte per page: every page in memory
""",
    "int4 packed -> HF bf16": """
import time
from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.int4_packed import build_packed_model
start = time.perf_counter()
model = build_packed_model(open_artifact(PATH), torch.bfloat16)
""",
    "int4 -> HF f32": """
import time
from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.int4_model import build_model
start = time.perf_counter()
model = build_model(open_artifact(PATH), torch.float32)
""",
    "int4 -> HF bf16": """
import time
from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.int4_model import build_model
start = time.perf_counter()
model = build_model(open_artifact(PATH), torch.bfloat16)
""",
    "HF bf16": """
import time
from transformers import AutoModelForCausalLM
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.bfloat16)
""",
    "HF f32": """
import time
from transformers import AutoModelForCausalLM
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32)
""",
}


CHILD_ENV = dict(os.environ)


def run_child(args: list[str], env: dict | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of one child process."""
    env = CHILD_ENV | (env or {})
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: {' '.join(args)}")
    return wall, usage.ru_maxrss * 1024, out


PREIMPORT = {"model_module": ""}


def python_child(code: str) -> list[str]:
    # The libraries every variant needs are imported before the clock starts, for all alike.
    head = "import torch, transformers, accelerate, gemmactl.formats.int4.reader\n" + PREIMPORT["model_module"]
    return [sys.executable, "-c", head + code]


DECODE = """
import inspect, json
arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
with torch.inference_mode():
    out = model(input_ids=torch.tensor([[2, 651, 6037, 576, 573, 3413, 603, 235248]]), use_cache=True)
    ready = time.perf_counter() - start
    tokens, began = [], time.perf_counter()
    for _ in range(DECODE_TOKENS):
        cache = out[arg] if arg in out else out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{arg: cache})
    decode_tok_s = DECODE_TOKENS / (time.perf_counter() - began) if DECODE_TOKENS else None
print(json.dumps({"load_s": loaded, "ready_s": ready, "decode_tok_s": decode_tok_s, "tokens": tokens}))
"""


def loader_code(name: str, artifact: Path, checkpoint: Path, decode_tokens: int) -> str:
    body = LOADERS[name].replace("PATH", repr(str(artifact))).replace("CKPT", repr(str(checkpoint)))
    body += "\nloaded = time.perf_counter() - start\n"
    if name == "int4 packed":
        return body + "import json\nprint(json.dumps({'load_s': loaded}))\n"
    return body + DECODE.replace("DECODE_TOKENS", str(decode_tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantize-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every child (default: torch's own)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens decoded after loading")
    parser.add_argument("--cold-imports", action="store_true",
                        help="time the import of the model's transformers module inside each load")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        CHILD_ENV["OMP_NUM_THREADS"] = str(args.threads)

    from gemmactl.formats.int4.checkpoint import open_checkpoint
    from gemmactl.formats.int4.layout import tensor_layer

    source = open_checkpoint(args.checkpoint)
    if not args.cold_imports:
        model_type = json.loads((args.checkpoint / "config.json").read_text())["model_type"]
        PREIMPORT["model_module"] = f"import transformers.models.{model_type.split('_')[0]}.modeling_{model_type.split('_')[0]}\n"
    source_bytes = sum(t.numel * {"bfloat16": 2, "float16": 2, "float32": 4}[t.dtype] for t in source.tensors)
    layers: dict = {}
    for t in source.tensors:
        layers[tensor_layer(t.name)] = layers.get(tensor_layer(t.name), 0) + t.numel * 2
    largest_layer = max(v for k, v in layers.items() if k is not None)
    largest_tensor = max(t.numel * 2 for t in source.tensors)

    report: dict = {"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
                    "cpus": len(os.sched_getaffinity(0)), "threads": args.threads, "load_avg": os.getloadavg(),
                    "source_bytes": source_bytes,
                    "largest_layer_bf16_bytes": largest_layer, "largest_tensor_bf16_bytes": largest_tensor}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GEMMACTL_HOME=str(Path(tmp) / "home"), GEMMACTL_NO_PROGRESS="1")
        baseline = [run_child([sys.executable, "-c", BASELINE])[1] for _ in range(2)]
        runs = []
        for i in range(args.quantize_repeats):
            out = Path(tmp) / f"art{i}"
            cmd = [sys.executable, "-m", "gemmactl", "quantize", str(args.checkpoint), "--int4-stream",
                   "--group-size", str(args.group_size), "--out", str(out), "--json"]
            wall, rss, stdout = run_child(cmd, env)
            runs.append({"wall_s": wall, "peak_rss": rss, "seconds": json.loads(stdout)["seconds"]})
        artifact = Path(tmp) / "art0"
        seconds = statistics.median(r["seconds"] for r in runs)
        report["quantize"] = {
            "runs": runs,
            "baseline_rss": min(baseline),
            "peak_rss_above_baseline": max(r["peak_rss"] for r in runs) - min(baseline),
            "seconds_median": seconds,
            "source_MB_per_s": source_bytes / seconds / 1e6,
            "params_per_s": source_bytes / 2 / seconds,
        }
        print(json.dumps(report["quantize"]), file=sys.stderr)

        timings: dict[str, list] = {name: [] for name in LOADERS}
        def code(name: str) -> list[str]:
            return python_child(loader_code(name, artifact, args.checkpoint, args.decode_tokens))

        for name in LOADERS:  # warm the page cache for both files
            run_child(code(name))
        for _ in range(args.repeats):
            for name in LOADERS:
                wall, rss, stdout = run_child(code(name))
                row = json.loads(stdout.strip().splitlines()[-1])
                timings[name].append({"load_forward_s": row.get("ready_s"), **row, "wall_s": wall, "peak_rss": rss})
        report["reload"] = {
            name: {
                "load_s_median": statistics.median(r["load_s"] for r in rows),
                "load_s_min": min(r["load_s"] for r in rows),
                "load_forward_s_median": statistics.median(r["load_forward_s"] for r in rows) if rows[0].get("ready_s") else None,
                "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rows) if rows[0].get("decode_tok_s") else None,
                "tokens": rows[0].get("tokens"),
                "peak_rss_median": statistics.median(r["peak_rss"] for r in rows),
                "runs": rows,
            }
            for name, rows in timings.items()
        }
        hf = report["reload"]["HF bf16"]["load_s_median"]
        report["reload_ratio_vs_hf_bf16"] = {name: hf / v["load_s_median"] for name, v in report["reload"].items()}
        hf_ready = report["reload"]["HF bf16"]["load_forward_s_median"]
        report["ready_ratio_vs_hf_bf16"] = {
            name: hf_ready / v["load_forward_s_median"] for name, v in report["reload"].items() if name != "int4 packed"
        }
        report["packed_tokens_equal_dense"] = (
            report["reload"]["int4 packed -> HF bf16"]["tokens"] == report["reload"]["int4 -> HF bf16"]["tokens"]
        )
    report["load_avg_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
