"""Malformed and hostile plan documents thrown at ``dynatrain verify`` and ``plan_from_json``.

Starting from a real plan (tiny-gpt TP2·DP2 -> PP2·DP2, both specs embedded), every document is
either read and verified (exit 0 or 1, the report on stdout, nothing on stderr), or refused with
exit 2 and exactly one line on stderr, ``dynatrain: error: malformed plan: <path>: <rule>``,
whose path leads to the field that was broken. A node replaced by a value of another JSON type,
a missing key or an unknown one is always malformed; values of the right type (huge, negative,
out of range, structural edits of lists) may go either way, but never to a traceback, another
exit status, or a reader that accepts what the verifier then trips over.

Every property runs under one derandomized profile, so CI sees the same examples every run.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
from functools import cache

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dynatrain.cli import main
from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec, spec_to_dict
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan_schema import PlanFormatError
from dynatrain.planner.serialize import plan_from_json, plan_to_json
from dynatrain.verify.check import verify
from dynatrain.verify.mutate import OPERATORS, mutants

settings.register_profile(
    "dynatrain-plan-hostile",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
HOSTILE = settings.get_profile("dynatrain-plan-hostile")

SRC, DST = "specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml"
OPTIONAL = {"derived", "summary"}  # top-level keys a document may leave out


@cache
def _base() -> tuple[dict, Layout, Layout]:
    src, dst = Layout(load_spec(SRC)), Layout(load_spec(DST))
    plan = plan_transition(src, dst, 1 << 20)  # a small budget: several rounds
    doc = plan_to_json(plan, spec_to_dict(src.spec), spec_to_dict(dst.spec, plan.dst_devices))
    return json.dumps(doc), src, dst


def base() -> dict:
    """A fresh copy of the good document."""
    return json.loads(_base()[0])


@cache
def paths() -> tuple[tuple, ...]:
    """Every node of the good document outside the embedded specs (the spec loader's job)."""
    out, stack = [], [((), base())]
    while stack:
        path, v = stack.pop()
        out.append(path)
        if type(v) is dict:
            stack.extend((path + (k,), x) for k, x in v.items()
                         if path or k not in ("src_spec", "dst_spec"))
        elif type(v) is list:
            stack.extend((path + (i,), x) for i, x in enumerate(v))
    return tuple(sorted(out, key=lambda p: (len(p), str(p))))


def get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def put(doc, path, value):
    if not path:
        return value
    get(doc, path[:-1])[path[-1]] = value
    return doc


def field_of(path: tuple) -> str:
    """``path`` as the reader names it: ``plan.rounds[0][1].transfers[2][6]``."""
    out = "plan"
    for i, p in enumerate(path):
        if type(p) is int:
            out += f"[{p}]"
        elif path[0] == "order" and i == 2:  # a device's order: keyed by device name
            out += f"[{p!r}]"
        else:
            out += f".{p}"
    return out


def leads_to(field: str, path: tuple) -> bool:
    """``field`` names the node at ``path`` or one of its ancestors."""
    target = field_of(path)
    return target == field or target.startswith((field + "[", field + "."))


def jtype(v) -> str:
    return "bool" if type(v) is bool else type(v).__name__


def cli(text: str, tmp) -> tuple[int, str, str]:
    path = tmp / "plan.json"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(path)])
    return code, out.getvalue(), err.getvalue()


def refused(doc, tmp, text: str | None = None) -> PlanFormatError:
    """The reader refuses ``doc`` and ``dynatrain verify`` says the same in one line, exit 2."""
    with pytest.raises(PlanFormatError) as info:
        plan_from_json(doc)
    err = info.value
    msg = str(err)
    assert msg.splitlines() == [msg] and msg.isprintable() and len(msg) <= 400, repr(msg)
    assert msg.startswith(f"malformed plan: {err.field}: {err.rule}"), msg
    code, out, stderr = cli(json.dumps(doc) if text is None else text, tmp)
    assert (code, out, stderr) == (2, "", f"dynatrain: error: {msg}\n")
    return err


