"""The pipeline's pieces that need ranks, on the in-process harness (real Gloo processes):

- the loss normaliser: one plain-SGD step (lr 1, no momentum, no clip) of a pipeline beside data-parallel
  replicas moves the weights by exactly the full batch's mean gradient (the oracle of
  tests/data/test_accumulation.py). The pipeline's last stage scales each micro-batch's loss sum by the
  data-parallel size over the step's items (``train/step.py``'s ``_pipeline``); AdamW hardly sees that scale (a
  4x error moved a loss by 3e-5, issue 45), plain SGD takes it whole.
- the shape agreement (``pipeline_schedule.agree_shapes``): data-parallel ranks with different micro-batch
  counts, rows and widths end with the same ones, the additions padding the loss does not read.

Bound: test_uneven_shares.py's (the sums run in another order than the oracle's).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringtrain.config import load_config
from ringtrain.data import build_datasets
from ringtrain.data.text import IGNORE_INDEX
from ringtrain.models import build_model
from ringtrain.parallel.pipeline_schedule import agree_shapes
from tests.distributed import run_distributed
from tests.data.test_accumulation import PLAIN_SGD, full_batch_gradient
from tests.trainers import REPO, build_test_trainer

pytestmark = pytest.mark.ranks

BOUND = dict(rtol=1e-4, atol=2e-6)
CONFIG = "configs/debug_lm.toml"
# 12 sequences a step: 6 for each of the 2 pipelines, 2 micro-batches of 3; text, so the items are target tokens.
OVERRIDES = [*PLAIN_SGD, "model.n_layers=2", "model.d_model=16", "data.seq_len=32", "train.global_batch_size=12",
             "train.local_batch_size=3", "train.auto_micro_batch=false", "train.grad_clip_norm=1e9", "parallel.pp=2"]


def one_pipelined_step(rank: int, world_size: int, run_dir: str) -> dict:
    trainer = build_test_trainer(rank, world_size, CONFIG, OVERRIDES, run_dir)
    assert trainer.parts.strategy.pipelined and trainer.parts.strategy.dp == 2
    full = trainer.parts.strategy.full_named_parameters
    before = {name: p.detach().clone() for name, p in full(trainer.model).items()}
    batch = next(iter(trainer.parts.train_loader))
    trainer.train_step(batch)
    after = full(trainer.model)
    shares: list = [None] * world_size
    dist.all_gather_object(shares, batch.indices.tolist())
    return {"before": before, "applied": {name: before[name] - after[name] for name in before}, "shares": shares}


def test_a_pipelined_sgd_step_applies_the_full_batch_gradient(tmp_path):
    per_rank = run_distributed(one_pipelined_step, 4, str(tmp_path), timeout_s=300)
    got = per_rank[0]
    # Each pipeline's two ranks hold the same share; the two pipelines hold the window between them, each sample once.
    window = sorted({i for share in got["shares"] for i in share})
    assert sum(map(len, got["shares"])) == 2 * len(window) == 24, got["shares"]
    config = load_config(REPO / CONFIG, OVERRIDES)
    names = [name for name, _ in build_model(config.model, build_datasets(config.data)).named_parameters()]
    assert names == list(got["before"]), "the pipeline's full form is the unsplit model's, in its order"
    before = torch.cat([got["before"][name].reshape(-1) for name in names])
    applied = torch.cat([got["applied"][name].reshape(-1) for name in names])
    reference = full_batch_gradient(CONFIG, OVERRIDES, before, window)
    torch.testing.assert_close(applied, reference, **BOUND)
    for rank, other in enumerate(per_rank[1:], 1):
        for name in names:
            assert torch.equal(other["applied"][name], got["applied"][name]), f"rank {rank} disagrees on {name}"


def agreed_shapes(rank: int, world_size: int) -> list[tuple[list[int], list[int]]]:
    # Rank 0: 2 micro-batches of 3 and 2 sequences 5 wide; rank 1: 1 micro-batch of 1 sequence 7 wide.
    if rank == 0:
        mine = [(torch.ones(3, 5, dtype=torch.int64), torch.ones(3, 5, dtype=torch.int64)),
                (torch.ones(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.int64))]
    else:
        mine = [(torch.ones(1, 7, dtype=torch.int64), torch.ones(1, 7, dtype=torch.int64))]
    agreed, rows = agree_shapes(mine, max(len(t) for _, t in mine), dist.group.WORLD)
    for (x, t), (x0, t0) in zip(agreed, mine):  # the sequences padded on the right: tokens 0, targets ignored
        assert torch.equal(x[:, : x0.shape[1]], x0) and not x[:, x0.shape[1]:].any()
        assert (t[:, t0.shape[1]:] == IGNORE_INDEX).all()
    return rows, [list(x.shape) for x, _ in agreed], [list(t.shape) for _, t in agreed]


def test_data_parallel_ranks_agree_on_the_steps_micro_batch_shapes():
    (rows0, xs0, ts0), (rows1, xs1, ts1) = run_distributed(agreed_shapes, 2, timeout_s=120)
    assert rows0 == rows1 == 3  # the step's widest micro-batch: every one is padded to its rows
    assert xs0 == [[3, 7], [2, 7]] and xs1 == [[1, 7], [0, 7]], (xs0, xs1)  # as wide as the widest; as many
    assert ts0 == xs0 and ts1 == xs1
