"""`gemmactl run`: one-shot generation through the tier router."""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from gemmactl.cli import complete
from gemmactl.cli.output import StreamPrinter, byte_progress, emit_json, progress_enabled, warn
from gemmactl.cli.types import NON_NEGATIVE
from gemmactl.sizes import format_size


def expert_options(command):
    """--expert-cache, --expert-policy, --expert-prefetch and --expert-cpu-share, as `run` and `bench` take them."""
    for option in reversed((
        click.option("--expert-cache", "expert_cache", metavar="SIZE|auto|off", help="MoE models on the int4 engine: GPU memory for cached experts (default: the tier's, else auto: the room the plan leaves)."),
        click.option("--expert-policy", "expert_policy", metavar="lru|lfu|hot", help="Which cached expert makes room for a new one (default: the tier's, else lfu)."),
        click.option("--expert-prefetch/--no-expert-prefetch", "expert_prefetch", default=None, help="Copy in the next MoE layer's likely experts ahead of it (default: the tier's, else on)."),
        click.option("--expert-cpu-share", "expert_cpu_share", metavar="FRACTION|auto", help="Share of each MoE layer's experts always computed on the CPU, beside the GPU's cache (default: the tier's, else auto: the plan's split)."),
    )):
        command = option(command)
    return command


@click.command("run")
@click.argument("prompt", nargs=-1)
@click.option("--tier", "tier", metavar="NAME", shell_complete=complete.tiers, help="Use this tier, whatever the prefix or heuristic says.")
@click.option("--model", "model", metavar="REF", shell_complete=complete.models, help="A .gguf file, an int4-stream folder, or a store name, instead of the tier's model.")
@click.option("--recipe", "recipe", metavar="FILE|NAME", shell_complete=complete.recipes, help="Recipe of tiers (default: built-in 'default', or $GEMMACTL_RECIPE).")
@click.option("--max-tokens", type=click.IntRange(min=1), metavar="N", help="Most tokens to generate (default: the tier's).")
@click.option("--temperature", type=NON_NEGATIVE, metavar="T", help="Sampling temperature; 0 is greedy (default: the tier's).")
@click.option("--seed", type=int, metavar="N", help="Seed for sampling, for repeatable output.")
@click.option("--system", "system", metavar="TEXT", help="System text to answer under (a chat template's system turn, or a line above a base model's question).")
@click.option("--show-thinking", is_flag=True, help="Also print what the model thinks before answering.")
@click.option("--raw", is_flag=True, help="Send the prompt as is: no chat template, no question frame.")
@click.option("--stats", is_flag=True, help="Print the routing decision and speed figures to stderr.")
@click.option("--rpc", "rpc", multiple=True, metavar="HOST:PORT[=SIZE]", help="RPC workers (`gemmactl worker`) that take a share of a GGUF's layers; repeatable or comma-separated (default: the tier's rpc).")
@expert_options
@click.option("--kv-cache", "kv_cache", metavar="MODE", help="KV cache mode: bf16, int8, tq4 or tq3 on the int4 engine (GLOBAL/WINDOWS, e.g. tq4/bf16, gives the sliding windows their own); f16, q8_0 or q4_0 on llama.cpp (default: the tier's).")
@click.option("--yarn", "yarn", type=click.FloatRange(min=1, max=64), metavar="FACTOR", help="YaRN rope scaling of the global layers by FACTOR (int4 engine; default: the tier's).")
@click.option("--draft", "draft", metavar="MODEL", shell_complete=complete.models, help="Speculative decoding on the int4 engine with this draft (an int4-stream artifact of the same vocabulary; default: the tier's speculative draft_model).")
@click.option("--draft-max", "draft_max", type=click.IntRange(min=1, max=16), metavar="N", help="Most tokens the draft proposes per round (default: the tier's, else 4).")
@click.option("--draft-tune/--no-draft-tune", "draft_tune", default=None, help="Let the tuner choose the draft length and turn speculation off when it loses (default), or always draft --draft-max.")
@click.option("--json", "json_mode", is_flag=True, help="Print one JSON object: answer, thinking, route and stats.")
def run(prompt, tier, model, recipe, max_tokens, temperature, seed, system, show_thinking, raw, stats, rpc, expert_cache,
        expert_policy, expert_prefetch, expert_cpu_share, kv_cache, yarn, draft, draft_max, draft_tune, json_mode):
    """Answer a prompt with a local model, routed to a tier.

    The answer streams to stdout as it is generated. The PROMPT comes from the arguments, or
    from stdin when there are none. A prefix picks the tier: `quick:`/`fast:` → fast, `deep:` →
    deep, `reason:`/`think:` → reason (else deep) with thinking on; without one a small heuristic
    decides (see docs/tiers.md).

    \b
    Examples:
      gemmactl run "quick: What is the capital of France?"
      echo "deep: prove that sqrt(2) is irrational" | gemmactl run --stats
    """
    from gemmactl.generate import (backend_for, draft_settings_for, expert_settings_for, open_backend, plan_run,
                                   resolve_run_model, stream_generate)
    from gemmactl.recipes import resolve_recipe
    from gemmactl.runtime.base import GenerationStats
    from gemmactl.store import Store

    workers = _workers(rpc)
    text = " ".join(prompt) if prompt else _read_stdin()
    spec = plan_run(
        text,
        resolve_recipe(recipe),
        tier=tier,
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        raw=raw,
        system=system,
    )
    store = Store()
    with byte_progress("assembling the embedded model", progress_enabled(json_mode)) as progress:
        resolved = resolve_run_model(spec, store, progress=progress)
    experts = expert_settings_for(spec.tier, expert_cache, expert_policy, expert_prefetch, expert_cpu_share)
    speculation = draft_settings_for(spec.tier, store, draft, draft_max, draft_tune,
                                     engine=backend_for(resolved) == "int4")
    # The layout file of a CPU-only machine is made at the first load; experts homed on the CPU
    # of a GPU machine are laid out at every load.
    with byte_progress("laying out the experts for the CPU", progress_enabled(json_mode),
                       lazy=True) as progress:
        backend = open_backend(resolved, context=spec.tier.context, store=store, vram=spec.tier.vram,
                               rpc=workers or spec.tier.rpc, experts=replace(experts, progress=progress),
                               kv_cache=kv_cache or spec.tier.kv_cache, yarn=yarn or spec.tier.yarn, draft=speculation)
    if not json_mode:
        for notice in backend.notices:
            warn(notice)
    try:
        answer, thinking, final = [], [], None
        printer = StreamPrinter(show_thinking) if not json_mode else None
        for event in stream_generate(backend, spec.request):
            if isinstance(event, GenerationStats):
                final = event
                continue
            (answer if event.channel == "answer" else thinking).append(event.text)
            if printer:
                printer.write(event.channel, event.text)
        if printer:
            printer.finish()
        described = backend.describe()  # while the model is still loaded
    finally:
        backend.close()

    empty = not "".join(answer).strip()
    if empty and not json_mode:
        warn(f"the answer is empty: {final.why_empty()}")
    if json_mode:
        emit_json(
            {
                "answer": "".join(answer).strip(),
                "thinking": "".join(thinking).strip() or None,
                "tier": spec.tier.name,
                "route": {
                    "tier": spec.route.tier,
                    "reason": spec.route.reason,
                    "prefix": spec.route.prefix,
                    "thinking": spec.request.thinking,
                },
                "model": {
                    "ref": spec.model_ref,
                    "path": str(resolved.path),
                    "backend": backend.name,
                    "library": backend.library,
                    **({"engine": described} if described else {}),
                },
                "notices": backend.notices,
                **({"empty_answer": final.why_empty()} if empty else {}),
                "stats": final.to_dict(),
            }
        )
    if stats:
        click.echo(_stats_text(spec, resolved.path, final, backend, described), err=True)


