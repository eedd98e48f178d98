"""The z3 lemmas of ``dynatrain.verify.lemmas``: they prove, fast, and they are about the code.

Three kinds of test:
- every registered lemma proves, and all of them in a few seconds;
- each model function the lemmas are built from agrees with the IR function it restates, on a
  grid of concrete sizes (so a lemma cannot drift into an idealisation of the code);
- deliberately wrong variants (the same lemma over a wrong model) are disproved, and their
  counterexample, plugged into the wrong formula as plain ints, really breaks the property,
  while the real IR function on the same input does not.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import z3

from dynatrain.ir.box import Box
from dynatrain.ir.errors import LayoutError
from dynatrain.ir.buffers import BufferLayout, BufferParam, layout_buffer, owned_ranges
from dynatrain.ir.mesh import Grid, Mesh
from dynatrain.ir.model import ParamDef, TPSplit, chunk_params, padded_vocab
from dynatrain.ir.shard import logical_box, shard
from dynatrain.ir.spec import ModelConfig
from dynatrain.ir.geometry import flat_boxes, local_to_global
from dynatrain.ir.slots import flat_index as _flat_index
from dynatrain.planner.intersect import Holders, _Sorted
from dynatrain.verify import lemmas as L
from dynatrain.verify.simulate import _within

TOTAL_BUDGET_S = 10.0


# ---- every lemma proves -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(L.LEMMAS))
def test_lemma_proves(name: str) -> None:
    r = L.prove(name)
    print(f"{name}: proved={r.proved} in {r.seconds:.3f} s")
    assert r.proved, r
    assert r.counterexample is None
    assert r.seconds < 5.0


def test_prove_all_is_fast() -> None:
    t0 = time.perf_counter()
    results = L.prove_all()
    total = time.perf_counter() - t0
    print("\n" + "\n".join(f"{r.name:30s} {r.seconds:6.3f} s" for r in results))
    print(f"{'total':30s} {total:6.3f} s")
    assert [r.name for r in results] == list(L.LEMMAS)
    assert all(r.proved for r in results), [r for r in results if not r.proved]
    assert total < TOTAL_BUDGET_S


def test_timeout_is_not_a_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """z3's "unknown" (what a timeout gives) proves nothing. Simulated: a real 1 ms timeout is
    soft, and z3 sometimes finishes this proof inside it anyway (seen once in a full run)."""
    monkeypatch.setattr(L, "_check", lambda goal, timeout_ms: (z3.unknown, None))
    r = L.prove("flat_boxes_2d", timeout_ms=1)
    assert not r.proved and r.counterexample is None


def test_purify_keeps_false_statements_false() -> None:
    x, y = z3.Ints("x y")
    r = L.prove(lambda: z3.Implies(y > 0, x / y * y == x))
    assert not r.proved
    cex = r.counterexample
    assert cex is not None and cex["y"] > 0 and cex["x"] // cex["y"] * cex["y"] != cex["x"]


# ---- the model functions are the IR's formulas --------------------------------------------------

def test_even_shard_is_shard() -> None:
    for k in range(1, 9):
        for n in range(k, 8 * k + 1, k):
            owners = []
            for dim in (0, 1):
                split = TPSplit(dim, "tp")
                shape = (n, 3) if dim == 0 else (3, n)
                p = ParamDef("w", "w", shape, split=split)
                for r in range(k):
                    (piece,) = shard(p, r, k).pieces
                    assert (piece.box.lo[dim], piece.box.hi[dim]) == L.even_shard(r, n, k)
                    if dim == 0:
                        owners += range(piece.box.lo[0], piece.box.hi[0])
            assert sorted(owners) == list(range(n))  # the tiling, concretely


def test_glu_model_is_shard() -> None:
    for tp in range(1, 5):
        for rows in range(2 * tp, 12 * tp + 1, 2 * tp):
            p = ParamDef("fc1", "fc1", (rows, 3), split=TPSplit(0, "tp", glu=True))
            seen = []
            for r in range(tp):
                sh = shard(p, r, tp)
                got = tuple((pc.local_offset[0], pc.box.lo[0], pc.box.shape[0]) for pc in sh.pieces)
                assert got == L.glu_pieces(r, rows, tp)
                for j in range(sh.local_shape[0]):
                    ((_, box),) = local_to_global(sh, (j, 0), (1, 3), vocab=0)
                    assert box.lo[0] == L.glu_global_row(r, j, rows, tp)
                    seen.append(box.lo[0])
            assert sorted(seen) == list(range(rows))


def _boxes(ndim: int, coords: range) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    spans = [(l, h) for l in coords for h in coords]
    return [(tuple(s[0] for s in c), tuple(s[1] for s in c))
            for c in itertools.product(spans, repeat=ndim)]


@pytest.mark.parametrize("ndim,coords", [(1, range(-1, 4)), (2, range(0, 3))])
def test_box_and_model_is_box_and(ndim: int, coords: range) -> None:
    boxes = _boxes(ndim, coords)
    for a, b in itertools.product(boxes, repeat=2):
        ok, lo, hi = L.box_and(a, b)
        got = Box(*a) & Box(*b)
        assert (got is not None) == ok
        if ok:
            assert (got.lo, got.hi) == (lo, hi)


def test_flat_pieces_is_flat_boxes() -> None:
    for R, C in itertools.product(range(1, 6), repeat=2):
        assert all(_flat_index((R, C), (i, j)) == i * C + j for i in range(R) for j in range(C))
        for a in range(R * C):
            for b in range(a + 1, R * C + 1):
                want = [((r0, c0), (r1 - r0, c1 - c0))
                        for on, r0, r1, c0, c1 in L.flat_pieces(C, a, b) if on]
                assert flat_boxes((R, C), a, b) == want


@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 2, 3), (4,)])
def test_flat_boxes_tiles_beyond_two_dims(shape: tuple[int, ...]) -> None:
    # The lemma is 2-D; the recursion for more dims is checked exhaustively on small shapes.
    n = math.prod(shape)
    for a in range(n):
        for b in range(a + 1, n + 1):
            cover = np.zeros(shape, np.int64)
            boxes = flat_boxes(shape, a, b)
            assert len(boxes) <= 2 * len(shape) - 1
            for lo, size in boxes:
                assert all(s > 0 for s in size)
                cover[tuple(slice(l, l + s) for l, s in zip(lo, size))] += 1
            want = np.zeros(n, np.int64)
            want[a:b] = 1
            assert (cover.reshape(-1) == want).all()


def _model(vocab: int, multiple: int) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=vocab,
                       make_vocab_size_divisible_by=multiple)


def test_padded_vocab_model_and_logical_rows() -> None:
    for V, m, tp in itertools.product((1, 2, 7, 100, 127, 128, 129, 1000), (1, 3, 8, 128),
                                      range(1, 9)):
        P = padded_vocab(_model(V, m), tp)
        assert P == L.padded_vocab_rows(V, m, tp)
        p = ParamDef("emb", "emb", (P, 4), split=TPSplit(0, "tp", vocab=True))
        for r in range(tp):
            box = shard(p, r, tp).pieces[0].box
            lo, hi = L.even_shard(r, P, tp)
            clipped = logical_box(p, box, V)
            if lo >= V:
                assert clipped is None
            else:
                assert clipped.lo[0] == lo and clipped.hi[0] == min(hi, V)


BUFFER_CASES = [
    # (numels in named_parameters order, shared flags, dp, bucket_size)
    ((10, 200, 64, 1, 129), (False,) * 5, 1, None),
    ((10, 200, 64, 1, 129), (False,) * 5, 3, None),
    ((1000, 7, 7, 300, 5), (True, False, False, False, False), 6, 256),
    ((33, 65, 127, 128, 129, 4096), (False,) * 5 + (True,), 5, 300),
    ((17,) * 9, (False,) * 9, 8, 40),
    ((100, 3000, 50), (False, False, True), 129, 1000),
]


@pytest.mark.parametrize("numels,shared,dp,bucket_size", BUFFER_CASES)
def test_buffer_models_are_layout_buffer(numels, shared, dp, bucket_size) -> None:
    params = tuple((f"p{i}", n, s) for i, (n, s) in enumerate(zip(numels, shared)))
    buf = layout_buffer(0, False, "bf16", params, dp, bucket_size, True)
    div = math.lcm(dp, 128)
    prev_end = 0
    for p in buf.params:  # each start is the previous end (or bucket start) padded to 64
        bs = buf.buckets[p.bucket][0]
        assert p.start in (L.pad_up(prev_end, 64), L.pad_up(bs, 64)) and p.start % 64 == 0
        prev_end = p.end
    for b, (bs, be) in enumerate(buf.buckets):
        last = max(p.end for p in buf.params if p.bucket == b)
        assert be == L.pad_up(last, div) and bs % div == 0 and (be - bs) % dp == 0
        assert all(bs <= p.start <= p.end <= be for p in buf.params if p.bucket == b)
    per_param: dict[str, int] = {}
    for r in range(dp):
        owned = {(o.name, o.bucket): o for o in owned_ranges(buf, r)}
        for p in buf.params:
            bs, be = buf.buckets[p.bucket]
            lo, hi = L.owned_range(bs, be, dp, r)
            on, a, z = L.owned_piece(p.start, p.end, lo, hi)
            o = owned.get((p.name, p.bucket))
            assert (o is not None) == on
            if on:
                assert o.gbuf_world == (a, z) and o.gbuf_local == (a - lo, z - lo)
                assert o.param == (a - p.start, z - p.start)
                per_param[p.name] = per_param.get(p.name, 0) + z - a
    assert per_param == {p.name: p.end - p.start for p in buf.params if p.end > p.start}


def _moe(experts: int) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
                       num_moe_experts=experts, moe_ffn_hidden_size=4)


def _experts_held(experts: int, ep: int, ep_rank: int) -> dict[int, int]:
    """Local expert index -> global expert index, as chunk_params builds EP rank ``ep_rank``."""
    defs, _ = chunk_params(_moe(experts), 1, ep, ep_rank, (0,), False, False, False,
                           megatron_core="0.16.1")
    out = {}
    for d in defs:
        if d.expert:
            local = int(d.name.split("local_experts.")[1].split(".")[0])
            out[local] = d.prepend[-1][0]
    return out


def test_expert_models_are_chunk_params() -> None:
    for E in (1, 2, 4, 6, 8, 12):
        for ep in (d for d in range(1, E + 1) if E % d == 0):
            owners = []
            for r in range(ep):
                held = _experts_held(E, ep, r)
                assert sorted(held) == list(range(E // ep))
                for j, e in held.items():
                    assert e == L.expert_global(r, j, E, ep)
                    assert L.expert_home(e, E, ep) == (r, j)
                    owners.append(e)
            assert sorted(owners) == list(range(E))


def test_grid_peels_tokens_as_the_radix_step() -> None:
    for sizes in [(2, 3, 4), (1, 5, 2), (4, 1, 1, 3), (2, 2, 2, 2, 2)]:
        order = "-".join(f"t{i}" for i in range(len(sizes)))
        g = Grid(tuple(order.split("-")), sizes)
        rest = Grid(g.order[1:], sizes[1:])
        ranks = []
        for c in itertools.product(*map(range, sizes)):
            coords = dict(zip(g.order, c))
            rank = g.rank(**coords)
            assert rank == c[0] + sizes[0] * rest.rank(**dict(zip(rest.order, c[1:])))
            assert g.coords(rank) == coords
            ranks.append(rank)
        assert sorted(ranks) == list(range(g.world))


def test_each_expert_has_one_ep_owner_per_edp_replica() -> None:
    for tp, cp, dp, pp, ep, etp in [(2, 1, 4, 2, 4, 1), (1, 2, 4, 1, 2, 2), (2, 1, 2, 1, 4, 1)]:
        world = tp * cp * dp * pp
        mesh = Mesh("tp-cp-ep-dp-pp", tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp,
                    edp=world // (etp * ep * pp))
        replicas: dict[tuple[int, int, int], list[int]] = {}
        for rank in range(world):
            c = mesh.coords(rank)
            replicas.setdefault((c.pp, c.edp, c.etp), []).append(c.ep)
        assert all(sorted(v) == list(range(ep)) for v in replicas.values())


def test_box_subset_and_split_on_boxes() -> None:
    anchor = Box((2, 3), (9, 8))
    for part in (Box((3, 4), (5, 8)), Box((2, 3), (9, 8)), Box((8, 7), (9, 8))):
        sl = _within(part, anchor)
        view = np.zeros(anchor.shape)[sl]
        assert view.shape == part.shape
        for d in (0, 1):
            for c in range(part.lo[d] + 1, part.hi[d]):
                left = Box(part.lo, tuple(c if k == d else h for k, h in enumerate(part.hi)))
                right = Box(tuple(c if k == d else l for k, l in enumerate(part.lo)), part.hi)
                assert left.numel + right.numel == part.numel


def test_index_window_is_sorted_query() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        entries = []
        for _ in range(int(rng.integers(1, 25))):
            lo = int(rng.integers(0, 40))
            box = Box((lo, 0), (lo + int(rng.integers(1, 8)), 2))
            entries.append((box, (Holders((0,), None, None),)))
        entries = list({b: h for b, h in entries}.items())
        idx = _Sorted(list(entries), 0)
        for qlo in range(0, 45, 3):
            query = Box((qlo, 0), (qlo + int(rng.integers(1, 9)), 2))
            got = {p for p, _ in idx.query(query)}
            want = {query & b for b, _ in entries if query & b is not None}
            assert got == want
            scanned = [b for (b, _), end in zip(idx.entries, idx.ends)
                       if L.index_window(b.lo[0], end, query.lo[0], query.hi[0])]
            assert {query & b for b in scanned if query & b is not None} == want


def test_index_query_filters_many_candidates() -> None:
    """Past ``_SCAN`` candidates a query filters them in numpy: the same parts as testing
    every box (boxes side by side in the other dim, so most candidates miss)."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        entries = {}
        for _ in range(int(rng.integers(30, 120))):
            r, c = int(rng.integers(0, 40)), int(rng.integers(0, 16))
            box = Box((r, c), (r + int(rng.integers(1, 6)), c + int(rng.integers(1, 3))))
            entries[box] = (Holders((0,), None, None),)
        idx = _Sorted(list(entries.items()), 0)
        for _ in range(30):
            r, c = int(rng.integers(0, 40)), int(rng.integers(0, 16))
            query = Box((r, c), (r + int(rng.integers(1, 12)), c + int(rng.integers(1, 4))))
            got = [p for p, _ in idx.query(query)]
            want = [query & b for b, _ in idx.entries if query & b is not None]
            assert got == want


