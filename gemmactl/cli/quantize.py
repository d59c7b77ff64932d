"""`gemmactl quantize`: checkpoint → artifact, in exactly one output format."""

from __future__ import annotations

from pathlib import Path

import click

from gemmactl.cli import complete
from gemmactl.cli.output import emit_json, progress_enabled, step_progress, work_progress
from gemmactl.sizes import format_size

# flag name → the format it writes; the command refuses zero or several.
MODES = {"int4_stream": "--int4-stream", "gguf": "--gguf TYPE"}


@click.command("quantize")
@click.argument("model", shell_complete=complete.models)
@click.option("--int4-stream", "int4_stream", is_flag=True, help="Write an int4-stream artifact: group-wise int4 shards for the int4 backend.")
@click.option("--gguf", "gguf_type", metavar="TYPE", help="Write a GGUF of this llama.cpp type (Q4_K_M, Q8_0, Q6_K, Q5_K_M, Q4_0, IQ4_XS, F16, BF16 …) with the active build.")
@click.option("--out", type=click.Path(path_type=Path), metavar="PATH", help="Output folder (--int4-stream) or .gguf file (--gguf); default: in the store.")
@click.option("--imatrix", type=click.Path(dir_okay=False, exists=True, path_type=Path), metavar="FILE", help="--gguf: an importance matrix for llama-quantize.")
@click.option("--calibration", type=click.Path(dir_okay=False, exists=True, path_type=Path), metavar="TEXTFILE", help="Calibrate on this text first: --gguf computes llama.cpp's importance matrix; --int4-stream weighs each int4 group's fit by activation importance (loads the model once).")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="32", show_default=True, help="Weights per int4 group (one fp16 scale and zero each).")
@click.option("--shard-size", default="1GiB", show_default=True, metavar="SIZE", help="Largest shard file, e.g. 512MiB or 2GB.")
@click.option("--embeddings", type=click.Choice(["int4", "int8", "bf16"]), default="int8", show_default=True, help="How to store the token and per-layer embedding tables.")
@click.option("--sensitive", type=click.Choice(["int8", "int4"]), default="int8", show_default=True, help="How to store the attention v_proj and MLP down_proj weights (--int4-stream).")
@click.option("--head", type=click.Choice(["tied", "int4"]), default="tied", show_default=True, help="A tied model's output head (--int4-stream): the embedding table as stored, or an int4 copy of its own (about 0.6× the int8 table's GPU memory and reads; its fidelity: docs/benchmarks.md).")
@click.option("--force", is_flag=True, help="Replace an existing artifact, or start an unfinished one over.")
@click.option("--json", "json_mode", is_flag=True, help="Print the result as one JSON object (no progress bar).")
def quantize(model, int4_stream, gguf_type, out, imatrix, calibration, group_size, shard_size, embeddings, sensitive, head, force,
             json_mode):
    """Quantize a checkpoint into an artifact a gemmactl backend runs.

    MODEL is a Hugging Face checkpoint directory (config.json + safetensors) or the store name of
    one (from `gemmactl pull`). Pick the output format: --gguf TYPE (llama.cpp's converter and
    llama-quantize from the active `gemmactl build`) or --int4-stream. The result is registered
    in the store. An interrupted int4-stream run resumes from its finished shards when run again
    with the same settings.

    \b
    Examples:
      gemmactl quantize google/gemma-4-E2B-it --gguf Q4_K_M
      gemmactl quantize ./gemma-3-270m --int4-stream --group-size 32
      gemmactl quantize ./gemma-3-270m --int4-stream --calibration notes.txt
      gemmactl quantize google/gemma-4-E4B-it --int4-stream --shard-size 2GiB
      gemmactl quantize google/gemma-4-E4B-it --int4-stream --head int4
    """
    mode = _chosen_mode(int4_stream=int4_stream, gguf=gguf_type is not None)
    if mode == "gguf":
        if head != "tied":
            raise click.UsageError("--head goes with --int4-stream (llama-quantize picks the GGUF's output type)",
                                   ctx=click.get_current_context())
        _quantize_gguf(model, gguf_type, out, imatrix, calibration, force, json_mode)
        return
    if imatrix:
        raise click.UsageError("--imatrix goes with --gguf (--int4-stream takes --calibration TEXTFILE)", ctx=click.get_current_context())
    from gemmactl.sizes import parse_size
    from gemmactl.store import Store
    from gemmactl.store.quantize import quantize_int4_stream

    with work_progress("quantizing", progress_enabled(json_mode)) as progress:
        artifact, result = quantize_int4_stream(
            model,
            store=Store(),
            out=out,
            group_size=int(group_size),
            shard_size=parse_size(shard_size, option="--shard-size"),
            embeddings=embeddings,
            sensitive=sensitive,
            head=head,
            calibration=calibration,
            force=force,
            progress=progress,
        )
    totals = result.index["totals"]
    report = {
        "artifact": artifact.to_dict(),
        "shards_written": result.shards_written,
        "shards_reused": result.shards_reused,
        "seconds": round(result.seconds, 3),
        "tensors": totals["source_tensors"],
        "params": totals["params"],
        "size_bytes": totals["stored_bytes"],
        "bf16_bytes": totals["bf16_bytes"],
        "compression": totals["bf16_bytes"] / totals["stored_bytes"],
    }
    if json_mode:
        emit_json(report)
        return
    shards = result.shards_written + result.shards_reused
    reused = f", {result.shards_reused} kept from an earlier run" if result.shards_reused else ""
    calibrated = f", calibrated on {calibration.name}" if calibration else ""
    click.echo(
        f"Quantized {model} → {artifact.name} ({artifact.extra['scheme']}, embeddings {embeddings}, "
        f"sensitive {sensitive}{', head int4' if result.index['scheme'].get('head') else ''}{calibrated})"
    )
    click.echo(f"  {artifact.path}")
    click.echo(
        f"  {format_size(report['size_bytes'])} in {shards} shard{'s' if shards != 1 else ''}{reused}, "
        f"{report['compression']:.2f}× smaller than bf16, {report['tensors']} tensors, {result.seconds:.1f} s"
    )
    click.echo(f"Run it: gemmactl run --model {artifact.name} \"...\"")


