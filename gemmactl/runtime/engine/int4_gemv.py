"""One token times int4-stream matrices on CUDA, in Triton kernels that read the artifact's own layout.

The artifact stores int4 codes nibble-packed two to a byte (low nibble first) with an fp16 scale and
zero per group of g columns: w = q·scale + zero. These kernels read that layout in place, so an
expert needs no repack and can be read wherever it lies, in device memory or in pinned host memory
(CUDA maps pinned host memory into the device's address space): `grouped` multiplies one token by
the k experts a MoE layer chose, found through a table of addresses, in one launch, with no host
decision between the router and the experts. Each program owns a block of rows and walks K a tile
of whole groups at a time; per group it sums q·x over the group's columns and adds
scale·Σqx + zero·Σx (the zero term needs only the token's own sum per group, shared by every row).
Triton is the well-kept route to a kernel of this shape (it ships with torch's CUDA wheels);
torchao's and gemlite's int4 GEMVs take their own layouts, which would bring a repack back and
could not read a table of addresses. Measured (benchmarks/int4_gemv_sweep.py): for a 26B-A4B
layer's 8 experts, 44 µs grouped against 122 for tinygemm one expert at a time on an H100 (87
against 117 on the H200 before the codes were read in vectors); on single dense matrices tinygemm
stays faster (runtime/engine/kernels.py says where each runs). As for the
int8 GEMV (runtime/engine/int8_gemv.py), tiles are fixed by shape rather than left to Triton's
autotuner (which would allocate a flush buffer inside the plan's budget), and matrices with few row
blocks split K. Custom ops, so torch.compile keeps them whole and a CUDA graph replays them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from gemmactl.runtime.engine.gemv_common import available, split_k, tile_setting  # noqa: F401 (available: kernels.py)
from gemmactl.runtime.engine.gemv_common import sms as _sms

TILE_ENV = "GEMMACTL_INT4_TILE"  # "ROWS,GROUPS,WARPS[,PROGRAMS]": one tile for every shape, to measure one


class Tile(NamedTuple):
    rows: int  # BLOCK_N: rows a program owns
    groups: int  # BLOCK_G: whole groups it reads per iteration (BLOCK_G × g columns)
    warps: int
    programs_per_sm: int = 4  # fewer row blocks than this per multiprocessor: K is split to make more


# benchmarks/int4_gemv_sweep.py on the H200 (49 tiles, every int4 shape of E2B and 26B-A4B, groups
# of 32): 4 rows × 16 groups × 4 warps was the best single tile over 26B-A4B's shapes and within
# 1.42× of each shape's best on E2B's (dense matrices run in tinygemm, runtime/engine/kernels.py).
# The experts' grouped products run in this tile; once the kernel read their codes in vectors, a
# 26B-A4B layer's 8 experts took 44.0 µs in 8 rows × 16 groups × 4 warps with no K split (one
# program a multiprocessor: a layer's 8 matrices give it programs enough) against 51.0 in the tile
# before, and 86.0 before the vectors (an H100, docs/benchmarks.md).
DEFAULT_TILE = Tile(8, 16, 4, 1)


@functools.cache
def tile_for(out_features: int, in_features: int) -> Tile:
    """The tile for a matrix: TILE_ENV when set (to measure one), else the measured default."""
    forced = tile_setting(TILE_ENV, Tile, "ROWS,GROUPS,WARPS[,PROGRAMS]", "8,8,4")
    return DEFAULT_TILE if forced is None else forced


def split(out_features: int, groups: int, sms: int, tile: Tile) -> tuple[int, int]:
    """(splits, groups per split): too few row blocks to give every multiprocessor the tile's
    programs splits K, and the partial sums are added after."""
    return split_k(out_features, tile.rows, groups, tile.groups, sms, tile.programs_per_sm)


@functools.cache
def _kernels():
    """(triton, the GEMV, the grouped GEMV, the decoder): Triton's jit functions live in their own
    module (they find each other through its globals), imported only where a kernel runs."""
    import triton

    from gemmactl.runtime.engine import int4_triton as k

    return triton, k.int4_gemv, k.int4_gemv_grouped, k.int4_dequantize


@torch.library.custom_op("gemmactl::int4_gemv", mutates_args=())
def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              in_features: int) -> torch.Tensor:
    """x [in] (one token) · (qweight [out, Cp/2] uint8, scales and zeros [out, G] fp16) → [out] in x's dtype."""
    triton, kernel, _, _ = _kernels()
    out_features, groups = scales.shape
    group = qweight.shape[1] * 2 // groups
    tile = tile_for(out_features, in_features)
    splits, per = split(out_features, groups, _sms(x.device), tile)
    if splits == 1:
        y = torch.empty(out_features, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty((splits, out_features), dtype=torch.float32, device=x.device)
    kernel[(triton.cdiv(out_features, tile.rows), splits)](
        x.contiguous(), qweight, scales, zeros, y, out_features, in_features, groups, qweight.stride(0),
        scales.stride(0), per, BLOCK_N=tile.rows, BLOCK_G=tile.groups, GROUP=group, num_warps=tile.warps)
    return y if splits == 1 else _parts_sum(y).to(x.dtype)


def _parts_sum(parts: torch.Tensor) -> torch.Tensor:
    """The K parts [splits, ...] added in a fixed order, one after another: the same bits whatever
    the shape beside (one matrix or a layer's k), where a reduction's order could follow it."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


@int4_gemv.register_fake
def _(x, qweight, scales, zeros, in_features):
    return x.new_empty(scales.shape[0])


@torch.library.custom_op("gemmactl::int4_gemv_grouped", mutates_args=())
def grouped(x: torch.Tensor, addresses: torch.Tensor, out_features: int, in_features: int,
            group_size: int) -> torch.Tensor:
    """x [M, in] or [in] (shared) · M matrices of one shape, each at addresses [M, 3] int64 (its codes,
    scales and zeros, laid out as int4_gemv takes them, contiguous, each starting 16-byte aligned:
    the kernel reads them in vectors) → [M, out] in x's dtype."""
    triton, _, kernel, _ = _kernels()
    matrices = addresses.shape[0]
    groups = -(-in_features // group_size)
    tile = tile_for(out_features, in_features)
    # K split as for one matrix of the shape, so each product is summed exactly as int4_gemv sums it
    # (a step captured with the experts grouped gives the eager step's numbers bit for bit).
    splits, per = split(out_features, groups, _sms(x.device), tile)
    y = torch.empty((splits, matrices, out_features), dtype=x.dtype if splits == 1 else torch.float32,
                    device=x.device)
    x = x.contiguous()
    stride_x = 0 if x.dim() == 1 else x.shape[1]
    kernel[(triton.cdiv(out_features, tile.rows) * matrices, splits)](
        x, stride_x, addresses, y, out_features, in_features, groups,
        groups * group_size // 2, groups, per, matrices, BLOCK_N=tile.rows, BLOCK_G=tile.groups, GROUP=group_size,
        num_warps=tile.warps)
    return y[0] if splits == 1 else _parts_sum(y).to(x.dtype)


@grouped.register_fake
def _(x, addresses, out_features, in_features, group_size):
    return x.new_empty((addresses.shape[0], out_features))


# copy_rows: words a program moves per turn of its loop (8 KiB), and in all (64 KiB: a 26B-A4B
# expert's 3.7 MB row in 57 programs, so many reads are in flight over the link at once).
ROW_COPY_BLOCK = 2048
ROW_COPY_PER = 16384


def copy_rows(sources: torch.Tensor, targets: torch.Tensor, flags: torch.Tensor, nbytes: int,
              anchor: torch.Tensor) -> None:
    """Copy M rows of nbytes each on the device: row m from the address sources[m] to targets[m]
    ([M] int64), where flags[m] ([M] bool) is set. A source may be a pinned host row, read in place
    over the link. Which rows move is decided on the device, so this runs inside a captured step
    (graph_moe.TableDecode's fetch of the next layer's guessed experts): a copy node's addresses are
    fixed when it is captured and the copy engine cannot be told on the device what to move, so a
    kernel does it, in Triton (the project's kernels' language) rather than hand-written CUDA.
    nbytes is a multiple of 16 and every address 16-byte aligned; anchor is an int32 tensor that
    the addresses are taken relative to (any 16-byte aligned one: the arena's device rows)."""
    import triton

    from gemmactl.runtime.engine import int4_triton

    words = nbytes // 4
    int4_triton.copy_rows[(sources.shape[0], triton.cdiv(words, ROW_COPY_PER))](
        sources, targets, flags, anchor, words, ROW_COPY_PER, BLOCK=ROW_COPY_BLOCK, num_warps=4)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The matrix [out, in] in dtype, decoded on the device in one launch (several tokens' path:
    decoded a block of rows at a time, then cuBLAS)."""
    triton, _, _, kernel = _kernels()
    out_features, groups = scales.shape
    group = qweight.shape[1] * 2 // groups
    w = torch.empty((out_features, in_features), dtype=dtype, device=qweight.device)
    rows, block_groups = 8, max(1, 256 // group)
    kernel[(triton.cdiv(out_features, rows), triton.cdiv(groups, block_groups))](
        qweight, scales, zeros, w, out_features, in_features, groups, qweight.stride(0), scales.stride(0), w.stride(0),
        BLOCK_N=rows, BLOCK_G=block_groups, GROUP=group, num_warps=4)
    return w