# ---- wrong variants: disproved, with a counterexample that really breaks the property -------

def _disproved(name: str, build) -> dict[str, int]:
    build.__name__ = name
    r = L.prove(build)
    assert not r.proved and r.counterexample is not None, r
    print(f"{r.name}: counterexample {r.counterexample} ({r.seconds:.3f} s)")
    return r.counterexample


def _vocab_ok(V: int, m: int, tp: int, P: int) -> bool:
    return V <= P and P - V < m * tp and P % tp == 0


def test_wrong_padding_without_tp() -> None:
    def pad_without_tp(V, m, tp):  # rounds to make_vocab_size_divisible_by only
        return L.pad_up(V, m)

    cex = _disproved("pad_without_tp", lambda: L.vocab_padding(pad_without_tp))
    V, m, tp = cex["V"], cex["m"], cex["tp"]
    assert V > 0 and m > 0 and tp > 0
    assert not _vocab_ok(V, m, tp, pad_without_tp(V, m, tp))
    assert _vocab_ok(V, m, tp, padded_vocab(_model(V, m), tp))


def _cells(boxes, R: int, C: int) -> np.ndarray:
    cover = np.zeros((R + 2, C + 2), np.int64)  # room to see a box spill out of the shape
    for r0, r1, c0, c1 in boxes:
        cover[max(r0, 0):r1, max(c0, 0):c1] += 1
    return cover


