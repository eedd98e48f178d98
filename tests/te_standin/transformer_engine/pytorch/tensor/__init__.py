"""Quantized tensor types: megatron-core imports ``QuantizedTensor`` for isinstance checks.

The stand-in never creates one (fp8 is off), so every such check is False, as with real TE
when fp8 parameters are off.
"""

import torch


class QuantizedTensor(torch.Tensor):
    """Base class of TE's quantized tensors; never instantiated here."""
