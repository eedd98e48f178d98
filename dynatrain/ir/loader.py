"""Read a layout spec from YAML text or a file into a validated ``LayoutSpec``.

Only PyYAML's ``SafeLoader`` is used, the loader behind ``yaml.safe_load`` (as
``strict.StrictSafeLoader``, which also refuses a key written twice in one mapping): YAML tags
that construct objects (``!!python/object/apply:...``) are refused, and named as such, since
specs are plain data. Documents that would take far longer to build than to read
(merge-key bombs, huge numbers) are refused before they are built. Every failure, whatever the
input, surfaces as a single ``SpecError`` with a one-line message.
"""

from __future__ import annotations

import os
import re
import reprlib
import unicodedata
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .errors import SpecError
from .presets import PRESETS
from .rules import check_rules
from .spec import LayoutSpec
from .strict import DuplicateKeyError, StrictSafeLoader, read_bounded

MAX_SPEC_BYTES = 1 << 20
MAX_MAPPING_ENTRIES = 1 << 16  # after merge keys; a real spec has a few dozen
MAX_NUMBER_CHARS = 1000  # an int past 2**40 is out of range anyway; 1000 still shows 2**200
_YAML_TAG_PREFIX = "tag:yaml.org,2002:"
_MERGE_TAG = _YAML_TAG_PREFIX + "merge"
_INT_TAG = "tag:yaml.org,2002:int"
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")