def test_wrong_flat_boxes_head_row_off_by_one() -> None:
    def head_one_row_down(cols, a, b):
        (on, r0, r1, c0, c1), mid, tail = L.flat_pieces(cols, a, b)
        return (on, r0 + 1, r1 + 1, c0, c1), mid, tail

    cex = _disproved("head_one_row_down",
                     lambda: L.flat_boxes_2d(head_one_row_down))
    R, C, a, b = cex["R"], cex["C"], cex["a"], cex["b"]
    assert 0 < C and 0 <= a < b <= R * C
    want = np.zeros((R + 2, C + 2), np.int64)
    want[:R, :C] = (np.arange(R * C).reshape(R, C) >= a) & (np.arange(R * C).reshape(R, C) < b)
    wrong = [(r0, r1, c0, c1) for on, r0, r1, c0, c1 in head_one_row_down(C, a, b) if on]
    assert not (_cells(wrong, R, C) == want).all()
    real = [(lo[0], lo[0] + s[0], lo[1], lo[1] + s[1]) for lo, s in flat_boxes((R, C), a, b)]
    assert (_cells(real, R, C) == want).all()


def _owned_lengths(bs: int, be: int, dp: int) -> list[tuple[int, int]]:
    buf = BufferLayout(0, False, "bf16", dp, be, be, ((bs, be),), (BufferParam("p", bs, be, 0),))
    return [o.gbuf_world for r in range(dp) for o in owned_ranges(buf, r)]


