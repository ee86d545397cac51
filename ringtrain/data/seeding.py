"""Randomness derived from what a draw is for, never carried from the past.

A sample's augmentation is drawn from ``(seed, epoch, sample id)`` whichever rank or DataLoader worker
loads it, and the model's randomness (dropout) from ``(seed, step, rank)``, reseeded at every step. So a
sample looks the same at any world size, a resume is bit-exact without saving any generator state (a
DataLoader worker's, which lives in a subprocess that prefetches ahead, could not be saved anyway), and an
elastic resize does not change what any sample sees::

    seed_everything(derive_seed(seed, epoch, index))       # before loading sample ``index``
    seed_everything(derive_seed(seed, step, rank))         # before the forward passes of ``step``

Initial weights are the exception: every rank seeds with ``seed`` alone before building the model, so
the replicas start identical.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["derive_seed", "seed_everything", "SAMPLE_STREAM", "STEP_STREAM"]

SAMPLE_STREAM = 1
"""Domain of ``derive_seed`` for a sample's augmentation: (SAMPLE_STREAM, seed, epoch, sample id)."""
STEP_STREAM = 2
"""Domain for a step's model randomness: (STEP_STREAM, seed, step, rank)."""

_MASK = (1 << 64) - 1


def derive_seed(*keys: int) -> int:
    """A 63-bit seed mixed from ``keys`` (splitmix64 over each key): equal keys, equal seed; any key
    changed, an unrelated seed. Pure integer arithmetic: the same on every host and Python version."""
    state = 0x9E3779B97F4A7C15
    for key in keys:
        state = (state ^ (int(key) & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK
        state ^= state >> 29
    return state >> 1


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators, and CUDA's once CUDA is in use.

    Called once per sample, so it avoids ``torch.manual_seed`` (about 200 us: it visits every device type)."""
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
