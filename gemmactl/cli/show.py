"""`gemmactl show`: what a model is, from its headers, for any model reference."""

from __future__ import annotations

import click

from gemmactl.cli import complete
from gemmactl.cli.output import emit_json
from gemmactl.sizes import format_size


@click.command("show")
@click.argument("model", shell_complete=complete.models)
@click.option("--json", "json_mode", is_flag=True, help="Print the facts as one JSON object.")
def show(model, json_mode):
    """Show a model's shape, size, quantization, template and origin.

    Architecture, layers, parameters, quantization, context, chat template and thinking, files,
    and where it came from. MODEL is `embedded`, a store name, or a path to a GGUF file, an int4-stream artifact or a
    Hugging Face checkpoint folder. Only headers are read.

    \b
    Examples:
      gemmactl show embedded
      gemmactl show ./gemma-4-E2B-it-Q4_K_M.gguf --json
    """
    from gemmactl.plan.describe import describe_model
    from gemmactl.store import Store
    from gemmactl.store.refs import ANY, resolve_model

    facts = describe_model(resolve_model(model, Store(), accept=ANY))
    if json_mode:
        emit_json(facts)
        return
    click.echo(render(facts))


def render(f: dict) -> str:
    """The facts as a person reads them."""
    experts = f" · {f['experts']['count']} experts, {f['experts']['used']} per token" if f["experts"] else ""
    extras = [f"{f['kv_shared_layers']} layers share KV"] if f["kv_shared_layers"] else []
    if f["per_layer_embeddings"]:
        extras.append("per-layer embeddings")
    template = ("yes, with a thinking switch" if f["thinking"] else "yes") if f["chat_template"] else \
        "none (a base model: gemmactl frames questions as Question:/Answer:)"
    files = len(f["files"])
    lines = [
        f["store_name"] or f["name"],
        f"  path          {f['path']}",
        f"  format        {f['format']}, {f['quantization']}",
        f"  architecture  {f['architecture']}, {f['layers']} layers ({f['sliding_layers']} sliding, window "
        f"{f['sliding_window']}){experts}" + (f" · {', '.join(extras)}" if extras else ""),
        f"  parameters    {f['params'] / 1e9:.2f} B" if f["params"] >= 1e9 else f"  parameters    {f['params'] / 1e6:.1f} M",
        f"  context       {f['context']:,} tokens",
        f"  chat template {template}",
        f"  size          {format_size(f['size_bytes'])} in {files} file{'s' if files != 1 else ''}",
        f"  source        {f['source']}" + (f" @ {f['revision'][:12]}" if f["revision"] else "")
        + (f" (added {f['created'][:10]})" if f["created"] else ""),
    ]
    return "\n".join(lines)