def test_wrong_bucket_padded_to_128_only() -> None:
    # Floored (be - bs) / D ranges leave a bucket's tail unowned when D does not divide it:
    # the real owned_ranges refuses such a bucket (as Megatron asserts) rather than drop it.
    cex = _disproved("bucket_padded_to_128", lambda: L.optimizer_ranges_tile(
        bucket_ok=lambda bs, be, dp: (be - bs) % 128 == 0))
    bs, be, D = cex["bs"], cex["be"], cex["D"]
    assert (be - bs) % 128 == 0 and (be - bs) % D != 0
    assert D * ((be - bs) // D) < be - bs  # what floored ranges would cover
    with pytest.raises(LayoutError, match="does not split"):
        _owned_lengths(bs, be, D)
    # layout_buffer's padding fixes it (buckets start aligned there; z3's bs need not be).
    padded = bs + L.pad_up(be - bs, math.lcm(D, 128))
    assert sum(z - a for a, z in _owned_lengths(bs, padded, D)) == padded - bs


def test_wrong_ceil_sized_ranges() -> None:
    def ceil_ranges(bs, be, dp, r):
        size = L._div(L.pad_up(be - bs, dp), dp)  # (n + D - 1) // D
        return bs + r * size, bs + (r + 1) * size

    cex = _disproved("ceil_ranges", lambda: L.optimizer_ranges_tile(
        ceil_ranges, bucket_ok=lambda bs, be, dp: True))
    bs, be, D = cex["bs"], cex["be"], cex["D"]
    ranges = [ceil_ranges(bs, be, D, r) for r in range(D)]
    owners = [sum(lo <= x < hi for lo, hi in ranges) for x in range(bs, be)]
    assert ranges[-1][1] > be or any(n != 1 for n in owners)


def test_wrong_expert_owner_e_div_ep() -> None:
    def home_div_ep(e, E, ep):
        return e / ep, e % (E / ep)

    cex = _disproved("home_div_ep", lambda: L.expert_owner_unique(home_div_ep))
    E, ep, e = cex["E"], cex["ep"], cex["e"]
    assert E % ep == 0 and 0 <= e < E
    owner, local = e // ep, e % (E // ep)
    assert owner >= ep or _experts_held(E, ep, owner).get(local) != e
    r, j = L.expert_home(e, E, ep)
    assert _experts_held(E, ep, r)[j] == e  # the real chunk_params puts it there


def test_wrong_box_and_as_bounding_box() -> None:
    def hull(a, b):
        lo = tuple(L._min(x, y) for x, y in zip(a[0], b[0]))
        hi = tuple(L._max(x, y) for x, y in zip(a[1], b[1]))
        return L._and(*(x < y for x, y in zip(lo, hi))), lo, hi

    cex = _disproved("hull", lambda: L.box_and_exact(2, hull))
    a = Box((cex["alo0"], cex["alo1"]), (cex["ahi0"], cex["ahi1"]))
    b = Box((cex["blo0"], cex["blo1"]), (cex["bhi0"], cex["bhi1"]))
    p = (cex["p0"], cex["p1"])

    def inside(box: Box | None) -> bool:
        return box is not None and all(l <= x < h for l, x, h in zip(box.lo, p, box.hi))

    ok, lo, hi = hull((a.lo, a.hi), (b.lo, b.hi))
    assert (ok and inside(Box(lo, hi))) != (inside(a) and inside(b))
    assert inside(a & b) == (inside(a) and inside(b))


def test_wrong_glu_up_offset_by_local_size() -> None:
    def up_at_local(rank, j, rows, tp):
        local, half = L._div(rows, tp), L._div(rows, 2)
        chunk = L._div(local, 2)
        return L._if(j < chunk, rank * chunk + j, half + rank * local + j - chunk)

    cex = _disproved("up_at_local", lambda: L.glu_shard_bijective(up_at_local))
    rows, tp = cex["rows"], cex["tp"]
    assert rows % (2 * tp) == 0
    got = [up_at_local(r, j, rows, tp) for r in range(tp) for j in range(rows // tp)]
    assert sorted(got) != list(range(rows))
    p = ParamDef("fc1", "fc1", (rows, 1), split=TPSplit(0, "tp", glu=True))
    real = [L.glu_global_row(r, j, rows, tp) for r in range(tp) for j in range(rows // tp)]
    assert sorted(real) == list(range(rows)) and shard(p, 0, tp).local_shape[0] == rows // tp
