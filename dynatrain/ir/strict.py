"""YAML and JSON readers that refuse a key given twice in one mapping, and a bounded file read.

``yaml.safe_load`` and ``json.loads`` keep the last of two equal keys without a word: a spec
with two ``parallel:`` blocks would take its tp from the second, a plan with two
``budget_bytes`` the later one. Every document DynaTrain reads (specs, plans, topology files,
Megatron argument dumps, HuggingFace configs) goes through these instead, so a duplicate is
refused naming the key, as an unknown key is.

A YAML merge key (``<<: *base``) is not a duplicate of the keys it brings in: overriding a
merged key is what merges are for. Only keys written in the mapping itself are compared.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import yaml

from .errors import DynatrainError, SpecError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(DynatrainError, ValueError):
    """A mapping names the same key twice.

    Attributes:
        key: the repeated key.
        line: 1-based line of the second occurrence (YAML only; None for JSON).
    """

    def __init__(self, key: Any, line: int | None = None, first: int | None = None) -> None:
        self.key, self.line = key, line
        shown = repr(key) if len(repr(key)) <= 60 else repr(key)[:57] + "..."
        where = "" if line is None else f" at line {line}" + (
            f" (first at line {first})" if first is not None else "")
        super().__init__(f"duplicate key {shown}{where}: each key may appear once in a mapping")


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings refuse a key written twice (``DuplicateKeyError``)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise DuplicateKeyError(key, line, first)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (``DuplicateKeyError``)."""
    return yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # the common case costs one len(): plans have many objects
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(k)
            seen.add(k)
    return out


def json_loads(data: str | bytes, *, finite: bool = False) -> Any:
    """``json.loads`` that refuses an object naming a key twice (``DuplicateKeyError``);
    with ``finite``, also ``NaN`` and ``Infinity``, which Python writes but JSON has not
    (``DynatrainError``)."""
    if finite:
        return json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    return json.loads(data, object_pairs_hook=_no_duplicates)


def _no_constant(name: str) -> float:
    raise DynatrainError(f"{name} is not a JSON number (expected a finite number)")


def json_load(f) -> Any:
    """``json.load`` that refuses duplicate keys (``DuplicateKeyError``)."""
    return json.load(f, object_pairs_hook=_no_duplicates)


def read_bounded(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of file ``path``, at most ``limit + 1`` of them (more than ``limit``: the
    caller refuses the file; a size ``stat`` reports means nothing for ``/dev/zero``).

    Opened without blocking: opening a named pipe that no process writes blocks forever, and
    opened so it reads as at its end instead (empty); a pipe with a writer (``<(cat f)``)
    reads as usual.

    Raises:
        OSError: the file cannot be opened or read (a directory included).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):  # read as a pipe reads: wait for the writer
            os.set_blocking(fd, True)
        return f.read(limit + 1)


def json_object(data: bytes, where: str, what: str, *, finite: bool = False) -> dict[str, Any]:
    """The JSON object in ``data``, which another program wrote (a config, an args dump, a
    request in a job's store), read strictly: UTF-8, no key twice (``finite``: no NaN or
    Infinity), nesting the parser can take, an object of ``what``.

    Raises:
        SpecError: one line, ``where: what is wrong`` (exit status 2).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(where, f"not UTF-8 (byte {err.start})") from None
    try:
        doc = json_loads(text, finite=finite)
    except DynatrainError as err:  # a duplicate key, a NaN
        raise SpecError(where, str(err)) from None
    except RecursionError:  # the parser recurses per level of nesting
        raise SpecError(where, "not JSON (nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError
        raise SpecError(where, f"not JSON ({str(err).splitlines()[0][:80]})") from None
    if not isinstance(doc, dict):
        raise SpecError(where, f"must be a JSON object of {what} (got {type(doc).__name__})")
    return doc
