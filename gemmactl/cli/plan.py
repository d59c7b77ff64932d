"""`gemmactl plan`: where each layer of a model goes, how fast it will decode, and (--verify) whether that holds."""

from __future__ import annotations

import click

from gemmactl.cli import complete
from gemmactl.cli.output import emit_json, table, warn
from gemmactl.sizes import format_size


class ContextLength(click.ParamType):
    """A number of tokens, or max."""

    name = "context"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or str(value).strip().lower() == "max":
            return value if isinstance(value, int) else "max"
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number of tokens nor max", param, ctx)


@click.command("plan")
@click.argument("model", shell_complete=complete.models)
@click.option("--vram", metavar="SIZE", help="GPU memory to plan for (default: the GPU's free memory, or the profile's).")
@click.option("--ram", metavar="SIZE", help="RAM to plan for (default: this machine's, or the profile's).")
@click.option("--context", type=ContextLength(), default="8192", show_default=True, metavar="N|max", help="Context length in tokens, per sequence; max: the longest the int4 engine's plan fits in the budget (it also names the longest that keeps every layer on the GPU).")
@click.option("--kv-cache", "kv_cache", metavar="MODE", help="The KV cache mode to size: bf16 (default), int8, tq4 or tq3 with --backend int4 (GLOBAL/WINDOWS, e.g. tq4/bf16, gives the sliding windows their own); f16 (default), q8_0 or q4_0 for llama.cpp.")
@click.option("--parallel", type=click.IntRange(min=1), default=1, show_default=True, metavar="N", help="Sequences served at once (each gets --context).")
@click.option("--backend", type=click.Choice(["llamacpp", "int4"]), default="llamacpp", show_default=True, help="Runtime the plan is for.")
@click.option("--quant", metavar="TYPE", help="For a checkpoint or a config-only folder: the quantization to plan for (Q4_K_M, Q8_0, BF16, int4-g32, ...; a config alone defaults to Q4_K_M).")
@click.option("--hardware", metavar="PROFILE", help="Plan for a shipped hardware profile (desktop-4g, dgx-spark) instead of this machine.")
@click.option("--profile", "remeasure", is_flag=True, help="Measure this machine again instead of using the cached profile.")
@click.option("--draft", "draft", metavar="MODEL", help="With --backend int4: keep room in the engine's map for this speculative draft (an int4-stream artifact), as `run --draft` loads it.")
@click.option("--draft-max", "draft_max", type=click.IntRange(min=1, max=16), metavar="N", help="With --draft: the most tokens it drafts a round (spare KV slots in both models; default 4).")
@click.option("--verify", is_flag=True, help="Run a short real decode with the plan and compare it with the prediction.")
@click.option("--rpc", "rpc", multiple=True, metavar="HOST:PORT[=SIZE]", help="Split the model across this machine and llama.cpp RPC workers lending SIZE each (without =SIZE: what the worker reports free); repeatable or comma-separated.")
@click.option("--json", "json_mode", is_flag=True, help="Print the plan as JSON (schema in docs/placement.md).")
@click.option("--out", "out", metavar="FILE", type=click.Path(dir_okay=False), help="Write the plan as JSON to FILE (atomically).")
def plan(model, vram, ram, context, kv_cache, parallel, backend, quant, hardware, remeasure, draft, draft_max, verify, rpc,
         json_mode, out):
    """Place a model's layers under a VRAM budget and predict its speed.

    MODEL is a store name, a .gguf file, an int4-stream folder, a Hugging Face checkpoint folder,
    or a folder holding only config.json, or that config.json (planned at Q4_K_M unless --quant
    says otherwise). Only headers are read.

    SIZE units are binary: 4G = 4GB = 4GiB = 4096M = 4 × 1024³ bytes; 3.5G works too.

    \b
    Examples:
      gemmactl plan embedded --vram 4G
      gemmactl plan ./gemma-4-26B-A4B --quant Q4_K_M --vram 8G --ram 32G --context 16384 --json
      gemmactl plan model.gguf --vram 4G --verify
    """
    from gemmactl.plan.report import build_plan, plan_dict

    if json_mode and out:
        raise click.UsageError("pass either --json or --out, not both")
    if out:
        from pathlib import Path

        folder = Path(out).expanduser().absolute().parent
        if not folder.is_dir():
            raise click.BadParameter(f"the folder {folder} does not exist; create it first or pick another",
                                     param_hint="--out")
    result = build_plan(
        model, vram=vram, ram=ram, context=context, parallel=parallel, backend=backend, quant=quant,
        hardware=hardware, remeasure=remeasure, rpc=tuple(rpc), kv_cache=kv_cache, draft=draft, draft_max=draft_max,
    )
    for message in result.warnings:
        warn(message)
    verified = None
    if verify:
        from functools import partial

        from gemmactl.generate import open_backend
        from gemmactl.plan.verify import verify_plan
        from gemmactl.store import Store
        from gemmactl.store.refs import GGUF, INT4_STREAM, resolve_model

        store = Store()
        announce = lambda what: click.echo(f"verify: {what}…", err=True)  # noqa: E731
        if backend == "int4":
            from gemmactl.plan.verify import verify_engine_plan

            if result.plan.inventory.source != "int4-stream":
                raise click.UsageError("--verify --backend int4 runs the engine, which loads int4-stream artifacts; "
                                       "make one with `gemmactl quantize MODEL --int4-stream` and plan that")
            model = resolve_model(str(result.model_path), store, accept=(INT4_STREAM,))
            verified = verify_engine_plan(result, partial(open_backend, model, store=store), store=store,
                                          announce=announce)
        else:
            model = resolve_model(str(result.model_path), store, accept=(GGUF,))
            verified = verify_plan(result.plan, partial(open_backend, model, store=store), store=store,
                                   announce=announce)
    data = plan_dict(result.plan, result, verified)
    if out:
        import json
        from pathlib import Path

        from gemmactl.fileio import atomic_write_text

        atomic_write_text(Path(out), json.dumps(data, indent=2) + "\n")
    if json_mode:
        emit_json(data)
    else:
        click.echo(render(data))
        if out:
            click.echo(f"plan written to {out}")
    if verified is not None and not verified.within_budget:
        from gemmactl.errors import GemmactlError

        raise GemmactlError(
            f"the verify run used {verified.peak_gpu_bytes / 2**30:.2f} GiB of GPU memory, over the "
            f"{result.plan.budget.vram_bytes / 2**30:.2f} GiB budget",
            hint="Plan with a smaller --vram or --context; docs/placement.md explains the margins.",
        )