def outcome(doc, tmp) -> int:
    """Exit 2 with one clean line, or a plan that verifies to a report: 0 if it holds, else 1."""
    try:
        plan = plan_from_json(doc)
    except PlanFormatError:
        refused(doc, tmp)
        return 2
    _, src, dst = _base()
    report = verify(plan, src, dst)  # anything but a report escapes and fails the test
    code, out, err = cli(json.dumps(doc), tmp)
    assert err == "" and code == (0 if report.ok else 1), (code, out, err)
    assert out.startswith("verified" if report.ok else "verification failed"), out
    return code


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("plans")


# ---- values --------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from([2**63, 2**63 - 1, 2**64, 2**200, -2**200, 10**30, -1, -2**63])
ODD_STRINGS = ["", " ", "0", "1.5", "node0:gpu0", "node9:gpu9", "param", "exp_avg", "stack",
               "\n", "a\nb", "\u2028", "\x00", "x" * 500, "[]", "null", "NaN"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1.0, -0.0, 1e308]),
    st.text(max_size=12), st.sampled_from(ODD_STRINGS),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=5),
    st.dictionaries(st.text(max_size=6), SCALARS, max_size=3),
    st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=3),
)
BASE = base()  # read only
PARAM_SLOT = next(i for i, s in enumerate(BASE["slots"]) if s[0] == "param")
# Uniform over nodes would nearly always land inside a transfer: shallow nodes drawn too.
NODES = st.one_of(st.sampled_from(paths()),
                  st.sampled_from([p for p in paths() if len(p) <= 4]))


# ---- properties ----------------------------------------------------------------------------

@settings(HOSTILE, max_examples=250)
@given(path=NODES, value=VALUES)
def test_a_value_of_another_type_is_refused_and_named(tmp, path, value):
    doc = base()
    old = get(doc, path)
    # Statistics are free-form JSON data: another value there is no error (tested below).
    assume(jtype(value) != jtype(old) and not (path[:1] == ("summary",) and len(path) >= 2))
    err = refused(put(doc, path, value), tmp)
    assert leads_to(err.field, path), (err.field, field_of(path))


SAME_TYPE = {
    "int": st.one_of(st.integers(-3, 70), HUGE_INTS),
    "float": st.floats(allow_nan=True, allow_infinity=True),
    "str": st.one_of(st.text(max_size=12), st.sampled_from(ODD_STRINGS)),
    "bool": st.booleans(),
}


@settings(HOSTILE, max_examples=120)
@given(path=NODES, data=st.data())
def test_values_of_the_right_type_are_read_or_refused_cleanly(tmp, path, data):
    doc = base()
    old = get(doc, path)
    if type(old) is list and old:  # a structural edit: drop, repeat or swap items
        i = data.draw(st.integers(0, len(old) - 1))
        edit = data.draw(st.sampled_from(["drop", "repeat", "reverse"]))
        new = (old[:i] + old[i + 1:] if edit == "drop" else old[:i + 1] + old[i:]
               if edit == "repeat" else old[::-1])
    else:
        assume(jtype(old) in SAME_TYPE)
        new = data.draw(SAME_TYPE[jtype(old)])
    code = outcome(put(doc, path, new), tmp)
    if type(old) is int and not -1 <= new < 2**63 and path[:1] != ("summary",):
        assert code == 2  # below -1 or beyond int64: no count, index or coordinate is that


@settings(HOSTILE, max_examples=60)
@given(path=st.sampled_from([p for p in paths() if type(get(BASE, p)) is dict]),
       key=st.one_of(st.text(max_size=10), st.sampled_from(["budget_byte", "Format", "slot"])),
       value=VALUES)
def test_unknown_keys(tmp, path, key, value):
    doc = base()
    target = get(doc, path)
    assume(key not in target)
    target[key] = value
    if path[:1] in (("summary",), ("order",)):  # statistics; an order of a device
        outcome(doc, tmp)
    else:
        err = refused(doc, tmp)
        assert err.field == field_of(path) and err.value == key