def load_spec(source: str | os.PathLike[str]) -> LayoutSpec:
    """Load and validate a spec from a path.

    Raises:
        SpecError: the file cannot be read, is not YAML, or breaks a rule.
    """
    try:
        path = Path(source)
    except TypeError:
        raise SpecError("spec", "a spec path must be a string or a path", _kind(source)) from None
    where = _label(str(path))
    try:
        data = read_bounded(path, MAX_SPEC_BYTES)  # /dev/zero, a pipe: never read whole
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise SpecError(where, f"cannot read the spec file: {err.__class__.__name__}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(where, f"a spec file must be at most {MAX_SPEC_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(where, "cannot read the spec file: it is not UTF-8 text") from None
    return parse_spec(text, origin=_label(path.name))


def parse_spec(text: str, origin: str = "spec") -> LayoutSpec:
    """Parse and validate spec YAML text.

    Example:
        >>> parse_spec("model: llama3.1-8b\\nparallel: {tp: 8}\\nworld: {nodes: 1, gpus_per_node: 8}").parallel.tp
        8
    """
    if not isinstance(text, str):
        raise SpecError(origin, "a spec must be YAML text", type(text).__name__)
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(origin, f"a spec must be at most {MAX_SPEC_BYTES} characters", len(text))
    try:
        raw = _safe_load(text, origin)
    except SpecError:
        raise
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(origin, f"is not valid YAML{where}") from None
    except Exception as err:  # noqa: BLE001
        # PyYAML's safe constructors raise bare IndexError / KeyError / AttributeError on
        # malformed tagged scalars (``!!int ""``, ``!!bool x``, ``!!timestamp x``), and deep
        # nesting ends in RecursionError: all of them are bad input, not bugs of ours.
        raise SpecError(origin, f"is not valid YAML ({err.__class__.__name__})") from None
    return spec_from_dict(raw, origin)


def _safe_load(text: str, origin: str) -> Any:
    """``yaml.safe_load``, split in two so the node graph is checked before it is built.

    The SafeLoader builds no objects beyond plain data, but two of its plain-data features cost
    far more than the text they come from: ``<<`` merge keys copy whole mappings (each level of
    ``&aN {<<: [*aM, *aM]}`` doubles the work, so a 1 KiB document never finishes) and a
    sexagesimal int (``1:2:3:...``) is summed in quadratic time. Plain aliases are safe: the
    loader builds each aliased node once and shares it.
    """
    loader = StrictSafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:  # an empty document
            return None
        _refuse_bombs(node, origin)
        try:
            return loader.construct_document(node)
        except DuplicateKeyError as err:
            raise SpecError(origin, str(err)) from None
        except yaml.constructor.ConstructorError:
            # Most often a tag the SafeLoader has no constructor for: name it, since the
            # document is valid YAML that we refuse, not text we failed to read.
            refused = _unknown_tag(node)
            if refused is None:
                raise
            raise SpecError(origin, _tag_refusal(refused)) from None
    finally:
        loader.dispose()


def _unknown_tag(root: yaml.Node) -> yaml.Node | None:
    """The first node (document order) whose tag ``yaml.safe_load`` cannot construct."""
    known = yaml.SafeLoader.yaml_constructors
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.tag not in known:
            return node
        if isinstance(node, yaml.MappingNode):
            # A ``<<`` key is a merge, not a value: the loader never constructs it.
            pairs = [(v,) if k.tag == _MERGE_TAG else (k, v) for k, v in node.value]
            todo.extend(reversed([n for pair in pairs for n in pair]))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend(reversed(node.value))
    return None


def _tag_refusal(node: yaml.Node) -> str:
    """``unsafe YAML tag !!python/object/apply:os.system refused at line 1 (...)``."""
    tag = node.tag
    if tag.startswith(_YAML_TAG_PREFIX):  # the form people write: !!python/..., !!merge
        tag = "!!" + tag[len(_YAML_TAG_PREFIX):]
    # %-escapes in tags decode to any character: keep the line printable and short.
    shown = tag if tag.isprintable() and len(tag) <= 80 else _BRIEF.repr(tag)
    what = "unsafe" if tag.startswith("!!python/") else "unknown"
    return (f"{what} YAML tag {shown} refused at line {node.start_mark.line + 1} (specs are "
            "plain data)")


def _refuse_bombs(root: yaml.Node, origin: str) -> None:
    """Raise ``SpecError`` for a document that would take far longer to build than to read."""
    expanded: dict[int, int] = {}

    def entries(node: yaml.MappingNode) -> int:
        """How many entries the mapping has once its merge keys are expanded."""
        if id(node) not in expanded:
            expanded[id(node)] = 0  # a merge cycle adds nothing (PyYAML drops the key first)
            n = 0
            for key, value in node.value:
                if key.tag != _MERGE_TAG:
                    n += 1
                    continue
                for m in value.value if isinstance(value, yaml.SequenceNode) else [value]:
                    n += entries(m) if isinstance(m, yaml.MappingNode) else 0
            expanded[id(node)] = n
        return expanded[id(node)]

    total, seen, todo = 0, set(), [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            total += entries(node)
            if total > MAX_MAPPING_ENTRIES:
                raise SpecError(origin, f"expands to more than {MAX_MAPPING_ENTRIES} mapping "
                                "entries (YAML merge keys)")
            todo.extend(n for pair in node.value for n in pair)
        elif isinstance(node, yaml.SequenceNode):
            todo.extend(node.value)
        elif node.tag == _INT_TAG and len(node.value) > MAX_NUMBER_CHARS:
            raise SpecError(origin, f"has an integer of {len(node.value)} characters at line "
                            f"{node.start_mark.line + 1} (at most {MAX_NUMBER_CHARS})")


def spec_from_dict(raw: Any, origin: str = "spec") -> LayoutSpec:
    """Validate an already-parsed mapping (e.g. from YAML or JSON)."""
    if not isinstance(raw, dict):
        raise SpecError(origin, "a spec must be a mapping with model, parallel and world", _kind(raw))
    raw = dict(raw)
    if "model" in raw:
        raw["model"] = _resolve_model(raw["model"])
    try:
        spec = LayoutSpec.model_validate(raw)
    except ValidationError as err:
        raise _first_error(err) from None
    except (RecursionError, ValueError, TypeError, OverflowError) as err:
        raise SpecError(origin, f"cannot be validated ({err.__class__.__name__})") from None
    check_rules(spec)
    _check_name(spec.name)
    return spec


# Unicode categories a name must not hold: controls (Cc: newlines, escapes), format characters
# (Cf: bidirectional overrides such as U+202E, zero-width joiners), separators other than the
# space (Zl, Zp), unassigned and private-use code points. A name is printed on terminals and
# in reports: a right-to-left override would show it reversed, an escape would drive the terminal.
_BAD_NAME_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
MAX_NAME_CHARS = 200


def _check_name(name: str | None) -> None:
    if name is None:
        return
    if len(name) > MAX_NAME_CHARS:
        raise SpecError("name", f"must be at most {MAX_NAME_CHARS} characters", len(name))
    for i, ch in enumerate(name):
        if unicodedata.category(ch) in _BAD_NAME_CATEGORIES or (ch.isspace() and ch != " "):
            raise SpecError("name", f"must be printable text: character {i} is "
                            f"U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character')}); "
                            "control, bidirectional and other invisible characters are refused")


def _resolve_model(model: Any) -> Any:
    """A preset name, or a mapping with an optional ``preset`` key plus overrides."""
    if isinstance(model, str):
        if model not in PRESETS:
            raise SpecError("model", f"unknown preset; known: {', '.join(sorted(PRESETS))}", model)
        return dict(PRESETS[model])
    if isinstance(model, dict) and "preset" in model:
        name = model["preset"]
        if not isinstance(name, str) or name not in PRESETS:
            raise SpecError(
                "model.preset", f"unknown preset; known: {', '.join(sorted(PRESETS))}",
                _shown(name),
            )
        rest = {k: v for k, v in model.items() if k != "preset"}
        return {**PRESETS[name], **rest}
    return model


def _first_error(err: ValidationError) -> SpecError:
    errors = err.errors(include_url=False)
    first = errors[0]
    field = _field_path(first["loc"])
    # A union field (moe_layer_freq: int or list) reports one error per member; the deepest one
    # names the bad entry (``model.moe_layer_freq.3``) instead of "should be an integer".
    for other in errors[1:]:
        path = _field_path(other["loc"])
        if path.startswith(field + "."):
            first, field = other, path
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    elif first["type"] == "missing":
        msg = "is required"
    elif first["type"] == "value_error":  # our validators' words, without pydantic's prefix
        msg = msg.removeprefix("Value error, ")
    elif first["type"] in ("model_type", "dict_type"):
        msg = "must be a preset name or a mapping" if field == "model" else "must be a mapping"
    value = first.get("input")
    got = None if first["type"] == "missing" or isinstance(value, dict) else _shown(value)
    return SpecError(field, _one_line(msg), got)


def _field_path(loc: tuple[Any, ...]) -> str:
    """Dotted path of a pydantic error location.

    Inside a leaf field (one that is not a section model) the only places are list indexes; the
    strings pydantic puts there are the tags of union members (``constrained-int``), which name
    no place in the spec, so they are dropped.
    """
    parts: list[str] = []
    model: type[BaseModel] | None = LayoutSpec
    for step in loc:
        if model is not None:
            parts.append(_segment(step))
            field = model.model_fields.get(step) if isinstance(step, str) else None
            sub = field.annotation if field is not None else None
            model = sub if isinstance(sub, type) and issubclass(sub, BaseModel) else None
        elif isinstance(step, int):
            parts.append(str(step))
    return ".".join(parts) or "spec"


def _segment(key: Any) -> str:
    """One path step: a plain key as is, anything odd (newlines, huge, not a string) quoted."""
    if isinstance(key, str) and _PLAIN_KEY.match(key):
        return key
    if isinstance(key, int) and not isinstance(key, bool) and key.bit_length() <= 64:
        return str(key)
    return _BRIEF.repr(key)


def _label(text: str) -> str:
    """A file name or path fit to start a one-line message."""
    return text if text.isprintable() and 0 < len(text) <= 200 else _BRIEF.repr(text)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.splitlines())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Brief(reprlib.Repr):
    """``reprlib`` that also bounds ints: Python refuses to print one past 4300 digits."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1024:
            return f"<{'-' if x < 0 else ''}{x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


_BRIEF = _Brief()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 3, 40, 40, 40


class _Shown:
    """Stands in for a value whose full repr could be huge (an alias bomb) or fail (a huge int)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown(value: Any) -> Any:
    """The value itself when its repr is cheap and safe, else a bounded stand-in."""
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return value
    if isinstance(value, int) and value.bit_length() <= 1024:
        return value
    return _Shown(_BRIEF.repr(value))


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def spec_to_dict(spec: LayoutSpec, devices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A plain document of ``spec`` that ``spec_from_dict`` reads back to an equal spec.

    ``devices``: run the ranks on these devices instead (a placement chosen by the planner).
    """
    doc = spec.model_dump(mode="json", exclude_none=True)
    if devices is not None:
        doc["world"] = {"devices": list(devices)}
    return doc


def spec_to_yaml_text(spec: LayoutSpec, devices: tuple[str, ...] | None = None) -> str:
    """``spec_to_dict`` as YAML text that ``parse_spec`` reads back to an equal spec.

    A dense model (no ``num_moe_experts``) leaves out the MoE fields still at their defaults:
    they mean nothing without experts, and reading the text back gives them again.
    """
    doc = spec_to_dict(spec, devices)
    if spec.model.num_moe_experts is None:
        fields = type(spec.model).model_fields
        doc["model"] = {k: v for k, v in doc["model"].items()
                        if not (k.startswith("moe_") and k in fields
                                and getattr(spec.model, k) == fields[k].default)}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
