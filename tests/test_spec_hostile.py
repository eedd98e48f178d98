"""Thousands of malformed and hostile specs thrown at the loader.

Whatever comes in (a shipped spec with wrong-typed, missing, extra or absurd fields; text that
is not YAML or YAML of the wrong shape; YAML tags that try to construct objects; alias and merge
bombs; deep nesting; huge documents), the loader either returns a valid ``LayoutSpec`` that
compiles to a ``Layout``, or raises ``SpecError`` with one printable line that starts with the
offending field path. No other exception escapes, nothing hangs, and nothing gets executed.

Every property runs under one derandomized profile, so CI sees the same examples every run.
"""

from __future__ import annotations

import copy
import datetime
import re
import string
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynatrain.ir.errors import SpecError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import MAX_SPEC_BYTES, load_spec, parse_spec, spec_from_dict
from dynatrain.ir.presets import PRESETS
from dynatrain.ir.spec import LayoutSpec, ModelConfig, ParallelConfig, StateConfig, WorldConfig

settings.register_profile(
    "dynatrain-hostile",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
HOSTILE = settings.get_profile("dynatrain-hostile")

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_FILES = sorted((ROOT / "specs").glob("*/*.yaml"))
SHIPPED = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in SHIPPED_FILES]
TINY_DENSE = {
    "model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 8,
              "num_query_groups": 4, "ffn_hidden_size": 128, "vocab_size": 1000},
    "parallel": {"tp": 2, "pp": 2},
    "world": {"nodes": 1, "gpus_per_node": 8},
}
TINY_MOE = {
    "model": {**TINY_DENSE["model"], "num_moe_experts": 8, "moe_ffn_hidden_size": 64},
    "parallel": {"tp": 2, "ep": 2, "etp": 1},
    "world": {"devices": [f"node{n}:gpu{g}" for n in (3, 1) for g in range(4)]},
}
# Most shipped specs name a preset; spelled-out copies let mutations reach every model field.
BASES = (
    SHIPPED
    + [dict(s, model=dict(PRESETS[s["model"]])) for s in SHIPPED if isinstance(s["model"], str)]
    + [dict(s, model={"preset": s["model"]}) for s in SHIPPED if isinstance(s["model"], str)]
    + [TINY_DENSE, TINY_MOE]
)
SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "world": WorldConfig,
            "state": StateConfig}
FIELDS = {
    name: sorted(set(cls.model_fields) | {
        alias for f in cls.model_fields.values()
        for alias in getattr(f.validation_alias, "choices", ())
    })
    for name, cls in SECTIONS.items()
}
TOP_LEVEL = {"spec", "name", *SECTIONS}
ONE_LINE_FIELD = re.compile(r"\S(?:.*\S)?")


def assert_clean_error(err: SpecError, roots: set[str] | None = None) -> None:
    """One printable line, ``field: rule`` with an optional ``(got ...)``, field first."""
    msg = str(err)
    assert msg.splitlines() == [msg], repr(msg)
    assert msg.isprintable(), repr(msg)
    assert len(msg) <= 600, repr(msg)
    assert isinstance(err.field, str) and ONE_LINE_FIELD.fullmatch(err.field), repr(msg)
    assert msg.startswith(f"{err.field}: "), repr(msg)
    assert err.rule and msg[len(err.field) + 2:].startswith(err.rule), repr(msg)
    # pydantic's union-member tags are no place in a spec
    assert "constrained-int" not in err.field and "function-" not in err.field, repr(msg)
    if roots is not None:
        head = err.field.split(".", 1)[0]
        odd_key = re.fullmatch(r"[-+]?(\d.*|inf|nan)|None|True|False", head)
        assert head in roots or err.field[0] in "'\"<" or odd_key, repr(msg)


def outcome(load, arg, roots: set[str] | None = None) -> str:
    """Load ``arg``; a SpecError must be clean, a success must compile. Anything else escapes."""
    try:
        spec = load(arg)
    except SpecError as err:
        assert_clean_error(err, roots)
        return "error"
    assert isinstance(spec, LayoutSpec)
    layout = Layout(spec)
    assert layout.world >= 1 and layout.dp >= 1
    layout.chunks(0)
    layout.chunks(spec.parallel.pp - 1)
    return "ok"


