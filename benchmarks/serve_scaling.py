"""Aggregate tok/s from 1 to N concurrent clients for a matrix of llama-server settings, direct and through the front.

For each config of the built-in matrix (slots, tokens per slot, flash attention, KV layout,
sampling on the GPU or the CPU):
  direct  a llama-server of the active llama.cpp build (-ngl 999, every core) gets N concurrent
          greedy /completion requests with ignore_eos, so each one makes exactly --max-tokens;
  front   (--front, the default) a `gemmactl serve` process whose one-tier recipe has the
          config's parallel, flash_attn and backend_sampling gets the same through /v1/completions. The front has
          no ignore_eos: its tokens are counted from each response's `usage`.
Greedy requests send llama-server's filters in their cheapest no-op form, as gemmactl does (--compare-filters also
measures direct requests with its default top-k 40 etc.).
Aggregate tok/s = generated tokens / wall time of the round (first request sent → last answer
read), the median of --rounds. Each level is compared with the same config at 1 client, and with
the best single stream of any config (direct), which is the honest ratio: what N clients get
over the fastest way this machine serves one.

    python benchmarks/serve_scaling.py --model GGUF [--levels 1,16,64] [--max-tokens 64] [--rounds 2]
        [--configs np16-fa-off,np16-fa-on-bs] [--threads N] [--no-front] [--stream] [--compare-filters]
        [--home DIR] [--json OUT]

llama-server is the active build of the store --home (default: $GEMMACTL_HOME, else gemmactl's
default store); --model is a GGUF path or a store name (default: the embedded Gemma 3 270M).
Recipes and logs go to a new temporary folder (`work_dir` in the result). Prints a table per
config; --json writes every figure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from serve_bench import PROSE, median  # noqa: E402

PROMPTS = (
    *PROSE,
    "The three most important inventions of the nineteenth century were",
    "Dear neighbours, we are writing to let you know that next week",
    "Early in the morning the fishermen of the harbour town",
    "Question: What is the capital of France?\nAnswer:",
)
TIER = "bulk"
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Config:
    """One llama-server setting: slots of `context` tokens each, -fa, and the KV layout."""

    parallel: int
    flash_attn: str  # off | on | auto
    context: int = 512  # tokens per slot
    kv_unified: bool = False  # one KV buffer shared by all slots instead of one per slot
    backend_sampling: bool = False  # llama-server --backend-sampling: sample on the GPU, not the CPU
    ubatch: int | None = None  # llama-server -ub: at most this many tokens per graph evaluation

    @property
    def extra_args(self) -> tuple[str, ...]:
        # LlamaServer always passes --no-kv-unified; llama-server applies flags in order, so the
        # later --kv-unified wins (the server log's `kv_unified = true` confirms it).
        return ((("--kv-unified",) if self.kv_unified else ()) + (("--backend-sampling",) if self.backend_sampling else ())
                + (("-ub", str(self.ubatch)) if self.ubatch else ()))

    @property
    def not_in_a_recipe(self) -> str | None:
        """Why `gemmactl serve` cannot run this config, or None."""
        if self.kv_unified:
            return "kv_unified is not a recipe field: `gemmactl serve` always runs --no-kv-unified"
        if self.ubatch:
            return "ubatch is not a recipe field"
        return None

    def describe(self) -> str:
        kv = "unified KV" if self.kv_unified else "KV per slot"
        sampling = ", backend sampling" if self.backend_sampling else ""
        ubatch = f", -ub {self.ubatch}" if self.ubatch else ""
        return f"{self.parallel} slots x {self.context} tokens, -fa {self.flash_attn}, {kv}{sampling}{ubatch}"


THREADS = {"n": os.cpu_count() or 1}  # llama-server -t (--threads)

CONFIGS = {
    "np64-fa-off": Config(64, "off"),  # today's bulk tier (benchmarks/serve_bench.py)
    "np16-fa-off": Config(16, "off"),
    "np16-fa-on": Config(16, "on"),
    "np64-fa-on": Config(64, "on"),
    "np16-fa-on-unified": Config(16, "on", kv_unified=True),
    "np16-fa-on-bs": Config(16, "on", backend_sampling=True),
    "np16-fa-off-bs": Config(16, "off", backend_sampling=True),
    "np64-fa-on-bs": Config(64, "on", backend_sampling=True),
    "np8-fa-on-bs": Config(8, "on", backend_sampling=True),
    "np12-fa-on-bs": Config(12, "on", backend_sampling=True),
    "np32-fa-on-bs": Config(32, "on", backend_sampling=True),
    "np16-fa-on-bs-ub8": Config(16, "on", backend_sampling=True, ubatch=8),
}


# -- requests -------------------------------------------------------------------------------------


def post(port: int, path: str, body: dict, stream: bool, timeout: float = 900, key: str | None = None) -> tuple[dict, float]:
    """POST body to 127.0.0.1:port; returns (the JSON answer or the last event carrying counters, seconds)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        connection.request("POST", path, json.dumps(dict(body, stream=stream)), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status} from {path}: {response.read()[:300]!r}")
        if not stream:
            data = json.loads(response.read())
            return data, time.perf_counter() - start
        last: dict = {}
        for raw in response:
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            event = json.loads(raw[6:])
            if "error" in event:
                raise RuntimeError(f"error event from {path}: {event['error']}")
            # llama-server: the event with "stop": true; the front: the usage chunk.
            if event.get("stop") or event.get("usage"):
                last = event
        return last, time.perf_counter() - start
    finally:
        connection.close()


