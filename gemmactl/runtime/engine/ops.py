"""Small operations the engine's blocks share, written as transformers' Gemma code computes them."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Gemma norms compute it: in float32, then cast back. scale: already
    (1 + w) for Gemma 3, w for Gemma 4, None for a norm without one."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if scale is not None:
        y = y * scale
    return y.to(x.dtype)
