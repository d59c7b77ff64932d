"""`gemmactl bench`: decode-only and wall-clock speed, side by side with alternatives."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import click

from gemmactl.cli import complete
from gemmactl.cli.output import emit_json, progress_enabled
from gemmactl.cli.run import expert_options
from gemmactl.cli.types import FiniteFloatRange


@click.command("bench")
@click.option("--recipe", "recipe", metavar="FILE|NAME", shell_complete=complete.recipes, help="Recipe of tiers (default: built-in 'default', or $GEMMACTL_RECIPE).")
@click.option("--model", "model", metavar="REF", shell_complete=complete.models, help="A .gguf path or store name instead of the tier's model.")
@click.option("--tier", "tier", metavar="NAME", shell_complete=complete.tiers, help="The tier whose model and settings to measure (default: the recipe's default).")
@click.option("--prompts", "prompts", default="builtin", show_default=True, metavar="builtin|SET,...|FILE",
              help="builtin (all sets), sets among short, long-prefix, code, prose, or a file (one prompt per line, or .jsonl).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True, metavar="N", help="Tokens to generate per request.")
@click.option("--concurrency", "concurrency", default="1", show_default=True, metavar="LIST",
              help="Concurrent requests, e.g. 1,16,64; any level above 1 runs against llama-server with that many slots.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, metavar="N", help="Repeats of every measurement.")
@click.option("--warm-prefix", is_flag=True, help="Also send a ≥ 2k-token conversation twice: cold, then warm TTFT.")
@click.option("--compare", "compare", multiple=True, metavar="TARGET",
              help="Also measure llama-cpp-python, llama-server, hf-generate or accelerate, interleaved (repeatable).")
@click.option("--gguf", "gguf", metavar="REF", shell_complete=complete.models,
              help="The same model as GGUF, for the llama.cpp targets when --model is an int4 artifact.")
@click.option("--hf-model", "hf_model", metavar="DIR|NAME", help="Hugging Face checkpoint of the same model, for hf-generate and accelerate.")
@click.option("--vram", "vram", metavar="SIZE", help="VRAM cap for accelerate's device_map=\"auto\", e.g. 4GiB (default: the whole GPU).")
@click.option("--draft", "draft", metavar="GGUF", shell_complete=complete.models,
              help="Draft model (store name or .gguf path, same vocabulary) for speculative decoding in llama-server; "
                   "reports the acceptance rate. Needs --compare llama-server or --concurrency above 1.")
@click.option("--draft-max", "draft_max", type=click.IntRange(min=1), metavar="N",
              help="Most tokens the draft proposes per step (default: the tier's speculative draft_max, else 8).")
@expert_options
@click.option("--context", type=click.IntRange(min=128), metavar="N", help="Context size (default: the tier's, raised to fit the prompts).")
@click.option("--timeout", "timeout", type=FiniteFloatRange(min=1), default=600, show_default=True, metavar="S",
              help="Time limit in seconds for each concurrency level.")
@click.option("--rpc", "rpc", multiple=True, metavar="HOST:PORT[=SIZE]", help="RPC workers for gemmactl's own target (instead of the tier's rpc); it is then measured alone.")
@click.option("--json", "json_mode", is_flag=True, help="Print the whole result as one JSON object.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), metavar="DIR", help="Write result.json (and plot.png) here.")
@click.option("--plot", is_flag=True, help="With --out: also write plot.png (tok/s vs concurrency, cold vs warm TTFT).")
def bench(recipe, model, tier, prompts, max_tokens, concurrency, repeat, warm_prefix, compare, gguf, hf_model, vram,
          draft, draft_max, expert_cache, expert_policy, expert_prefetch, expert_cpu_share, context, timeout, rpc, json_mode, out, plot):
    """Measure decode-only and wall-clock speed, optionally side by side.

    Every run reports load time, time to first token, prefill, decode-only and wall-clock tok/s
    and peak memory, with a manifest (versions, build, machine, model sha256, flags). --compare
    runs alternatives on the same model and settings, interleaved, and prints ratios pair by pair.
    With --draft, llama-server decodes speculatively and each run reports its acceptance rate.
    An MoE model on the int4 engine also reports its expert cache: hit rate, bytes over the link
    per decoded token, share computed on the CPU.

    \b
    Examples:
      gemmactl bench --max-tokens 64 --repeat 5
      gemmactl bench --compare llama-cpp-python --compare llama-server --warm-prefix
      gemmactl bench --concurrency 1,4,16 --out results --plot
      gemmactl bench --compare llama-server --draft draft.gguf --draft-max 8
      gemmactl bench --model e2b-int4 --gguf e2b-Q4_K_M --compare llama-server
      gemmactl bench --model 26b-a4b-int4 --expert-cache 2G --expert-policy lru
    """
    from gemmactl.bench.report import plot_in_child, render_text, sections, write_result
    from gemmactl.bench.runner import BenchConfig, check_config, parse_concurrency, run_bench
    from gemmactl.cli.run import _workers
    from gemmactl.errors import InvalidOptionError
    from gemmactl.store import Store

    if plot and out is None:
        raise InvalidOptionError("--plot writes plot.png into --out DIR", hint="Pass --out DIR as well.")
    vram_bytes = None
    if vram:
        from gemmactl.sizes import parse_size

        vram_bytes = parse_size(vram, option="--vram")
    ctx = click.get_current_context()
    config = BenchConfig(
        recipe=recipe, model=model, tier=tier, prompts=prompts, max_tokens=max_tokens,
        concurrency=parse_concurrency(concurrency), repeat=repeat, warm_prefix=warm_prefix, compare=list(compare),
        gguf=gguf, hf_model=hf_model, vram_bytes=vram_bytes, draft=draft, draft_max=draft_max, context=context, timeout_s=timeout,
        rpc=_workers(rpc), experts=(expert_cache, expert_policy, expert_prefetch, expert_cpu_share), flags=dict(ctx.params),
        argv=_command_args(ctx),
    )
    check_config(config)
    if plot:
        _require_matplotlib()
    store = Store()
    log_dir = (out / "logs") if out else store.home / "bench" / "logs"
    with bench_progress(progress_enabled(json_mode)) as progress:
        result = run_bench(config, store, log_dir=log_dir, progress=progress)
    if out:
        write_result(result, out)
        if plot:
            plot_in_child(out)
    if json_mode:
        emit_json(result)
        return
    click.echo(render_text(sections(result)))
    if out:
        click.echo(f"\nWrote {out / 'result.json'}" + (f" and {out / 'plot.png'}" if plot else ""))


def _command_args(ctx: click.Context) -> list[str]:
    """The options that differ from their defaults, as a command line that repeats this run."""
    args = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or value is False or value == () or value == param.default:
            continue
        option = param.opts[0]
        for item in value if isinstance(value, tuple) else [value]:
            args += [option] if value is True else [option, str(item)]
    return args


def _require_matplotlib() -> None:
    from gemmactl.errors import InvalidOptionError

    from importlib.util import find_spec

    # Only looked up here: importing matplotlib beside a CUDA build of llama.cpp can crash the
    # process, so the chart is drawn in a child process once the measurements are done.
    if find_spec("matplotlib") is None:
        raise InvalidOptionError(
            "--plot needs matplotlib, which is not installed", hint="Install it: pip install 'gemmactl[bench]'"
        ) from None


@contextmanager
def bench_progress(enabled: bool):
    """One bar over the whole run, naming the step it is on."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=0, leave=False, file=sys.stderr, bar_format="{n_fmt}/{total_fmt} |{bar}| {desc} [{elapsed}<{remaining}]")

    def update(message: str, done: int, total: int) -> None:
        bar.total = total
        bar.set_description_str(message[:60], refresh=False)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()