def render(data: dict) -> str:
    """The plan as a person reads it: budget, totals, per-layer table, prediction, arguments."""
    hw, budget, totals, pred = data["hardware"], data["budget"], data["totals"], data["predicted"]
    lines = [
        f"model: {data['model']['path']} ({data['model']['architecture']}, {data['model']['quantization']}, "
        f"{data['model']['layers']} layers, from {data['model']['source']})",
        f"hardware: {hw['name']} — {hw['description']}",
        f"budget: VRAM {format_size(budget['vram_bytes'])}, RAM {format_size(budget['ram_bytes'])}; context {data['context']} × {data['parallel']}",
        "",
    ]
    engine = data.get("engine")
    rows = []
    for layer in data["layers"]:
        b = layer["bytes"]
        rows.append([
            str(layer["index"]), "sliding" if layer["sliding"] else "full",
            engine["layers"][layer["index"]] if engine else layer["device"],
            layer["experts_device"] or "-", f"{(b['attention'] + b['mlp'] + b['per_layer']) / 2**20:.1f}",
            f"{b['experts'] / 2**20:.1f}", f"{b['kv'] / 2**20:.1f}",
        ])
    lines.append(table(rows, ["layer", "attn", "device", "experts", "dense MiB", "experts MiB", "KV MiB"]))
    lines.append("")
    for item in data["globals"]:
        lines.append(f"{item['name']}: {item['device']} ({item['bytes'] / 2**20:.1f} MiB)")
    if engine:
        return "\n".join(lines + _render_engine(data, engine) + _render_verify(data))
    if data.get("rpc"):
        return "\n".join(lines + _render_rpc(data, data["rpc"]) + _render_verify(data))
    gpu, cpu = totals["gpu"], totals["cpu"]
    lines += [
        "",
        f"GPU: {format_size(totals['gpu_bytes'])} of {format_size(budget['vram_bytes'])} (weights {format_size(gpu['weights'])}, KV {format_size(gpu['kv'])}, "
        f"compute {format_size(gpu['compute'])}, reserve {format_size(gpu['reserve'])})",
        f"RAM: {format_size(totals['cpu_bytes'])} of {format_size(budget['ram_bytes'])} (weights {format_size(cpu['weights'])}, KV {format_size(cpu['kv'])}, "
        f"compute {format_size(cpu['compute'])})",
        f"predicted: decode {pred['decode_tok_s']:.1f} tok/s, time to first token {pred['ttft_s']:.3f} s "
        f"({pred['prompt_tokens']}-token prompt)",
        f"llama.cpp: {' '.join(data['llama_cpp_args']['argv'])}",
    ]
    for note in data["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines + _render_verify(data))


def _render_verify(data: dict) -> list[str]:
    """plan --verify's line: measured against predicted, and the budget."""
    if not data.get("verify"):
        return []
    v = data["verify"]
    line = (f"verify: measured decode {v['measured_decode_tok_s']:.1f} tok/s vs predicted {v['predicted_decode_tok_s']:.1f} "
            f"({v['ratio']:.2f}×); peak GPU memory {format_size(v['peak_gpu_bytes'])} of "
            f"{format_size(data['budget']['vram_bytes'])} ({'within' if v['within_budget'] else 'OVER'} budget)")
    layers = v.get("engine_layers")
    if layers and v["placement"] != "plan":
        line += "; the engine ran every layer on the CPU (no usable GPU here)"
    elif layers:
        line += (f"; the engine ran the plan's map: {layers['resident']} layers on the GPU, {layers['streamed']} "
                 f"streamed, {layers['host']} on the CPU")
    return [line]


def _render_engine(data: dict, engine: dict) -> list[str]:
    """The int4 engine's map: where its layers go, its memory and link traffic, its predicted rate."""
    counts, gpu = engine["counts"], engine["gpu_bytes"]
    parts = ", ".join(f"{name} {format_size(gpu[key])}" for key, name in (
        ("reserve", "reserve"), ("globals", "head"), ("tables", "tables"), ("kv", "KV"), ("work", "work"),
        ("layers", "layers"), ("staging", "staging"), ("experts", "expert cache"), ("draft", "draft")) if gpu.get(key))
    lines = [
        "",
        f"engine: {counts['resident']} layers on the GPU, {counts['streamed']} streamed, {counts['host']} on the CPU; "
        f"embedding tables {'in host memory' if engine['tables'] == 'host' else 'on the GPU'}",
        f"GPU: {format_size(gpu['total'])} of {format_size(data['budget']['vram_bytes'])} ({parts}); "
        f"least that works: {format_size(engine['minimum_vram_bytes'])}",
        f"host memory: {format_size(engine['host_bytes'])}; over the link per token: {format_size(engine['link_bytes_per_token'])}",
        f"predicted: decode {engine['decode_tok_s']:.1f} tok/s"
        + (" (a captured step reads every cache slot)" if engine["captured"] else
           f" with the caches full ({engine['context']} tokens), {engine['decode_tok_s_start']:.1f} at the start"),
    ]
    if engine.get("longest_resident_context") is not None:
        resident = engine["longest_resident_context"]
        lines.append(f"every layer on the GPU up to {resident:,} tokens of context" if resident else
                     "no context keeps every layer on the GPU at this budget")
    if engine.get("experts"):
        e = engine["experts"]
        lines.insert(-1, f"experts: {e['cached']} of {e['count']} cached on the GPU ({format_size(e['cache_bytes'])}, "
                         f"{format_size(e['expert_bytes'])} each); the rest in host memory (docs/experts.md)")
    return lines + [f"note: {note}" for note in data["notes"]]


def _render_rpc(data: dict, split: dict) -> list[str]:
    """The split across this machine and its RPC workers, and what the network costs per token."""
    lines = [""]
    for device in split["devices"]:
        span = f"layers {device['layers'][0]}–{device['layers'][1]}" if device["layers"] else "no layers"
        lines.append(f"{device['name']:9} {device['address']:22} {span:16} {format_size(device['bytes'])} "
                     f"of {format_size(device['capacity_bytes'])}")
    link = split["assumed_link"]
    lines += [
        f"network: {format_size(split['link_bytes_per_token'])} per token (assumed {link['bandwidth_bytes_s'] * 8 / 1e9:g} "
        f"Gbit/s, {link['latency_s'] * 1e3:g} ms per round trip, {link['round_trips_per_token']} round trips per worker)",
        f"predicted: decode {split['decode_tok_s']:.1f} tok/s",
        f"llama.cpp: {' '.join(split['server_args'])}",
    ]
    return lines + [f"note: {note}" for note in data["notes"]]