# ---- values --------------------------------------------------------------------------------

# Out of the schema's range, or not numbers Python will print (2**20000 has > 4300 digits;
# built by a map so that hypothesis never has to print the strategy).
HUGE_INTS = st.one_of(
    st.sampled_from([2**40 + 1, 2**53 + 1, 2**63, 2**64, 2**200, -2**200, 10**100, -1, -2**63, 0]),
    st.sampled_from([20000, -20000]).map(lambda e: (1 if e > 0 else -1) * 2 ** abs(e)),
)
# In range and plausible, so that some mutations stay valid and reach the rules and the layout.
# (Valid ints up to 2**40 are left out on purpose: see test_largest_num_layers_is_refused.)
PLAUSIBLE_INTS = st.one_of(st.integers(-3, 130), st.sampled_from([256, 1000, 1024, 4096, 8192]))
ODD_STRINGS = ["", " ", "8", "0x10", "1e3", "2.0", "tp", "bf16", "rope", "RMSNorm",
               "node0:gpu0", "node0:gpu0 ", "llama3.1-8b", "tp-cp-ep-dp-pp", "pp-dp-ep-cp-tp",
               "\n", "a\nb", "\r", "\u2028", "\x00", "\x85", "x" * 1200, "{}", "[]", "null",
               "~", "!!python/object/apply:os.system", "'", '"']
