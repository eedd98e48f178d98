"""Plan reports: the traffic matrix adds up, the heatmap is a real PNG, the DOT text parses.

Real plans come from tiny two-node layouts; hand-built plans pin exact numbers, device order and
quoting of hostile names. The DOT check is a small parser over the DOT grammar's subset we emit,
so an unescaped quote or a stray brace fails it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Message, Plan, Round, Transfer
from dynatrain.ir.units import format_bytes
from dynatrain.report.dot import (LEGEND, MessageCounts, check_dot_path, check_dot_size,
                                  count_label, human_bytes, message_counts, plan_to_dot,
                                  write_dot)
from dynatrain.report.heatmap import (DPI, FIGSIZE_IN, NO_TRAFFIC, byte_ticks, device_order,
                                      heatmap_figure, traffic_matrix, write_heatmap)

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
             vocab_size=200, make_vocab_size_divisible_by=16, max_position_embeddings=64)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _spec(world: int, **par: object):
    return spec_from_dict({"model": MODEL, "parallel": par,
                           "world": {"nodes": max(1, world // 2), "gpus_per_node": min(2, world)}})


def _real_plan(budget: int = 40_000) -> Plan:
    """tp2-dp2 -> pp2-dp2 on two nodes of two GPUs: local copies, intra- and inter-node traffic."""
    return plan_transition(Layout(_spec(4, tp=2)), Layout(_spec(4, pp=2)), budget)


def _msg(src: str, dst: str, *sizes: int) -> Message:
    # Only nbytes matters to the reports; the other transfer fields are placeholders.
    return Message(src, dst, tuple(Transfer("w", ("param",), None, 0, 0, None, None, None, None, n)
                                   for n in sizes))


def _hand_plan(name: str = "src", src_devices: tuple[str, ...] = (),
               dst_devices: tuple[str, ...] = (), rounds: tuple[Round, ...] = ()) -> Plan:
    return Plan(name, "dst", src_devices, dst_devices, rounds, 1 << 30)


@pytest.fixture(scope="module")
def real_plan() -> Plan:
    return _real_plan()


# ---- traffic matrix -------------------------------------------------------------------------

def test_matrix_sums_to_plan_stats(real_plan: Plan) -> None:
    devices, m = traffic_matrix(real_plan)
    st = real_plan.stats
    assert st["bytes_local"] > 0 and st["bytes_moved"] > 0  # the fixture exercises both
    assert int(m.sum()) == st["bytes_moved"] + st["bytes_local"]
    assert int(np.trace(m)) == st["bytes_local"]
    assert int(m.sum() - np.trace(m)) == st["bytes_moved"]
    assert m.shape == (len(devices), len(devices)) and m.dtype == np.int64


def test_matrix_cells_equal_per_message_sums(real_plan: Plan) -> None:
    devices, m = traffic_matrix(real_plan)
    want: dict[tuple[str, str], int] = {}
    for msg in real_plan.messages():
        key = (msg.src_device, msg.dst_device)
        want[key] = want.get(key, 0) + sum(t.nbytes for t in msg.transfers)
    for i, s in enumerate(devices):
        for j, d in enumerate(devices):
            assert m[i, j] == want.get((s, d), 0), (s, d)


def test_matrix_exact_numbers_across_rounds() -> None:
    a, b, c = "node0:gpu0", "node0:gpu1", "node1:gpu0"
    plan = _hand_plan(src_devices=(a, b), dst_devices=(b, c), rounds=(
        Round((_msg(a, b, 100, 20), _msg(b, b, 7))),
        Round((_msg(a, b, 30), _msg(b, c, 5))),
    ))
    devices, m = traffic_matrix(plan)
    assert devices == [a, b, c]
    np.testing.assert_array_equal(m, [[0, 150, 0], [0, 7, 5], [0, 0, 0]])


def test_device_order_is_numeric_and_covers_both_sides() -> None:
    src = ("node10:gpu0", "node9:gpu10", "node9:gpu2")
    dst = ("node9:gpu1", "node2:gpu0", "node10:gpu0")
    plan = _hand_plan(src_devices=src, dst_devices=dst)
    want = ["node2:gpu0", "node9:gpu1", "node9:gpu2", "node9:gpu10", "node10:gpu0"]
    assert device_order(plan) == want
    devices, m = traffic_matrix(plan)
    assert devices == want and m.shape == (5, 5) and not m.any()


# ---- heatmap --------------------------------------------------------------------------------

def _check_png(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    img = mpimg.imread(path)
    assert img.shape[:2] == (round(FIGSIZE_IN[1] * DPI), round(FIGSIZE_IN[0] * DPI))
    assert img.shape[0] > 0 and img.shape[1] > 0
    assert img[..., :3].std() > 0  # something was drawn


def test_heatmap_writes_png(real_plan: Plan, tmp_path: Path) -> None:
    out = tmp_path / "traffic.png"
    write_heatmap(real_plan, out)
    _check_png(out)


def test_heatmap_many_devices_and_mathtext_in_names(tmp_path: Path) -> None:
    # 600 devices on 150 nodes: cells are binned; "$\bogus$" would crash mathtext if unescaped.
    devs = tuple(f"node{i // 4}:gpu{i % 4}" for i in range(600))
    rounds = (Round(tuple(_msg(devs[i], devs[(i * 37) % 600], 1 + i) for i in range(600))),)
    plan = _hand_plan(r"$\bogus$ spec", devs, devs, rounds)
    out = tmp_path / "big.PNG"
    write_heatmap(plan, out)
    _check_png(out)
    assert heatmap_figure(plan).axes[1].get_ylabel() == "bytes sent per 2x2 devices (log scale)"


def test_heatmap_empty_plan(tmp_path: Path) -> None:
    out = tmp_path / "empty.png"
    write_heatmap(_hand_plan(src_devices=("node0:gpu0",), dst_devices=("node0:gpu0",)), out)
    _check_png(out)


@pytest.mark.parametrize("name", ["traffic.jpg", "traffic", "traffic.png.svg"])
def test_heatmap_rejects_non_png_suffix(real_plan: Plan, tmp_path: Path, name: str) -> None:
    with pytest.raises(DynatrainError, match=r"must end in \.png"):
        write_heatmap(real_plan, tmp_path / name)
    assert not (tmp_path / name).exists()


def test_heatmap_unwritable_path_raises(real_plan: Plan, tmp_path: Path) -> None:
    with pytest.raises(DynatrainError, match="cannot write"):
        write_heatmap(real_plan, tmp_path / "missing-dir" / "traffic.png")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(DynatrainError, match="cannot write"):
        write_heatmap(real_plan, tmp_path / "dir.png")


def test_importing_heatmap_does_not_import_matplotlib() -> None:
    code = ("import sys, dynatrain.report.heatmap, dynatrain.report.dot; "
            "sys.exit('matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- DOT ------------------------------------------------------------------------------------

_TOKEN = re.compile(r'\s+|"(?:\\.|[^"\\])*"|->|[{}\[\];,=]|[A-Za-z_][A-Za-z0-9_]*|-?\d+(?:\.\d+)?')


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m, f"bad DOT at {pos}: {text[pos:pos + 40]!r}"
        if not m.group().isspace():
            out.append(m.group())
        pos = m.end()
    return out


def _unquote(tok: str) -> str:
    if not tok.startswith('"'):
        return tok
    return re.sub(r'\\(.)', lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), tok[1:-1])


class _Dot:
    """Parses the DOT subset plan_to_dot emits; any other shape is an assertion failure."""

    def __init__(self, text: str) -> None:
        self.toks, self.i = _tokens(text), 0
        self.clusters: list[str] = []
        self.graph: dict[str, str] = {}  # the top-level graph [...] attributes
        self.cluster_labels: dict[str, str] = {}
        self.nodes: dict[str, dict[str, str]] = {}
        self.edges: list[tuple[str, str, dict[str, str], str | None]] = []
        assert self._take() == "digraph"
        self._id()
        self._block(None)
        assert self.i == len(self.toks), "text after the closing brace"

    def _take(self, want: str | None = None) -> str:
        assert self.i < len(self.toks), "unexpected end (unbalanced braces?)"
        tok = self.toks[self.i]
        self.i += 1
        assert want is None or tok == want, f"expected {want!r}, got {tok!r}"
        return tok

    def _id(self) -> str:
        tok = self._take()
        assert tok not in "{}[];,=" and tok != "->", f"expected an ID, got {tok!r}"
        return _unquote(tok)

    def _attrs(self) -> dict[str, str]:
        out: dict[str, str] = {}
        self._take("[")
        while True:
            key = self._id()
            self._take("=")
            out[key] = self._id()
            if self._take() == "]":
                return out

    def _block(self, cluster: str | None) -> None:
        self._take("{")
        while self.toks[self.i] != "}":
            if self.toks[self.i] == "subgraph":
                self._take()
                name = self._id()
                assert cluster is None, "nested cluster"
                self.clusters.append(name)
                self._block(name)
                continue
            head = self._id()
            if head in ("graph", "node", "edge"):
                attrs = self._attrs()
                if head == "graph" and cluster is None:
                    self.graph = attrs
            elif self.toks[self.i] == "=":
                self._take()
                value = self._id()
                if head == "label" and cluster is not None:
                    self.cluster_labels[cluster] = value
            elif self.toks[self.i] == "->":
                self._take()
                tail = self._id()
                self.edges.append((head, tail, self._attrs(), cluster))
            else:
                self.nodes[head] = self._attrs()
            self._take(";")
        self._take("}")


def test_dot_structure_matches_plan(real_plan: Plan) -> None:
    g = _Dot(plan_to_dot(real_plan))
    n_rounds = len(real_plan.rounds)
    assert n_rounds > 2
    assert g.clusters == [f"cluster_r{i}" for i in range(n_rounds)]
    msg_edges = [e for e in g.edges if "transfer" in e[2].get("label", "")]
    order_edges = [e for e in g.edges if "label" not in e[2]]
    assert len(msg_edges) == sum(1 for _ in real_plan.messages())
    assert len(msg_edges) + len(order_edges) == len(g.edges)
    assert [(a, b) for a, b, _, _ in order_edges] == [(f"round{i}", f"round{i + 1}")
                                                      for i in range(n_rounds - 1)]
    # Message edges sit in their round's cluster, in plan order, with size, count and style.
    want = [(f"{m.src_device}@r{i}", f"{m.dst_device}@r{i}", f"cluster_r{i}", m)
            for i, r in enumerate(real_plan.rounds) for m in r.messages]
    for (a, b, attrs, cl), (wa, wb, wcl, m) in zip(msg_edges, want):
        assert (a, b, cl) == (wa, wb, wcl)
        n = len(m.transfers)
        assert attrs["label"].startswith(f"{human_bytes(m.nbytes)}\n{n} transfer")
        assert (attrs.get("style") == "dashed") == m.local
        assert a in g.nodes and b in g.nodes


def test_dot_quotes_hostile_device_names() -> None:
    weird = 'node"0:gpu\\1 {x}; -> y'
    plan = _hand_plan(src_devices=(weird,), dst_devices=("node1:gpu0",), rounds=(
        Round((_msg(weird, "node1:gpu0", 3 << 20), _msg(weird, weird, 10))),))
    g = _Dot(plan_to_dot(plan))
    assert g.nodes[f"{weird}@r0"]["label"] == weird
    assert [(a, b) for a, b, _, _ in g.edges] == [(f"{weird}@r0", "node1:gpu0@r0"),
                                                  (f"{weird}@r0", f"{weird}@r0")]
    assert g.edges[0][2]["label"] == "3.0 MiB\n1 transfer"


def test_dot_refuses_big_plans(real_plan: Plan) -> None:
    counts = message_counts(real_plan)
    total = counts.total
    plan_to_dot(real_plan, max_messages=total)  # the limit itself is fine
    check_dot_size(real_plan, max_messages=total)
    want = (rf"^--dot: the plan has {total} messages \({counts.between_devices} messages between "
            rf"devices \+ {counts.local_copies} local copies\); --dot draws plans of at most "
            rf"{total - 1} messages$")
    with pytest.raises(DynatrainError, match=want):
        plan_to_dot(real_plan, max_messages=total - 1)
    with pytest.raises(DynatrainError, match=want):
        check_dot_size(real_plan, max_messages=total - 1)


def test_check_dot_size_default_limit_counts_local_copies() -> None:
    # 499 messages between devices + 2 local copies: 501 edges, one over the default limit.
    a, b = "node0:gpu0", "node1:gpu0"
    msgs = tuple(_msg(a, b, 1) for _ in range(499)) + (_msg(a, a, 1), _msg(b, b, 1))
    plan = _hand_plan(src_devices=(a, b), dst_devices=(a, b), rounds=(Round(msgs),))
    with pytest.raises(DynatrainError) as info:
        check_dot_size(plan)
    assert str(info.value) == ("--dot: the plan has 501 messages (499 messages between devices "
                               "+ 2 local copies); --dot draws plans of at most 500 messages")
    check_dot_size(_hand_plan(src_devices=(a, b), dst_devices=(a, b), rounds=(Round(msgs[1:]),)))


def test_write_dot_refuses_big_plan_without_writing(real_plan: Plan, tmp_path: Path) -> None:
    out = tmp_path / "plan.dot"
    with pytest.raises(DynatrainError, match="--dot draws plans of at most 3 messages"):
        write_dot(real_plan, out, max_messages=3)
    assert not out.exists()


def test_check_dot_path(tmp_path: Path) -> None:
    assert check_dot_path(tmp_path / "plan.GV") == tmp_path / "plan.GV"
    with pytest.raises(DynatrainError, match=r"^--dot: the output must end in \.dot or \.gv"):
        check_dot_path(tmp_path / "plan.png")
    with pytest.raises(DynatrainError, match=r"^--dot: cannot write .*\(no such directory\)$"):
        check_dot_path(tmp_path / "missing-dir" / "plan.dot")
    (tmp_path / "dir.dot").mkdir()
    with pytest.raises(DynatrainError, match=r"\(it is a directory\)$"):
        check_dot_path(tmp_path / "dir.dot")


def test_dot_label_counts_messages_and_local_copies_apart(real_plan: Plan) -> None:
    g = _Dot(plan_to_dot(real_plan))
    counts = message_counts(real_plan)
    # The summary's "N messages" (plan.stats) is the between-devices count; local copies apart.
    assert counts.between_devices == real_plan.stats["messages"]
    assert counts.local_copies > 0  # the fixture has local copies
    lines = g.graph["label"].split("\n")
    moved, local = real_plan.stats["bytes_moved"], real_plan.stats["bytes_local"]
    assert lines[1] == (f"{counts.between_devices} messages between devices + "
                        f"{counts.local_copies} local copies ({format_bytes(moved)} moved "
                        f"between devices, {format_bytes(local)} copied locally)")
    assert lines[2] == LEGEND
    # The drawing agrees with the label: dashed self-loops are the local copies.
    msg_edges = [e for e in g.edges if "transfer" in e[2].get("label", "")]
    dashed = [e for e in msg_edges if e[2].get("style") == "dashed"]
    assert len(dashed) == counts.local_copies
    assert all(a == b and e["label"].endswith("(local copy)") for a, b, e, _ in dashed)
    assert len(msg_edges) - len(dashed) == counts.between_devices
    for i, rnd in enumerate(real_plan.rounds):
        c = MessageCounts.of(rnd.messages)
        assert g.cluster_labels[f"cluster_r{i}"].startswith(f"round {i}: {c},")


@pytest.mark.parametrize("remote,local,text", [
    (10, 4, "10 messages between devices + 4 local copies"),
    (1, 1, "1 message between devices + 1 local copy"),
    (0, 0, "0 messages between devices + 0 local copies"),
])
def test_count_label(remote: int, local: int, text: str) -> None:
    assert count_label(remote, local) == text == str(MessageCounts(remote, local))


def test_write_dot(real_plan: Plan, tmp_path: Path) -> None:
    out = tmp_path / "plan.dot"
    write_dot(real_plan, out)
    assert out.read_text(encoding="utf-8") == plan_to_dot(real_plan)
    with pytest.raises(DynatrainError, match=r"must end in \.dot or \.gv"):
        write_dot(real_plan, tmp_path / "plan.png")
    with pytest.raises(DynatrainError, match="cannot write"):
        write_dot(real_plan, tmp_path / "missing-dir" / "plan.gv")


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                    (int(12.5 * 2**20), "12.5 MiB"), (3 * 2**40, "3.0 TiB"),
                                    (2**52, "4096.0 TiB")])
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


# ---- heatmap colour bar and legend ------------------------------------------------------------

@pytest.mark.parametrize("lo,hi,want", [
    (1000, 3 << 30, ["1.0 KiB", "32.0 KiB", "1.0 MiB", "32.0 MiB", "1.0 GiB"]),
    (1024, 4096, ["1.0 KiB", "2.0 KiB", "4.0 KiB"]),
    (100, 120, ["100 B", "120 B"]),  # no power of two inside: the two ends
    (0.5, 1, ["1 B"]),  # never a tick below one byte
    (1, 1 << 50, ["1 B", "1.0 KiB", "1.0 MiB", "1.0 GiB", "1.0 TiB", "1024.0 TiB"]),
])
def test_byte_ticks(lo: float, hi: float, want: list[str]) -> None:
    ticks = byte_ticks(lo, hi)
    assert [format_bytes(t) for t in ticks] == want
    assert all(max(lo, 1) <= t <= hi for t in ticks) and ticks == sorted(ticks)


def _figure_texts(fig) -> list[str]:
    from matplotlib.text import Text

    return [t.get_text() for t in fig.findobj(Text)]


def test_heatmap_colour_bar_in_binary_units_and_no_traffic_legend(real_plan: Plan) -> None:
    fig = heatmap_figure(real_plan)
    ax, bar = fig.axes
    fig.canvas.draw()  # tick labels are filled in when drawn
    labels = [t.get_text() for t in bar.get_yticklabels()]
    _, m = traffic_matrix(real_plan)
    lo, hi = int(m[m > 0].min()), int(m.max())
    assert labels and labels == [format_bytes(t) for t in byte_ticks(lo, hi)]
    assert all(re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB|GiB|TiB)", t) for t in labels), labels
    assert bar.get_ylabel() == "bytes sent (log scale)"
    assert NO_TRAFFIC == "white: no traffic" and NO_TRAFFIC in _figure_texts(fig)
    [legend] = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [NO_TRAFFIC]


def test_heatmap_empty_plan_says_no_traffic() -> None:
    fig = heatmap_figure(_hand_plan(src_devices=("node0:gpu0",), dst_devices=("node0:gpu0",)))
    fig.canvas.draw()
    _, bar = fig.axes
    assert bar.get_ylabel() == "no traffic in this plan"
    assert [t.get_text() for t in bar.get_yticklabels()] == []
    assert NO_TRAFFIC in _figure_texts(fig)
