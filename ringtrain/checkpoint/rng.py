"""Random-number-generator state of every rank: captured into a checkpoint, restored on resume.

Each rank draws from its own generators (dropout masks, augmentation), so a bit-exact resume needs every
rank's state, not just the writer's: ``gather_rng_states`` collects them on rank 0, which writes them.
The states hold only tensors, ints, floats and tuples, so ``torch.load(weights_only=True)`` reads them.

    state["rng"] = gather_rng_states()          # a collective: every rank calls it; rank 0 gets the list
    restore_rng_state(state["rng"][rank])
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["capture_rng_state", "restore_rng_state", "gather_rng_states", "seed_fresh_rank"]


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and CUDA generator states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's keys as a tensor: the weights-only unpickler refuses numpy arrays.
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached_gaussian": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_python_state(state["python"]))
    numpy = state["numpy"]
    np.random.set_state(
        (numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
         numpy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states() -> list[dict[str, Any]] | None:
    """Every rank's state, in rank order, on rank 0 (None elsewhere). All ranks must call it."""
    mine = capture_rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def seed_fresh_rank(seed: int, rank: int, step: int) -> None:
    """Seed a rank the checkpoint has no state for (the job grew): distinct per rank, reproducible."""
    mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)


def _as_python_state(state: Any) -> tuple:
    # random.setstate wants tuples; keep it that way whatever container the unpickler returned.
    version, internal, gauss = state
    return version, tuple(internal), gauss
