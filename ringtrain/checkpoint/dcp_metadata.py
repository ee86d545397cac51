"""A sharded checkpoint's ``.metadata``, read as ringtrain writes it and nothing more: before any shard file
is opened, the file's opcodes are checked against an allow-list (nothing unpickled yet), then it is unpickled
with the same allow-list, and what comes out is checked entry by entry.

Why both: DCP reads ``.metadata`` with ``pickle.load`` (any class, any code), and an entry of kind
``BytesStorageMetadata`` makes DCP read its bytes with ``torch.load(weights_only=False)`` (again any code).
ringtrain stores tensors only (``sharded._only_tensors``), so every entry is ``TensorStorageMetadata`` and
every piece of storage a stretch of a ``__R_I.distcp`` file in the folder. The sha256 manifest does not
help here: whoever can write the folder can rewrite it too.

The classes a real save pickles (DDP, zero1, zero3 and FSDP runs, torch 2.14): ``Metadata``,
``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``, ``_MEM_FORMAT_ENCODING``,
``MetadataIndex``, ``StorageMeta``, ``filesystem._StorageInfo``, ``torch.Size``, torch dtypes,
``torch.serialization._get_layout`` and ``pathlib.PosixPath`` (``StorageMeta.checkpoint_id``).

An allow-list of classes (``find_class``) is not enough: pickle's opcodes do more with an admitted class than
make an instance of it. ``BUILD`` on the class itself sets class attributes (``PosixPath.__fspath__`` set to
``_get_layout``, whose ``cache`` attribute another ``BUILD`` fills with the attacker's paths: every later
``open(path)`` of the process goes where the pickle said, ``ringtrain export`` included); ``SETITEMS`` on
something that is not a dict, ``REDUCE`` on something that is not an admitted class, with arguments that are
objects, reach further. So before unpickling, ``decode_limits.check_pickle`` walks the opcodes with ``ALLOW``
and admits only what a real save writes: ``NEWOBJ``/``REDUCE`` of an admitted class (or ``_get_layout``) with
plain values, each new instance ``BUILD`` at most once with a dict of that class's dataclass fields
(``TensorProperties``: its ``__setstate__`` tuple), ``SETITEMS`` into dicts and ``APPEND`` into lists, classes
and functions never used as values; within ``decode_limits``' bounds on nesting, size and memo slots. Checking
the stream, rather than overriding the C unpickler's ``BUILD`` (which only the slower pure-Python unpickler
allows), refuses a hostile file before any of it has run.

    metadata = read_metadata(raw_bytes, folder, listed=manifest["files"])       # or UnsafeCheckpoint
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path, PosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, metadata as md

from ringtrain.checkpoint.sharded import SHARD_FILE
from ringtrain.decode_limits import MAX_PICKLE_BYTES, AllowList, Refused, check_pickle
from ringtrain.errors import CorruptCheckpoint, UnsafeCheckpoint

__all__ = ["read_metadata", "check_metadata", "ALLOWED_CLASSES", "ALLOW", "SHARD_FILE"]


class _BytesEntry:
    """What ``BytesStorageMetadata`` unpickles to: a marker, never DCP's class, so the check below can name the
    entry it stands for; DCP would not take it for a bytes entry even if it got one."""


ALLOWED_CLASSES: dict[tuple[str, str], Any] = {
    **{(md.__name__, name): getattr(md, name) for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
        "MetadataIndex", "StorageMeta")},
    (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PosixPath,
    # A pickled object's entry: admitted as a harmless marker only so that the refusal names the entry.
    (md.__name__, "BytesStorageMetadata"): _BytesEntry,
}
"""(module, name) -> what it unpickles to. Torch dtypes (``torch.float32``...) are admitted besides."""

_METADATA_FIELDS = {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _state_rule(cls: Any) -> frozenset[str] | str | None:
    """What BUILD may do to a new instance of ``cls``: set its dataclass fields, or hand ``__setstate__`` a tuple."""
    if "__setstate__" in vars(cls):
        return "setstate"
    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


ALLOW = AllowList(
    classes={**{key: _state_rule(cls) for key, cls in ALLOWED_CLASSES.items() if dataclasses.is_dataclass(cls)},
             (md.__name__, "BytesStorageMetadata"): frozenset(),
             (md.__name__, "_MEM_FORMAT_ENCODING"): None, ("torch", "Size"): None, ("pathlib", "PosixPath"): None},
    functions=frozenset({("torch.serialization", "_get_layout")}),
    values=_is_dtype,
)
"""The opcode check's allow-list: the classes above, each with what BUILD may set on a new instance (None: no
BUILD: an enum, a tuple, a path), ``_get_layout`` called with a name, dtypes as values."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED_CLASSES.get((module, name))
        if found is not None:
            return found
        if _is_dtype(module, name):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"checkpoint metadata refers to {module}.{name}, which ringtrain's metadata never holds; "
                               "it was not loaded (refusing to run code from a checkpoint)")


def read_metadata(raw: bytes, folder: Path, listed: Any = None) -> md.Metadata:
    """``raw`` (the bytes of ``folder/.metadata``) as DCP metadata: its opcodes checked (``ALLOW``), unpickled
    with the same allow-list, then checked by ``check_metadata``. ``listed``: the manifest's file names."""
    try:
        check_pickle(raw, allow=ALLOW, max_bytes=MAX_PICKLE_BYTES)
    except Refused as err:
        kind = CorruptCheckpoint if err.corrupt else UnsafeCheckpoint
        raise kind(f"checkpoint metadata {folder.name}/.metadata {err}; refused before anything was unpickled (not "
                   "written by ringtrain, or tampered with)") from None
    try:
        metadata = _Unpickler(io.BytesIO(raw)).load()
    except UnsafeCheckpoint as err:
        raise UnsafeCheckpoint(str(err).replace("checkpoint metadata", f"checkpoint metadata {folder.name}/.metadata", 1)) from None
    except Exception as err:  # noqa: BLE001 - any other unpickling failure is a corrupt file
        raise CorruptCheckpoint(f"checkpoint metadata {folder.name}/.metadata is unreadable ({type(err).__name__}: {err})") from None
    check_metadata(metadata, folder, listed)
    return metadata


