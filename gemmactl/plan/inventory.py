"""What a model holds, per layer and by kind, read from headers or config only (never weights).

Sources: a GGUF header, safetensors headers (8-byte length + JSON), an int4-stream index.json,
or a config.json alone with an intended quantization. Kinds per decoder layer: `attention`,
`mlp` (dense FFN and router), `experts` (MoE stacks), `per_layer` (Gemma 4 per-layer input
gate/projection). Global tensors: `token_embd`, `per_layer_embd` (gathered row by row),
`per_layer_proj`, `output`, `output_norm`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from gemmactl.errors import InvalidOptionError, NotACheckpointError, UnsupportedModelError
from gemmactl.formats.int4.checkpoint import read_safetensors_header, safetensors_files
from gemmactl.formats.int4.spec import HEAD_NAME
from gemmactl.plan.model_shape import ModelShape, shape_from_config, shape_from_gguf, tensors_from_config
from gemmactl.plan.quant import check_quant, intended_bytes

LAYER_KINDS = ("attention", "mlp", "experts", "per_layer")
GLOBAL_KINDS = ("token_embd", "per_layer_embd", "per_layer_proj", "output", "output_norm")

_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class LayerInventory:
    """One decoder layer: bytes and parameter counts by kind, and what its KV cache holds."""

    index: int
    sliding: bool
    kv_heads: int  # 0 when the layer reads another layer's KV (Gemma 4 shared KV)
    head_dim_k: int
    head_dim_v: int
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LAYER_KINDS, 0))
    params: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LAYER_KINDS, 0))
    kv_value_bytes: float = 2.0  # bytes a cached K or V value takes (f16; llama.cpp's q8_0/q4_0 less)


@dataclass
class Inventory:
    """A model's placement-relevant facts: shapes, per-layer bytes, global tensors."""

    source: str  # gguf | safetensors | int4-stream | config
    path: str
    quantization: str
    shape: ModelShape
    layers: list[LayerInventory]
    globals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GLOBAL_KINDS, 0))
    global_params: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GLOBAL_KINDS, 0))
    kv_type: str = "f16"  # llama.cpp's cache type the layers' kv_value_bytes are for (with_kv_type)
    ignored_bytes: int = 0  # vision/audio towers: not part of text decoding

    @property
    def total_bytes(self) -> int:
        return sum(self.globals.values()) + sum(sum(layer.bytes.values()) for layer in self.layers)

    @property
    def output_tied(self) -> bool:
        return self.shape.tied_output


def _hf_kind(rest: str) -> str:
    if ".experts." in f".{rest}" or rest.startswith("experts."):
        return "experts"
    if rest.startswith(("mlp.", "router.")) or "feedforward" in rest:
        return "mlp"
    if "per_layer" in rest:
        return "per_layer"
    return "attention"


def _gguf_kind(rest: str) -> str:
    if "_exps" in rest:
        return "experts"
    if rest.startswith(("ffn", "pre_ffw", "post_ffw")):
        return "mlp"
    if rest.startswith(("inp_gate", "proj.", "post_norm")):
        return "per_layer"
    return "attention"


def _hf_global(name: str) -> str | None:
    if "vision" in name or "audio" in name or "embed_vision" in name or "embed_audio" in name:
        return None
    if name.endswith("embed_tokens_per_layer.weight"):
        return "per_layer_embd"
    if name.endswith("embed_tokens.weight"):
        return "token_embd"
    if "per_layer_model_projection" in name or "per_layer_projection_norm" in name:
        return "per_layer_proj"
    if name.endswith(HEAD_NAME):
        return "output"
    return "output_norm"


def _gguf_global(name: str) -> str:
    if name.startswith("per_layer_token_embd"):
        return "per_layer_embd"
    if name.startswith("token_embd"):
        return "token_embd"
    if name.startswith(("per_layer_model_proj", "per_layer_proj_norm")):
        return "per_layer_proj"
    if name == "output.weight":
        return "output"
    return "output_norm"


def hf_role(name: str, shape: tuple[int, ...]) -> str:
    """The role quant.py sizes a tensor by: norm, attn_v, ffn_down, router, token_embd, ..."""
    if len(shape) < 2:
        return "norm"
    if name.endswith("embed_tokens_per_layer.weight"):
        return "per_layer_embd"
    if name.endswith("embed_tokens.weight"):
        return "token_embd"
    if "per_layer_model_projection" in name:
        return "per_layer_proj"
    if name.endswith(HEAD_NAME):
        return "output"
    if "router" in name:
        return "router"
    if "v_proj" in name:
        return "attn_v"
    if "down_proj" in name:
        return "ffn_down"
    return "weight"


def _empty_layers(shape: ModelShape) -> list[LayerInventory]:
    return [
        LayerInventory(i, shape.sliding[i], shape.kv_heads[i], shape.head_dim_k[i], shape.head_dim_v[i])
        for i in range(shape.n_layers)
    ]


def _add_hf(inventory: Inventory, name: str, shape: tuple[int, ...], nbytes: int) -> None:
    numel = 1
    for dim in shape:
        numel *= dim
    match = _HF_LAYER.search(name)
    if match and "vision" not in name and "audio" not in name:
        layer = int(match.group(1))
        if layer >= len(inventory.layers):
            raise NotACheckpointError(f"tensor {name} is in layer {layer}, but the config has {len(inventory.layers)} layers")
        kind = _hf_kind(match.group(2))
        inventory.layers[layer].bytes[kind] += nbytes
        inventory.layers[layer].params[kind] += numel
        return
    kind = _hf_global(name)
    if kind is None:
        inventory.ignored_bytes += nbytes
        return
    inventory.globals[kind] += nbytes
    inventory.global_params[kind] += numel


