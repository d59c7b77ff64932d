"""What the engine's Triton GEMVs (int8_gemv.py, int4_gemv.py) share: a tile forced by an
environment setting, the K split for matrices with few row blocks, the device's multiprocessors,
and whether Triton is there."""

from __future__ import annotations

import functools
import os

import torch


def tile_setting(env: str, tile_type, fields: str, example: str):
    """The tile env forces ("ROWS,K,WARPS[,MORE]", the first three powers of two, the rest at least 1),
    or None when unset."""
    setting = os.environ.get(env, "").strip()
    if not setting:
        return None
    try:
        tile = tile_type(*(int(v) for v in setting.split(",")))
    except (TypeError, ValueError):
        tile = None
    if tile is None or not all(v > 0 and v & (v - 1) == 0 for v in tile[:3]) or any(v < 1 for v in tile[3:]):
        raise ValueError(f"{env}={setting!r}: expected {fields}, the first three powers of two (e.g. {example}); "
                         "unset it for the engine's own tiles")
    return tile


def split_k(out_features: int, rows: int, k: int, k_tile: int, sms: int, programs_per_sm: int) -> tuple[int, int]:
    """(splits, K units per split) for a matrix of out_features rows in blocks of `rows` and k units
    of K in tiles of k_tile: too few row blocks to give every multiprocessor programs_per_sm programs
    splits K, and the partial sums are added after."""
    row_blocks = -(-out_features // rows)
    tiles = -(-k // k_tile)
    splits = max(1, min(tiles, -(-programs_per_sm * sms // row_blocks)))
    per = -(-tiles // splits) * k_tile
    return -(-k // per), per


def sms(device: torch.device) -> int:
    """The device's multiprocessors (1 off CUDA: Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def dot_dtype():
    """The dtype the kernels hand tl.dot: bfloat16, as the engine computes; float16 under Triton's
    CPU interpreter (the tests' way to run a kernel without a GPU), whose tl.dot takes bfloat16
    bits for integers (Triton 3.8)."""
    import triton.language as tl

    return tl.float16 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


def available(device) -> bool:
    """Whether a Triton GEMV can run on device (CUDA with Triton importable)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
