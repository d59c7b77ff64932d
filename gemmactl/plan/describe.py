"""What a model is, from its headers alone: architecture, parameters, quantization, context,
chat template and thinking, size, files, and where it came from (`gemmactl show`)."""

from __future__ import annotations

import json
from pathlib import Path

from gemmactl.plan.inventory import take_inventory
from gemmactl.store.refs import ResolvedModel

# Chat templates that take a thinking switch render it from this variable (Gemma 4's do).
THINKING_VARIABLE = "enable_thinking"


def describe_model(model: ResolvedModel) -> dict:
    """The facts `gemmactl show` prints, for a GGUF file, an int4-stream artifact or a checkpoint."""
    inventory = take_inventory(model.path)
    shape = inventory.shape
    params = sum(inventory.global_params.values()) + sum(sum(layer.params.values()) for layer in inventory.layers)
    template = chat_template(model)
    files = _files(model.path)
    artifact = model.artifact
    return {
        "ref": model.ref,
        "name": model.name,
        "path": str(model.path),
        "format": model.format,
        "architecture": shape.architecture,
        "params": params,
        "quantization": inventory.quantization,
        "layers": shape.n_layers,
        "sliding_layers": sum(shape.sliding),
        "sliding_window": shape.sliding_window,
        "context": shape.max_context,
        "experts": {"count": shape.n_experts, "used": shape.experts_used} if shape.n_experts else None,
        "per_layer_embeddings": bool(shape.per_layer_hidden),
        "kv_shared_layers": shape.kv_shared_layers,
        "chat_template": template is not None,
        "thinking": bool(template and THINKING_VARIABLE in template),
        "size_bytes": sum(size for _, size in files),
        "files": [{"name": name, "size": size} for name, size in files],
        "source": model.source,
        "revision": model.revision,
        "store_name": artifact.name if artifact else None,
        "created": artifact.created if artifact else None,
    }


def chat_template(model: ResolvedModel) -> str | None:
    """The model's own chat template: GGUF metadata, or the tokenizer files of a folder."""
    if model.format == "gguf":
        from gemmactl.formats.gguf_header import read_gguf_header

        value = read_gguf_header(model.path, tensors=False).metadata.get("tokenizer.chat_template")
        return str(value) if value else None
    folder = Path(model.path)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace")
    for name, key in (("chat_template.json", "chat_template"), ("tokenizer_config.json", "chat_template")):
        try:
            value = json.loads((folder / name).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, list):  # named templates: the default one
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(value, str) and value:
            return value
    return None


def _files(path: Path) -> list[tuple[str, int]]:
    if path.is_file():
        return [(path.name, path.stat().st_size)]
    return sorted((str(f.relative_to(path)), f.stat().st_size) for f in path.rglob("*") if f.is_file())
