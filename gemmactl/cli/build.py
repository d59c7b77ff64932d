"""`gemmactl build`: llama.cpp from source with the right kernels for this machine."""

from __future__ import annotations

import sys
import time

import click

from gemmactl.cli.output import emit_json, progress_enabled


@click.command("build")
@click.option("--source", "source_dir", metavar="DIR", type=click.Path(file_okay=False), help="A llama.cpp checkout (default: the tree bundled with the installed llama-cpp-python).")
@click.option("--backend", type=click.Choice(["auto", "cpu", "cuda", "vulkan"]), default="auto", show_default=True, help="auto: CUDA when nvcc and a GPU are present, else an optimized CPU build.")
@click.option("--cuda-arch", metavar="ARCH", help="CUDA compute capability to compile for, e.g. 90 (default: the GPU's own).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), metavar="N", help="Parallel compile jobs (default: all cores).")
@click.option("--force", is_flag=True, help="Build again even if this exact build exists.")
@click.option("--json", "json_mode", is_flag=True, help="Print the build manifest as JSON.")
def build(source_dir, backend, cuda_arch, jobs, force, json_mode):
    """Build llama.cpp from source with the right kernels for this machine.

    Builds llama-server, llama-cli, llama-quantize, llama-bench, llama-imatrix, llama-perplexity
    and the shared libraries into the store, under an id derived from source, backend and
    flags: building the same thing again is a no-op. The full log stays next to the build.
    """
    from pathlib import Path

    from gemmactl.llamacpp.build import plan_build, resolve_backend, run_build
    from gemmactl.llamacpp.source import bundled_source, user_source
    from gemmactl.machine import detect_machine
    from gemmactl.store import Store

    store = Store()
    machine = detect_machine()
    resolve_backend(backend, machine, cuda_arch)  # refuse a wrong backend before fetching anything
    source = user_source(Path(source_dir)) if source_dir else bundled_source(store)
    plan = plan_build(store, source, machine, backend=backend, cuda_arch=cuda_arch, jobs=jobs)
    if not json_mode:
        archs = f" for sm_{','.join(plan.gpu_archs)}" if plan.gpu_archs else ""
        click.echo(f"Building llama.cpp ({plan.source.version}) with the {plan.backend} backend{archs}, {plan.jobs} jobs → build {plan.build_id}", err=True)
    manifest, built = run_build(store, plan, force=force, progress=_status_line(progress_enabled(json_mode), json_mode))
    if json_mode:
        emit_json({**manifest.to_dict(), "built": built})
        return
    if built:
        click.echo(f"Built {manifest.build_id} in {manifest.build_seconds:.0f} s: {len(manifest.binaries)} tools in {manifest.lib_dir}")
    else:
        click.echo(f"Build {manifest.build_id} already exists ({manifest.lib_dir}); use --force to rebuild.")
    click.echo(f"Log: {plan.log_path}")


def _status_line(live: bool, quiet: bool):
    """Progress as one rewritten line with the elapsed time (terminal), or a line per step."""
    state = {"step": None, "shown": 0.0}

    def show(step: str, elapsed: float, line: str) -> None:
        if quiet:
            return
        if live:
            text = f"\r[{step} {int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {line[:90]}"
            sys.stderr.write(text.ljust(120)[:120])
            sys.stderr.flush()
        elif step != state["step"] or time.monotonic() - state["shown"] > 60:
            click.echo(f"[{step} {int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {line[:100]}", err=True)
            state["shown"] = time.monotonic()
        state["step"] = step

    return show
