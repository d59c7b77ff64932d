"""One box against a head with 1 and 2 RPC workers on loopback: decode and wall-clock tok/s, and the
bytes llama.cpp sends to the workers per generated token.

Each configuration runs `gemmactl bench` (greedy, the `short` prompts) twice, at TOKENS_A and
TOKENS_B generated tokens; the loopback interface's byte counter (/proc/net/dev, `lo`: every byte
sent on 127.0.0.1, counted once) is read around each run, so the difference between the two runs
divided by the difference in generated tokens is the traffic per decoded token, without the model
upload that every load makes. With workers, gemmactl runs the split in a llama-server child, whose
streamed HTTP events (a few hundred bytes a token) are in that count too; nothing else may use
loopback while it runs. The same configurations run interleaved,
REPEATS times each, in one process tree, so the ratios are side by side.

    GEMMACTL_HOME=STORE python benchmarks/rpc_loopback.py [--model REF] [--repeats 3] [--out FILE]

STORE must hold a llama.cpp build with the RPC backend (`gemmactl build`) and the model (default:
the embedded Gemma 3 270M).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys

TOKENS_A, TOKENS_B = 32, 160


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker() -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "gemmactl", "worker", "--port", str(free_port()), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return proc, json.loads(proc.stdout.readline())


def loopback_bytes() -> int:
    for line in open("/proc/net/dev").read().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])  # received on lo = sent on lo
    raise SystemExit("no loopback interface in /proc/net/dev")


def bench(model: str, tokens: int, repeats: int, workers: list[dict]) -> dict:
    command = [sys.executable, "-m", "gemmactl", "bench", "--model", model, "--prompts", "short", "--max-tokens",
               str(tokens), "--repeat", str(repeats), "--json"]
    if workers:
        command += ["--rpc", ",".join(w["address"] for w in workers)]
    before = loopback_bytes()
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, GEMMACTL_NO_PROGRESS="1"))
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    sent = loopback_bytes() - before
    runs = [r for r in json.loads(proc.stdout)["runs"] if r["target"] == "gemmactl"]
    return {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "wall_tok_s": statistics.median(r["wall_tok_s"] for r in runs),
            "generated_tokens": sum(r["generated_tokens"] for r in runs), "texts": sorted({r["text"] for r in runs}),
            "loopback_bytes": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    workers = [start_worker() for _ in range(2)]
    try:
        configs = {"one box": [], "head + 1 worker": [workers[0][1]], "head + 2 workers": [w[1] for w in workers]}
        result = {name: {"a": [], "b": []} for name in configs}
        for _ in range(args.repeats):  # interleaved: one of each, then again
            for name, used in configs.items():
                result[name]["a"].append(bench(args.model, TOKENS_A, 1, used))
                result[name]["b"].append(bench(args.model, TOKENS_B, 1, used))
        report = {"model": args.model, "tokens": [TOKENS_A, TOKENS_B], "repeats": args.repeats,
                  "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "configs": {}}
        base = None
        for name, runs in result.items():
            b = runs["b"]
            decode = statistics.median(r["decode_tok_s"] for r in b)
            wall = statistics.median(r["wall_tok_s"] for r in b)
            per_token = statistics.median(
                (rb["loopback_bytes"] - ra["loopback_bytes"]) / max(rb["generated_tokens"] - ra["generated_tokens"], 1)
                for ra, rb in zip(runs["a"], runs["b"]))
            base = base or (decode, wall, b[0]["texts"])
            report["configs"][name] = {
                "decode_tok_s": round(decode, 1), "wall_tok_s": round(wall, 1),
                "decode_ratio": round(decode / base[0], 3), "wall_ratio": round(wall / base[1], 3),
                "bytes_per_token": round(per_token), "same_text_as_one_box": b[0]["texts"] == base[2],
            }
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(text + "\n")
    finally:
        for proc, _ in workers:
            proc.send_signal(signal.SIGINT)
            proc.wait(15)


if __name__ == "__main__":
    main()
