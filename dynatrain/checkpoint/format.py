"""A megatron-core ``torch_dist`` checkpoint directory, read without trusting its pickles.

``dist_checkpointing.save`` (``torch_dist`` backend) writes:

* ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1}``, and
  in megatron-core 0.16.x also ``"common_backend": "torch", "common_backend_version": 1``
  (0.19.x dropped both fields with the ``common.pt`` file: megatron/core/dist_checkpointing/
  core.py:22-34);
* ``.metadata``: PyTorch DCP's pickled ``Metadata``: per checkpoint key its dtype, global shape
  and chunks (global offset and size of each saved shard), and per chunk where its bytes are
  (file, offset, length). It is read here by ``_MetadataUnpickler``, which builds only the
  classes that file really contains and refuses anything else by name;
* ``__<rank>_<i>.distcp``: the chunks, each a ``torch.save`` of one tensor at its offset (read
  with ``torch.load(weights_only=True)``, a chunk at a time);
* the non-sharded part (optimizer param groups, Adam's step): plain Python data, read with
  ``torch.load(weights_only=True)``. megatron-core 0.16.x ``torch.save``s it to ``common.pt``;
  0.19.x saves it as one more ShardedObject, ``common_state`` of global shape (1,)
  (dist_checkpointing/serialization.py:439-445), i.e. the ``.metadata`` bytes entry
  ``common_state/shard_0_1`` whose bytes, in a chunk file like any ShardedObject's, are the
  ``torch.save`` of the one-element list ``[common]`` (strategies/torch.py:316-320). 0.19.x
  still reads a ``common.pt`` first when the directory has one (serialization.py:200-237), and
  so does this reader.

``open_checkpoint`` checks all of it before anything is read into a destination: a directory
that is missing, of an unknown format version, whose metadata does not unpickle under the
allow-list, whose fields are not of their types (a size that is not a list of whole numbers,
a storage entry without a length), whose chunks do not tile each tensor exactly (every element
in exactly one chunk: ``ir.tiling``, never a count of elements, where a duplicated chunk and a
hole cancel out), or whose chunk files are missing or shorter than the metadata says (the
``common_state`` entry's file included) is refused with one ``CheckpointError`` line (exit
status 2). Every file is checked to be a regular file before it is opened (opening a named pipe
for reading waits for a writer forever), and a metadata file larger than its cap is refused
unread.

Links: the directory itself may be a link (it is resolved once, ``Checkpoint.root``), and so
may its members, as long as they resolve inside it. A member that resolves outside (a chunk
file linked to ``/etc/passwd``) is refused before it is opened, every time a file is opened.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import stat
from dataclasses import dataclass, field

import torch

from ..ir.box import Box
from ..ir.errors import DynatrainError, shown
from ..ir.strict import DuplicateKeyError, json_loads
from ..ir.tiling import Fault, tiling_fault
from ..ir.units import format_bytes

FORMATS = {("torch_dist", 1)}  # (sharded_backend, sharded_backend_version) read here
COMMON_FORMATS = {("torch", 1)}  # (common_backend, common_backend_version): common.pt
COMMON_PT = "common.pt"
# ShardedObject("common_state", None, (1,), (0,)).unique_key: where megatron-core >= 0.19 keeps
# the common state (mapping.py:397-403, serialization.py:227).
COMMON_STATE = "common_state/shard_0_1"

_DCP = "torch.distributed.checkpoint"
# Exactly the classes a torch_dist ``.metadata`` holds (torch 2.6-2.13: found by loading the
# files megatron-core 0.16.1 and 0.19.2 write with a recording unpickler; 0.19.2's use a subset
# of these, its common_state entry being one more BytesStorageMetadata), plus torch's dtypes.
_ALLOWED = {
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.planner", "SavePlan"),
    (f"{_DCP}.planner", "WriteItem"),
    (f"{_DCP}.planner", "WriteItemType"),
    (f"{_DCP}.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # str -> torch.layout (a lookup, nothing else)
}
_CHUNK_FILE = re.compile(r"^__[0-9]+_[0-9]+\.distcp$")
# The most bytes read of a metadata file, checked before it is read (a sparse 8 GiB file would be
# read whole). megatron writes a metadata.json of about 100 bytes. A .metadata takes some 120-250
# bytes per chunk (its box, and its storage entry naming the key again): a 405B model's is tens
# to hundreds of MB; 2 GiB holds some 10 million chunks (and unpickles to several times that).
MAX_FORMAT_BYTES = 1 << 20
MAX_METADATA_BYTES = 2 << 30


class CheckpointError(DynatrainError, ValueError):
    """A checkpoint that cannot be read into the destination (bad input: exit status 2)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the DCP metadata classes (``_ALLOWED``) and torch dtypes; refuses the rest."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"refuses to unpickle {module}.{name}: not a class a torch_dist "
                              ".metadata file holds")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One saved shard of a checkpoint tensor: its global box and where its bytes are."""

    box: Box
    file: str  # chunk file name inside the checkpoint directory
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Blob:
    """Where a bytes entry (a megatron ShardedObject) of the checkpoint lies."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class CkptTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Checkpoint:
    """What ``open_checkpoint`` read: tensors by checkpoint key, chunk files and their sizes."""

    path: str  # as given (messages name it)
    tensors: dict[str, CkptTensor]
    files: dict[str, int]  # chunk file -> size in bytes
    format: tuple[str, int]
    common_state: Blob | None = None  # the common_state entry; None: common.pt holds it
    _common: dict | None = field(default=None, repr=False)
    root: str = ""  # the directory resolved (links followed once); "": resolved from ``path``

    def __post_init__(self) -> None:
        if not self.root:
            self.root = os.path.realpath(self.path)

    def member(self, name: str) -> str:
        """The path of file ``name`` of the checkpoint, refused if it resolves outside it."""
        return member(self.path, self.root, name)

    @property
    def common_name(self) -> str:
        """Where the common state is, for messages."""
        return COMMON_PT if self.common_state is None else f"{COMMON_STATE} in .metadata"

    def common(self) -> dict:
        """The non-sharded state (plain data: ``torch.load(weights_only=True)``), read once."""
        if self._common is None:
            self._common = (_read_common(self.path, self.root) if self.common_state is None
                            else _read_common_state(self.path, self.root, self.common_state))
        return self._common

    @property
    def total_bytes(self) -> int:
        """Bytes of the chunk files the metadata refers to."""
        return sum(self.files.values())


