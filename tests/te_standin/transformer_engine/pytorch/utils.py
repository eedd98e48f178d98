"""Init helpers (TE ``utils.py:212-250``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def init_method_normal(sigma: float) -> Callable:
    """utils.py: normal(0, sigma) init."""
    def init_(tensor: torch.Tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def get_default_init_method() -> Callable:
    """utils.py:227-229: weights default to normal(0, 0.023)."""
    return init_method_normal(0.023)


def init_method_constant(val: float) -> Callable:
    """utils.py:232-250: fill with a constant (ones/zeros for norms and biases)."""
    def init_(tensor: torch.Tensor):
        return torch.nn.init.constant_(tensor, val)
    return init_


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
