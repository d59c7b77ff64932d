"""N concurrent HTTP clients against llama-server with N slots, bounded in time."""

from __future__ import annotations

import threading
import time
from typing import Callable

from gemmactl.bench.prompts import BenchPrompt
from gemmactl.bench.stats import aggregate_tok_s, draft_totals, percentiles, request_metrics, summary
from gemmactl.bench.targets import WARMUP_TOKENS, LlamaServerTarget, TargetSettings
from gemmactl.errors import ServerError


def run_level(
    settings: TargetSettings,
    prompts: list[BenchPrompt],
    clients: int,
    *,
    rounds: int,
    max_tokens: int,
    timeout_s: float,
    progress: Callable[[str], None],
) -> dict:
    """Start llama-server with `clients` slots; each round, `clients` threads send one request at once."""
    target = LlamaServerTarget(settings, parallel=clients)
    try:
        target.generate(prompts[0].text, WARMUP_TOKENS)
        deadline = time.perf_counter() + timeout_s
        round_rates, replies = [], []
        for round_index in range(rounds):
            progress(f"llama-server, {clients} concurrent, round {round_index + 1}/{rounds}")
            batch = _one_round(target, prompts, clients, max_tokens, deadline)
            round_rates.append(aggregate_tok_s([reply.timing for reply in batch]))
            replies.extend(batch)
        memory = target.memory()
        info = target.info()
    finally:
        target.close()
    metrics = [request_metrics(reply.timing) for reply in replies]
    speculative = draft_totals([reply.extra for reply in replies]) if target.speculative else {}
    return {
        "target": "llama-server",
        "concurrency": clients,
        "requests": len(metrics),
        "rounds": rounds,
        "load_s": target.load_s,
        "aggregate_tok_s": summary(round_rates),
        "latency_s": percentiles([m["wall_s"] for m in metrics]),
        "ttft_s": percentiles([m["ttft_s"] for m in metrics]),
        "decode_tok_s": percentiles([m["decode_tok_s"] for m in metrics]),
        "generated_tokens": sum(m["generated_tokens"] for m in metrics),
        **speculative,
        **memory,
        "server": info,
    }


def _one_round(target: LlamaServerTarget, prompts: list[BenchPrompt], clients: int, max_tokens: int, deadline: float):
    """Every client starts together (a barrier) and sends one request; all must end before the deadline."""
    barrier = threading.Barrier(clients)
    replies: list = [None] * clients
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            barrier.wait(timeout=max(1.0, deadline - time.perf_counter()))
            remaining = max(1.0, deadline - time.perf_counter())
            replies[index] = target.generate(prompts[index % len(prompts)].text, max_tokens, timeout=remaining)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.perf_counter()) + 5)
    if any(thread.is_alive() for thread in threads):
        target.close()  # closing the server ends the stuck streams
        raise ServerError(
            f"{clients} concurrent requests did not finish within the time limit",
            hint="Raise --timeout, or lower --max-tokens or --concurrency.",
        )
    if errors:
        first = errors[0]
        raise first if isinstance(first, ServerError) else ServerError(f"a concurrent request failed: {first}")
    return [sample for sample in replies]