SCALARS = st.one_of(
    st.none(), st.booleans(), PLAUSIBLE_INTS, HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([2.0, -0.0, 1e308, 8.5]),
    st.text(max_size=20), st.sampled_from(ODD_STRINGS), st.binary(max_size=16),
    st.dates(min_value=datetime.date(1900, 1, 1), max_value=datetime.date(2100, 1, 1)),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=6),
    st.dictionaries(st.text(max_size=6), SCALARS, max_size=4),
    st.lists(st.sampled_from(["node0:gpu0", "node0:gpu1", "node1:gpu0", "gpu0", "node0:gpu0"]),
             max_size=10),
)
# Plausible field values: mostly the right type, so mutations often stay valid.
FIELD_VALUES = st.one_of(
    PLAUSIBLE_INTS, st.booleans(), st.none(),
    st.sampled_from(["bf16", "fp16", "fp32", "rope", "none", "learned_absolute", "LayerNorm",
                     "RMSNorm", "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "pp-tp-cp-ep-dp"]),
    st.lists(st.integers(0, 1), min_size=1, max_size=130),
    VALUES,
)
UNKNOWN_KEYS = st.one_of(
    st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8).map(lambda s: "x_" + s),
    st.sampled_from(["a\nb", "a b", "a.b", "", " ", "\x00", "é", "x" * 300, "x_" + "y" * 100]),
    st.integers(-5, 2**70), st.none(), st.booleans(), st.floats(allow_nan=False),
)


def nested(value, depth: int, kind: str):
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


# ---- mutations of shipped specs ------------------------------------------------------------

def containers(node, path=(), depth=0):
    """(path, container) of every dict and list in ``node``, shallow first (deep ones skipped)."""
    if depth > 6:
        return
    if isinstance(node, (dict, list)):
        yield path, node
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            yield from containers(v, path + (k,), depth + 1)


def op_replace_leaf(spec, data):
    path, node = data.draw(st.sampled_from(list(containers(spec))))
    if not node:
        return
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    node[data.draw(st.sampled_from(keys))] = data.draw(VALUES)


def op_set_field(spec, data):
    section = data.draw(st.sampled_from(sorted(SECTIONS)))
    if isinstance(spec.get(section), str):  # a preset name: keep it, override a field
        spec[section] = {"preset": spec[section]}
    if not isinstance(spec.get(section), dict):
        spec[section] = {}
    spec[section][data.draw(st.sampled_from(FIELDS[section]))] = data.draw(FIELD_VALUES)


def op_delete_key(spec, data):
    dicts = [node for _, node in containers(spec) if isinstance(node, dict) and node]
    if dicts:
        node = data.draw(st.sampled_from(dicts))
        del node[data.draw(st.sampled_from(list(node)))]


def op_add_unknown(spec, data):
    dicts = [node for _, node in containers(spec) if isinstance(node, dict)]
    data.draw(st.sampled_from(dicts))[data.draw(UNKNOWN_KEYS)] = data.draw(VALUES)


def op_nest(spec, data):
    path, node = data.draw(st.sampled_from(list(containers(spec))))
    if not node:
        return
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    key = data.draw(st.sampled_from(keys))
    depth = data.draw(st.sampled_from([1, 2, 10, 100, 3000]))
    node[key] = nested(node[key], depth, data.draw(st.sampled_from(["list", "dict"])))


def op_replace_section(spec, data):
    spec[data.draw(st.sampled_from(sorted(TOP_LEVEL - {"spec"})))] = data.draw(VALUES)


OPS = [op_replace_leaf, op_set_field, op_set_field, op_delete_key, op_add_unknown, op_nest,
       op_replace_section]


def yaml_text(spec) -> str | None:
    """The spec as YAML, or None where PyYAML itself cannot write it (too deep, too big)."""
    try:
        return yaml.safe_dump(spec, sort_keys=False)
    except (RecursionError, ValueError, yaml.YAMLError):
        return None


@settings(HOSTILE, max_examples=1200)
@given(data=st.data())
def test_mutated_shipped_specs(data):
    spec = copy.deepcopy(data.draw(st.sampled_from(BASES), label="base"))
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        data.draw(st.sampled_from(OPS), label="op")(spec, data)
    roots = TOP_LEVEL | {k for k in spec if isinstance(k, str)}
    got = outcome(spec_from_dict, spec, roots)
    text = yaml_text(spec)
    if text is not None and len(text) <= MAX_SPEC_BYTES:
        # The same spec through YAML must come out the same way.
        assert outcome(parse_spec, text, roots) == got


def test_mutations_reach_both_outcomes():
    """The strategy is not all-reject: some mutated specs stay valid and compile."""
    seen = []

    @settings(HOSTILE, max_examples=200)
    @given(data=st.data())
    def run(data):
        spec = copy.deepcopy(data.draw(st.sampled_from(BASES)))
        data.draw(st.sampled_from([op_set_field, op_add_unknown]))(spec, data)
        seen.append(outcome(spec_from_dict, spec))

    run()
    assert "ok" in seen and "error" in seen


# ---- not YAML, or YAML of the wrong shape --------------------------------------------------

YAML_CHARS = "{}[]:,-?&*!|>'\"%@`#<=~ \n\t\r\x00\ufeffab01._"


@settings(HOSTILE, max_examples=250)
@given(text=st.one_of(st.text(max_size=200), st.text(alphabet=YAML_CHARS, max_size=120)))
def test_arbitrary_text(text):
    outcome(parse_spec, text)


JSONISH = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)


@settings(HOSTILE, max_examples=250)
@given(value=st.one_of(
    JSONISH,
    st.fixed_dictionaries({"model": JSONISH, "parallel": JSONISH, "world": JSONISH}),
    st.fixed_dictionaries({"model": st.sampled_from(sorted(PRESETS)), "world": JSONISH}),
))
def test_yaml_of_the_wrong_shape(value):
    text = yaml_text(value)
    if text is not None:
        outcome(parse_spec, text)
    outcome(spec_from_dict, value)


@pytest.mark.parametrize("value", [None, b"model: llama3.1-8b", 3, ["model"], bytearray(b"x")])
def test_parse_spec_takes_only_text(value):
    outcome(parse_spec, value)


@pytest.mark.parametrize("value", [None, 3, "model: x", [], (), {1: 2}, {None: None},
                                   {"model": {"preset": 2**20000}}, {(1, 2): 3},
                                   {"model": "llama3.1-8b", "world": {"nodes": 2**20000}}])