def _keys() -> list[tuple]:
    """Each key of the top level and of the first message, once."""
    doc = base()
    return [(k,) for k in doc] + [("rounds", 0, 0, k) for k in doc["rounds"][0][0]]


@pytest.mark.parametrize("path", _keys(), ids=lambda p: field_of(p))
def test_missing_keys(tmp, path):
    doc = base()
    del get(doc, path[:-1])[path[-1]]
    if path[-1] in OPTIONAL and len(path) == 1:
        assert outcome(doc, tmp) == 0
    elif path[-1] in ("src_spec", "dst_spec"):  # then the specs must come from --src/--dst
        code, out, err = cli(json.dumps(doc), tmp)
        assert code == 2 and err.count("\n") == 1 and f"no {path[-1]} in the plan" in err
    else:
        err = refused(doc, tmp)
        assert err.field == field_of(path) and "missing" in err.rule


def test_every_mutant_of_the_verifier_reads_back_and_fails_verification(tmp):
    """Well-formed but wrong plans (one fault each, every operator) are the verifier's: exit 1,
    never refused by the reader."""
    _, src, dst = _base()
    plan = plan_from_json(base())
    found = mutants(plan, src, dst, random.Random(0), len(OPERATORS))
    assert len(found) >= 10
    for m in found:
        doc = json.loads(json.dumps(plan_to_json(m.plan, base()["src_spec"],
                                                 base()["dst_spec"])))
        assert outcome(doc, tmp) == 1, m.operator


# ---- the cases users met, and other concrete ones -------------------------------------------

def _transfer(doc, i=0):
    return next(m for r in doc["rounds"] for m in r if m["src_device"] != m["dst_device"]
                )["transfers"][i]


def _message(doc):
    return doc["rounds"][0][0]


