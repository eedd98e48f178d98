"""A key written twice in one mapping is refused, naming the key, in every document read.

``yaml.safe_load`` and ``json.loads`` keep the last of two equal keys: a spec with two
``parallel:`` blocks took its tp from the second, a plan with two ``budget_bytes`` the later
one. The property tests take valid spec and plan documents, write a duplicate of a key into a
random mapping (with the same value or another) and check the refusal; the CLI tests cover the
other documents (topology files, HuggingFace configs, Megatron argument dumps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynatrain as dt
from dynatrain.ir.errors import DynatrainError, SpecError
from dynatrain.ir.loader import parse_spec
from dynatrain.ir.strict import DuplicateKeyError, json_loads, safe_load
from test_cli_errors import assert_one_error_line, run_main

ROOT = Path(__file__).resolve().parent.parent
SPEC_FILES = sorted((ROOT / "specs").glob("*/*.yaml"))
SPEC_TEXTS = [p.read_text(encoding="utf-8") for p in SPEC_FILES]
TINY_SRC = ROOT / "specs" / "tiny-gpt" / "pp2-dp2.yaml"
TINY_DST = ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml"
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 1000}
PROFILE = settings(derandomize=True, database=None, deadline=None, max_examples=150,
                   suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    dt.save_plan(dt.plan(TINY_SRC, TINY_DST), path)
    return path.read_text(encoding="utf-8")


def _mappings(node: yaml.Node, out: list) -> list:
    if isinstance(node, yaml.MappingNode):
        if node.value:
            out.append(node)
        for k, v in node.value:
            _mappings(k, out)
            _mappings(v, out)
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            _mappings(v, out)
    return out


@settings(PROFILE)
@given(st.sampled_from(SPEC_TEXTS), st.data())
def test_spec_with_a_duplicate_key_is_refused_naming_it(text, data):
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    mapping = data.draw(st.sampled_from(_mappings(root, [])))
    key, value = data.draw(st.sampled_from(mapping.value))
    # the same value again, another key's value, or a plain scalar
    other = data.draw(st.sampled_from([value, *(v for _, v in mapping.value),
                                       yaml.ScalarNode("tag:yaml.org,2002:int", "1")]))
    at = data.draw(st.integers(0, len(mapping.value)))
    mapping.value.insert(at, (yaml.ScalarNode(key.tag, key.value), other))
    bad = yaml.serialize(root, Dumper=yaml.SafeDumper)
    with pytest.raises(SpecError) as err:
        parse_spec(bad, "spec.yaml")
    msg = str(err.value)
    assert f"duplicate key {key.value!r}" in msg and "\n" not in msg, msg
    assert msg.startswith("spec.yaml: "), msg


def _objects(doc, path=()) -> list[tuple]:
    """Paths (tuples of keys and indexes) of every non-empty JSON object in ``doc``."""
    out = []
    if isinstance(doc, dict):
        if doc:
            out.append(path)
        for k, v in doc.items():
            out.extend(_objects(v, path + (k,)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.extend(_objects(v, path + (i,)))
    return out


def _dump_with(doc, target: tuple, extra: tuple[int, str, object], path=()) -> str:
    """``doc`` as JSON, with the object at ``target`` given one more (key, value) pair at
    position ``extra[0]`` (json.dumps cannot write a key twice)."""
    if isinstance(doc, dict):
        pairs = [(k, _dump_with(v, target, extra, path + (k,))) for k, v in doc.items()]
        if path == target:
            at, k, v = extra
            pairs.insert(at, (k, json.dumps(v)))
        return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"
    if isinstance(doc, list):
        return "[" + ",".join(_dump_with(v, target, extra, path + (i,))
                              for i, v in enumerate(doc)) + "]"
    return json.dumps(doc)


@settings(PROFILE)
@given(st.data())
def test_plan_with_a_duplicate_key_is_refused_naming_it(plan_text, tmp_path_factory, data):
    doc = json.loads(plan_text)
    target = data.draw(st.sampled_from(_objects(doc)))
    obj = doc
    for step in target:
        obj = obj[step]
    key = data.draw(st.sampled_from(sorted(obj)))
    value = data.draw(st.sampled_from([obj[key], 0, "x", None]))
    at = data.draw(st.integers(0, len(obj)))
    path = tmp_path_factory.mktemp("dup") / "plan.json"
    path.write_text(_dump_with(doc, target, (at, key, value)), encoding="utf-8")
    with pytest.raises(DynatrainError) as err:
        dt.load_plan(path)
    msg = str(err.value)
    assert f"duplicate key {key!r}" in msg and "\n" not in msg, msg


def test_two_parallel_blocks_refused(tmp_path, capsys):
    spec = tmp_path / "two.yaml"
    spec.write_text("model: llama3.1-8b\nparallel: {tp: 2}\nworld: {nodes: 1, gpus_per_node: 8}"
                    "\nparallel: {tp: 4}\n")
    line = assert_one_error_line(*run_main(["layout", str(spec)], capsys),
                                 "duplicate key 'parallel' at line 4 (first at line 2)")
    assert line.startswith("dynatrain: error: two.yaml: "), line


def test_two_budget_bytes_refused(plan_text, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(plan_text.replace('"budget_bytes":', '"budget_bytes":1,"budget_bytes":', 1))
    assert_one_error_line(*run_main(["verify", str(path)], capsys),
                          "duplicate key 'budget_bytes'")


def test_topology_file_duplicate_refused(tmp_path, capsys):
    topo = tmp_path / "topo.yaml"
    topo.write_text("inter_node_GBps: 50\nlatency_us: 5\ninter_node_GBps: 25\n")
    assert_one_error_line(*run_main(["plan", str(TINY_SRC), str(TINY_DST), "--topology",
                                     str(topo)], capsys),
                          "duplicate key 'inter_node_GBps' at line 3 (first at line 1)")


@pytest.mark.parametrize("option", ["--from-hf", "--from-args"])
def test_json_configs_duplicate_refused(option, tmp_path, capsys):
    path = tmp_path / "config.json"
    body = json.dumps(HF_CONFIG)[1:]
    path.write_text('{"hidden_size": 32, ' + body)
    argv = ["spec", option, str(path), "--world", "nodes=1,gpus_per_node=8"]
    if option == "--from-hf":
        argv += ["--parallel", "tp=2"]
    assert_one_error_line(*run_main(argv, capsys), "duplicate key 'hidden_size'")


def test_merge_keys_may_override_what_they_merge():
    # Overriding a merged key is what a merge is for, not a duplicate.
    assert safe_load("a: &a {x: 1, y: 2}\nb: {<<: *a, x: 3}\n")["b"] == {"x": 3, "y": 2}
    with pytest.raises(DuplicateKeyError):
        safe_load("b: {x: 1, x: 1}\n")


def test_json_without_duplicates_reads_as_json_loads(plan_text):
    assert json_loads(plan_text) == json.loads(plan_text)


def test_checkpoint_metadata_json_duplicate_refused(tmp_path):
    # The backend named twice: the first would be read as torch_dist, the last wins in json.
    (tmp_path / "metadata.json").write_text(
        '{"sharded_backend": "zarr", "sharded_backend": "torch_dist", '
        '"sharded_backend_version": 1}')
    from dynatrain.checkpoint.format import CheckpointError, open_checkpoint

    with pytest.raises(CheckpointError, match="sharded_backend"):
        open_checkpoint(tmp_path)