def test_spec_from_dict_takes_anything(value):
    outcome(spec_from_dict, value)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


@settings(HOSTILE, max_examples=150)
@given(blob=st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"\xff\xfe\x00", "\ufeffmodel: llama3.1-8b".encode(), b"\x00" * 100]),
))
def test_spec_files_of_random_bytes(scratch, blob):
    path = scratch / "random.yaml"
    path.write_bytes(blob)
    outcome(load_spec, path)


def test_unreadable_paths(scratch):
    for source in [scratch, scratch / "missing.yaml", "a\x00b.yaml", "/dev/zero", "/dev/null",
                   3, None, b"specs"]:
        outcome(load_spec, source)


def test_oversized_file_is_refused(scratch):
    path = scratch / "big.yaml"
    path.write_bytes(b"# " + b"x" * MAX_SPEC_BYTES)
    with pytest.raises(SpecError, match="at most"):
        load_spec(path)


# ---- YAML that tries to construct objects ----------------------------------------------------

@pytest.fixture(scope="module")
def marker(tmp_path_factory):
    return tmp_path_factory.mktemp("marker") / "executed"


def payloads(marker: Path) -> list[str]:
    """Tag-and-argument texts that would create ``marker`` if any of them were constructed."""
    m = str(marker)
    return [
        f'!!python/object/apply:os.system ["touch {m}"]',
        f'!!python/object/new:os.system ["touch {m}"]',
        f'!!python/object/apply:subprocess.check_call [["touch", "{m}"]]',
        f'!!python/object/apply:builtins.open ["{m}", "w"]',
        f'!!python/object/apply:builtins.exec ["open(\'{m}\', \'w\')"]',
        f'!!python/object/apply:builtins.eval ["__import__(\'os\').system(\'touch {m}\')"]',
        f'!!python/object/apply:os.system {{args: ["touch {m}"]}}',
        f'!<tag:yaml.org,2002:python/object/apply:os.system> ["touch {m}"]',
        f'!<tag:yaml.org,2002:python/object/apply:os.sys%74em> ["touch {m}"]',
        f'!<tag:yaml.org,2002:python/object/apply:pathlib.Path.touch> ["{m}"]',
        "!!python/name:os.system",
        "!!python/module:os",
        "!!python/object:builtins.dict {a: 1}",
        "!!python/tuple [1, 2]",
        "!!python/bytes aGk=",
        "!!binary aGVsbG8=",
        "!!binary '!!!not base64'",
        "!!binary 'é'",
        "!!set {a, b}",
        "!!set [a, b]",
        "!!omap [a: 1, b: 2]",
        "!!omap {a: 1}",
        "!!pairs [a: 1, a: 2]",
        "!!timestamp 2001-12-14t21:59:43.10-05:00",
        "!!timestamp not-a-time",
        "!!timestamp 2001-13-45",
        '!!int ""',
        "!!int 0x",
        "!!int 1e5",
        "!!int ':'",
        '!!float ""',
        "!!float abc",
        "!!bool maybe",
        "!!null x",
        "!!str",
        "!!map [1, 2]",
        "!!seq {a: 1}",
        "!!merge x",
        "!!value x",
        "!custom 1",
        "!!custom 1",
        "!<!> 1",
    ]


POSITIONS = [
    "{p}",
    "model: {p}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: llama3.1-8b\nparallel: {{tp: {p}}}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: llama3.1-8b\nparallel:\n  tp: {p}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "name: {p}\nmodel: llama3.1-8b\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: llama3.1-8b\nworld:\n  devices:\n  - node0:gpu0\n  - {p}",
    "? {p}\n: 1\nmodel: llama3.1-8b\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: {{preset: {p}}}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "%TAG !p! tag:yaml.org,2002:python/\n--- \nmodel: llama3.1-8b\nx: {p}",
]


