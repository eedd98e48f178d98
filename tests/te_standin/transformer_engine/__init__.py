"""A CPU stand-in for NVIDIA Transformer Engine, for tests only.

It registers parameters exactly as TE's modules do (names, shapes, dtypes, order, TP
attributes, an empty ``_extra_state`` with fp8 off) and computes their forward passes with
plain torch, so megatron-core's own TE wrappers (``megatron/core/extensions/
transformer_engine.py``) and TE layer specs can build and train a model on CPU under gloo.
Every registration mirrors TE's source at NVIDIA/TransformerEngine commit d0067d0da
(version 2.20.0.dev0); comments cite ``file:line`` there, relative to
``transformer_engine/pytorch/``. fp8 runs as TE's state machine (delayed-scaling scales and
amax histories, autocast, global amax reduction and update, ``_extra_state``) with
quantize-dequantize GEMM operands in torch's float8 dtypes; its ``FusedAdam`` keeps TE's state
layout. fp8 parameters, fp8 grouped GEMMs and every fused/userbuffer path are out of scope:
asking for them raises. Put ``tests/te_standin`` on ``sys.path`` only in a process that is meant to
see TE (``tests/megatron_support/te.py`` does it in a subprocess).
"""

# The version of the TE source the registrations follow; megatron-core gates features on it
# (>= 1.9 grouped linear, >= 1.13 fused ops, >= 2.0 byte-tensor extra state).
__version__ = "2.20.0.dev0"

from . import common, pytorch  # noqa: F401
