"""ResumableSampler: one global order per epoch, dealt across workers one optimizer step at a time.

The order of an epoch depends only on ``(seed, epoch)``. A ``cursor`` counts the samples of that order
consumed by committed optimizer steps. Each step takes the next ``global_batch_size`` samples of the order
(the *window*; the last window of an epoch may be shorter) and deals them round robin across the workers
that exist *now*. So when the number of workers changes, the rest of the epoch, ``order[cursor:]``, is
re-dealt across the new set and no sample is used twice or skipped. The window need not divide by the
number of workers: shares then differ by one sample, and every rank runs the same number of micro-batches,
``grad_accum_steps_for_window`` (smaller ones, possibly of 0 rows, where its share is smaller).

    sampler = ResumableSampler(num_samples=1437, global_batch_size=64, seed=0)
    for indices in sampler.iter_shards(rank, world_size):   # this rank's share of each step
        ...train on indices...
        sampler.advance()                                    # the step committed
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ringtrain.config.checks import grad_accum_steps_for_window  # the count every rank derives (data -> config)

__all__ = ["ResumableSampler", "eval_shard", "grad_accum_steps_for_window"]


class ResumableSampler:
    """Global order from (seed, epoch); a cursor of committed samples; shares dealt per step.

    Every rank makes the same one; ``advance()`` after each committed optimizer step, ``set_epoch`` when
    the epoch is done; its ``state_dict()`` (epoch, cursor) in the checkpoint makes a resume continue
    mid-epoch with the samples not yet used::

        sampler = ResumableSampler(len(train_set), global_batch_size=64, seed=0)
        loader = build_train_loader(train_set, sampler, rank, world_size)   # one StepBatch per step
        for batch in loader:                      # the rest of the epoch, from the cursor
            window = sampler.next_window_size()   # samples in this step, all ranks together
            ...
            sampler.advance()
        sampler.set_epoch(sampler.epoch + 1)
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.global_batch_size)

    @property
    def epoch_finished(self) -> bool:
        return self.cursor >= self.num_samples

    def order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch``: a permutation that depends on (seed, epoch) only."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample."""
        self.epoch = epoch
        self.cursor = 0

    def next_window_size(self) -> int:
        """Samples in the next optimizer step across all workers (short at the end of an epoch)."""
        return min(self.global_batch_size, self.num_samples - self.cursor)

    def iter_shards(self, rank: int, world_size: int) -> Iterator[list[int]]:
        """This rank's sample ids for each remaining step of the epoch, from the current cursor.

        A snapshot: it does not move the cursor (a loader may prefetch ahead); ``advance()`` does.
        """
        _check_rank(rank, world_size)
        order = self.order(self.epoch)
        for start in range(self.cursor, self.num_samples, self.global_batch_size):
            window = order[start : start + self.global_batch_size]
            yield window[rank::world_size].tolist()

    def remaining_steps(self) -> int:
        return math.ceil((self.num_samples - self.cursor) / self.global_batch_size)

    def advance(self) -> int:
        """Commit one optimizer step: move the cursor past its window; returns the window size."""
        size = self.next_window_size()
        if size <= 0:
            raise RuntimeError(f"epoch {self.epoch} is finished; call set_epoch() before advancing")
        self.cursor += size
        return size

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state is for {key}={state[key]!r} but this run has {key}={getattr(self, key)!r}; "
                    "the dataset or seed changed since the checkpoint"
                )
        if not 0 <= state["cursor"] <= self.num_samples:
            raise ValueError(f"sampler cursor {state['cursor']} outside 0..{self.num_samples}")
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]




def eval_shard(num_samples: int, rank: int, world_size: int) -> list[int]:
    """Evaluation ids of ``rank``: every sample exactly once across ranks, no padding duplicates."""
    _check_rank(rank, world_size)
    return list(range(rank, num_samples, world_size))


def _check_rank(rank: int, world_size: int) -> None:
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