def direct_request(server, prompt: str, max_tokens: int, stream: bool, filters: bool = False) -> dict:
    """One greedy llama-server /completion that makes exactly max_tokens tokens.

    Sampling as gemmactl sends it (LlamaServer.sampling_fields), or with filters=True only
    `temperature: 0`, so that llama-server runs its default filters (top-k 40 ...) before the argmax.
    """
    sampling = {"temperature": 0} if filters else server.sampling_fields(0, 0, 1.0, 0.0, 1.0)
    body = {"prompt": prompt, "n_predict": max_tokens, "seed": 0, "ignore_eos": True, "cache_prompt": True, **sampling}
    data, seconds = post(server.port, "/completion", body, stream, key=server.api_key)
    return {"tokens": int(data.get("tokens_predicted", 0)), "latency_s": seconds,
            "engine_tok_s": data.get("timings", {}).get("predicted_per_second")}


def front_request(port: int, prompt: str, max_tokens: int, stream: bool) -> dict:
    """One greedy /v1/completions through the front; tokens as its `usage` counts them."""
    body = {"model": TIER, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    data, seconds = post(port, "/v1/completions", body, stream)
    return {"tokens": int(data.get("usage", {}).get("completion_tokens", 0)), "latency_s": seconds,
            "engine_tok_s": data.get("gemmactl", {}).get("decode_tok_s")}


def one_round(send, level: int, max_tokens: int) -> tuple[float, list[dict]]:
    """level concurrent requests released together; (aggregate tok/s, per-request results)."""
    results: list[dict] = [{} for _ in range(level)]
    gate = threading.Barrier(level + 1)

    def client(i: int) -> None:
        gate.wait()
        try:
            results[i] = send(PROMPTS[i % len(PROMPTS)], max_tokens)
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
            results[i] = {"error": str(exc)[:300], "tokens": 0}
        results[i]["end"] = time.perf_counter()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(level)]
    for thread in threads:
        thread.start()
    gate.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    span = max(r["end"] for r in results) - start
    return sum(r["tokens"] for r in results) / span, results


