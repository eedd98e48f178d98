"""The spec's ``megatron_core`` field and the rules that depend on it (pure IR, no megatron).

What the layouts of each version look like against megatron-core itself is checked in
``test_versions_parity.py``; this file checks the field (default, spelling, refusals), the
version-dependent rules, and that the installed version is read without importing torch.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from importlib import metadata

import pytest

from dynatrain.ir import versions
from dynatrain.ir.buffers import experts_in_own_buffer
from dynatrain.ir.errors import SpecError
from dynatrain.ir.loader import parse_spec, spec_from_dict, spec_to_dict, spec_to_yaml_text

MOE = {
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "ffn_hidden_size": 96, "vocab_size": 200, "num_moe_experts": 4,
              "moe_ffn_hidden_size": 32},
    "parallel": {"tp": 2},
    "world": {"nodes": 1, "gpus_per_node": 4},
}


_DEFAULT = object()


def _spec(version: object = _DEFAULT, **parallel: object):
    doc = copy.deepcopy(MOE)
    doc["parallel"].update(parallel)
    if version is not _DEFAULT:
        doc["megatron_core"] = version
    return spec_from_dict(doc)


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """Pretend a given megatron-core (or none) is installed."""
    def set_to(version: str | None) -> None:
        monkeypatch.setattr(versions, "installed", lambda: version)
    return set_to


@pytest.mark.parametrize(("text", "want"), [
    ("0.16.1", "0.16.1"), ("0.19.2", "0.19.2"), ("0.19.2+a7fd0c1", "0.19.2"),
    ("0.16", "0.16"), ("0.19.0rc1", "0.19.0rc1"), ("0.16.0.dev0+abc.1", "0.16.0.dev0"),
])
def test_known_versions_are_accepted(text: str, want: str) -> None:
    assert versions.normalize(text) == want
    assert _spec(text).megatron_core == want


@pytest.mark.parametrize(("value", "rule"), [
    ("0.18.0", "no known layout rules for megatron-core 0.18.0; known: 0.16.x (tested: 0.16.1), "
               "0.19.x (tested: 0.19.2) (a spec without megatron_core means the installed one)"),
    ("1.16.1", "no known layout rules for megatron-core 1.16.1"),
    ("0.16.1; rm -rf /", "must be a megatron-core version such as '0.19.2'"),
    ("v0.19.2", "must be a megatron-core version such as '0.19.2'"),
    (19, "must be a megatron-core version such as '0.19.2'"),
    (None, "must be a megatron-core version such as '0.19.2'"),
    (0.19, "write the version as a quoted string, e.g. '0.16.1' (YAML reads an unquoted 0.19 "
           "as a number)"),
])
def test_bad_versions_are_refused_naming_the_field(value: object, rule: str) -> None:
    with pytest.raises(SpecError) as err:
        _spec(value)  # type: ignore[arg-type]
    assert err.value.field == "megatron_core"
    assert err.value.rule.startswith(rule)
    assert "\n" not in str(err.value)


def test_unquoted_yaml_version_is_refused_with_a_hint() -> None:
    text = spec_to_yaml_text(_spec("0.19.2", etp=1)).replace("megatron_core: 0.19.2", "megatron_core: 0.19")
    with pytest.raises(SpecError, match=r"^megatron_core: write the version as a quoted string"):
        parse_spec(text)


def test_default_is_the_installed_megatron_core(installed) -> None:
    installed("0.19.2")
    assert _spec(etp=1).megatron_core == "0.19.2"  # etp != tp at ep=1: valid on 0.19 only
    installed("0.16.1")
    assert _spec().megatron_core == "0.16.1"
    with pytest.raises(SpecError, match=r"^parallel\.etp: .* 0\.16\.1 silently loses"):
        _spec(etp=1)
    installed(None)  # not installed here (planning on a laptop): megatron-core 0.16.1
    assert _spec().megatron_core == versions.DEFAULT == "0.16.1"


def test_an_installed_unknown_version_is_refused_not_replaced(installed) -> None:
    installed("0.18.1")
    with pytest.raises(SpecError, match=r"^megatron_core: no known layout rules for megatron-core "
                       r"0\.18\.1.*means the installed one"):
        _spec()
    assert _spec("0.19.2").megatron_core == "0.19.2"  # naming a known one still works


def test_installed_version_comes_from_package_metadata() -> None:
    """What ``installed`` reports is the distribution's metadata (or None), read in a fresh
    process that must not import torch or megatron for it."""
    try:
        want = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        want = None
    code = ("import sys; from dynatrain.ir import versions, loader; "
            "print(versions.installed()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
    assert out[0] == str(want)
    assert out[1] == "[]"


def test_explicit_version_survives_a_round_trip(installed) -> None:
    """A plan made where 0.19.2 is installed keeps meaning 0.19.2 where 0.16.1 is."""
    installed("0.19.2")
    doc = spec_to_dict(_spec(etp=1))
    assert doc["megatron_core"] == "0.19.2"
    installed("0.16.1")
    assert spec_from_dict(doc).megatron_core == "0.19.2"
    assert parse_spec(spec_to_yaml_text(spec_from_dict(doc))) == spec_from_dict(doc)


@pytest.mark.parametrize(("version", "tp", "ep", "etp", "own"), [
    ("0.16.1", 2, 1, 1, False), ("0.19.2", 2, 1, 1, True),
    ("0.16.1", 1, 1, 2, False), ("0.19.2", 1, 1, 2, True),
    ("0.16.1", 2, 1, 2, False), ("0.19.2", 2, 1, 2, False),
    ("0.16.1", 2, 2, 1, True), ("0.19.2", 2, 2, 2, True),
])
def test_expert_buffer_rule(version: str, tp: int, ep: int, etp: int, own: bool) -> None:
    """megatron-core's ``allreduce=False`` condition: 0.16 ``ep > 1`` (M16 layers.py:886);
    0.19 ``ep > 1 or etp != tp`` (M19 layers.py:961-964)."""
    assert experts_in_own_buffer(version, tp, ep, etp) is own


def test_ep1_etp_ne_tp_refused_on_0_16_only() -> None:
    with pytest.raises(SpecError) as err:
        _spec("0.16.1", etp=1)
    assert err.value.field == "parallel.etp"
    assert "megatron-core 0.16.1 silently loses optimizer state" in err.value.rule
    assert _spec("0.19.2", etp=1).parallel.expert_tp == 1
    # Without the distributed optimizer nothing is lost: both versions accept it.
    assert _spec("0.16.1", etp=1, use_distributed_optimizer=False).megatron_core == "0.16.1"


def test_expert_slices_check_follows_the_buffer() -> None:
    """cp before tp with ep=1: the experts' ETP slices differ within a dense DP x CP group.
    That loses state only where the experts sit in the dense buffer: etp == tp on either
    version, etp != tp on 0.16 (already refused); 0.19 gives etp != tp a buffer of its own."""
    bad = dict(tp=2, cp=2, order="cp-tp-ep-dp-pp")
    for version in ("0.16.1", "0.19.2"):
        with pytest.raises(SpecError, match=r"^parallel\.order: .*different expert-TP slices"):
            _spec(version, etp=2, **bad)
    doc = copy.deepcopy(MOE)
    doc["parallel"].update(etp=1, **bad)
    doc["world"]["gpus_per_node"] = 8
    assert spec_from_dict({**doc, "megatron_core": "0.19.2"}).parallel.cp == 2
    with pytest.raises(SpecError, match=r"^parallel\.etp: etp != tp with ep=1"):
        spec_from_dict({**doc, "megatron_core": "0.16.1"})