def inventory_from_gguf(path: Path) -> Inventory:
    from gemmactl.formats.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    shape = shape_from_gguf(header)
    file_type = header.metadata.get("general.file_type")
    inventory = Inventory("gguf", str(path), _FILE_TYPES.get(file_type, f"file_type {file_type}"), shape, _empty_layers(shape))
    for tensor in header.tensors:
        match = _GGUF_LAYER.match(tensor.name)
        if match:
            layer = inventory.layers[int(match.group(1))]
            kind = _gguf_kind(match.group(2))
            layer.bytes[kind] += tensor.nbytes
            layer.params[kind] += tensor.numel
        else:
            kind = _gguf_global(tensor.name)
            inventory.globals[kind] += tensor.nbytes
            inventory.global_params[kind] += tensor.numel
    return inventory


# llama_ftype values of the types plan names (llama.h).
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               30: "IQ4_XS", 32: "BF16"}


def _read_config(path: Path) -> dict:
    return _read_config_file(path / "config.json")


def _read_config_file(file: Path) -> dict:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NotACheckpointError(f"{file} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise NotACheckpointError(f"{file} is not a JSON object")
    return config


DEFAULT_CONFIG_QUANT = "Q4_K_M"  # what a config-only plan sizes by default: the fast tier's GGUF type


def inventory_from_checkpoint(path: Path, quant: str | None, *, config_only: bool = False) -> Inventory:
    """A directory with config.json: its safetensors headers, or the config alone when there are none.

    quant None sizes a checkpoint as its files are (bf16), and a config alone at
    DEFAULT_CONFIG_QUANT; a quantization sizes what `gemmactl quantize` would make of it.
    config_only: ignore any weight files (path may then also be the config.json itself).
    """
    path = Path(path)
    if path.is_file():
        config, path, config_only = _read_config_file(path), path.parent, True
    else:
        config = _read_config(path)
    shape = shape_from_config(config)
    files = [] if config_only else safetensors_files(path)
    quant = check_quant(quant) if quant else None
    if not files and quant is None:
        quant = DEFAULT_CONFIG_QUANT
    tensors: list[tuple[str, tuple[int, ...], int | None]] = []  # (name, shape, bytes as stored)
    if files:
        for file in files:
            if not file.is_file():
                raise NotACheckpointError(f"the checkpoint index lists {file.name}, which is missing")
            for name, info in read_safetensors_header(file)[0].items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                tensors.append((name, tuple(int(d) for d in info["shape"]), int(end) - int(start)))
        source = "safetensors"
    else:
        tensors = [(name, dims, None) for name, dims in tensors_from_config(shape)]
        source = "config"
    inventory = Inventory(source, str(path), quant or "bf16", shape, _empty_layers(shape))
    for name, dims, stored in tensors:
        if quant is None:
            nbytes = stored
        else:
            match = _HF_LAYER.search(name)
            nbytes = intended_bytes(
                hf_role(name, dims), dims, quant,
                layer=int(match.group(1)) if match else None, n_layers=shape.n_layers, tied_output=shape.tied_output,
            )
        _add_hf(inventory, name, dims, nbytes)
    return inventory


def inventory_from_int4(path: Path) -> Inventory:
    from gemmactl.formats.int4.reader import read_index

    index = read_index(path)
    shape = shape_from_config(index.get("config") or {})
    if any(record["name"] == HEAD_NAME for record in index.get("tensors", [])):
        shape = replace(shape, tied_output=False)  # a head of its own (`quantize --head int4`), whatever the config says
    inventory = Inventory("int4-stream", str(path), str(index.get("scheme", {}).get("name", "int4")), shape, _empty_layers(shape))
    for record in index.get("tensors", []):
        dims = tuple(int(d) for d in record["shape"])
        _add_hf(inventory, str(record["name"]), dims, int(record["nbytes"]))
    return inventory


def take_inventory(path: Path, *, quant: str | None = None) -> Inventory:
    """The inventory of a GGUF file, an int4-stream artifact, a checkpoint or config directory, or a config.json."""
    from gemmactl.formats import GGUF, INT4_STREAM, detect_format

    path = Path(path)
    kind = detect_format(path)
    if kind in (GGUF, INT4_STREAM) and quant:
        raise InvalidOptionError(
            f"{path} is already a {kind} artifact; --quant applies to checkpoints and config-only directories",
            hint="Drop --quant.",
        )
    if kind == GGUF:
        return inventory_from_gguf(path)
    if kind == INT4_STREAM:
        return inventory_from_int4(path)
    if (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".json"):
        return inventory_from_checkpoint(path, quant)
    if path.is_dir():
        raise NotACheckpointError(f"{path} has neither a config.json, an int4-stream index.json, nor is it a GGUF file")
    raise UnsupportedModelError(f"{path} is neither a GGUF file nor a model directory")


def with_kv_type(inventory: "Inventory", mode: str | None) -> "Inventory":
    """The inventory with llama.cpp's KV cache type `mode` (f16, q8_0, q4_0; None: f16) sizing its caches."""
    from dataclasses import replace

    from gemmactl.runtime.engine.kv_modes import LLAMACPP_VALUE_BYTES

    if mode is None:
        return inventory
    size = LLAMACPP_VALUE_BYTES[mode]
    return replace(inventory, layers=[replace(layer, kv_value_bytes=size) for layer in inventory.layers], kv_type=mode)