def check_metadata(metadata: Any, folder: Path, listed: Any = None) -> None:
    """Raise UnsafeCheckpoint, naming the entry, unless ``metadata`` is what ringtrain writes: tensor entries
    only, each stretch of storage inside a ``__R_I.distcp`` file of ``folder`` (one the manifest ``listed``,
    when given). Only ``stat``s files: nothing is read."""
    where = f"checkpoint metadata {folder.name}/.metadata"

    def refuse(what: str) -> None:
        raise UnsafeCheckpoint(f"{where}: {what}; ringtrain writes tensor entries only, stored in its __R_I.distcp "
                               "files: refused before any shard was read (not written by ringtrain, or tampered with)")

    try:
        _check(metadata, folder, listed, refuse)
    except AttributeError as err:  # an object unpickled without one of its fields
        refuse(f"lacks a field ({err})")


def _check(metadata: Any, folder: Path, listed: Any, refuse) -> None:
    if type(metadata) is not md.Metadata:
        refuse(f"holds a {type(metadata).__name__}, not DCP metadata")
    if set(vars(metadata)) - _METADATA_FIELDS:
        refuse(f"has fields DCP metadata does not have ({', '.join(sorted(set(vars(metadata)) - _METADATA_FIELDS))})")
    entries = metadata.state_dict_metadata
    if type(entries) is not dict:
        refuse(f"its state_dict_metadata is a {type(entries).__name__}, not a dict")
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            refuse(f"entry {fqn!r} is named by a {type(fqn).__name__}, not a string")
        if type(entry) is not md.TensorStorageMetadata:
            kind = "BytesStorageMetadata (a pickled object)" if type(entry) is _BytesEntry else type(entry).__name__
            refuse(f"entry {fqn!r} is a {kind}, not tensor storage")
        problem = _tensor_problem(entry)
        if problem:
            refuse(f"entry {fqn!r} {problem}")
    storage = metadata.storage_data
    if type(storage) is not dict:
        refuse(f"its storage_data is a {type(storage).__name__}, not a dict")
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if type(index) is not md.MetadataIndex or type(index.fqn) is not str or index.fqn not in entries:
            refuse(f"storage key {index!r} names no tensor entry")
        if type(info) is not filesystem._StorageInfo:
            refuse(f"entry {index.fqn!r} is stored as a {type(info).__name__}, not a stretch of a shard file")
        name = info.relative_path
        if type(name) is not str or not SHARD_FILE.match(name):
            refuse(f"entry {index.fqn!r} points at {name!r}, not a __R_I.distcp file in the folder")
        if listed is not None and name not in listed:
            refuse(f"entry {index.fqn!r} points at {name}, which the manifest does not list")
        if getattr(info, "transform_descriptors", None):
            refuse(f"entry {index.fqn!r} asks for transforms {info.transform_descriptors!r} ringtrain never writes")
        if name not in sizes:
            file = folder / name
            if file.is_symlink() or not file.is_file():
                refuse(f"entry {index.fqn!r} points at {name}, which is not a file in the folder")
            sizes[name] = file.stat().st_size
        offset, length = info.offset, info.length
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0 and offset + length <= sizes[name]):
            refuse(f"entry {index.fqn!r} points at bytes {offset!r}+{length!r} of {name}, which has {sizes[name]}")
    _check_rest(metadata, refuse)


def _tensor_problem(entry: md.TensorStorageMetadata) -> str | None:
    props, size, chunks = entry.properties, entry.size, entry.chunks
    if type(props) is not md.TensorProperties or not isinstance(props.dtype, torch.dtype):
        return "has no tensor properties"
    if props.layout is not torch.strided:
        return f"has layout {props.layout!r}, not strided"
    if not _is_shape(size):
        return f"has size {size!r}, not a torch.Size of whole numbers"
    if type(chunks) is not list:
        return f"has chunks {type(chunks).__name__}, not a list"
    for chunk in chunks:
        if type(chunk) is not md.ChunkStorageMetadata or not _is_shape(chunk.offsets) or not _is_shape(chunk.sizes):
            return "has a chunk that is not offsets and sizes"
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size) or any(
                o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size)):
            return f"has a chunk at {list(chunk.offsets)} of {list(chunk.sizes)} outside its size {list(size)}"
    return None


def _check_rest(metadata: md.Metadata, refuse) -> None:
    planner = metadata.planner_data
    if planner is not None and not (type(planner) is dict and all(
            type(k) is str and type(v) in (tuple, list) and all(type(p) in (str, int) for p in v) for k, v in planner.items())):
        refuse("its planner_data is not a map of names to key paths")
    meta = metadata.storage_meta
    if meta is not None:
        if type(meta) is not md.StorageMeta:
            refuse(f"its storage_meta is a {type(meta).__name__}")
        if not (type(meta.checkpoint_id) in (str, PosixPath, type(None)) and type(meta.save_id) in (str, type(None))
                and type(meta.load_id) in (str, type(None)) and type(meta.modules) is list
                and all(type(m) is str for m in meta.modules)):
            refuse("its storage_meta holds values other than names")
    if type(metadata.version) not in (str, type(None)):
        refuse(f"its version is a {type(metadata.version).__name__}")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_shape(value: Any) -> bool:
    return type(value) is torch.Size and all(type(n) is int and n >= 0 for n in value)
