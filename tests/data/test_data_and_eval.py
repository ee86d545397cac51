"""Sharding and evaluation across real Gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringtrain.data import ResumableSampler, build_eval_loader, build_train_loader
from ringtrain.data.digits import load_digits_split
from ringtrain.models import MLP
from ringtrain.train.evaluate import evaluate
from ringtrain.train.tasks import builtin_task
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks


def shards_per_epoch(rank: int, world_size: int, epochs: int) -> list[list[list[int]]]:
    """Every rank's sample ids of each epoch, as seen through the real train loader."""
    data = load_digits_split(0.2, 0)
    sampler = ResumableSampler(len(data.train), global_batch_size=48, seed=0)
    loader = build_train_loader(data.train, sampler, rank, world_size)
    seen = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ids = []
        for batch in loader:
            ids += batch.indices.tolist()
            assert torch.equal(batch.inputs, torch.stack([data.train[i][0] for i in batch.indices]))
            sampler.advance()
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, ids)
        seen.append(gathered)
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_worker_sees_a_disjoint_shard_and_the_order_changes(world_size):
    epochs = run_distributed(shards_per_epoch, world_size, 2)[0]
    num_train = len(load_digits_split(0.2, 0).train)
    for per_rank in epochs:
        flat = [i for ids in per_rank for i in ids]
        assert len(flat) == len(set(flat)) == num_train, "shards overlap or miss samples"
    assert epochs[0][0] != epochs[1][0], "rank 0 saw the same order in two epochs"


def eval_metrics(rank: int, world_size: int) -> dict:
    data = load_digits_split(0.2, 0)
    torch.manual_seed(0)
    model = MLP(64, [32], 10)
    loader = build_eval_loader(data.test, rank, world_size, batch_size=64)
    return evaluate(model, loader, builtin_task("digits"), torch.device("cpu"))


def test_eval_counts_each_test_sample_once_at_any_world_size():
    num_test = len(load_digits_split(0.2, 0).test)
    reference = run_distributed(eval_metrics, 1)[0]
    assert reference["count"] == num_test
    for world_size in (2, 3):
        results = run_distributed(eval_metrics, world_size)
        for metrics in results:
            assert metrics["count"] == num_test
            assert metrics["accuracy"] == reference["accuracy"]
            assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-6)
