"""``Fp8Padding`` / ``Fp8Unpadding`` (TE ``module/fp8_padding.py``, ``fp8_unpadding.py``).

Plain ``torch.nn.Module``s without parameters or state: megatron-core's grouped experts pad
each expert's token rows to the fp8 GEMM alignment before the grouped linear and drop the
padding after it (M16 transformer/moe/experts.py:603-606). The alignment is 32 for MXFP8 and
16 for the other recipes, read from the active recipe on the first forward
(fp8_padding.py:74-140); the stand-in pads with zeros in plain torch.
"""

from __future__ import annotations

import torch

from ..fp8 import FP8GlobalStateManager


def _align(module) -> int:
    if module.align_size is None:
        module.align_size = 32 if FP8GlobalStateManager.get_fp8_recipe().mxfp8() else 16
    return module.align_size


def _padded(m_splits: list[int], align: int) -> list[int]:
    return [(m + align - 1) // align * align for m in m_splits]


class Fp8Padding(torch.nn.Module):
    """Pad every split's rows to the alignment (fp8_padding.py:74-140)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]):
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        padded = _padded(m_splits, _align(self))
        if padded == m_splits:
            return inp, m_splits
        x = inp.view(-1, inp.shape[-1])
        parts = [torch.nn.functional.pad(p, (0, 0, 0, n - m))
                 for p, m, n in zip(torch.split(x, m_splits), m_splits, padded)]
        return torch.cat(parts), padded


class Fp8Unpadding(torch.nn.Module):
    """Drop the rows ``Fp8Padding`` added (fp8_unpadding.py)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        padded = _padded(m_splits, _align(self))
        if padded == m_splits:
            return inp
        return torch.cat([p[:m] for p, m in zip(torch.split(inp, padded), m_splits)])
