"""Export a checkpoint's model weights as safetensors: plain tensors, no pickle, loadable anywhere.

    ringtrain export runs/digits_mlp                       # newest valid checkpoint -> RUN_DIR/model.safetensors
    ringtrain export runs/digits_mlp --checkpoint runs/digits_mlp/checkpoints/step_00000900.pt --out mlp.safetensors

    from safetensors.torch import load_file
    model.load_state_dict(load_file("mlp.safetensors"))
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save

from ringtrain.checkpoint.manager import CheckpointManager, load_checkpoint_file
from ringtrain.checkpoint.manifest import write_atomic
from ringtrain.errors import CheckpointError

__all__ = ["export_model"]


def export_model(checkpoints: CheckpointManager, out: Path, checkpoint: Path | None = None,
                 warn: Callable[[str], None] = print) -> Path:
    """Write the model weights of ``checkpoint`` (default: the newest valid one) to ``out``; returns
    the checkpoint used."""
    if checkpoint is None:
        found = checkpoints.load_latest(warn)
        if found is None:
            raise CheckpointError(f"no valid checkpoint in {checkpoints.directory} to export")
        checkpoint, state = found
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