@settings(HOSTILE, max_examples=300)
@given(data=st.data())
def test_hostile_tags(marker, data):
    payload = data.draw(st.sampled_from(payloads(marker)))
    text = data.draw(st.sampled_from(POSITIONS)).format(p=payload)
    outcome(parse_spec, text)
    assert not marker.exists(), f"a YAML payload ran: {text!r}"


def test_every_hostile_tag_everywhere(marker):
    """The same, exhaustively: every payload at every position."""
    for payload in payloads(marker):
        for position in POSITIONS:
            outcome(parse_spec, position.format(p=payload))
    # %TAG handles spell the python tags without writing them out.
    outcome(parse_spec, f'%TAG !p! tag:yaml.org,2002:python/\n--- !p!object/apply:os.system '
                        f'["touch {marker}"]\n')
    assert not marker.exists()


def test_os_system_payload_prints_nothing(capfd):
    """The issue's own example: refused as an unsafe tag, and no shell ever echoes."""
    with pytest.raises(SpecError) as info:
        parse_spec('!!python/object/apply:os.system ["echo hi"]')
    assert str(info.value) == ("spec: unsafe YAML tag !!python/object/apply:os.system refused "
                               "at line 1 (specs are plain data)")
    out, err = capfd.readouterr()
    assert "hi" not in out and "hi" not in err


# ---- bombs, deep nesting, huge documents -----------------------------------------------------

