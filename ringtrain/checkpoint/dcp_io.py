"""The parts of sharded checkpoints that subclass ``torch.distributed.checkpoint`` (DCP): staging into kept
buffers, and a reader and planner that load tensors and nothing else (``.metadata`` through
``dcp_metadata``'s allow-list and checks; no read of a pickled object). Kept apart from
``checkpoint/sharded.py`` so that importing the trainer does not import DCP (about half a second per worker)."""

from __future__ import annotations

import io
import pickle
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.futures import Future

from ringtrain.checkpoint.manager import forbidden_global, refused_pickle
from ringtrain.checkpoint.manifest import open_regular, read_regular
from ringtrain.checkpoint.sharded import METADATA_FILE
from ringtrain.decode_limits import MAX_PICKLE_BYTES, Refused, load_weights_only
from ringtrain.errors import CorruptCheckpoint, UnsafeCheckpoint

__all__ = ["ReusedStager", "SafeFileSystemReader", "TensorsOnlyLoadPlanner"]


class ReusedStager(BlockingAsyncStager):
    """Stages a background save by copying into buffers kept from the last save: no allocation and no page
    faults on the training thread after the first save (torch's own cache pins its buffers, which needs
    CUDA). Safe because ``save`` waits for the previous background write before staging the next. A state of
    another shape than the last (DiLoCo's outer momentum, once its first outer step made it; an exchange in
    flight) gets new buffers."""

    def __init__(self):
        super().__init__(cache_staged_state_dict=True)
        self._shape: list | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        shape = _shape_of(state_dict)
        if self.state_dict_cache is None or shape != self._shape:
            self.state_dict_cache = _create_cpu_state_dict(_unshared(state_dict))
            self._shape = shape
        return _copy_state_dict(state_dict, self.state_dict_cache)


def _shape_of(state: Any, path: str = "") -> list:
    """The keys, types, shapes and dtypes of ``state``'s tensors (nested dicts): what its staging buffers must fit."""
    if isinstance(state, dict):
        return [entry for key, value in state.items() for entry in _shape_of(value, f"{path}.{key}")]
    if isinstance(state, torch.Tensor):
        local = state.local_shards()[0].tensor.shape if hasattr(state, "local_shards") and state.local_shards() else None
        return [(path, type(state).__name__, tuple(state.shape), local, state.dtype)]
    return [(path, type(state).__name__)]


