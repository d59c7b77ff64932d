"""KV cache modes: their names and sizes (no torch here: the planner and the CLI read these).

- bf16: keys and values as computed (the engine's compute dtype); the default.
- int8: each key and value vector (one head, one position) as int8 with an fp16 scale.
- tq4, tq3: TurboQuant-style (arXiv 2504.19874, its MSE variant): each vector is turned by a
  fixed random rotation (a Hadamard matrix with random signs), which makes its coordinates
  near-Gaussian, then every coordinate is quantized on its own to the 16 or 8 levels of the
  Lloyd-Max quantizer for a Gaussian, scaled by the vector's RMS (fp16). 4 or 3 bits a
  coordinate plus 16 bits a vector.

The llama.cpp tiers take their own cache types from the same recipe field (f16, q8_0, q4_0:
llama.cpp's -ctk/-ctv, with flash attention for a quantized V).
"""

from __future__ import annotations

ENGINE_MODES = ("bf16", "int8", "tq4", "tq3")
LLAMACPP_MODES = ("f16", "q8_0", "q4_0")
DEFAULT_MODE = "bf16"
_BITS = {"int8": 8, "tq4": 4, "tq3": 3}
# llama.cpp's cache types, bytes a value: f16, and ggml's blocks of 32 values (q8_0: 32 int8 and an
# f16 scale; q4_0: 16 bytes of nibbles and an f16 scale).
LLAMACPP_VALUE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def vector_bytes(mode: str, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes one key or value vector of head_dim coordinates takes in the engine's cache."""
    if mode == "bf16":
        return head_dim * dtype_bytes
    return (head_dim * _BITS[mode] + 7) // 8 + 2  # packed codes and an fp16 scale


def compression(mode: str, head_dim: int) -> float:
    """How many times smaller than bfloat16 the mode keeps a vector."""
    return head_dim * 2 / vector_bytes(mode, head_dim)


def check_mode(mode: str | None, backend: str, *, option: str = "--kv-cache") -> str | None:
    """The mode for a backend ("int4" engine or "llamacpp"), or a one-line error listing the modes."""
    from gemmactl.errors import InvalidOptionError

    if mode is None:
        return None
    known = ENGINE_MODES if backend == "int4" else LLAMACPP_MODES
    if mode not in known:
        where = "the int4 engine" if backend == "int4" else "llama.cpp"
        raise InvalidOptionError(f"{option} {mode!r} is not a KV cache mode of {where}",
                                 hint=f"Use one of: {', '.join(known)}.")
    return mode
