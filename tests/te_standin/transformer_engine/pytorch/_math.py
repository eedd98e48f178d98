"""The normalisations TE computes in its kernels, in plain torch (fp32 inside)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def norm(x: torch.Tensor, kind: str, weight: torch.Tensor, bias: torch.Tensor | None,
         eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dim, computed in fp32 and cast back (as TE's
    kernels accumulate in fp32); ``zero_centered_gamma`` scales by (1 + gamma)."""
    gamma = weight.float() + 1 if zero_centered_gamma else weight.float()
    xf = x.float()
    if kind == "LayerNorm":
        y = F.layer_norm(xf, (xf.shape[-1],), gamma, None if bias is None else bias.float(), eps)
    elif kind == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma
    else:
        raise ValueError(f"unsupported normalization {kind!r}")
    return y.to(x.dtype)
