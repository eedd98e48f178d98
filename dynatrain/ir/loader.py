"""Read a layout spec from YAML text or a file into a validated ``LayoutSpec``.

Only ``yaml.safe_load`` is used (YAML tags that construct objects are refused). Every failure,
whatever the input, surfaces as a single ``SpecError`` with a one-line message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .errors import SpecError
from .presets import PRESETS
from .rules import check_rules
from .spec import LayoutSpec

MAX_SPEC_BYTES = 1 << 20


def load_spec(source: str | os.PathLike[str]) -> LayoutSpec:
    """Load and validate a spec from a path.

    Raises:
        SpecError: the file cannot be read, is not YAML, or breaks a rule.
    """
    path = Path(source)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError(str(path), f"a spec file must be at most {MAX_SPEC_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except SpecError:
        raise
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(str(path), f"cannot read the spec file: {err.__class__.__name__}") from None
    return parse_spec(text, origin=path.name)


def parse_spec(text: str, origin: str = "spec") -> LayoutSpec:
    """Parse and validate spec YAML text.

    Example:
        >>> parse_spec("model: llama3.1-8b\\nparallel: {tp: 8}\\nworld: {nodes: 1, gpus_per_node: 8}").parallel.tp
        8
    """
    if not isinstance(text, str):
        raise SpecError(origin, "a spec must be YAML text", type(text).__name__)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(origin, f"is not valid YAML{where}") from None
    except (RecursionError, ValueError, TypeError, OverflowError) as err:
        raise SpecError(origin, f"is not valid YAML ({err.__class__.__name__})") from None
    return spec_from_dict(raw, origin)


def spec_from_dict(raw: Any, origin: str = "spec") -> LayoutSpec:
    """Validate an already-parsed mapping (e.g. from YAML or JSON)."""
    if not isinstance(raw, dict):
        raise SpecError(origin, "a spec must be a mapping with model, parallel and world", _kind(raw))
    raw = dict(raw)
    raw["model"] = _resolve_model(raw.get("model"))
    try:
        spec = LayoutSpec.model_validate(raw)
    except ValidationError as err:
        raise _first_error(err) from None
    except (RecursionError, ValueError, TypeError, OverflowError) as err:
        raise SpecError(origin, f"cannot be validated ({err.__class__.__name__})") from None
    check_rules(spec)
    return spec


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
                "model.preset", f"unknown preset; known: {', '.join(sorted(PRESETS))}", name
            )
        rest = {k: v for k, v in model.items() if k != "preset"}
        return {**PRESETS[name], **rest}
    return model


def _first_error(err: ValidationError) -> SpecError:
    first = err.errors(include_url=False)[0]
    field = ".".join(str(p) for p in first["loc"]) or "spec"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    elif first["type"] == "missing":
        msg = "is required"
    value = first.get("input")
    got = None if first["type"] == "missing" or isinstance(value, dict) else value
    return SpecError(field, msg, got)


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