def _fail(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {what}")


def member(path: str, root: str, name: str) -> str:
    """``name`` inside checkpoint directory ``root`` (resolved), links followed; ``path``
    names the checkpoint in messages.

    Raises:
        CheckpointError: ``name`` resolves outside ``root`` (a link out of the checkpoint).
    """
    real = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, real]) != root:
        raise _fail(path, f"{name} is a link to {real}, outside the checkpoint directory "
                          "(refused: a checkpoint's files must be inside it)")
    return real


def _open(path: str, full: str, name: str, missing: str, cap: int | None = None):
    """Checkpoint file ``name`` (at ``full``, from ``member``) opened for reading in binary.

    Raises:
        CheckpointError: it is absent (the message ``missing``), not a regular file, or larger
            than ``cap`` bytes.
    """
    # Checked before opening: opening a named pipe for reading waits for a writer, forever.
    try:
        st = os.stat(full)
    except FileNotFoundError:
        raise _fail(path, missing) from None
    except OSError as err:
        raise _fail(path, f"{name} cannot be read ({err.strerror})") from None
    _regular(path, name, st, cap)
    try:  # without blocking, checked again: it may have been swapped since (for a pipe)
        f = os.fdopen(os.open(full, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb")
    except OSError as err:
        raise _fail(path, f"{name} cannot be read ({err.strerror})") from None
    try:
        _regular(path, name, os.fstat(f.fileno()), cap)
    except CheckpointError:
        f.close()
        raise
    return f


def _regular(path: str, name: str, st: os.stat_result, cap: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else
                "a named pipe" if stat.S_ISFIFO(st.st_mode) else "a device or socket")
        raise _fail(path, f"{name} is {kind}, not a regular file")
    if cap is not None and st.st_size > cap:
        raise _fail(path, f"{name} is {st.st_size} bytes, over the {format_bytes(cap)} limit "
                          "for that file (refused unread)")


def _read_small(path: str, root: str, name: str, missing: str, cap: int) -> bytes:
    """All the bytes of checkpoint file ``name``, which must be at most ``cap`` bytes."""
    with _open(path, member(path, root, name), name, missing, cap) as f:
        data = f.read(cap + 1)  # grown since the stat: still never read past the cap
    if len(data) > cap:
        raise _fail(path, f"{name} is over the {format_bytes(cap)} limit for that file")
    return data


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and check a torch_dist checkpoint's metadata (no tensor data is read).

    Raises:
        CheckpointError: the directory is missing, of an unknown format or version, its
            metadata is over its size cap, refuses to unpickle or is malformed (a field of the
            wrong type included), a tensor's chunks do not tile it exactly, a file it names is
            a link out of the directory or not a regular file, or a chunk file is missing or
            shorter than its chunks need.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise _fail(path, "no such directory")
    root = os.path.realpath(path)  # once: a checkpoint directory may itself be a link
    fmt, common_pt = _read_format(path, root)
    md = _read_metadata(path, root)
    tensors, files = _index(path, md)
    blob = None
    if not common_pt:
        blob = _common_state_entry(path, md)
        files[blob.file] = max(files.get(blob.file, 0), blob.offset + blob.length)
    for name, need in files.items():
        with _open(path, member(path, root, name), f"chunk file {name}",
                   f"chunk file {name} is missing") as f:
            size = os.fstat(f.fileno()).st_size
        if size < need:
            raise _fail(path, f"chunk file {name} is truncated: {size} bytes, its chunks need "
                              f"{need}")
        files[name] = size
    return Checkpoint(path, tensors, files, fmt, blob, root=root)


def _read_format(path: str, root: str) -> tuple[tuple[str, int], bool]:
    """(sharded format, whether the common state is ``common.pt``)."""
    data = _read_small(path, root, "metadata.json",
                       "no metadata.json (not a megatron dist checkpoint)", MAX_FORMAT_BYTES)
    try:
        doc = json_loads(data.decode("utf-8"))  # a key written twice is refused
    except DuplicateKeyError as err:
        raise _fail(path, f"metadata.json: {err}") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise _fail(path, "metadata.json is not JSON (nested too deeply)") from None
    except ValueError as err:
        raise _fail(path, f"metadata.json is not JSON ({type(err).__name__})") from None
    if not isinstance(doc, dict):
        raise _fail(path, "metadata.json must be a JSON object")
    fmt = (doc.get("sharded_backend"), doc.get("sharded_backend_version"))
    if not _known(fmt, FORMATS):
        reads = ", ".join(f"{b} version {v}" for b, v in FORMATS)
        raise _fail(path, f"format {shown(fmt[0])} version {shown(fmt[1])} is not one "
                          f"DynaTrain reads (it reads {reads})")
    if "common_backend" not in doc and "common_backend_version" not in doc:
        # megatron-core >= 0.19: no common backend; the common state is the common_state entry,
        # unless a legacy common.pt is there, which megatron reads first (serialization.py:224).
        # (exists, not isfile: a common.pt that is a pipe or a directory is refused, not skipped)
        return fmt, os.path.exists(member(path, root, COMMON_PT))  # type: ignore[return-value]
    common = (doc.get("common_backend"), doc.get("common_backend_version"))
    if not _known(common, COMMON_FORMATS):
        raise _fail(path, f"common format {shown(common[0])} version {shown(common[1])} is "
                          "not one DynaTrain reads (it reads torch version 1)")
    return fmt, True  # type: ignore[return-value]


def _known(fmt: tuple, known: set[tuple[str, int]]) -> bool:
    # Compared, not looked up: a JSON list or object is unhashable. (And true is not version 1.)
    return type(fmt[1]) is int and any(fmt == k for k in known)


def _read_metadata(path: str, root: str):
    from torch.distributed.checkpoint.metadata import Metadata

    data = _read_small(path, root, ".metadata",
                       "no .metadata file (the checkpoint was not finished)", MAX_METADATA_BYTES)
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as err:
        raise _fail(path, f".metadata: {err}") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a malformed file
        raise _fail(path, f".metadata is malformed or truncated ({type(err).__name__})") from None
    if not isinstance(md, Metadata):
        raise _fail(path, f".metadata holds a {type(md).__name__}, not DCP Metadata")
    version = getattr(md, "version", None)
    if version is not None and not str(version).startswith("1."):
        raise _fail(path, f".metadata version {version!r} is not one DynaTrain reads (1.x)")
    return md


def _index(path: str, md) -> tuple[dict[str, CkptTensor], dict[str, int]]:
    """Tensors by key with their chunks' storage, and per chunk file the bytes its chunks need."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)

    # The pickle builds only allowed classes, but sets their fields to anything: each field is
    # checked (getattr: one may be missing) before it is used.
    sdm, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise _fail(path, ".metadata has no state dict or storage index")
    where: dict[tuple[str, tuple[int, ...]], _StorageInfo] = {}
    for idx, info in storage.items():
        if (not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo)
                or not isinstance(idx.fqn, str)):
            raise _fail(path, ".metadata storage index holds something other than chunk entries")
        if idx.offset is not None:
            where[(idx.fqn, _dims(path, f"{idx.fqn} (storage index)", "offset", idx.offset))] = info
    tensors: dict[str, CkptTensor] = {}
    files: dict[str, int] = {}
    for key, tmd in sdm.items():
        if isinstance(tmd, BytesStorageMetadata):
            continue  # megatron's ShardedObjects (_extra_state, rng state): not training state
        if not isinstance(tmd, TensorStorageMetadata) or not isinstance(key, str):
            raise _fail(path, f".metadata entry {shown(key)} is neither a tensor nor bytes")
        shape = _dims(path, key, "size", getattr(tmd, "size", None))
        dtype = getattr(getattr(tmd, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise _fail(path, f".metadata entry {key}: properties.dtype {shown(dtype)} is not a "
                              "torch dtype")
        listed = getattr(tmd, "chunks", None)
        if not isinstance(listed, (list, tuple)):
            raise _fail(path, f".metadata entry {key}: chunks {shown(listed)} is not a list")
        chunks = []
        for i, c in enumerate(listed):
            off = _dims(path, key, f"chunks[{i}].offsets", getattr(c, "offsets", None), shape)
            size = _dims(path, key, f"chunks[{i}].sizes", getattr(c, "sizes", None), shape)
            box = Box.of(off, size)
            if any(h > s for h, s in zip(box.hi, shape)):
                raise _fail(path, f"{key}: chunk at {list(off)} of size {list(size)} lies "
                                  f"outside the tensor's shape {list(shape)}")
            info = where.get((key, off))
            if info is None:
                raise _fail(path, f"{key}: the chunk at {list(off)} has no storage entry")
            name = info.relative_path
            if not isinstance(name, str) or not _CHUNK_FILE.match(name):
                raise _fail(path, f"{key}: chunk file name {name!r} is not __<rank>_<i>.distcp")
            transforms = getattr(info, "transform_descriptors", None)  # torch >= 2.7 only
            if transforms:
                raise _fail(path, f"{key}: chunk stored with transforms "
                                  f"{shown(transforms)} (DynaTrain reads plain "
                                  "torch.save chunks)")
            start, length = _byte_range(path, f"{key}: the chunk at {list(off)}", info)
            files[name] = max(files.get(name, 0), start + length)
            chunks.append(Chunk(box, name, start, length))
        if math.prod(shape):  # (an empty tensor has nothing to cover, and its chunks are empty)
            whole = Box((0,) * len(shape), shape)
            fault = tiling_fault(whole, [c.box for c in chunks])
            if fault is not None:
                raise _fail(path, f"{key}: its chunks do not tile the tensor {list(shape)}: "
                                  f"{untiled(fault, [c.box for c in chunks], 'chunk')}")
        tensors[key] = CkptTensor(key, dtype, shape, tuple(chunks))
    return tensors, files


def _whole(x: object) -> bool:
    """An int in [0, 2**63) (not a bool): what a size, an offset or a byte count must be
    (torch's sizes and file offsets are int64)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def _dims(path: str, key: str, what: str, value: object,
          shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """``.metadata`` field ``what`` of entry ``key`` (a shape or an offset) as whole numbers,
    one per dimension of ``shape`` when given.

    Raises:
        CheckpointError: it is not a list (torch.Size, tuple) of that many ints >= 0.
    """
    if (not isinstance(value, (list, tuple)) or not all(map(_whole, value))
            or (shape is not None and len(value) != len(shape))):
        rank = "" if shape is None else f", {len(shape)} of them (the tensor's rank)"
        raise _fail(path, f".metadata entry {key}: {what} {shown(value)} is not a list of whole "
                          f"numbers in [0, 2**63){rank}")
    return tuple(value)


def _byte_range(path: str, what: str, info: object) -> tuple[int, int]:
    """(offset, length) of a storage entry: whole numbers, the length at least 1.

    Raises:
        CheckpointError: either is missing, not an int, or out of range.
    """
    start, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not (_whole(start) and _whole(length) and length > 0):
        raise _fail(path, f"{what}: storage offset {shown(start)} and length {shown(length)} are "
                          "not a byte range (whole numbers in [0, 2**63), the length at least 1)")
    return start, length


def untiled(fault: Fault, boxes: list[Box], what: str) -> str:
    """Why ``boxes`` (``what``s: chunks, pieces) do not tile: the fault's witness in words."""
    at = [list(boxes[i].lo) for i in fault.boxes]
    if fault.what == "missing":
        return f"element {list(fault.point)} is in no {what}"
    if fault.what == "twice":
        return (f"element {list(fault.point)} is in two {what}s (at {at[0]} and {at[1]}: "
                "a duplicate)")
    if fault.what == "empty":
        return f"the {what} at {at[0]} is empty or inverted (a size below one)"
    return f"the {what} at {at[0]} sticks out at element {list(fault.point)}"


def _common_state_entry(path: str, md) -> Blob:
    """Where megatron-core >= 0.19 put the common state: the ``common_state`` bytes entry."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    # (``_index`` has checked the state dict and storage index are dicts of the right types)
    if not isinstance(md.state_dict_metadata.get(COMMON_STATE), BytesStorageMetadata):
        raise _fail(path, f"no common.pt and no {COMMON_STATE} bytes entry in .metadata "
                          "(megatron-core 0.16 writes the one, 0.19 the other)")
    found = [info for idx, info in md.storage_data.items() if idx.fqn == COMMON_STATE]
    if len(found) != 1 or not isinstance(found[0], _StorageInfo):
        raise _fail(path, f"{COMMON_STATE} has {len(found)} storage entries, not one")
    info = found[0]
    name = info.relative_path
    if not isinstance(name, str) or not _CHUNK_FILE.match(name):
        raise _fail(path, f"{COMMON_STATE}: file name {name!r} is not __<rank>_<i>.distcp")
    if getattr(info, "transform_descriptors", None):  # torch >= 2.7 only
        raise _fail(path, f"{COMMON_STATE} stored with transforms "
                          f"{shown(info.transform_descriptors)} (DynaTrain reads plain bytes)")
    return Blob(name, *_byte_range(path, COMMON_STATE, info))


# What Megatron-LM's checkpoints add to megatron-core's common state: its ``args`` (an
# ``argparse.Namespace`` holding enum members and a ``signal.Signals``) and the rerun state
# machine's enums (megatron/training/checkpointing.py ``generate_state_dict``). These classes,
# and enums of these modules only, are allowed by name; enums are built from their value.
_NAMED_CLASSES = ("argparse.Namespace", "signal.Signals")
_ENUM_MODULES = ("megatron.core.enums", "megatron.core.transformer.enums",
                 "megatron.core.rerun_state_machine")


def _allowed(name: str) -> type | None:
    """The class ``name`` if the allow-list takes it, else None."""
    import enum
    import importlib

    module, _, attr = name.rpartition(".")
    if name not in _NAMED_CLASSES and module not in _ENUM_MODULES:
        return None
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None
    if name in _NAMED_CLASSES or (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        return cls
    return None


def _load_plain(path: str, what: str, source) -> object:
    """``torch.load(weights_only=True)`` of ``source`` with Megatron-LM's few classes allowed
    by name (``_allowed``); a refusal or broken bytes is one line."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
        if hasattr(source, "seek"):
            source.seek(0)
        extra = [cls for cls in map(_allowed, names) if cls is not None]
        with torch.serialization.safe_globals(extra):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch's allow-list refusal or a broken file
        text = str(err)
        m = re.search(r"GLOBAL ([\w.]+)", text)
        why = (f"refuses to unpickle {m.group(1)}" if m else
               f"cannot be read ({type(err).__name__})")
        raise _fail(path, f"{what} {why}") from None


def _read_common(path: str, root: str) -> dict:
    with _open(path, member(path, root, COMMON_PT), COMMON_PT,
               "no common.pt (the checkpoint was not finished)") as f:
        common = _load_plain(path, COMMON_PT, f)
    if not isinstance(common, dict):
        raise _fail(path, "common.pt does not hold a dict")
    return common


def _read_common_state(path: str, root: str, blob: Blob) -> dict:
    """megatron-core >= 0.19's common state: ``[common]`` saved as the common_state entry."""
    with _open(path, member(path, root, blob.file), f"chunk file {blob.file}",
               f"chunk file {blob.file} is missing") as f:
        f.seek(blob.offset)
        data = f.read(blob.length)
    if len(data) != blob.length:
        raise _fail(path, f"chunk file {blob.file} is truncated at {COMMON_STATE}")
    held = _load_plain(path, COMMON_STATE, io.BytesIO(data))
    # One ShardedObject's data in a list (strategies/torch.py:320); megatron takes [0].
    if not (isinstance(held, list) and len(held) == 1 and isinstance(held[0], dict)):
        raise _fail(path, f"{COMMON_STATE} holds a {type(held).__name__}, not [dict] as "
                          "megatron saves it")
    return held[0]


def read_chunk(ckpt: Checkpoint, key: str, chunk: Chunk) -> torch.Tensor:
    """One chunk's tensor (a fresh CPU tensor of the chunk's shape and the key's dtype).

    Raises:
        CheckpointError: the bytes do not hold a tensor of that dtype and shape, or the
            chunk file is now a link out of the checkpoint or not a regular file.
    """
    t = ckpt.tensors[key]
    with _open(ckpt.path, ckpt.member(chunk.file), f"chunk file {chunk.file}",
               f"chunk file {chunk.file} is missing") as f:
        f.seek(chunk.offset)
        data = f.read(chunk.length)
    if len(data) != chunk.length:
        raise _fail(ckpt.path, f"chunk file {chunk.file} is truncated at {key}")
    try:
        out = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - corrupt bytes
        raise _fail(ckpt.path, f"{key}: the chunk at {list(chunk.box.lo)} in {chunk.file} is "
                               f"corrupt ({type(err).__name__})") from None
    if (not isinstance(out, torch.Tensor) or out.dtype != t.dtype
            or tuple(out.shape) != chunk.box.shape):
        got = (f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise _fail(ckpt.path, f"{key}: the chunk at {list(chunk.box.lo)} in {chunk.file} holds "
                               f"{got}, its metadata says {t.dtype} {list(chunk.box.shape)}")
    return out