def measure(send, levels: list[int], rounds: int, max_tokens: int) -> list[dict]:
    """Every level, rounds times: aggregate tok/s (median), latency and the engine's own per-request tok/s."""
    send(PROMPTS[0], max_tokens)  # warm-up: first-request costs (graphs, buffers) stay out of the figures
    one_round(send, max(levels), WARMUP_TOKENS)
    rows = []
    for level in levels:
        rates, requests = [], []
        for _ in range(rounds):
            rate, results = one_round(send, level, max_tokens)
            rates.append(rate)
            requests += results
        done = [r for r in requests if "error" not in r]
        engine = [r["engine_tok_s"] for r in done if r.get("engine_tok_s")]
        rows.append({
            "clients": level, "aggregate_tok_s": median(rates), "rounds": rates,
            "p50_latency_s": median([r["latency_s"] for r in done]),
            "engine_tok_s_p50": median(engine),
            "tokens_per_request": statistics.mean(r["tokens"] for r in done) if done else 0,
            "short_requests": sum(1 for r in done if r["tokens"] < max_tokens),
            "errors": [r["error"] for r in requests if "error" in r][:3],
            "failed": len(requests) - len(done),
        })
    base = rows[0]["aggregate_tok_s"]
    for row in rows:
        row["x_vs_own_first_level"] = row["aggregate_tok_s"] / base if base else None
    return rows


# -- direct: LlamaServer ----------------------------------------------------------------------------


