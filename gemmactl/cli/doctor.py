"""`gemmactl doctor`: is this machine set up to run fast, and can we prove it?"""

from __future__ import annotations

import click

from gemmactl.cli import complete
from gemmactl.cli.output import emit_json
from gemmactl.sizes import format_size


@click.command("doctor")
@click.option("--no-proof", is_flag=True, help="Skip the short inference that shows where the layers ran.")
@click.option("--model", "model", metavar="GGUF", shell_complete=complete.models, help="Prove with this GGUF instead of the embedded model.")
@click.option("--json", "json_mode", is_flag=True, help="Print the report as JSON.")
def doctor(no_proof: bool, model: str | None, json_mode: bool) -> None:
    """Check the machine, the llama.cpp build, and where layers really run.

    Shows the GPU, VRAM, driver, CUDA, RAM and CPU features, the active build, and the result of a
    short inference of the embedded model with all layers offloaded, read from llama.cpp's own log.
    A CPU-only build on a GPU machine, or layers that stayed on the CPU, is a warning with the fix.
    """
    from gemmactl.generate import open_model
    from gemmactl.llamacpp.doctor import run_doctor
    from gemmactl.runtime.base import GpuPlacement
    from gemmactl.store import Store

    store = Store()
    proof = None
    if not no_proof:
        proof = open_model(model or "embedded", store, accept=("gguf",), context=512,
                           placement=GpuPlacement.all_on_gpu("doctor: every layer offered to the GPU"))
    report = run_doctor(store, proof_backend=proof)
    if json_mode:
        emit_json(report.to_dict())
        return
    m = report.machine
    click.echo(f"CPU      {m.cpu_model} ({m.cpu_cores} cores, {m.arch}); features: {' '.join(m.to_dict()['cpu_flags'])}")
    click.echo(f"RAM      {format_size(m.ram_bytes)}")
    if m.gpus:
        for gpu in m.gpus:
            click.echo(f"GPU {gpu.index}    {gpu.name}, {format_size(gpu.memory_bytes)}, driver {gpu.driver}, compute {gpu.compute_cap}")
    else:
        click.echo("GPU      none found (nvidia-smi)")
    click.echo(f"CUDA     {'nvcc ' + m.cuda_toolkit if m.cuda_toolkit else 'no toolkit (nvcc)'}")
    b = report.build
    if b:
        archs = f", sm_{','.join(b.gpu_archs)}" if b.gpu_archs else ""
        click.echo(f"Build    {b.build_id}: {b.backend}{archs}, {b.source['version']}, {b.compiler}, built {b.created}")
    else:
        click.echo("Build    none")
    p = report.proof
    if p:
        where = (f"{p.layers_offloaded}/{p.layers_total} layers on the GPU" if p.layers_total is not None
                 else "no GPU offload reported")
        buffers = ", ".join(f"{dev} {mib:.0f} MiB" for dev, mib in p.model_buffers_mib.items()) or "none reported"
        click.echo(f"Proof    library {p.library}: {where}; model buffers: {buffers}")
        click.echo(f"         answered {p.answer!r} at {p.decode_tok_s} tok/s decode")
        click.echo(f"         {p.system_info}")
    for warning in report.warnings:
        click.secho(f"WARNING: {warning}", fg="red", bold=True, err=True)
    if not report.warnings:
        click.echo("OK")
