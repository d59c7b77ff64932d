"""Small operations the engine's blocks share, written as transformers' Gemma code computes them."""

from __future__ import annotations

import os

import torch

from gemmactl.runtime.engine import row_norm

NORM_ENV = "GEMMACTL_ENGINE_NORM"  # auto (the kernel where a step is not fused) | kernel (everywhere on CUDA) | torch
NORM_SETTING = os.environ.get(NORM_ENV, "auto").strip().lower()


def rms_norm(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Gemma norms compute it: in float32, then cast back. scale: already
    (1 + w) for Gemma 3, w for Gemma 4, None for a norm without one (float32).

    On CUDA, where the step is not fused by torch.compile (eager, or captured unfused as a streamed
    model's step is), a Triton kernel that gives each row the same bits whatever rows run beside
    it, in one launch instead of torch's several (row_norm.py). Inside a fused step torch.compile
    writes the norm into its neighbours' kernels. NORM_ENV=kernel puts the kernel there too (and
    the fused step in inductor's deterministic mode: graph.row_stable_options): on an H100 an E4B
    shape decoded 225 tok/s against 249 with torch's norms (both in that mode), and its fused
    verify step was still not exact (docs/speculation.md). NORM_ENV=torch keeps torch's norm everywhere."""
    if x.is_cuda and NORM_SETTING != "torch" and (NORM_SETTING == "kernel" or not torch.compiler.is_compiling()) \
            and row_norm.usable(x):
        return torch.ops.gemmactl.rms_norm_rows(x, scale, eps)
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if scale is not None:
        y = y * scale
    return y.to(x.dtype)


def in_row_blocks(flat: torch.Tensor, out_features: int, in_features: int, decode_rows, block_values: int) -> torch.Tensor:
    """flat [T, in] times a quantized matrix, decoded a block of rows at a time (decode_rows(slice)
    → [rows, in] in flat's dtype, about block_values values) into a dense product: the
    temporaries stay bounded whatever the matrix."""
    import torch.nn.functional as F

    out = torch.empty((flat.shape[0], out_features), dtype=flat.dtype, device=flat.device)
    step = max(1, block_values // max(in_features, 1))
    for start in range(0, out_features, step):
        rows = slice(start, start + step)
        out[:, rows] = F.linear(flat, decode_rows(rows))
    return out


def key_scores(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q·k for query rows qg [T, K, g, D] over keys k [S, K, D]: [T, K, g, S], unscaled.

    One batched product per KV head over the keys as the cache lays them out ([K, S, D] strided,
    rows contiguous), the queries of a head's group side by side. The same products as
    einsum("tkgd,skd->tkgs") (bit for bit on the CPU in bfloat16, within float32 rounding in
    float32: tested), but einsum first made the keys
    [K, D, S] contiguous, a copy of the whole cache read each step: on 2 cores one query row of an
    E4B-shaped layer over 4,096 keys took 5.6 ms that way against 0.34 ms this way
    (docs/benchmarks.md)."""
    t, heads, groups, dim = qg.shape
    q = qg.permute(1, 0, 2, 3).reshape(heads, t * groups, dim)  # [K, T·g, D]
    scores = torch.matmul(k.transpose(0, 1), q.transpose(1, 2))  # [K, S, T·g]
    return scores.transpose(1, 2).reshape(heads, t, groups, k.shape[0]).permute(1, 0, 2, 3)


def weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention weights [T, K, g, S] applied to values v [S, K, D]: [T, K, g, D].

    As key_scores, one product per KV head over the values as the cache lays them out; the
    einsum("tkgs,skd->tkgd") values bit for bit on the CPU for a decode row (tested), 0.64 ms
    against 0.97 for one query row of an E4B-shaped layer over 4,096 values on 2 cores."""
    t, heads, groups, keys = weights.shape
    w = weights.permute(1, 0, 2, 3).reshape(heads, t * groups, keys)  # [K, T·g, S]
    out = torch.matmul(w, v.transpose(0, 1))  # [K, T·g, D]
    return out.reshape(heads, t, groups, v.shape[-1]).permute(1, 0, 2, 3)


def gated(gate_up: torch.Tensor) -> torch.Tensor:
    """An MoE expert's activation from its joined gate and up products [..., 2w]: GELU(tanh)(gate) · up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def expert_forward(linears: tuple, x: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens x [t, H]: GELU(tanh)(gate) · up, then down."""
    gate_up, down = linears
    return down(gated(gate_up(x)))
