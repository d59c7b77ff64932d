"""A burst of concurrent requests against a real `gemmactl serve`: none may be dropped.

Starts `gemmactl serve` (the default recipe: the embedded model) on a free port with --queue
set, sends N chat requests at once from N client threads over real HTTP, and reports status codes,
latency percentiles and the server's own counters. A second, smaller --queue shows the bound:
past it, 503 with Retry-After.

    python benchmarks/serve_burst.py --requests 500 --queue 512 --max-tokens 4 [--home STORE] [--json OUT]
    python benchmarks/serve_burst.py --requests 500 --queue 64 --max-tokens 4   # the bound

The server uses the store --home (default: $GEMMACTL_HOME, else gemmactl's default store), which
needs a llama.cpp build (`gemmactl build`) for the default recipe's llama-server tiers. The summary
goes to stdout as JSON and, with --json, to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gemmactl serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if json.load(reply).get("status") == "ok":
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("gemmactl serve did not become ready")


def one(url: str, index: int, max_tokens: int) -> tuple[int, float, str | None]:
    body = json.dumps({"model": "fast", "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Question {index}: what is {index} plus 1?"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            json.load(reply)
            return reply.status, time.perf_counter() - start, None
    except urllib.error.HTTPError as exc:
        return exc.code, time.perf_counter() - start, exc.headers.get("Retry-After")
    except OSError as exc:
        return 0, time.perf_counter() - start, type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--queue", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--home", help="store for `gemmactl serve` (default: $GEMMACTL_HOME)")
    parser.add_argument("--json", help="write the summary here too")
    args = parser.parse_args()
    env = {**os.environ, "GEMMACTL_NO_PROGRESS": "1"}
    if args.home:
        env["GEMMACTL_HOME"] = str(Path(args.home).absolute())

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "gemmactl", "serve", "--port", str(port), "--queue", str(args.queue)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        wait_ready(url, proc)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            results = list(pool.map(lambda i: one(url, i, args.max_tokens), range(args.requests)))
        wall = time.perf_counter() - start
        with urllib.request.urlopen(url + "/health", timeout=10) as reply:
            health = json.load(reply)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    codes: dict[int, int] = {}
    for code, _, _ in results:
        codes[code] = codes.get(code, 0) + 1
    ok = sorted(latency for code, latency, _ in results if code == 200)
    retry_after = sorted({extra for code, _, extra in results if code == 503 and extra})
    pct = lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] if ok else None  # noqa: E731
    summary = {
        "requests": args.requests, "queue": args.queue, "max_tokens": args.max_tokens, "wall_s": round(wall, 2),
        "status_codes": codes, "retry_after": retry_after,
        "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": ok[-1] if ok else None},
        "tiers": {name: {k: tier.get(k) for k in ("requests", "completed", "errors", "rejected")}
                  for name, tier in health.get("tiers", {}).items()},
        "load_average": os.getloadavg(),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
