"""ResumableSampler: shards are disjoint and complete, orders change per epoch, positions resume."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from ringtrain.data.loader import build_train_loader
from ringtrain.data.sampler import ResumableSampler, eval_shard, grad_accum_steps_for_window

pytestmark = pytest.mark.unit


def epoch_shards(sampler: ResumableSampler, world_size: int, steps: int | None = None) -> list[list[list[int]]]:
    """shards[step][rank] for the next ``steps`` steps (default: the rest of the epoch), advancing as
    a training loop would."""
    taken = []
    iterators = [sampler.iter_shards(rank, world_size) for rank in range(world_size)]
    for per_rank in itertools.islice(zip(*iterators), steps):
        taken.append(list(per_rank))
        sampler.advance()
    return taken


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_samples,global_batch", [(100, 12), (97, 10), (5, 8), (64, 64)])
def test_every_sample_exactly_once_per_epoch(world_size, num_samples, global_batch):
    sampler = ResumableSampler(num_samples, global_batch, seed=3)
    used = [i for step in epoch_shards(sampler, world_size) for shard in step for i in shard]
    assert sorted(used) == list(range(num_samples))
    assert sampler.epoch_finished


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_get_disjoint_shards_of_near_equal_size(world_size):
    sampler = ResumableSampler(50, 12, seed=0)
    for step in epoch_shards(sampler, world_size):
        for a, b in itertools.combinations(step, 2):
            assert not set(a) & set(b)
        sizes = [len(shard) for shard in step]
        assert max(sizes) - min(sizes) <= 1


def test_order_depends_on_seed_and_epoch_only():
    a, b = ResumableSampler(200, 16, seed=1), ResumableSampler(200, 16, seed=1)
    assert np.array_equal(a.order(0), b.order(0))
    assert not np.array_equal(a.order(0), a.order(1)), "the order must change between epochs"
    assert not np.array_equal(a.order(0), ResumableSampler(200, 16, seed=2).order(0))


def test_set_epoch_changes_what_each_rank_sees():
    sampler = ResumableSampler(64, 16, seed=0)
    first = list(sampler.iter_shards(0, 2))
    sampler.set_epoch(1)
    assert list(sampler.iter_shards(0, 2)) != first


def test_state_dict_resumes_mid_epoch():
    sampler = ResumableSampler(100, 8, seed=5)
    sampler.set_epoch(2)
    for _ in range(3):
        sampler.advance()
    resumed = ResumableSampler(100, 8, seed=5)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed.iter_shards(1, 2)) == list(sampler.iter_shards(1, 2))
    assert (resumed.epoch, resumed.cursor) == (2, 24)


def test_world_size_change_mid_epoch_redeals_the_rest_exactly_once():
    sampler = ResumableSampler(101, 10, seed=7)
    before = [i for step in epoch_shards(sampler, 2, steps=4) for shard in step for i in shard]
    after = [i for step in epoch_shards(sampler, 3) for shard in step for i in shard]
    assert len(before) == 40
    assert sorted(before + after) == list(range(101))


def test_load_rejects_state_of_another_dataset():
    state = ResumableSampler(100, 8, seed=5).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        ResumableSampler(90, 8, seed=5).load_state_dict(state)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_shards_cover_each_sample_once(world_size):
    shards = [eval_shard(10, rank, world_size) for rank in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(10))


@pytest.mark.parametrize("num_samples,global_batch,local_batch,world_size,rows", [
    (300, 96, 32, 2, [[24, 24], [24, 24]]),        # the global batch at 2 workers: 48 each
    (300, 96, 32, 3, [[32], [32], [32]]),
    (300, 97, 16, 2, [[13, 12, 12, 12], [12, 12, 12, 12]]),   # 49 + 48: 48 alone would need 3
    (300, 100, 16, 3, [[12, 11, 11], [11, 11, 11], [11, 11, 11]]),
    (300, 4, 1, 3, [[1, 1], [1, 0], [1, 0]]),     # 2 + 1 + 1: 0-row micro-batches in a full window
    (5, 4, 1, 3, [[1, 1], [1, 0], [1, 0]]),       # ... and the epoch's short last window (1 + 0 + 0) next
])
def test_an_uneven_window_is_dealt_with_one_micro_batch_count_on_every_rank(
        num_samples, global_batch, local_batch, world_size, rows):
    dataset = TensorDataset(torch.arange(num_samples).float().unsqueeze(1), torch.arange(num_samples))
    sampler = ResumableSampler(num_samples, global_batch, seed=1)
    loaders = [iter(build_train_loader(dataset, sampler, rank, world_size)) for rank in range(world_size)]
    first = True
    while not sampler.epoch_finished:
        window = sampler.next_window_size()
        count = grad_accum_steps_for_window(window, world_size, local_batch)
        micro = [next(loader).micro_batches(count) for loader in loaders]
        if first:
            assert [[len(targets) for _, targets in m] for m in micro] == rows
            first = False
        for share in micro:
            assert len(share) == count and all(len(targets) <= local_batch for _, targets in share)
        # The fewest pieces of at most local_batch samples that hold the largest share.
        largest = max(sum(len(targets) for _, targets in share) for share in micro)
        assert (count - 1) * local_batch < largest <= count * local_batch or (largest == 0 and count == 1)
        ids = [int(i) for share in micro for inputs, targets in share for i in targets]
        assert all(torch.equal(inputs[:, 0].long(), targets) for share in micro for inputs, targets in share)
        assert len(ids) == len(set(ids)) == window, "a sample lost or dealt twice"
        assert sorted(ids) == sorted(sampler.order(sampler.epoch)[sampler.cursor : sampler.cursor + window].tolist())
        sampler.advance()