def _unshared(state: Any) -> Any:
    """``state`` with every ShardedTensor's local shards in tensors of their own. torch makes the staging
    buffers of a ShardedTensor by deep-copying it, which copies the whole storage its shards are views of
    (a zero strategy's bucket or shard, once per parameter): only shapes and dtypes matter here."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(state, dict):
        return {k: _unshared(v) for k, v in state.items()}
    if isinstance(state, ShardedTensor) and state.local_shards():
        shards = [Shard(torch.empty_like(s.tensor), s.metadata) for s in state.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, state.metadata())
    return state


# --- loading that cannot unpickle an object ------------------------------------------------------------
class SafeFileSystemReader(FileSystemReader):
    """DCP's reader for a ringtrain checkpoint: ``.metadata`` through ``dcp_metadata.read_metadata`` (its
    opcodes checked against an allow-list, then every entry checked) before any shard is opened, read once and
    kept (what DCP plans from is what was checked); rank-local metadata refused (ringtrain never writes it); and
    a read of a pickled object (DCP's ``load_bytes``: ``torch.load(weights_only=False)``) refused before its
    bytes are read, should a plan ever hold one. Each tensor's stretch is read as DCP reads it, but from a
    regular file (``open_regular``) and with its pickle bounded first (``decode_limits``), then
    ``torch.load(weights_only=True)``; a stretch that does not read is ``CorruptCheckpoint`` naming it.

    ``listed``: the files of the checkpoint's manifest (its ``files``: names, or names to ``{bytes, sha256}``);
    ``.metadata`` must be one of them (read only at the size listed), and storage outside them is refused."""

    def __init__(self, path: str | Path, listed: Mapping[str, Any] | Collection[str] | None = None):
        super().__init__(path)
        self.listed = listed
        self._metadata = None

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        from ringtrain.checkpoint.dcp_metadata import read_metadata
        from torch.distributed.checkpoint.metadata import StorageMeta

        folder = Path(self.path)
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpoint(f"checkpoint {folder.name}: DCP asked for rank-local metadata "
                                   f"__{kwargs['rank']}.metadata, which ringtrain never writes; refused")
        if self._metadata is None:
            metadata = read_metadata(self._metadata_bytes(folder), folder, self.listed)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    def _metadata_bytes(self, folder: Path) -> bytes:
        """``.metadata``, as its manifest lists it: never a file the manifest left out (a FIFO would hang here),
        never a symlink or anything but a regular file, its size checked before reading."""
        size = None
        if self.listed is not None:
            if METADATA_FILE not in self.listed:
                raise CorruptCheckpoint(f"checkpoint {folder.name}: its manifest does not list {METADATA_FILE}; "
                                        "refused without reading it")
            if isinstance(self.listed, Mapping):
                size = self.listed[METADATA_FILE]["bytes"]
        try:
            return read_regular(folder / METADATA_FILE, size=size, limit=MAX_PICKLE_BYTES)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"checkpoint {folder.name} has no {METADATA_FILE}") from None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``FileSystemReader.read_data`` for tensors (its loop, less transforms, which ringtrain never
        writes and the metadata check refuses), each stretch bounded before ``torch.load(weights_only=True)``."""
        folder = Path(self.path)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise _bytes_read_refused(folder, item)
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            if self.listed is not None and name not in self.listed:
                raise UnsafeCheckpoint(f"checkpoint {folder.name}: a read of {name}, which the manifest does not "
                                       "list; refused")
            try:
                stream, _ = open_regular(folder / name)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"checkpoint {folder.name}: shard file {name} is missing") from None
            with stream:
                for item in items:
                    self._read_tensor(folder, name, stream, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_tensor(self, folder: Path, name: str, stream, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        where = f"checkpoint {folder.name}: {name} bytes {info.offset}+{info.length} (entry {item.storage_index.fqn!r})"
        if info.transform_descriptors:
            raise UnsafeCheckpoint(f"{where} asks for transforms {info.transform_descriptors!r} ringtrain never writes")
        try:
            tensor = load_weights_only(self._slice_file(stream, info))
        except Refused as err:
            raise refused_pickle(err, where) from None
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(f"{where} holds {forbidden_global(err)}, which ringtrain never stores; refused "
                                   "(not written by ringtrain, or tampered with)") from None
        except Exception as err:  # noqa: BLE001 - torch raises several types for bytes that are not its own
            raise CorruptCheckpoint(f"{where} matches its manifest but cannot be read ({type(err).__name__})") from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpoint(f"{where} holds a {type(tensor).__name__}, not a tensor")
        try:
            tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        except Exception as err:  # noqa: BLE001 - offsets outside the stored tensor
            raise CorruptCheckpoint(f"{where} holds a tensor of size {list(tensor.size())}, which the read of "
                                    f"{list(item.lengths)} at {list(item.storage_offsets)} does not fit "
                                    f"({type(err).__name__})") from None
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpoint(f"{where} holds a tensor of size {list(tensor.size())} where {list(target.size())} "
                                    "was planned")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner without ``load_bytes`` (``torch.load(weights_only=False)`` of a stored object):
    the second lock on the same door as ``SafeFileSystemReader.read_data``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise _bytes_read_refused(None, read_item)


def _bytes_read_refused(folder: Path | None, item: ReadItem) -> UnsafeCheckpoint:
    where = f"checkpoint {folder.name}" if folder is not None else "sharded checkpoint"
    return UnsafeCheckpoint(f"{where}: entry {item.dest_index.fqn!r} would be read as a pickled object "
                            "(torch.load(weights_only=False)), which ringtrain never stores; refused")