def laughs(levels: int, width: int) -> tuple[str, str]:
    """Anchors ``l0`` .. ``l{levels-1}``, each a list of ``width`` aliases of the one before."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n", f"*l{levels - 1}"


def merges(levels: int, width: int) -> tuple[str, str]:
    """Anchors ``m0`` .. whose ``<<`` merge keys copy the level below ``width`` times."""
    lines = ["m0: &m0 {a: 1, b: 2}"]
    for i in range(1, levels):
        lines.append(f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * width)}]}}")
    return "\n".join(lines) + "\n", f"*m{levels - 1}"


BOMB_USES = [
    "model: {b}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: llama3.1-8b\nparallel: {{tp: {b}}}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: llama3.1-8b\nname: {b}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: llama3.1-8b\nworld: {{devices: {b}}}",
    "model: {{preset: qwen3-30b-a3b, moe_layer_freq: {b}}}\nworld: {{nodes: 1, "
    "gpus_per_node: 8}}",
    "model: {{preset: {b}}}\nworld: {{nodes: 1, gpus_per_node: 8}}",
    "model: llama3.1-8b\nworld: {{nodes: 1, gpus_per_node: 8}}\nextra: {b}",
    "model: llama3.1-8b\nworld: {{nodes: 1, gpus_per_node: 8, first_node: {b}}}",
    "state: {{param: {b}}}\nmodel: llama3.1-8b\nworld: {{nodes: 1, gpus_per_node: 8}}",
]


def bounded(text: str, seconds: float = 5.0, mib: float | None = 64) -> None:
    """Load ``text``: a clean SpecError, in bounded time (and memory, traced where ``mib``)."""
    if mib is not None:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(SpecError) as info:
            parse_spec(text)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] if mib is not None else 0
    finally:
        tracemalloc.stop()
    assert_clean_error(info.value)
    assert elapsed < seconds, f"{elapsed:.1f} s for {text[:80]!r}"
    assert mib is None or peak < mib * 2**20, f"{peak / 2**20:.0f} MiB for {text[:80]!r}"


@pytest.mark.parametrize("use", BOMB_USES)
@pytest.mark.parametrize("bomb", ["laughs", "merges", "merge-fan-out"])
def test_bombs_are_cheap(bomb, use):
    anchors, alias = {"laughs": laughs(12, 10), "merges": merges(60, 2),
                      "merge-fan-out": merges(3, 300)}[bomb]
    bounded(anchors + use.format(b=alias))


@settings(HOSTILE, max_examples=100)
@given(levels=st.integers(1, 30), width=st.integers(1, 12), kind=st.sampled_from(["l", "m"]),
       use=st.sampled_from(BOMB_USES))
def test_random_bombs(levels, width, kind, use):
    anchors, alias = (laughs if kind == "l" else merges)(levels, width)
    t0 = time.perf_counter()
    outcome(parse_spec, anchors + use.format(b=alias))
    assert time.perf_counter() - t0 < 5.0


def test_small_merges_still_work():
    text = ("parallel: &p {tp: 2, pp: 2}\nmodel: {<<: {preset: llama3.1-8b}, num_layers: 8}\n"
            "world: {<<: [{nodes: 1}, {gpus_per_node: 8}]}\n")
    spec = parse_spec(text)
    assert (spec.parallel.tp, spec.model.num_layers, spec.world.gpus_per_node) == (2, 8, 8)


@pytest.mark.parametrize("text", [
    "a: &a [*a]",
    "&a [*a]",
    "&a {model: *a, world: *a}",
    "model: &m {preset: llama3.1-8b, x: *m}\nworld: {nodes: 1, gpus_per_node: 8}",
    "model: llama3.1-8b\nworld: &w {nodes: 1, gpus_per_node: 8, devices: [*w]}",
    "m: &m {<<: *m}\nmodel: llama3.1-8b",
    "a: &a {<<: *b}\nb: &b {<<: *a}",
    "model: *undefined",
])
def test_recursive_and_undefined_aliases(text):
    bounded(text)


# PyYAML gives up at Python's recursion limit; on one line its scanner first weighs every open
# bracket within 1024 characters as a possible key, so each of these costs about a second.
@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,
    "model: {a: " * 5000 + "1" + "}" * 5000 + "\nworld: {nodes: 1, gpus_per_node: 8}",
    "".join(" " * i + "- \n" for i in range(0, 4000, 2)),
    "".join(" " * i + f"k{i}:\n" for i in range(0, 4000, 2)),
    "x: " + "!!seq " * 1000 + "[]",
    "- &a " * 3000,
], ids=["flow-list", "flow-map", "block-list", "block-map", "tags", "anchors"])
def test_deep_nesting(text):
    bounded(text, seconds=20, mib=None)


@pytest.mark.parametrize("text", [
    "x: " + "1" * 100_000,
    "x: 1" + ":1" * 300_000,
    "x: !!int '" + "9" * 100_000 + "'",
    "x: 0b" + "1" * 400_000,
    "x: 1." + "1" * 400_000,
    "model: llama3.1-8b\nparallel: {tp: " + "9" * 999 + "}\nworld: {nodes: 1, gpus_per_node: 8}",
    "model: llama3.1-8b\nparallel: {tp: " + "9" * 5000 + "}\nworld: {nodes: 1, gpus_per_node: 8}",
    "model: llama3.1-8b\nworld: {devices: [" + ", ".join(["node0:gpu0"] * 10_000) + "]}",
    "model: llama3.1-8b\nworld: {nodes: 1, gpus_per_node: 8}\n" + "".join(
        f"k{i}: {i}\n" for i in range(10_000)),
    "name: '" + "x" * (MAX_SPEC_BYTES - 20) + "'",
    "# " + "x" * MAX_SPEC_BYTES,
], ids=["long-int", "sexagesimal", "tagged-int", "binary-int", "long-float", "999-digits",
        "5000-digits", "devices-10k", "keys-10k", "name-1MiB", "over-limit"])
def test_huge_documents(text):
    bounded(text, seconds=20, mib=None)


def test_huge_numbers_are_named():
    base = "model: llama3.1-8b\nworld: {{nodes: 1, gpus_per_node: 8}}\nparallel: {{tp: {v}}}"
    for v, fragment in [(2**200, "less than or equal"), (-(2**63), "greater than or equal"),
                        (0, "greater than or equal"), ("9" * 999, "less than or equal")]:
        with pytest.raises(SpecError, match=fragment) as info:
            parse_spec(base.format(v=v))
        assert info.value.field == "parallel.tp"
        assert_clean_error(info.value)


# num_layers up to the schema's 2**40 passes every rule, and the pipeline map then builds a tuple
# of every layer index: MemoryError at 2**40, minutes and gigabytes at 10**9. Run in a child
# with a 2 GiB address-space cap so the failure is quick and cannot hurt the test machine.
_CHILD = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from dynatrain.ir.errors import SpecError
    from dynatrain.ir.loader import spec_from_dict
    try:
        spec_from_dict({"model": {"preset": "llama3.1-8b", "num_layers": int(sys.argv[1])},
                        "world": {"nodes": 1, "gpus_per_node": 8}})
    except SpecError as err:
        print("refused:", err)
    else:
        print("accepted")
""")


