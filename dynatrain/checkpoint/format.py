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
allow-list, whose chunks do not tile each tensor exactly (every element in exactly one chunk:
``ir.tiling``, never a count of elements, where a duplicated chunk and a hole cancel out), or
whose chunk files are missing or shorter than the metadata says (the ``common_state`` entry's
file included) is refused with one ``CheckpointError`` line (exit status 2).

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
from dataclasses import dataclass, field

import torch

from ..ir.box import Box
from ..ir.errors import DynatrainError
from ..ir.strict import DuplicateKeyError, json_load
from ..ir.tiling import Fault, tiling_fault

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


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and check a torch_dist checkpoint's metadata (no tensor data is read).

    Raises:
        CheckpointError: the directory is missing, of an unknown format or version, its
            metadata refuses to unpickle or is malformed, a tensor's chunks do not tile it
            exactly, a file it names is a link out of the directory, or a chunk file is
            missing or shorter than its chunks need.
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
        full = member(path, root, name)
        if not os.path.isfile(full):
            raise _fail(path, f"chunk file {name} is missing")
        size = os.path.getsize(full)
        if size < need:
            raise _fail(path, f"chunk file {name} is truncated: {size} bytes, its chunks need "
                              f"{need}")
        files[name] = size
    return Checkpoint(path, tensors, files, fmt, blob, root=root)


def _read_format(path: str, root: str) -> tuple[tuple[str, int], bool]:
    """(sharded format, whether the common state is ``common.pt``)."""
    meta = member(path, root, "metadata.json")
    if not os.path.isfile(meta):
        raise _fail(path, "no metadata.json (not a megatron dist checkpoint)")
    try:
        with open(meta, encoding="utf-8") as f:
            doc = json_load(f)  # a key written twice is refused, not last-one-wins
    except DuplicateKeyError as err:
        raise _fail(path, f"metadata.json: {err}") from None
    except (OSError, ValueError) as err:
        raise _fail(path, f"metadata.json is not JSON ({type(err).__name__})") from None
    if not isinstance(doc, dict):
        raise _fail(path, "metadata.json must be a JSON object")
    fmt = (doc.get("sharded_backend"), doc.get("sharded_backend_version"))
    if fmt not in FORMATS:
        raise _fail(path, f"format {fmt[0]!r} version {fmt[1]!r} is not one DynaTrain reads "
                          f"(it reads {', '.join(f'{b} version {v}' for b, v in FORMATS)})")
    if "common_backend" not in doc and "common_backend_version" not in doc:
        # megatron-core >= 0.19: no common backend; the common state is the common_state entry,
        # unless a legacy common.pt is there, which megatron reads first (serialization.py:224).
        return fmt, os.path.isfile(member(path, root, COMMON_PT))  # type: ignore[return-value]
    common = (doc.get("common_backend"), doc.get("common_backend_version"))
    if common not in COMMON_FORMATS:
        raise _fail(path, f"common format {common[0]!r} version {common[1]!r} is not one "
                          "DynaTrain reads (it reads torch version 1)")
    return fmt, True  # type: ignore[return-value]


def _read_metadata(path: str, root: str):
    from torch.distributed.checkpoint.metadata import Metadata

    meta = member(path, root, ".metadata")
    if not os.path.isfile(meta):
        raise _fail(path, "no .metadata file (the checkpoint was not finished)")
    with open(meta, "rb") as f:
        data = f.read()
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

    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise _fail(path, ".metadata has no state dict or storage index")
    where: dict[tuple[str, tuple[int, ...]], _StorageInfo] = {}
    for idx, info in md.storage_data.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _fail(path, ".metadata storage index holds something other than chunk entries")
        if idx.offset is not None:
            where[(idx.fqn, tuple(int(x) for x in idx.offset))] = info
    tensors: dict[str, CkptTensor] = {}
    files: dict[str, int] = {}
    for key, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, BytesStorageMetadata):
            continue  # megatron's ShardedObjects (_extra_state, rng state): not training state
        if not isinstance(tmd, TensorStorageMetadata) or not isinstance(key, str):
            raise _fail(path, f".metadata entry {key!r} is neither a tensor nor bytes")
        shape = tuple(int(s) for s in tmd.size)
        dtype = tmd.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise _fail(path, f"{key}: dtype {dtype!r} is not a torch dtype")
        chunks = []
        for c in tmd.chunks:
            off, size = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
            box = Box.of(off, size)
            if len(off) != len(shape) or any(l < 0 or h > s for l, h, s in
                                              zip(box.lo, box.hi, shape)):
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
                                  f"{list(transforms)} (DynaTrain reads plain "
                                  "torch.save chunks)")
            if info.offset < 0 or info.length <= 0:
                raise _fail(path, f"{key}: chunk at {list(off)} has a bad byte range")
            files[name] = max(files.get(name, 0), info.offset + info.length)
            chunks.append(Chunk(box, name, int(info.offset), int(info.length)))
        if math.prod(shape):  # (an empty tensor has nothing to cover, and its chunks are empty)
            whole = Box((0,) * len(shape), shape)
            fault = tiling_fault(whole, [c.box for c in chunks])
            if fault is not None:
                raise _fail(path, f"{key}: its chunks do not tile the tensor {list(shape)}: "
                                  f"{untiled(fault, [c.box for c in chunks], 'chunk')}")
        tensors[key] = CkptTensor(key, dtype, shape, tuple(chunks))
    return tensors, files


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
                          f"{list(info.transform_descriptors)} (DynaTrain reads plain bytes)")
    if info.offset < 0 or info.length <= 0:
        raise _fail(path, f"{COMMON_STATE} has a bad byte range")
    return Blob(name, int(info.offset), int(info.length))


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
    full = member(path, root, COMMON_PT)
    if not os.path.isfile(full):
        raise _fail(path, "no common.pt (the checkpoint was not finished)")
    common = _load_plain(path, COMMON_PT, full)
    if not isinstance(common, dict):
        raise _fail(path, "common.pt does not hold a dict")
    return common


def _read_common_state(path: str, root: str, blob: Blob) -> dict:
    """megatron-core >= 0.19's common state: ``[common]`` saved as the common_state entry."""
    with open(member(path, root, blob.file), "rb") as f:
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
            chunk file is now a link out of the checkpoint.
    """
    t = ckpt.tensors[key]
    with open(ckpt.member(chunk.file), "rb") as f:
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