CASES = {  # name: (edit of the document, path it names, words of its rule)
    "devices-as-ints": (lambda d: d.update(src_devices=[0, 1, 2, 3]), "plan.src_devices[0]",
                        "must be a string"),
    "summary-list": (lambda d: d.update(summary=[1]), "plan.summary", "must be an object"),
    "summary-string": (lambda d: d.update(summary="ab"), "plan.summary", "must be an object"),
    "summary-nan": (lambda d: d["summary"].update(bytes_moved=math.nan),
                    "plan.summary.bytes_moved", "finite"),
    "summary-odd-key": (lambda d: d["summary"].update({"a\nb" * 50: math.inf}),
                        "plan.summary['a\\nb", "finite"),
    "summary-nested-nan": (lambda d: d["summary"].update(x={"a": [1.0, math.nan]}),
                           "plan.summary.x.a[1]", "finite"),
    "summary-too-deep": (lambda d: d["summary"].update(x=[[[[[[1]]]]]]), "plan.summary.x",
                         "at most 4 levels"),
    "box-half": (lambda d: _transfer(d)[2][0].__setitem__(0, 0.5), "transfers[0][2]",
                 "box coordinate lo[0] must be an integer"),
    "box-bool": (lambda d: _transfer(d)[6][1].__setitem__(0, True), "transfers[0][6]",
                 "src_anchor coordinate hi[0] must be an integer"),
    "box-upside-down": (lambda d: _transfer(d)[2].reverse(), "transfers[0][2]", "lo <= hi"),
    "box-ranks": (lambda d: _transfer(d)[8].__setitem__(0, _transfer(d)[8][0][:-1]),
                  "transfers[0][8]", "one rank"),
    "anchor-ranks": (lambda d: _transfer(d).__setitem__(6, [[0] * 5, [1] * 5]), "transfers[0]",
                     "one rank"),
    "box-huge": (lambda d: _transfer(d)[2][1].__setitem__(0, 2**64), "transfers[0][2]",
                 "[0, 2**63)"),
    "src-rank-out": (lambda d: _transfer(d).__setitem__(3, 4), "transfers[0][3]",
                     "src_rank must be an integer in [0, 4)"),
    "dst-rank-negative": (lambda d: _transfer(d).__setitem__(4, -1), "transfers[0][4]",
                          "dst_rank"),
    "nbytes-negative": (lambda d: _transfer(d).__setitem__(9, -8), "transfers[0][9]",
                        "nbytes must be an integer in [0, 2**63)"),
    "nbytes-float": (lambda d: _transfer(d).__setitem__(9, 8.0), "transfers[0][9]",
                     "nbytes must be an integer"),
    "kinds-empty": (lambda d: _transfer(d).__setitem__(1, []), "transfers[0][1]",
                    "at least one"),
    "kinds-unknown": (lambda d: _transfer(d).__setitem__(1, ["weights"]), "transfers[0][1][0]",
                      "must be one of"),
    "slot-bool": (lambda d: _transfer(d).__setitem__(5, True), "transfers[0][5]",
                  "malformed slot reference"),
    "short-transfer": (lambda d: _transfer(d).pop(), "transfers[0]", "list of 10 fields"),
    "foreign-sender": (lambda d: _message(d).update(src_device="node7:gpu0"),
                       "plan.rounds[0][0].src_device", "one of plan.src_devices"),
    "foreign-receiver": (lambda d: _message(d).update(dst_device=3), "plan.rounds[0][0].dst_device",
                         "one of plan.dst_devices"),
    "order-out-of-range": (lambda d: d["order"][0]["node0:gpu0"].append(10**6),
                           "plan.order[0]['node0:gpu0']", "message index"),
    "order-short": (lambda d: d["order"].pop(), "plan.order", "one per-device order per round"),
    "budget-zero": (lambda d: d.update(budget_bytes=0), "plan.budget_bytes", "budget_bytes"),
    "budget-string": (lambda d: d.update(budget_bytes="2GiB"), "plan.budget_bytes",
                      "must be an integer"),
    "derived-unknown": (lambda d: d.update(derived=["weights"]), "plan.derived[0]",
                        "must be one of"),
    "devices-twice": (lambda d: d["dst_devices"].__setitem__(1, d["dst_devices"][0]),
                      "plan.dst_devices[1]", "twice"),
    "devices-none": (lambda d: d.update(src_devices=[]), "plan.src_devices", "at least one"),
    "slot-type": (lambda d: d["slots"][0].__setitem__(0, "tensor"), "plan.slots[0][0]",
                  "unknown slot type"),
    "slot-offset": (lambda d: d["slots"][PARAM_SLOT][3].__setitem__(0, -1),
                    f"plan.slots[{PARAM_SLOT}][3][0]", "local offset"),
    "stack-of-stacks": (lambda d: d["slots"].__setitem__(1, ["stack", 1, d["slots"][1], ["a"]]),
                        "plan.slots[1][2]", "member must be a param or flat slot"),
    "stack-axes-zero": (lambda d: d["slots"][1].__setitem__(1, 0), "plan.slots[1][1]", "axes"),
    "spec-not-a-mapping": (lambda d: d.update(src_spec=["model"]), "plan.src_spec",
                           "must be an object"),
    "spec-null": (lambda d: d.update(dst_spec=None), "plan.dst_spec", "must be an object"),
    "format": (lambda d: d.update(format="dynatrain.plan/4"), "plan.format",
               "not a dynatrain.plan/3 document"),
    "unknown-key": (lambda d: d.update(budget_byte=1), "plan", "unknown key"),
    "format-missing": (lambda d: d.clear() or d.update(rounds=3), "plan.format", "is missing"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_concrete_cases(tmp, name):
    edit, where, words = CASES[name]
    doc = base()
    assert doc["slots"][1][0] == "stack"  # the cases above that edit slot 1 rely on it
    assert doc["slots"][PARAM_SLOT][0] == "param"
    edit(doc)
    err = refused(doc, tmp)
    assert where in err.field and words in str(err), str(err)


def test_budget_of_1e999_is_refused(tmp):
    """Written by hand, ``1e999`` reads as an infinite float: no OverflowError."""
    text = json.dumps(base()).replace('"budget_bytes": 1048576', '"budget_bytes": 1e999')
    assert "1e999" in text
    err = refused(json.loads(text), tmp, text)
    assert err.field == "plan.budget_bytes" and "(got inf)" in str(err)


@pytest.mark.parametrize("text", ["[]", "3", "null", '"plan"', "NaN", "[" * 100_000 + "]" * 100_000,
                                  '{"format": "dynatrain.plan/3", "rounds": ' + "[" * 50_000
                                  + "]" * 50_000 + "}"])
def test_documents_of_the_wrong_shape(tmp, text):
    code, out, err = cli(text, tmp)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith(
        "dynatrain: error: ")


def test_deeply_nested_values_are_described_not_walked(tmp):
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for path in [("src",), ("rounds", 0, 0, "transfers", 0, 2), ("summary", "x"), ("slots", 0)]:
        doc = put(base(), path, deep)
        with pytest.raises(PlanFormatError, match="a list of 1 item"):
            plan_from_json(doc)


def test_huge_ints_are_described_not_printed():
    doc = base()
    _transfer(doc)[9] = 2**20000  # str() of it would raise: its size is printed instead
    with pytest.raises(PlanFormatError, match="an integer of 20001 bits"):
        plan_from_json(doc)


@pytest.mark.parametrize("value", [None, 3, "plan", [], (), {1: 2}, {"format": None}])
def test_plan_from_json_takes_anything(value):
    with pytest.raises(DynatrainError):
        plan_from_json(value)


def test_good_plan_reads_back_equal_and_interned():
    _, src, dst = _base()
    plan = plan_transition(src, dst, 1 << 20)
    back = plan_from_json(base())
    assert back == plan and back.stats == json.loads(_base()[0])["summary"]
    anchors = [t.src_anchor for m in back.messages() for t in m.transfers]
    assert len({id(a) for a in anchors}) == len(set(anchors))  # equal boxes: one object


def test_format_1_reads_inline_slots_and_names_a_bad_one(tmp):
    doc = base()
    old = {k: v for k, v in doc.items() if k not in ("order", "slots")}
    old["format"] = "dynatrain.plan/1"
    for r in old["rounds"]:
        for m in r:
            for t in m["transfers"]:
                t[5], t[7] = doc["slots"][t[5]], doc["slots"][t[7]]
    assert outcome(json.loads(json.dumps(old)), tmp) == 0
    _transfer(old)[7] = ["param", 0, "x", [0.5]]
    err = refused(old, tmp)
    assert err.field.endswith("transfers[0][7][3][0]") and "local offset" in err.rule
    old["slots"] = []  # /1 had no slot table
    assert refused(old, tmp).value == "slots"


def test_statistics_may_be_small_records(tmp):
    """``dynatrain plan --json`` writes records such as ``predicted_downtime``: read back."""
    doc = base()
    doc["summary"]["predicted_downtime"] = {"rounds": 3, "total_seconds": 0.5,
                                            "excludes": ["compute"], "topology": None}
    assert outcome(doc, tmp) == 0
    assert plan_from_json(doc).stats["predicted_downtime"]["excludes"] == ["compute"]


def test_a_summary_edited_by_hand_is_recounted_from_the_plan_read() -> None:
    src, dst = Layout(load_spec(SRC)), Layout(load_spec(DST))
    plan = plan_transition(src, dst, 1 << 20)
    doc = json.loads(json.dumps(plan_to_json(plan)))
    counts = ("rounds", "budget_bytes", "messages", "transfers", "bytes_moved", "bytes_local")
    for key in counts:
        doc["summary"][key] = -1
    doc["summary"]["rounds"] = "eight"
    read = plan_from_json(doc)
    assert {k: read.stats[k] for k in counts} == {k: plan.stats[k] for k in counts}
    assert read.stats["predicted_seconds"] == plan.stats["predicted_seconds"]  # as recorded
