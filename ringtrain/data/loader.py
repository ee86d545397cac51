"""Loaders: a train loader that yields this rank's whole share of each optimizer step, and an eval loader.

The train loader's unit is the optimizer step, not the micro-batch: each item is a ``StepBatch`` holding
every sample this rank uses in one step, with their ids. The training loop cuts it into micro-batches, so
the micro-batch size can change at run time (dynamic batch sizing) without touching the data pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data import default_collate

from ringtrain.data.batch import Inputs, map_tensors, split, take, to_device, trim
from ringtrain.data.sampler import ResumableSampler, eval_shard
from ringtrain.data.seeding import SAMPLE_STREAM, derive_seed, seed_everything
from ringtrain.data.text import IGNORE_INDEX, padded_length

__all__ = ["StepBatch", "build_train_loader", "build_eval_loader", "pack_by_tokens"]


@dataclass
class StepBatch:
    """One rank's samples for one optimizer step, with their dataset ids.

        for inputs, targets in batch.micro_batches(2):   # the same count on every rank
            ...
        ledger.record(step, epoch, batch.indices.tolist(), skipped=False)
    """

    indices: torch.Tensor
    """Dataset ids of the samples (what the exactly-once ledger records)."""
    inputs: Inputs
    """A tensor, a tuple or a dict of tensors (``data/batch.py``), samples along dimension 0."""
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.indices)

    def micro_batches(self, count: int) -> list[tuple[Inputs, torch.Tensor]]:
        """Split into ``count`` near-equal micro-batches; some are empty when there are fewer samples.

        Every rank must run the same number of forward passes per step (DDP's buffer broadcast and the
        gradient all-reduce are collectives), so the count is chosen by the caller for all ranks alike.
        """
        return list(zip(split(self.inputs, count), torch.tensor_split(self.targets, count)))

    def token_micro_batches(self, max_tokens: int, max_sequences: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Split padded sequences into micro-batches of at most ``max_tokens`` padded tokens (sequences x
        the longest) and ``max_sequences`` sequences, each trimmed to its longest sequence.

        Longest first, so sequences of similar length share a micro-batch and little is padding. The loss
        is a sum over real tokens, so how sequences are grouped does not change the step's gradient.
        Lengths count as padded to a multiple of PAD_MULTIPLE (few distinct shapes).
        """
        width = self.targets.shape[1]
        lengths = (self.targets != IGNORE_INDEX).sum(dim=1)
        order = torch.argsort(lengths, descending=True, stable=True)
        padded = [padded_length(n, width) for n in lengths[order].tolist()]
        micro = []
        for group in pack_by_tokens(padded, max_tokens, max_sequences):
            chosen = order[group[0] : group[-1] + 1]
            micro_width = padded[group[0]]
            # Every input leaf as wide as the targets (token ids, attention masks) is trimmed alike.
            inputs = trim(take(self.inputs, chosen), micro_width, width)
            micro.append((inputs, self.targets[chosen, :micro_width]))
        return micro

    def empty(self) -> tuple[Inputs, torch.Tensor]:
        """A micro-batch of 0 rows shaped like this one."""
        return map_tensors(self.inputs, lambda t: t[:0]), self.targets[:0]

    def to(self, device: torch.device) -> StepBatch:
        non_blocking = device.type == "cuda"
        return StepBatch(
            self.indices,
            to_device(self.inputs, device, non_blocking=non_blocking),
            self.targets.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> StepBatch:
        return StepBatch(self.indices, map_tensors(self.inputs, torch.Tensor.pin_memory), self.targets.pin_memory())


class _Indexed(Dataset):
    """Yields (id, sample...) so a StepBatch knows which samples it holds.

    Keys are ``(epoch, id)``: before loading a sample, every global generator is seeded from
    ``(seed, epoch, id)``, so its random augmentation is the same whichever rank or loader worker draws it.
    """

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        seed_everything(derive_seed(SAMPLE_STREAM, self.seed, epoch, index))
        return (index, *self.dataset[index])


class _StepCollator:
    """Stacks one step's samples; an empty share (a short last window) still gets tensors of 0 rows."""

    def __init__(self, dataset: Dataset, collate: Callable | None = None):
        self.collate = collate or default_collate
        self.example = self.collate([dataset[0]])

    def __call__(self, samples: Sequence[tuple]) -> StepBatch:
        if not samples:
            inputs, targets = self.example
            return StepBatch(torch.empty(0, dtype=torch.long), map_tensors(inputs, lambda t: t[:0]), targets[:0])
        ids = torch.as_tensor([sample[0] for sample in samples])
        inputs, targets = self.collate([sample[1:] for sample in samples])
        return StepBatch(ids, inputs, targets)


class _StepShards(Sampler[list[int]]):
    """Batch sampler over the ResumableSampler: one item per remaining optimizer step of the epoch."""

    def __init__(self, sampler: ResumableSampler, rank: int, world_size: int):
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.sampler.epoch  # an iterator covers the rest of one epoch
        for ids in self.sampler.iter_shards(self.rank, self.world_size):
            yield [(epoch, index) for index in ids]

    def __len__(self) -> int:
        return self.sampler.remaining_steps()


def build_train_loader(
    dataset: Dataset,
    sampler: ResumableSampler,
    rank: int,
    world_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable | None = None,
) -> DataLoader:
    """A loader of ``StepBatch``es, one per optimizer step: this rank's share of the sampler's next window.
    Each iteration covers the rest of the sampler's epoch, starting from its cursor (so after a resume,
    mid-epoch); it does not move the cursor, ``sampler.advance()`` does.

        loader = build_train_loader(train_set, sampler, rank, world_size)
        batch = next(iter(loader))          # batch.indices, batch.inputs, batch.targets
    """
    return DataLoader(
        _Indexed(dataset, sampler.seed),
        batch_sampler=_StepShards(sampler, rank, world_size),
        collate_fn=_StepCollator(dataset, collate_fn),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Each iterator draws a base seed for its workers, from its own generator, not the global RNG. (Samples
        # do not depend on it: _Indexed seeds each sample from its id.)
        generator=torch.Generator().manual_seed(sampler.seed),
    )


def build_eval_loader(
    dataset: Dataset,
    rank: int,
    world_size: int,
    batch_size: int,
    num_workers: int = 0,
    collate_fn: Callable | None = None,
    pin_memory: bool = False,
) -> DataLoader:
    """Every test sample exactly once across ranks (ranks may get one sample more or less)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=eval_shard(len(dataset), rank, world_size),
        num_workers=num_workers,
        # Not from the global RNG: an evaluation must not shift the training's random stream.
        generator=torch.Generator().manual_seed(0),
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )


def pack_by_tokens(lengths: Sequence[int], max_tokens: int, max_items: int) -> list[list[int]]:
    """Greedy groups of consecutive positions of ``lengths`` (sorted longest first) such that
    ``len(group) * lengths[group[0]] <= max_tokens`` and ``len(group) <= max_items``; an item longer
    than ``max_tokens`` forms a group alone.

        >>> pack_by_tokens([5, 4, 4, 2, 1], max_tokens=8, max_items=4)
        [[0], [1, 2], [3, 4]]
    """
    groups: list[list[int]] = []
    for position, length in enumerate(lengths):
        group = groups[-1] if groups else None
        if group is None or len(group) >= max_items or (len(group) + 1) * lengths[group[0]] > max_tokens:
            groups.append([position])
        else:
            group.append(position)
    return groups
