"""Export a checkpoint's model weights as safetensors: plain tensors, no pickle, loadable anywhere.

    ringtrain export runs/digits_mlp                       # newest valid checkpoint -> RUN_DIR/model.safetensors
    ringtrain export runs/digits_mlp --checkpoint runs/digits_mlp/checkpoints/step_00000900.pt --out mlp.safetensors

A sharded checkpoint (``step_N.dcp``, [checkpoint] sharded / async) is gathered here, in one process: every
rank's shards are read back into full tensors.

    from safetensors.torch import load_file
    model.load_state_dict(load_file("mlp.safetensors"))
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save

from ringtrain.checkpoint.manager import CheckpointManager, load_checkpoint_file
from ringtrain.checkpoint.manifest import write_atomic
from ringtrain.checkpoint.dcp_io import SafeFileSystemReader
from ringtrain.checkpoint.sharded import ShardedCheckpointer, checkpoint_step_of, committed, one_line_errors, verify
from ringtrain.errors import CheckpointError, CorruptCheckpoint

__all__ = ["export_model"]


def export_model(checkpoints: CheckpointManager, out: Path, checkpoint: Path | None = None,
                 warn: Callable[[str], None] = print) -> Path:
    """Write the model weights of ``checkpoint`` (default: the newest valid one) to ``out``; returns
    the checkpoint used."""
    if checkpoint is None:
        found = checkpoints.load_latest(warn)
        sharded = _newest_sharded(checkpoints.directory, warn)
        if sharded is not None and (found is None or checkpoint_step_of(sharded) > found[1]["train_state"]["step"]):
            checkpoint, state = sharded, gather_sharded(sharded)
        elif found is None:
            raise CheckpointError(f"no valid checkpoint in {checkpoints.directory} to export")
        else:
            checkpoint, state = found
    elif checkpoint.suffix == ".dcp":
        state = gather_sharded(checkpoint)
    else:
        state = load_checkpoint_file(checkpoint)
    # Own, contiguous copies: safetensors refuses tensors that share storage (tied weights).
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in state["model"].items()}
    metadata = {
        "format": "pt",
        "source": checkpoint.name,
        "step": str(state.get("train_state", {}).get("step", "")),
        "config_sha256": str(state.get("config_digest", "")),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = save(tensors, metadata=metadata)
    write_atomic(out, lambda f: f.write(payload))
    return checkpoint


def _newest_sharded(directory: Path, warn: Callable[[str], None]) -> Path | None:
    for path in reversed(committed(directory)):
        try:
            verify(path)
            return path
        except CorruptCheckpoint as err:
            warn(f"skipping {path.name}: {err}")
    return None


def gather_sharded(path: Path) -> dict:
    """A sharded checkpoint's model as full tensors, in this one process: every rank's shards read back
    (DCP without a process group), after the manifest verified every file."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeFileSystemReader(path, listed=verify(path)["files"])
    metadata = reader.read_metadata()
    model = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    if not model:
        raise CheckpointError(f"checkpoint {path.name} holds no model tensors")
    state = {"model": model}
    with one_line_errors():
        dcp.load(state, storage_reader=reader, no_dist=True)
    extra = ShardedCheckpointer.load_extra(path)
    return {"model": state["model"], "train_state": extra.get("train_state", {}), "config_digest": extra.get("config_digest", "")}