def log_settings(log_path: Path) -> dict:
    """What llama-server says it runs with: its slots, tokens per slot and KV layout (flash attention is not logged)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    found = re.findall(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'", text)
    if not found:
        return {}
    slots, per_slot, unified = found[-1]
    return {"n_slots": int(slots), "n_ctx_slot": int(per_slot), "kv_unified": unified}


def run_direct(name: str, config: Config, binary: Path, model: Path, args, log_dir: Path) -> dict:
    from gemmactl.llamacpp.server import LlamaServer

    server = LlamaServer(binary, str(model), threads=THREADS["n"], context=config.context,
                         parallel=config.parallel, n_gpu_layers=999, log_dir=log_dir, flash_attn=config.flash_attn,
                         extra_args=config.extra_args, label=f"scaling-{name}")
    with server:
        rows = measure(lambda prompt, n: direct_request(server, prompt, n, args.stream), args.levels_list,
                       args.rounds, args.max_tokens)
        with_filters = measure(lambda prompt, n: direct_request(server, prompt, n, args.stream, filters=True),
                               args.levels_list, args.rounds, args.max_tokens) if args.compare_filters else None
    common = {"command": server.command, "load_s": server.load_s, "log": str(server.log_path),
              "server_says": log_settings(server.log_path)}
    return {"direct": common | {"levels": rows},
            **({"direct-filters": common | {"levels": with_filters}} if with_filters else {})}


# -- front: a `gemmactl serve` process --------------------------------------------------------------


def recipe_for(name: str, config: Config, model: Path, max_tokens: int) -> str:
    tier = {"model": str(model), "context": config.context, "parallel": config.parallel,
            "flash_attn": config.flash_attn, "backend_sampling": config.backend_sampling,
            "sampling": {"temperature": 0.0, "repeat_penalty": 1.0, "max_tokens": max_tokens}}
    return json.dumps({"name": f"scaling-{name}", "tiers": {TIER: tier}})  # JSON is YAML


def start_front(recipe_path: Path, home: Path, log_path: Path, timeout: float = 600):
    """`gemmactl serve` in its own process (its own GIL, as users run it); (process, its --json state)."""
    command = [sys.executable, "-m", "gemmactl", "serve", "--recipe", str(recipe_path), "--port", "0",
               "--threads", str(THREADS["n"]), "--json"]
    log = open(log_path, "ab")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                               env=dict(os.environ, GEMMACTL_HOME=str(home)), cwd=ROOT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(process.stdout.fileno(), 65536) if ready else b""
        if not chunk:  # exited, or not ready in time
            stop_front(process)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"gemmactl serve did not start: {' | '.join(tail)} (log: {log_path})")
        line += chunk
    return process, json.loads(line.splitlines()[0])


def stop_front(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def process_command(pid: int | None) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (OSError, TypeError):
        return []


def flag_value(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command[:-1] else None


def run_front(name: str, config: Config, model: Path, args, home: Path, work: Path) -> dict:
    reason = config.not_in_a_recipe
    if reason:
        return {"skipped": reason}
    recipe_path = work / f"scaling-{name}.yaml"
    recipe_path.write_text(recipe_for(name, config, model, args.max_tokens))
    log_path = work / f"serve-{name}.log"
    started = time.perf_counter()
    process, state = start_front(recipe_path, home, log_path)
    try:
        tier = state["tiers"][TIER]
        command = process_command(tier.get("pid"))
        server_log = home / "logs" / "serve" / f"llama-server-{TIER}-{tier.get('port')}.log"
        result = {"recipe": json.loads(recipe_path.read_text()), "start_s": time.perf_counter() - started,
                  "backend": tier.get("backend"), "placement": tier.get("placement"), "command": command,
                  "log": str(log_path), "server_log": str(server_log), "server_says": log_settings(server_log)}
        if tier.get("backend") != "llama-server":
            return result | {"skipped": f"the tier runs on {tier.get('backend')}, not llama-server: {tier.get('reason')}"}
        actual = flag_value(command, "-fa")
        if command and config.backend_sampling and "--backend-sampling" not in command:
            return result | {"skipped": "the front's llama-server runs without --backend-sampling"}
        if command and actual != config.flash_attn:
            return result | {"skipped": f"the front's llama-server runs -fa {actual}, not {config.flash_attn}: this "
                                        "gemmactl does not pass a tier's flash_attn on to its server"}
        port = int(state["url"].rsplit(":", 1)[1])
        result["levels"] = measure(lambda prompt, n: front_request(port, prompt, n, args.stream), args.levels_list,
                                   args.rounds, args.max_tokens)
        return result
    finally:
        stop_front(process)


# -- report ---------------------------------------------------------------------------------------

PATHS = {"direct": "direct llama-server", "direct-filters": "direct llama-server, its default filters on",
         "front": "through gemmactl serve"}


def add_honest_ratios(result: dict) -> None:
    """Best single stream over every config (direct, 1 client); each level's aggregate over it."""
    singles = [(part["levels"][0]["aggregate_tok_s"], name, path)
               for name, entry in result["configs"].items() for path in ("direct", "direct-filters")
               for part in [entry.get(path, {})] if part.get("levels") and part["levels"][0]["clients"] == 1]
    best = max(singles) if singles else None
    result["best_single_stream"] = {"tok_s": best[0], "config": best[1], "path": best[2]} if best else None
    reference = 16 if 16 in result["levels"] else max(result["levels"])
    result["reference_clients"] = reference
    summary = []
    for name, entry in result["configs"].items():
        for path in PATHS:
            rows = entry.get(path, {}).get("levels")
            if not rows:
                continue
            for row in rows:
                row["x_vs_best_single"] = row["aggregate_tok_s"] / best[0] if best else None
            at = {row["clients"]: row for row in rows}
            if reference in at:
                summary.append({"config": name, "path": path, "one_client_tok_s": at.get(1, {}).get("aggregate_tok_s"),
                                "reference_tok_s": at[reference]["aggregate_tok_s"],
                                "x_vs_own_1": at[reference]["x_vs_own_first_level"] if 1 in at else None,
                                "x_vs_best_single": at[reference]["x_vs_best_single"]})
    result["summary"] = summary


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    lines = [f"{'clients':>7} {'agg tok/s':>10} {'x own 1':>8} {'x best 1':>9} {'p50 lat s':>10} "
             f"{'engine tok/s':>13} {'tok/req':>8} {'failed':>6}"]
    for row in rows:
        lines.append(f"{row['clients']:>7} {fmt(row['aggregate_tok_s'], '.1f'):>10} "
                     f"{fmt(row['x_vs_own_first_level'], '.2f'):>8} {fmt(row.get('x_vs_best_single'), '.2f'):>9} "
                     f"{fmt(row['p50_latency_s'], '.3f'):>10} {fmt(row['engine_tok_s_p50'], '.1f'):>13} "
                     f"{row['tokens_per_request']:>8.1f} {row['failed']:>6}")
    return "\n".join(lines)