@pytest.mark.skipif(sys.platform != "linux", reason="needs RLIMIT_AS")
@pytest.mark.parametrize("num_layers", [10**9, 2**40])
def test_largest_num_layers_is_refused(num_layers):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(num_layers)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("refused: model.num_layers"), (
        proc.stdout + proc.stderr[-300:])


# ---- pipeline layout strings and the bucket padding flag -----------------------------------

LAYOUT_ALPHABET = "EEtttttLLm||||()**0123456789,x \u0663"


@settings(HOSTILE, max_examples=400)
@given(text=st.one_of(st.text(alphabet=LAYOUT_ALPHABET, max_size=40),
                      st.sampled_from(["", "|", "E" + "(t*99999999)" * 3 + "L",
                                       "E" + "(" * 500 + "t" + ")*2" * 500 + "L",
                                       "E(t|)*" + "9" * 5000 + "L", "Et*\u0663|tL"])),
       pp=st.sampled_from([1, 2, 3]), vpp=st.sampled_from([None, 1, 2]))
def test_hostile_pipeline_layouts(text, pp, vpp):
    """Any layout string gives a compiled layout or one clean line, fast: refusals name the
    layout (or the vpp/pp it disagrees with)."""
    spec = copy.deepcopy(TINY_DENSE)
    spec["parallel"] = {"pp": pp, "pipeline_model_parallel_layout": text, "vpp": vpp,
                        "pad_buckets_for_high_nccl_busbw": True}
    spec["model"]["num_layers"] = 4
    spec["world"] = {"nodes": 1, "gpus_per_node": 2 * pp}
    start = time.perf_counter()
    try:
        layout = Layout(spec_from_dict(spec))
    except SpecError as err:
        assert_clean_error(err, TOP_LEVEL)
        assert err.field in ("parallel.pipeline_model_parallel_layout", "parallel.vpp",
                             "parallel.pp"), str(err)
    else:
        assert sum(len(c.layers) for r in range(pp) for c in layout.chunks(r)) == 4
    assert time.perf_counter() - start < 2.0


def test_hostile_layout_types_and_cli_exit_code(tmp_path):
    for bad in (["E", "tttttttt", "L"], 3, {"E": 1}, True, "x" * 70000):
        spec = copy.deepcopy(TINY_DENSE)
        spec["parallel"] = {"pp": 2, "pipeline_model_parallel_layout": bad}
        with pytest.raises(SpecError) as err:
            spec_from_dict(spec)
        assert_clean_error(err.value, TOP_LEVEL)
        assert err.value.field == "parallel.pipeline_model_parallel_layout"
    path = tmp_path / "bad-layout.yaml"
    path.write_text("model: {num_layers: 4, hidden_size: 64, num_attention_heads: 4, "
                    "vocab_size: 100}\nparallel: {pp: 2, pipeline_model_parallel_layout: "
                    "'Et|t(t|tL', pad_buckets_for_high_nccl_busbw: true}\n"
                    "world: {nodes: 1, gpus_per_node: 2}\n")
    proc = subprocess.run([sys.executable, "-m", "dynatrain.cli", "layout", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        "dynatrain: error: parallel.pipeline_model_parallel_layout: has the invalid layer "
        "character '(' after unrolling (known: E embedding, t decoder layer, m MTP layer, "
        "L loss; '(...)*n', 'x*n', ',' and '|' as separators) (got 'Et|t(t|tL')"], proc.stderr