def _chosen_mode(**flags) -> str:
    """The one output format asked for; a usage error (exit 2) for none or several."""
    chosen = [name for name, value in flags.items() if value]
    ctx = click.get_current_context(silent=True)
    if not chosen:
        raise click.UsageError(f"pick an output format: {' or '.join(MODES.values())}", ctx=ctx)
    if len(chosen) > 1:
        raise click.UsageError(f"pick one output format, not {' and '.join(MODES[c] for c in chosen)}", ctx=ctx)
    return chosen[0]


def _quantize_gguf(model, gguf_type, out, imatrix, calibration, force, json_mode) -> None:
    """The --gguf mode: validate cheaply first, then convert and quantize with the active build."""
    import sys
    import time

    from gemmactl.llamacpp.build import require_build
    from gemmactl.store import Store
    from gemmactl.store.quantize import plan_gguf, quantize_gguf

    if imatrix and calibration:
        raise click.UsageError("pass --imatrix or --calibration, not both", ctx=click.get_current_context())
    store = Store()
    job = plan_gguf(model, gguf_type, store, out, force)
    build = require_build(store, "quantize --gguf (its converter and llama-quantize)")

    start = time.monotonic()
    with step_progress(progress_enabled(json_mode), quiet=json_mode) as progress:
        artifact = quantize_gguf(job, build, store, imatrix=imatrix, calibration=calibration, progress=progress)
    if json_mode:
        emit_json(artifact.to_dict())
        return
    click.echo(f"Quantized {model} → {artifact.name} ({job.quant}, {format_size(artifact.size)}) in {time.monotonic() - start:.0f} s")
    click.echo(f"  {artifact.path}")
    click.echo(f"Run it: gemmactl run --model {artifact.name} \"...\"")
    sys.stdout.flush()
