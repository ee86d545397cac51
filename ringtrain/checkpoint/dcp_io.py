"""The parts of sharded checkpoints that subclass ``torch.distributed.checkpoint`` (DCP): staging into kept
buffers, and a reader whose ``.metadata`` goes through a restricted unpickler. Kept apart from
``checkpoint/sharded.py`` so that importing the trainer does not import DCP (about half a second per worker)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from ringtrain.errors import CorruptCheckpoint, UnsafeCheckpoint

__all__ = ["ReusedStager", "SafeFileSystemReader"]


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


# --- metadata without arbitrary unpickling -------------------------------------------------------------
def _allowed() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    names = ["Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
             "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"]
    allowed = {("torch.distributed.checkpoint.metadata", n): getattr(metadata, n) for n in names if hasattr(metadata, n)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = Path("x").__class__
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"checkpoint metadata refers to {module}.{name}, which a DCP metadata file never holds; "
                               "it was not loaded (refusing to run code from a checkpoint)")


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with ``.metadata`` read by a restricted unpickler (DCP's own uses ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            raw = stream.read()
        if not _MetadataUnpickler.allowed:
            _MetadataUnpickler.allowed = _allowed()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except UnsafeCheckpoint:
            raise
        except Exception as err:  # noqa: BLE001 - any unpickling failure is a corrupt file
            raise CorruptCheckpoint(f"checkpoint metadata {path} is unreadable ({err})") from None
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"checkpoint metadata {path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
