"""A megatron-core ``torch_dist`` checkpoint directory, read without trusting its pickles.

``dist_checkpointing.save`` (megatron-core 0.16.1, ``torch_dist`` backend) writes:

* ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1,
  "common_backend": "torch", "common_backend_version": 1}``;
* ``.metadata``: PyTorch DCP's pickled ``Metadata``: per checkpoint key its dtype, global shape
  and chunks (global offset and size of each saved shard), and per chunk where its bytes are
  (file, offset, length). It is read here by ``_MetadataUnpickler``, which builds only the
  classes that file really contains and refuses anything else by name;
* ``__<rank>_<i>.distcp``: the chunks, each a ``torch.save`` of one tensor at its offset (read
  with ``torch.load(weights_only=True)``, a chunk at a time);
* ``common.pt``: the non-sharded part (optimizer param groups, Adam's step), a ``torch.save``
  of plain Python data, read with ``torch.load(weights_only=True)``.

``open_checkpoint`` checks all of it before anything is read into a destination: a directory
that is missing, of an unknown format version, whose metadata does not unpickle under the
allow-list, or whose chunk files are missing or shorter than the metadata says is refused with
one ``CheckpointError`` line (exit status 2).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
from dataclasses import dataclass, field

import torch

from ..ir.box import Box
from ..ir.errors import DynatrainError

FORMATS = {("torch_dist", 1)}  # (sharded_backend, sharded_backend_version) read here
COMMON_FORMATS = {("torch", 1)}

_DCP = "torch.distributed.checkpoint"
# Exactly the classes a torch_dist ``.metadata`` holds (torch 2.6-2.13: found by loading the
# files megatron-core 0.16.1 writes with a recording unpickler), plus torch's dtypes.
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

    path: str
    tensors: dict[str, CkptTensor]
    files: dict[str, int]  # chunk file -> size in bytes
    format: tuple[str, int]
    _common: dict | None = field(default=None, repr=False)

    def common(self) -> dict:
        """``common.pt`` (plain data: ``torch.load(weights_only=True)``), read once."""
        if self._common is None:
            self._common = _read_common(self.path)
        return self._common

    @property
    def total_bytes(self) -> int:
        """Bytes of the chunk files the metadata refers to."""
        return sum(self.files.values())


def _fail(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {what}")


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and check a torch_dist checkpoint's metadata (no tensor data is read).

    Raises:
        CheckpointError: the directory is missing, of an unknown format or version, its
            metadata refuses to unpickle or is malformed, or a chunk file is missing or shorter
            than its chunks need.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise _fail(path, "no such directory")
    fmt = _read_format(path)
    md = _read_metadata(path)
    tensors, files = _index(path, md)
    for name, need in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise _fail(path, f"chunk file {name} is missing")
        size = os.path.getsize(full)
        if size < need:
            raise _fail(path, f"chunk file {name} is truncated: {size} bytes, its chunks need "
                              f"{need}")
        files[name] = size
    return Checkpoint(path, tensors, files, fmt)


def _read_format(path: str) -> tuple[str, int]:
    meta = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta):
        raise _fail(path, "no metadata.json (not a megatron dist checkpoint)")
    try:
        with open(meta, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise _fail(path, f"metadata.json is not JSON ({type(err).__name__})") from None
    if not isinstance(doc, dict):
        raise _fail(path, "metadata.json must be a JSON object")
    fmt = (doc.get("sharded_backend"), doc.get("sharded_backend_version"))
    if fmt not in FORMATS:
        raise _fail(path, f"format {fmt[0]!r} version {fmt[1]!r} is not one DynaTrain reads "
                          f"(it reads {', '.join(f'{b} version {v}' for b, v in FORMATS)})")
    common = (doc.get("common_backend"), doc.get("common_backend_version"))
    if common not in COMMON_FORMATS:
        raise _fail(path, f"common format {common[0]!r} version {common[1]!r} is not one "
                          "DynaTrain reads (it reads torch version 1)")
    return fmt  # type: ignore[return-value]


def _read_metadata(path: str):
    from torch.distributed.checkpoint.metadata import Metadata

    meta = os.path.join(path, ".metadata")
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
        volume = 0
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
            volume += box.numel
        if volume != math.prod(shape):
            raise _fail(path, f"{key}: its chunks hold {volume} elements of {math.prod(shape)}")
        tensors[key] = CkptTensor(key, dtype, shape, tuple(chunks))
    return tensors, files


def _read_common(path: str) -> dict:
    full = os.path.join(path, "common.pt")
    if not os.path.isfile(full):
        raise _fail(path, "no common.pt (the checkpoint was not finished)")
    try:
        common = torch.load(full, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch's allow-list refusal or a broken file
        text = str(err)
        m = re.search(r"GLOBAL ([\w.]+)", text)
        what = (f"refuses to unpickle {m.group(1)}" if m else
                f"cannot be read ({type(err).__name__})")
        raise _fail(path, f"common.pt {what}") from None
    if not isinstance(common, dict):
        raise _fail(path, "common.pt does not hold a dict")
    return common


def read_chunk(ckpt: Checkpoint, key: str, chunk: Chunk) -> torch.Tensor:
    """One chunk's tensor (a fresh CPU tensor of the chunk's shape and the key's dtype).

    Raises:
        CheckpointError: the bytes do not hold a tensor of that dtype and shape.
    """
    t = ckpt.tensors[key]
    with open(os.path.join(ckpt.path, chunk.file), "rb") as f:
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
