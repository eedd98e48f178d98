"""The megatron-core versions whose layouts the IR knows, and which one a spec means.

A spec names its megatron-core version in ``megatron_core`` (default: the installed
megatron-core, else 0.16.1). Versions are known per series (major.minor); each series has a
row in ``SERIES`` saying what it does differently to a layout, and the release CI compares the
IR against (``tests/test_megatron_parity.py`` runs against the installed megatron-core). The
installed version is read from package metadata: ``ir`` never imports torch or megatron.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata

DEFAULT = "0.16.1"  # what a spec means when megatron-core is not installed here
DISTRIBUTION = "megatron-core"
# PEP 440 as megatron-core releases spell it: 0.19.2, 0.16.0rc0, 0.20.0.dev0+a7fd0c1.
_VERSION = re.compile(r"^(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?((?:a|b|rc)\d{1,4})?"
                      r"(?:\.post\d{1,4})?(?:\.dev\d{1,4})?(?:\+[A-Za-z0-9.]{1,64})?$")


@dataclass(frozen=True, slots=True)
class Series:
    """What one megatron-core series (major.minor) does differently to a layout.

    Attributes:
        tested: the release of this series that CI checks the IR against.
        etp_own_expert_buffer: expert params leave the dense DDP buffer for the expert-DP one
            when ETP != TP even at EP=1 (0.19: ``use_expert_pgs``, M19
            tensor_parallel/layers.py:961-964 and 1379-1382); before, only when EP > 1
            (M16 tensor_parallel/layers.py:886, 1209).
        mla_q_proj_norm: with multi-latent attention, ``qk_layernorm`` and no ``q_lora_rank``,
            the query norm is fused into ``linear_q_proj`` over the hidden size (0.19:
            ``QKNormConfigResolver``, M19 transformer/mla_qk_norm_config.py:132-167); before,
            that query has no norm at all (M16 transformer/multi_latent_attention.py:391-404,
            497-503).
        te_cpu_init_dense_expert_bias: with ``use_cpu_initialization``, TE's column/row
            parallel wrappers re-create each bias as an all-reduced (dense) parameter and, on
            0.16, never mark an expert's bias again (M16 extensions/transformer_engine.py:
            992-1014, 1108-1114): sequential experts' biases then leave the expert buffer for
            the dense one when EP > 1. 0.19 marks them again (M19 extensions/
            transformer_engine.py:1474-1479, 1730-1735).
        mtp_inner_name: the parameter name of an MTP layer's transformer layer (0.19 renamed it
            ``mtp_model_layer``; its checkpoint key stays ``transformer_layer``).
        mtp_core_attention_extra_state: 0.16's MTP block first saves its whole state dict the
            default way (M16 transformer/multi_token_prediction.py:1150), so the TE core
            attention of an MTP layer leaves an ``_extra_state`` object that its own
            ``sharded_state_dict`` (vanilla softmax) does not; 0.19 starts from nothing (M19
            multi_token_prediction.py:1866).
    """

    tested: str
    etp_own_expert_buffer: bool
    mla_q_proj_norm: bool
    te_cpu_init_dense_expert_bias: bool
    mtp_inner_name: str
    mtp_core_attention_extra_state: bool


SERIES: dict[tuple[int, int], Series] = {
    (0, 16): Series(tested="0.16.1", etp_own_expert_buffer=False, mla_q_proj_norm=False,
                    te_cpu_init_dense_expert_bias=True, mtp_inner_name="transformer_layer",
                    mtp_core_attention_extra_state=True),
    (0, 19): Series(tested="0.19.2", etp_own_expert_buffer=True, mla_q_proj_norm=True,
                    te_cpu_init_dense_expert_bias=False, mtp_inner_name="mtp_model_layer",
                    mtp_core_attention_extra_state=False),
}


def known() -> str:
    """The known series in words, for messages: ``0.16.x (tested: 0.16.1), 0.19.x (...)``."""
    return ", ".join(f"{a}.{b}.x (tested: {s.tested})" for (a, b), s in sorted(SERIES.items()))


def normalize(text: object) -> str:
    """``text`` as a version string of a known series, or ``ValueError`` naming the rule.

    The local part (``+a7fd0c1``) of a build is dropped: it names a commit, not a layout.

    Example:
        >>> normalize("0.19.2+a7fd0c1")
        '0.19.2'
    """
    if isinstance(text, float):  # YAML reads an unquoted 0.19 as a number
        raise ValueError(f"write the version as a quoted string, e.g. '{DEFAULT}' (YAML reads "
                         "an unquoted 0.19 as a number)")
    if not isinstance(text, str) or not _VERSION.match(text):
        raise ValueError("must be a megatron-core version such as '0.19.2'")
    version = text.split("+", 1)[0]
    if series_key(version) not in SERIES:
        raise ValueError(f"no known layout rules for megatron-core {version}; known: {known()} "
                         "(a spec without megatron_core means the installed one)")
    return version


def series_key(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``0.19.2`` -> ``(0, 19)``)."""
    major, minor = version.split(".")[:2]
    return int(major), int(re.match(r"\d+", minor).group())  # type: ignore[union-attr]


def series(version: str) -> Series:
    """The layout rules of ``version``'s series (``normalize`` it first)."""
    return SERIES[series_key(version)]


@lru_cache(maxsize=1)
def installed() -> str | None:
    """The installed megatron-core's version (from its package metadata), None without one."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def default() -> str:
    """What a spec without ``megatron_core`` means: the installed version, else ``DEFAULT``.

    An installed version of an unknown series is returned as is, so that the spec's validation
    refuses it by name instead of silently using another series' rules.
    """
    found = installed()
    return DEFAULT if found is None else found
