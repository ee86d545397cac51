"""The parts of sharded checkpoints that subclass ``torch.distributed.checkpoint`` (DCP): staging into kept
buffers, and a reader and planner that load tensors and nothing else (``.metadata`` through
``dcp_metadata``'s allow-list and checks; no read of a pickled object). Kept apart from
``checkpoint/sharded.py`` so that importing the trainer does not import DCP (about half a second per worker)."""

from __future__ import annotations

import io
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from ringtrain.errors import UnsafeCheckpoint

__all__ = ["ReusedStager", "SafeFileSystemReader", "TensorsOnlyLoadPlanner"]


class ReusedStager(BlockingAsyncStager):
    """Stages a background save by copying into buffers kept from the last save: no allocation and no page
    faults on the training thread after the first save (torch's own cache pins its buffers, which needs
    CUDA). Safe because ``save`` waits for the previous background write before staging the next."""

    def __init__(self):
        super().__init__(cache_staged_state_dict=True)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(_unshared(state_dict))
        return _copy_state_dict(state_dict, self.state_dict_cache)


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
    """DCP's reader for a ringtrain checkpoint: ``.metadata`` through ``dcp_metadata.read_metadata`` (an
    allow-list, then every entry checked) before any shard is opened, read once and kept (what DCP plans
    from is what was checked); rank-local metadata refused (ringtrain never writes it); and a read of a
    pickled object (DCP's ``load_bytes``: ``torch.load(weights_only=False)``) refused before its bytes are
    read, should a plan ever hold one. Tensors are read by DCP with ``torch.load(weights_only=True)``.

    ``listed``: the files of the checkpoint's manifest; storage outside them is refused."""

    def __init__(self, path: str | Path, listed: set[str] | None = None):
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
            with self.fs.create_stream(self._get_metadata_path(), "rb") as stream:
                raw = stream.read()
            metadata = read_metadata(raw, folder, self.listed)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise _bytes_read_refused(Path(self.path), item)
        return super().read_data(plan, planner)


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner without ``load_bytes`` (``torch.load(weights_only=False)`` of a stored object):
    the second lock on the same door as ``SafeFileSystemReader.read_data``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise _bytes_read_refused(None, read_item)


def _bytes_read_refused(folder: Path | None, item: ReadItem) -> UnsafeCheckpoint:
    where = f"checkpoint {folder.name}" if folder is not None else "sharded checkpoint"
    return UnsafeCheckpoint(f"{where}: entry {item.dest_index.fqn!r} would be read as a pickled object "
                            "(torch.load(weights_only=False)), which ringtrain never stores; refused")
