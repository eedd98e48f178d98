"""CopyTable: a round's copies described once and run as a table, bit for bit what per-view
``copy_`` gives.

The torch path runs in this process on random strided view pairs (hypothesis). The Triton
kernel runs in a subprocess under Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set
before the kernel is defined, and another test may have imported the module already). The
one-process CUDA switch runs only where a GPU is present.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime import copytable, exchange
from dynatrain.runtime.copytable import Block, CopyTable, _blocks, _tiles
from dynatrain.runtime.executor import process_devices
from dynatrain.runtime.storage import (ByteViews, allocate, byte_view, fill_from_global,
                                       random_global)

DTYPES = (torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.int64)
TINY = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
            vocab_size=30, make_vocab_size_divisible_by=4, max_position_embeddings=8)


def strided_pair(rng: random.Random, src_base: torch.Tensor, dst_base: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A (source, destination) pair of byte views of one shape, each strided its own way: a
    typed tensor of up to 3 dims, narrowed inside a larger parent whose outer dims lie in a
    random order (a transpose), at a random offset of the given flat byte storage, then
    viewed as bytes."""
    dtype = rng.choice(DTYPES)
    isz = torch.empty((), dtype=dtype).element_size()
    dims = rng.randint(1, 3)
    shape = [rng.randint(1, 5) for _ in range(dims)]

    def side(base: torch.Tensor) -> torch.Tensor:
        perm = list(range(dims - 1))
        rng.shuffle(perm)
        order = perm + [dims - 1]
        parent = [shape[p] + rng.randint(0, 3) for p in order]
        numel = math.prod(parent)
        off = rng.randrange(0, (base.numel() - numel * isz) // isz + 1) * isz
        if isz == 1:
            off = max(0, off - rng.randint(0, 3))  # byte views start at any address
        t = base[off:off + numel * isz].view(dtype).view(parent)
        for d, p in enumerate(order):
            t = t.narrow(d, rng.randint(0, t.shape[d] - shape[p]), shape[p])
        return byte_view(t.permute(*[order.index(i) for i in range(dims)]))

    return side(src_base), side(dst_base)


def check_table(seed: int, n: int, kernel: bool) -> None:
    """``n`` random copies into two destinations, by table and by per-view ``copy_``, equal."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen) for _ in range(3)]
    # Disjoint destinations (one per copy, in one storage) so that the order does not matter.
    dst = torch.zeros(n * 2048, dtype=torch.uint8)
    pairs = []
    for k in range(n):
        s, d = strided_pair(rng, srcs[rng.randrange(3)], dst[k * 2048:(k + 1) * 2048])
        pairs.append((s, d))
    for s, d in pairs:
        d.copy_(s)
    want = dst.clone()
    dst.zero_()
    parts = [pairs[:n // 2], pairs[n // 2:]]
    CopyTable(parts, kernel=kernel).run()
    assert torch.equal(dst, want)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12))
def test_table_equals_per_view_copies(seed: int, n: int) -> None:
    check_table(seed, n, kernel=False)


def test_staging_parts_lie_one_after_the_other_in_the_region() -> None:
    src = torch.arange(256, dtype=torch.uint8)
    a = src[10:40].view(3, 10)
    b = src.view(16, 16)[2:5, 3:9]  # strided
    table = CopyTable([[(a, 0)], [(b, 0), (src[200:204], 18)]])
    assert table.starts == [0, 30]
    region = torch.zeros(52, dtype=torch.uint8)
    table.run(region)  # whole: part 1 starts after part 0's 30 bytes
    want = torch.cat([a.reshape(-1), b.reshape(-1), src[200:204]])
    assert torch.equal(region, want)
    one = torch.zeros(22, dtype=torch.uint8)
    table.run(one, part=1)  # one part: the region is that part's bytes alone
    assert torch.equal(one, want[30:])
    back = torch.zeros(256, dtype=torch.uint8)  # and the other way round: region -> views
    CopyTable([[(0, back[10:40].view(3, 10))], [(0, back.view(16, 16)[2:5, 3:9])]]).run(region)
    assert torch.equal(back[10:40], src[10:40]) and torch.equal(back.view(16, 16)[2:5, 3:9], b)


def test_adjacent_copies_merge_into_one() -> None:
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    table = CopyTable([[(src[0:8], dst[0:8]), (src[8:20], dst[8:20]), (src[30:34], dst[20:24])]])
    assert len(table) == 2 and table.copies == 3 and table.nbytes == 24
    table.run()
    assert torch.equal(dst[:20], src[:20]) and torch.equal(dst[20:24], src[30:34])


def test_blocks_collapse_contiguous_dims_and_cut_tiles(monkeypatch) -> None:
    # (2, 3, 4) bytes: rows of 12 on both sides contiguous in (3, 4): one block of 2 rows
    assert _blocks((2, 3, 4), (40, 4, 1), (12, 4, 1), 5, 0) == [Block(5, 0, 12, 2, 40, 12)]
    # an inner dim that is not unit-strided: rows of one byte
    assert _blocks((3,), (2,), (1,), 0, 0) == [Block(0, 0, 1, 3, 2, 1)]
    # a dim that merges on neither side: one block per outer index
    assert len(_blocks((2, 3, 4), (100, 8, 1), (50, 4, 1), 0, 0)) == 2
    assert _blocks((0, 4), (4, 1), (4, 1), 0, 0) == []
    monkeypatch.setattr(copytable, "TILE_BYTES", 16)
    assert _tiles(Block(0, 100, 40, 1, 40, 40)) == [
        Block(0, 100, 16, 1, 40, 40), Block(16, 116, 16, 1, 40, 40), Block(32, 132, 8, 1, 40, 40)]
    assert [t.rows for t in _tiles(Block(0, 0, 5, 7, 9, 5))] == [3, 3, 1]


def test_views_of_two_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        CopyTable([[(torch.zeros(4, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))]])
    with pytest.raises(ValueError, match="uint8"):
        CopyTable([[(torch.zeros(4), torch.zeros(4))]])


def _tiny_round_work():
    src_spec = spec_from_dict({"model": TINY, "parallel": {"tp": 2},
                               "world": {"nodes": 1, "gpus_per_node": 2}})
    dst_spec = spec_from_dict({"model": TINY, "parallel": {"pp": 2},
                               "world": {"nodes": 1, "gpus_per_node": 2}})
    sv, dv = transition_views(Layout(src_spec), Layout(dst_spec))
    plan = plan_transition(sv.layout, dv.layout, 1 << 20)
    devices = process_devices(plan)
    name = devices[0]
    sr, dr = plan.src_devices.index(name), plan.dst_devices.index(name)
    src = fill_from_global(sv, sr, random_global(sv, 3))
    dst = allocate(dv, dr)
    local = exchange.spread_local(plan.rounds, name, sr, dr)
    return [exchange.prepare_round(i, rnd, name, sr, dr, ByteViews(src), ByteViews(dst),
                                   devices, local[i]) for i, rnd in enumerate(plan.rounds)]


def test_a_prepared_round_packs_and_copies_by_its_tables(monkeypatch) -> None:
    monkeypatch.setattr(exchange, "DIRECT_MIN_BYTES", 1 << 62)  # every piece staged
    works = _tiny_round_work()
    work = next(w for w in works if w.sends)
    assert isinstance(work.pack, CopyTable) and isinstance(work.copies, CopyTable)
    staged = [p for p in work.sends if not p.direct]
    assert len(work.pack.parts) == len(staged) and all(p.table is work.pack for p in staged)
    arena = exchange.Arena()
    arena.carve(work)
    exchange._pack_all(work)  # one table run over the whole send region
    for p in staged:
        assert torch.equal(p.wire, torch.cat([v.reshape(-1) for v in p.views]))
    copies = [w for w in works if w.local]
    for w in copies:
        w.copies.run()
        for s, d in w.local_views():
            assert torch.equal(s, d)
    assert copies, "the tiny switch has local copies on device 0"


KERNEL_CHECK = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {tests!r})
import torch
from dynatrain.runtime import copytable
from test_copytable import check_table
assert copytable.triton is not None
copytable.TILE_BYTES = 64  # many tiles, rows cut in pieces
for seed in range(12):
    check_table(seed, 1 + seed % 9, kernel=True)
# a region side, at an odd address: the word class must narrow at run time
src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
t = copytable.CopyTable([[(src[64:320].view(8, 32), 0)], [(src.view(128, 128)[3:9, 8:24], 0)]],
                        kernel=True)
assert [w for *_, w in t._build_launches()] == [8]
buf = torch.zeros(400, dtype=torch.uint8)
t.run(buf[1:353])
assert torch.equal(buf[1:257], src[64:320]) and torch.equal(
    buf[257:353].view(6, 16), src.view(128, 128)[3:9, 8:24])
print("kernel ok")
"""


def test_triton_kernel_matches_copy_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK.format(tests=tests)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "kernel ok" in out.stdout, out.stderr[-3000:]


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
from dynatrain.runtime import copytable
assert copytable.triton is None
src = torch.arange(64, dtype=torch.uint8)
t = copytable.CopyTable([[(src.view(8, 8)[:, 2:6], 0)]])
assert not t.kernel
region = torch.zeros(32, dtype=torch.uint8)
t.run(region)
assert torch.equal(region.view(8, 4), src.view(8, 8)[:, 2:6])
try:
    copytable.CopyTable([[(src, 0)]], kernel=True)
    raise SystemExit("a kernel table without triton was built")
except RuntimeError:
    pass
print("torch path ok")
"""


def test_the_runtime_works_without_triton() -> None:
    out = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "torch path ok" in out.stdout, out.stderr[-3000:]


ONE_DEVICE_PLAN = """
import os, sys, datetime
import torch, torch.distributed as dist
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime.executor import switch
from dynatrain.runtime.storage import fill_from_global, random_global, checksums
TINY = {tiny!r}
one = {{"nodes": 1, "gpus_per_node": 1}}
a = spec_from_dict({{"model": TINY, "parallel": {{}}, "world": one}})
b = spec_from_dict({{"model": TINY, "parallel": {{"use_distributed_optimizer": False}},
                    "world": one}})
sv, dv = transition_views(Layout(a), Layout(b))
plan = plan_transition(sv.layout, dv.layout, 1 << 20)
"""  # a one-device switch's plan (distributed optimizer off), for the scripts below

CUDA_SWITCH = ONE_DEVICE_PLAN + """
assert all(m.local for r in plan.rounds for m in r.messages)
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
g = random_global(sv, 11)
src = {{k: t.cuda() for k, t in fill_from_global(sv, 0, g).items()}}
dst, report = switch(plan, sv, dv, plan.src_devices[0], src, timeout=60, verify_source=True,
                     check_transfers=True)
want = fill_from_global(dv, 0, g)
assert checksums({{k: t.cpu() for k, t in dst.items()}}) == checksums(want)
dist.destroy_process_group()
print("cuda ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_process_cuda_switch_copies_locally_bit_exact() -> None:
    out = subprocess.run([sys.executable, "-c", CUDA_SWITCH.format(tiny=TINY)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "cuda ok" in out.stdout, out.stderr[-3000:]


GLOO_TIMEOUT = ONE_DEVICE_PLAN + """
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=7))
def now():
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
src = fill_from_global(sv, 0, random_global(sv, 3))
switch(plan, sv, dv, plan.src_devices[0], src, timeout=123)
print("after", now().total_seconds())
dist.destroy_process_group()
"""


def test_a_switch_gives_the_group_its_own_timeout_back() -> None:
    # A switch waits up to its own timeout on the group it runs in, usually the job's default
    # group; afterwards the job's own collectives must again give up after the group's own
    # timeout (a bounded one releases survivors blocked on a dead peer).
    out = subprocess.run([sys.executable, "-c", GLOO_TIMEOUT.format(tiny=TINY)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "after 7.0" in out.stdout, out.stdout
