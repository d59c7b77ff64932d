"""What sampling GPU memory costs work that runs on every core: an int4 artifact's layers on the
CPU (the engine's layer code, one token at position 100), timed alone and while a sampler runs.

    python benchmarks/sampler_cost.py ARTIFACT [--threads N] [--rounds 3] [--out FILE]
        [--spawn "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits"]

The sampler of `plan --verify` and of the GPU benchmarks started a new nvidia-smi every 50 ms.
--spawn is the command started that way here (default: that nvidia-smi where there is one, else
`python -c pass`, a process of similar weight to start, on a machine without a GPU); with nvidia-smi
present, a single nvidia-smi looping on its own (--loop-ms=50, what the sampler does now) is timed
too. Rows: median ms a step of the artifact's layers over --rounds rounds of 5 steps.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from gemmactl.formats.int4.reader import open_artifact
from gemmactl.runtime.engine.model import GemmaModel

SMI_QUERY = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


class Spawner:
    """Starts command every interval_s, each run to its end, as the old sampler did."""

    def __init__(self, command: list[str], interval_s: float = 0.05):
        self.command, self.interval_s, self.stop = command, interval_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                subprocess.run(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.stop.wait(self.interval_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class Looping:
    """One process that runs until stopped (nvidia-smi --loop-ms)."""

    def __init__(self, command: list[str]):
        self.command = command

    def __enter__(self):
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spawn", help="the command started every 50 ms")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    smi = shutil.which("nvidia-smi")
    spawn = shlex.split(args.spawn) if args.spawn else ([smi, *SMI_QUERY] if smi else [sys.executable, "-c", "pass"])
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        engine = GemmaModel(open_artifact(args.artifact), device="cpu", dtype=torch.bfloat16, context=4096)
        spec = engine.spec
        x = torch.randn(1, spec.hidden, dtype=torch.bfloat16)
        at, rope, _ = engine.inputs_on(torch.device("cpu"), torch.tensor([100]), None)
        per = torch.randn(1, spec.n_layers, spec.ple_dim, dtype=torch.bfloat16) if spec.ple_dim else None

        def step() -> None:
            for layer in engine.layers:
                engine.layer_forward(layer, x, at, rope, per, end=101)

        def timed(label: str, around) -> dict:
            with around:
                step()
                rounds = []
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    for _ in range(5):
                        step()
                    rounds.append((time.perf_counter() - start) / 5 * 1e3)
            row = {"sampler": label, "ms_per_step": round(statistics.median(rounds), 1), "rounds_ms": [round(r, 1) for r in rounds]}
            print(json.dumps(row), flush=True)
            return row

        rows = [timed("none", nullcontext()), timed(f"a new {Path(spawn[0]).name} every 50 ms", Spawner(spawn))]
        if smi:
            rows.append(timed("one nvidia-smi --loop-ms=50", Looping([smi, *SMI_QUERY, "--loop-ms=50"])))
        rows.append(timed("none, again", nullcontext()))
    result = {"artifact": str(args.artifact), "threads": args.threads, "spawned": spawn, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
