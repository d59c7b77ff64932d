"""Bytes a tensor takes at an intended quantization, before the artifact exists.

The GGUF rules follow llama-quantize's choices for Gemma (llama-quant.cpp of the llama.cpp that
gemmactl builds): K-quant rows must be a multiple of 256 elements, else the type falls back to
a 32-block one; Q4_K_M gives attn_v and ffn_down Q6_K on "more bits" layers; a tied token
embedding is quantized like the output (Q6_K); per_layer_model_proj is never quantized; norms
stay F32. int4-stream sizes come from its own layout rules (formats/int4/spec.py).
"""

from __future__ import annotations

import math

from gemmactl.errors import InvalidOptionError
from gemmactl.formats.gguf_header import GGML_TYPES

_TYPE_ID = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}
# llama-quantize's fallback when a row is not a whole number of blocks.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q8_0": "F16", "Q4_0": "F16"}

GGUF_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "BF16", "F16")
INT4_QUANTS = ("int4-g32", "int4-g64", "int4-g128")
QUANTS = GGUF_QUANTS + INT4_QUANTS


def check_quant(name: str) -> str:
    """Normalise a --quant value (GGUF types upper case, int4-gNN lower case)."""
    for known in QUANTS:
        if name.lower() == known.lower():
            return known
    raise InvalidOptionError(f"unknown quantization '{name}'; plan knows {', '.join(QUANTS)}")


def _use_more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _ggml_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type type_name; shape in torch order (last dim = row)."""
    row = shape[-1] if shape else 1
    _, block, size = GGML_TYPES[_TYPE_ID[type_name]]
    while row % block:
        type_name = _FALLBACK.get(type_name, "F16")
        _, block, size = GGML_TYPES[_TYPE_ID[type_name]]
    return math.prod(shape) // block * size


def gguf_type_for(role: str, quant: str, *, layer: int | None, n_layers: int, tied_output: bool) -> str:
    """The ggml type llama-quantize gives a 2-D tensor of this role at this quantization."""
    if role == "norm":
        return "F32"
    if role == "per_layer_proj":
        return "BF16"
    if quant in ("BF16", "F16"):
        return quant
    if quant == "Q8_0":
        return "Q8_0"
    if role == "output" or (role == "token_embd" and tied_output):
        return "Q6_K" if quant != "Q8_0" else "Q8_0"
    if quant == "Q4_0":
        return "Q4_0"
    # Q4_K_M
    if role in ("attn_v", "ffn_down") and layer is not None and _use_more_bits(layer, n_layers):
        return "Q6_K"
    return "Q4_K"


def intended_bytes(role: str, shape: tuple[int, ...], quant: str, *, layer: int | None, n_layers: int, tied_output: bool) -> int:
    """Bytes of one tensor (an expert stack counts whole) at the intended quantization."""
    if quant.startswith("int4-"):
        return _int4_bytes(role, shape, int(quant.split("-g")[1]))
    if len(shape) < 2:
        return math.prod(shape) * 4
    return _ggml_bytes(gguf_type_for(role, quant, layer=layer, n_layers=n_layers, tied_output=tied_output), shape)


def _int4_bytes(role: str, shape: tuple[int, ...], group: int) -> int:
    from gemmactl.formats.int4.spec import part_sizes

    if len(shape) < 2 or math.prod(shape[-2:]) < 1024 or role == "router":
        return math.prod(shape) * 2  # kept as bf16
    if role in ("token_embd", "per_layer_embd"):
        scheme = "int8"  # the default embeddings policy
    else:
        scheme = "int4"
    stacks = shape[0] if len(shape) == 3 else 1
    per = sum(size for _, size in part_sizes(scheme, tuple(shape[-2:]), "bfloat16", group if scheme == "int4" else None))
    return stacks * per