def report(result: dict) -> str:
    out = []
    for name, entry in result["configs"].items():
        out.append(f"== {name}: {entry['settings_text']}")
        for path, title in PATHS.items():
            part = entry.get(path)
            if part is None:
                continue
            if part.get("skipped") or part.get("error"):
                out.append(f"-- {title}: skipped: {part.get('skipped') or part.get('error')}")
                continue
            says = ", ".join(f"{k} = {v}" for k, v in part.get("server_says", {}).items())
            load = part.get("load_s", part.get("start_s"))
            out.append(f"-- {title} (start {fmt(load, '.1f')} s{'; ' + says if says else ''})")
            out.append(table(part["levels"]))
    best = result["best_single_stream"]
    reference = result["reference_clients"]
    out.append("")
    out.append("best single stream: " + (f"{best['tok_s']:.1f} tok/s ({best['config']}, {best['path']})" if best else "-"))
    out.append(f"{'config':<20} {'path':<14} {'1 client':>9} {f'{reference} clients':>11} {'x own 1':>8} {'x best 1':>9}")
    for row in result["summary"]:
        out.append(f"{row['config']:<20} {row['path']:<14} {fmt(row['one_client_tok_s'], '.1f'):>9} "
                   f"{fmt(row['reference_tok_s'], '.1f'):>11} {fmt(row['x_vs_own_1'], '.2f'):>8} "
                   f"{fmt(row['x_vs_best_single'], '.2f'):>9}")
    return "\n".join(out)


def gpu_name() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path or store name (default: the embedded model)")
    parser.add_argument("--levels", default="1,16,64", help="concurrent clients, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server threads (-t)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list from {', '.join(CONFIGS)}")
    parser.add_argument("--front", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure each config through a `gemmactl serve` process")
    parser.add_argument("--stream", action="store_true", help="clients stream (SSE) instead of one JSON answer")
    parser.add_argument("--compare-filters", action="store_true",
                        help="also measure direct requests that leave llama-server's default filters on (top-k 40 ...)")
    parser.add_argument("--home", help="store folder with the llama.cpp build (default: $GEMMACTL_HOME)")
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    args.levels_list = [int(x) for x in args.levels.split(",")]
    names = [x.strip() for x in args.configs.split(",") if x.strip()]
    unknown = [x for x in names if x not in CONFIGS]
    if unknown or not names or any(level < 1 for level in args.levels_list):
        parser.error(f"unknown config {', '.join(unknown)}; pick from {', '.join(CONFIGS)}" if unknown
                     else "--configs and --levels need at least one entry, levels >= 1")

    from gemmactl.llamacpp.build import active_build
    from gemmactl.store.refs import resolve_model
    from gemmactl.store import Store

    store = Store(Path(args.home)) if args.home else Store()
    build = active_build(store)
    if build is None or "llama-server" not in build.binaries:
        sys.exit(f"no llama.cpp build with llama-server in {store.home}: run `gemmactl build` (or pass --home)")
    binary = build.binary("llama-server")
    model = resolve_model(args.model or "embedded", store).path
    work = Path(tempfile.mkdtemp(prefix="serve-scaling-"))
    THREADS["n"] = args.threads
    result = {"model": str(model), "build": build.build_id, "gpu": gpu_name(), "cpu_count": os.cpu_count(),
              "threads": args.threads,
              "levels": args.levels_list, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "stream": args.stream, "front": args.front, "work_dir": str(work), "configs": {}}
    for name in names:
        config = CONFIGS[name]
        entry = {"settings": asdict(config), "settings_text": config.describe()}
        result["configs"][name] = entry
        print(f"[{name}] direct ...", file=sys.stderr, flush=True)
        try:
            entry.update(run_direct(name, config, binary, model, args, work / "logs"))
        except Exception as exc:  # noqa: BLE001 - the other configs still run
            entry["direct"] = {"error": f"{type(exc).__name__}: {exc}"}
        if args.front:
            print(f"[{name}] front ...", file=sys.stderr, flush=True)
            try:
                entry["front"] = run_front(name, config, model, args, store.home, work)
            except Exception as exc:  # noqa: BLE001
                entry["front"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({name: entry}, default=str), file=sys.stderr, flush=True)
    add_honest_ratios(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(report(result))


if __name__ == "__main__":
    main()