def _workers(values) -> tuple[str, ...]:
    """--rpc values, checked (a malformed one is a usage error before anything loads)."""
    from gemmactl.endpoints import parse_endpoints

    entries = tuple(part.strip() for value in values for part in value.split(",") if part.strip())
    parse_endpoints(entries)
    return entries


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        return ""
    # Bytes that are not UTF-8 stay visible as escapes, for the request's one text rule to name.
    return sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")


def _stats_text(spec, model_path, s, backend, engine: dict) -> str:
    route = spec.route
    thinking = "on" if spec.request.thinking else "off"
    lines = [
        f"route: tier {route.tier} ({route.reason}), thinking {thinking}",
        f"model: {spec.model_ref} ({model_path}) on {backend.name}"
        + (f", {backend.threads} threads" if backend.threads else "")
        + (f", library: {backend.library}" if backend.library else "")
        + f", prompt mode {s.prompt_mode}",
        f"load {s.load_s:.2f} s · ttft {s.ttft_s:.3f} s · prompt {s.prompt_tokens} tok "
        f"({_rate(s.prefill_tok_s)} tok/s) · generated {s.generated_tokens} tok · "
        f"decode {_rate(s.decode_tok_s)} tok/s · wall {s.wall_tok_s:.1f} tok/s · "
        f"peak RSS {format_size(s.peak_rss_bytes)} · stop: {s.stop_reason}",
    ]
    placement = backend.placement
    if placement is not None and placement.applied:
        lines.append(f"placement: {placement.reason}; llama.cpp {' '.join(placement.server_args)}")
    if engine:
        lines.append(_engine_text(engine))
    return "\n".join(lines)


def _engine_text(d: dict) -> str:
    """The int4 engine's choices in one line (runtime/engine/backend.EngineBackend.describe)."""
    capture = "CUDA graph" if d.get("cuda_graph") else "eager"
    if d.get("compiled"):
        capture = f"compiled, {capture}"
    kv = f", KV {d['kv_cache']}" if d.get("kv_cache", "bf16") != "bf16" else ""
    text = (f"engine: {d['device']} {d['dtype']}{kv}, {'/'.join(d['kernels'])}, {capture}; {d['placement']}; "
            f"weights {format_size(d['weights_device_bytes'])} {'on the GPU' if d['device'] != 'cpu' else 'in memory'}")
    if d.get("weights_host_bytes"):
        text += f", {format_size(d['weights_host_bytes'])} in host memory"
    if d.get("link_bytes_per_token"):
        text += f"; {format_size(d['link_bytes_per_token'])} over the link per token"
    if d.get("speculation"):
        p = d["speculation"]
        acceptance = "-" if p["acceptance"] is None else f"{p['acceptance']:.0%}"
        verdict = ("on" if p["speculating"] else "off (plain decoding is faster)") if not p.get("plain_because") \
            else f"off ({p['plain_because']})"
        text += (f"\nspeculation: draft {p['draft']}, {p['mode']} k≤{p['k_max']}, {verdict}; {p['rounds']} rounds, "
                 f"{p['kept']}/{p['drafted']} drafts kept ({acceptance}), {p['plain_steps']} plain steps")
        if p.get("predicted_speedup"):
            text += f", predicted {p['predicted_speedup']:.2f}× plain"
    if d.get("experts"):
        from gemmactl.runtime.engine.expert_settings import describe_counters

        text += f"\nexperts: {describe_counters(d['experts'])}"
    return text


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
