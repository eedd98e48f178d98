"""The digest a same-devices switch agrees on depends on the layouts, not on how a spec's world
is written: a process that joined holds its spec as the rendezvous gave it (an explicit device
list), the others the ``nodes``/``gpus_per_node`` form they started from. The live example's
third switch (8 -> 8 processes after spares joined) was refused with "the processes planned
different switches" while the two digests differed."""

from __future__ import annotations

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict, spec_to_dict
from dynatrain.planner.cost import H100
from dynatrain.runtime.megatron.live import slice_digest

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=128, vocab_size=500, make_vocab_size_divisible_by=16,
             max_position_embeddings=64)


def _spec(name: str, parallel: dict, gpus: int = 8):
    return spec_from_dict({"name": name, "model": MODEL, "parallel": parallel,
                           "world": {"nodes": 1, "gpus_per_node": gpus}})


def _as_announced(spec):
    """The spec as a joining process reads it from a switch's announcement."""
    return spec_from_dict(spec_to_dict(spec, Layout(spec).devices))


def test_joined_and_staying_processes_agree_on_a_same_devices_switch() -> None:
    src, dst = _spec("tp2-pp2-vpp2-dp2", dict(tp=2, pp=2, vpp=2)), _spec("pp4-dp2", dict(pp=4))
    joined_src = _as_announced(src)
    assert spec_to_dict(joined_src) != spec_to_dict(src)  # the two forms the processes hold
    staying = slice_digest(src, Layout(src), dst, Layout(dst), 2 << 30, H100)
    joined = slice_digest(joined_src, Layout(joined_src), dst, Layout(dst), 2 << 30, H100)
    assert joined == staying


def test_the_digest_still_tells_switches_apart() -> None:
    src = _spec("tp2-dp4", dict(tp=2))
    base = slice_digest(src, Layout(src), _spec("pp4-dp2", dict(pp=4)),
                        Layout(_spec("pp4-dp2", dict(pp=4))), 2 << 30, H100)
    for dst, budget in ((_spec("pp2-dp4", dict(pp=2)), 2 << 30),
                        (_spec("pp4-dp2", dict(pp=4)), 1 << 30)):
        assert slice_digest(src, Layout(src), dst, Layout(dst), budget, H100) != base
