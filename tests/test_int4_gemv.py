"""The Triton int4 kernels (runtime/engine/int4_gemv.py) against the dequantized matrices.

On a GPU (the gpu tier): one token times a matrix, the grouped kernel over several matrices found
through a table of addresses (bit for bit the single kernel's numbers), the same read in place from
pinned host memory, the decoder, and the row copies a captured step's fetch makes. Without a GPU,
where Triton is installed, the same checks run in Triton's interpreter on the CPU (in a
subprocess, since the interpreter is chosen when the kernels are first compiled); where it is
not, they skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# (rows, columns, group): shapes with whole and partial tiles, columns not a multiple of a tile (704,
# as 26B-A4B's experts' down_proj), a group that is not the default.
SHAPES = [(64, 256, 32), (40, 176, 32), (33, 704, 32), (16, 128, 64), (8, 96, 16)]


def _matrix(rows, cols, group, device):
    from gemmactl.formats.int4.quant import dequantize_int4, quantize_int4

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols + group))
    q, s, z = quantize_int4(w, group)
    return q.to(device), s.to(device), z.to(device), dequantize_int4(q, s, z, cols, torch.float32).to(device)


# 26B-A4B's experts (gate_up joined: 1,408 × 2,816, its K split in two on an H100 or H200; down:
# 2,816 × 704), on the GPU only (Triton's interpreter takes minutes over them).
EXPERT_SHAPES = [(1408, 2816, 32), (2816, 704, 32)]


def check_kernels(device: str) -> None:
    """Every check, on device ("cuda", or "cpu" under Triton's interpreter)."""
    from gemmactl.runtime.engine import int4_gemv

    for rows, cols, group in SHAPES + (EXPERT_SHAPES if device == "cuda" else []):
        q, s, z, w = _matrix(rows, cols, group, device)
        x = torch.randn(cols, generator=torch.Generator().manual_seed(cols)).bfloat16().to(device)
        reference = w @ x.float()
        y = int4_gemv.int4_gemv(x, q, s, z, cols).float()
        # the products and sums in float32, the output rounded to bfloat16 (2^-8 relative)
        assert (y - reference).abs().max() <= 2 ** -7 * reference.abs().max(), (rows, cols, group)
        assert torch.equal(int4_gemv.dequantize(q, s, z, cols, torch.float32), w), (rows, cols, group)
        mats = [_matrix(rows, cols, group, device)[:3] for _ in range(3)]
        addresses = torch.tensor([[m.data_ptr() for m in parts] for parts in mats], dtype=torch.int64, device=device)
        xs = torch.randn(3, cols, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
        single = torch.stack([int4_gemv.int4_gemv(xs[i], *mats[i], cols) for i in range(3)])
        assert torch.equal(int4_gemv.grouped(xs, addresses, rows, cols, group), single), (rows, cols, group)
        shared = torch.stack([int4_gemv.int4_gemv(x, *mats[i], cols) for i in range(3)])
        assert torch.equal(int4_gemv.grouped(x, addresses, rows, cols, group), shared), (rows, cols, group)
        # One matrix at a time (an eager step's expert) gives the rows of all at once (a captured step's).
        alone = torch.cat([int4_gemv.grouped(xs[i:i + 1], addresses[i:i + 1], rows, cols, group) for i in range(3)])
        assert torch.equal(alone, single), (rows, cols, group)
        if device == "cuda":  # read in place from pinned host memory, over the link
            pinned = [tuple(t.cpu().pin_memory() for t in parts) for parts in mats]
            host = torch.tensor([[t.data_ptr() for t in parts] for parts in pinned], dtype=torch.int64, device=device)
            assert torch.equal(int4_gemv.grouped(xs, host, rows, cols, group), single), (rows, cols, group)


def check_copy_rows(device: str) -> None:
    """copy_rows moves the flagged rows whole, from the device or (on CUDA) pinned host memory, and
    leaves every other byte of the target alone: rows longer than one program's stretch, a
    stretch cut short, rows in a shuffled order."""
    from gemmactl.runtime.engine import int4_gemv

    nbytes = 2 * int4_gemv.ROW_COPY_PER * 4 + 48  # two programs' stretches and 12 words of a third
    generator = torch.Generator().manual_seed(5)
    source = torch.randint(0, 256, (4, nbytes), dtype=torch.uint8, generator=generator)
    sources = [source.to(device)] + ([source.pin_memory()] if device == "cuda" else [])
    for rows in sources:
        target = torch.zeros((5, nbytes), dtype=torch.uint8, device=device)
        picks, into = [2, 0, 3, 1], [1, 4, 0, 2]
        flags = torch.tensor([True, False, True, True], device=device)
        int4_gemv.copy_rows(torch.tensor([rows[r].data_ptr() for r in picks], dtype=torch.int64, device=device),
                            torch.tensor([target[j].data_ptr() for j in into], dtype=torch.int64, device=device),
                            flags, nbytes, target.view(torch.int32))
        if device == "cuda":
            torch.cuda.synchronize()
        expected = torch.zeros_like(target)
        for r, j, flag in zip(picks, into, flags.tolist()):
            if flag:
                expected[j] = source[r].to(device)
        assert torch.equal(target, expected)


@pytest.mark.gpu
def test_gpu_int4_kernels_match_the_dequantized_matrix_and_each_other():
    check_kernels("cuda")
    check_copy_rows("cuda")


def test_int4_kernels_in_tritons_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed here (it ships with torch's CUDA builds)")
    root = Path(__file__).resolve().parents[1]
    code = "import test_int4_gemv as t; t.check_kernels('cpu'); t.check_copy_rows('cpu')"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root / "tests"), str(root)])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_tile_is_the_measured_one_unless_set(monkeypatch):
    from gemmactl.runtime.engine import int4_gemv

    monkeypatch.delenv(int4_gemv.TILE_ENV, raising=False)
    int4_gemv.tile_for.cache_clear()
    assert int4_gemv.tile_for(1408, 2816) == int4_gemv.DEFAULT_TILE
    monkeypatch.setenv(int4_gemv.TILE_ENV, "8,8,2")
    int4_gemv.tile_for.cache_clear()
    assert int4_gemv.tile_for(1408, 2816) == int4_gemv.Tile(8, 8, 2)
    monkeypatch.setenv(int4_gemv.TILE_ENV, "8,6,2")  # not a power of two
    int4_gemv.tile_for.cache_clear()
    with pytest.raises(ValueError, match="powers of two"):
        int4_gemv.tile_for(1408, 2816)
    int4_gemv.tile_for.cache_clear()
    # few row blocks split K into as many parts as give every multiprocessor the tile's programs
    assert int4_gemv.split(2816, 22, 132, int4_gemv.Tile(4, 16, 4)) == (1, 32)  # 704 row blocks: enough
    splits, per = int4_gemv.split(256, 48, 132, int4_gemv.Tile(4, 16, 4))
    assert splits > 1 and per % 16 == 0 and splits * per >= 48

