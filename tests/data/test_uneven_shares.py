"""A global batch that does not divide by the world size (issue 21), across real Gloo workers.

A window of ``global_batch_size`` samples is dealt round robin, so at W workers the shares differ by one
sample at most; every rank runs ``ceil(largest share / local_batch_size)`` micro-batches (a rank with fewer
samples runs smaller ones, possibly of 0 rows), and losses are divided by the window's global item count.
The oracle, as in test_accumulation.py: one process, the mean loss over the whole window. With SGD at lr 1
and no momentum one step moves the weights by exactly the gradient.

Bound: ``rtol=1e-4, atol=2e-6`` (test_accumulation's; the sums run in another order than the oracle's).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringtrain.config import load_config
from tests.data.test_accumulation import PLAIN_SGD, full_batch_gradient
from tests.distributed import run_distributed
from tests.trainers import REPO, build_test_trainer

pytestmark = pytest.mark.ranks

BOUND = dict(rtol=1e-4, atol=2e-6)
MLP = ("configs/debug_mlp.toml", [*PLAIN_SGD, "model.hidden_sizes=[16]"])
TEXT = ("configs/debug_lm.toml", [*PLAIN_SGD, "model.n_layers=1", "model.d_model=16", "data.seq_len=32",
                                  "train.auto_micro_batch=false", "train.grad_clip_norm=1e9"])
REPLICATED = ["ddp", "manual"]
EVERY_STRATEGY = ["ddp", "manual", "zero1", "zero2", "zero3", "fsdp"]

# name -> (job, batch overrides, strategies, world sizes)
CASES = {
    # The numbers: 48 + 48 (2 micro-batches of 24) at 2 workers, 32 each at 3.
    "global96_local32": (MLP, ["train.global_batch_size=96", "train.local_batch_size=32"],
                         ["ddp", "manual", "zero2", "fsdp"], (2, 3)),
    # 49 + 48 at 2 workers: 4 micro-batches each (13 + 12 + 12 + 12, 12 x 4), where 48 alone would take 3.
    "global97_local16": (MLP, ["train.global_batch_size=97", "train.local_batch_size=16"],
                         ["ddp", "manual", "zero2", "fsdp"], (2,)),
    # 34 + 33 + 33 at 3 workers, 3 micro-batches each (12 + 11 + 11, 11 + 11 + 11).
    "global100_local16": (MLP, ["train.global_batch_size=100", "train.local_batch_size=16"],
                          ["ddp", "manual", "zero2", "fsdp"], (3,)),
    # 2 + 1 + 1 at 3 workers: 2 micro-batches each, so ranks 1 and 2 run one of 0 rows in a full window.
    "global4_local1": (MLP, ["train.global_batch_size=4", "train.local_batch_size=1"], EVERY_STRATEGY, (3,)),
    # Text, loss items are target tokens: fixed-count micro-batches (9 + 8 + 8 sequences, 3 + 3 + 3 / 3 + 3 + 2) ...
    "text_global25_local3": (TEXT, ["train.global_batch_size=25", "train.local_batch_size=3"], REPLICATED, (2, 3)),
    # 2 + 1 + 1 sequences: the Transformer's forward on 0 rows, under every strategy.
    "text_global4_local1": (TEXT, ["train.global_batch_size=4", "train.local_batch_size=1"], EVERY_STRATEGY, (3,)),
    # ... and token-budget ones.
    "text_global25_max_tokens": (TEXT, ["train.global_batch_size=25", "train.local_batch_size=4",
                                        "train.max_tokens=70"], REPLICATED, (2, 3)),
}


def _overrides(name: str, strategy: str) -> tuple[str, list[str]]:
    (config, job), batch, _, _ = CASES[name]
    return config, [*job, *batch, f"comm.strategy={strategy}"]


def one_step(rank: int, world_size: int, run_root: str, runs: list[tuple[str, str]]) -> dict:
    """Each run's parameters before and after one optimizer step, its window and this rank's micro-batches."""
    results = {}
    for name, strategy in runs:
        config, overrides = _overrides(name, strategy)
        trainer = build_test_trainer(rank, world_size, config, overrides, f"{run_root}/{name}-{strategy}")
        full = trainer.parts.strategy.full_named_parameters  # a collective under zero3 and fsdp
        before = torch.cat([p.reshape(-1) for p in full(trainer.model).values()]).numpy().copy()
        batch = next(iter(trainer.parts.train_loader))
        window = trainer.parts.sampler.next_window_size()
        plan = trainer.batcher.plan(batch, window)  # for text, one all-reduce (every rank makes it)
        rows = [len(targets) for _, targets in plan.micro_batches]
        trainer.train_step(batch)
        shares: list = [None] * world_size
        dist.all_gather_object(shares, batch.indices.tolist())
        results[(name, strategy)] = {
            "before": before,
            "after": torch.cat([p.reshape(-1) for p in full(trainer.model).values()]).numpy().copy(),
            "shares": shares,
            "rows": rows,
        }
    return results


def _runs(world_size: int) -> list[tuple[str, str]]:
    return [(name, strategy) for name, (_, _, strategies, sizes) in CASES.items() if world_size in sizes
            for strategy in strategies]


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_shares_give_the_full_batch_gradient(world_size, tmp_path):
    runs = _runs(world_size)
    per_rank = run_distributed(one_step, world_size, str(tmp_path), runs, timeout_s=300)
    worst = 0.0
    for name, strategy in runs:
        label = f"{name} {strategy} at {world_size} workers"
        got = [r[(name, strategy)] for r in per_rank]
        config, overrides = _overrides(name, strategy)
        train = load_config(REPO / config, overrides).train
        shares = got[0]["shares"]
        window = [i for share in shares for i in share]
        # Dealt round robin: every sample of the window once, shares within one sample of each other.
        assert len(window) == len(set(window)) == train.global_batch_size, label
        assert max(map(len, shares)) - min(map(len, shares)) <= 1, label
        counts = [len(r["rows"]) for r in got]
        assert len(set(counts)) == 1, f"{label}: micro-batches per rank {counts}: every rank must run as many"
        if train.max_tokens is None:
            largest = math.ceil(train.global_batch_size / world_size)
            assert counts[0] == math.ceil(largest / train.local_batch_size), label
            assert all(max(r["rows"]) <= train.local_batch_size for r in got), label
        for r, share in zip(got, shares):
            assert sum(r["rows"]) == len(share), label
        for other in got[1:]:
            assert np.array_equal(other["after"], got[0]["after"]), f"{label}: ranks disagree after the step"
        before = torch.from_numpy(got[0]["before"])
        applied = before - torch.from_numpy(got[0]["after"])  # SGD, lr 1, no momentum: the gradient itself
        reference = full_batch_gradient(config, overrides, before, sorted(window))
        torch.testing.assert_close(applied, reference, **BOUND, msg=lambda m: f"{label}: {m}")
        worst = max(worst, float((applied - reference).abs().max()))
    print(f"\n{len(runs)} runs at {world_size} workers: largest difference from the full batch's gradient {worst:.2e}")
    if world_size == 3:
        rows = [r[("global4_local1", "ddp")]["rows"] for r in per_rank]
        assert rows == [[1, 1], [1, 0], [1, 0]], f"the case must make 0-row micro-batches: {rows}"


def batch_norm_step(rank: int, world_size: int, run_root: str, strategies: list[str]) -> dict:
    """ResNet-18 (BatchNorm) on 2 + 1 + 1 images: ranks 1 and 2 run a micro-batch of 0 rows."""
    results = {}
    for strategy in strategies:
        overrides = ["train.global_batch_size=4", "train.local_batch_size=1", "train.auto_micro_batch=false",
                     "train.precision=fp32", f"comm.strategy={strategy}"]
        trainer = build_test_trainer(rank, world_size, "configs/debug_resnet.toml", overrides, f"{run_root}/{strategy}")
        batch = next(iter(trainer.parts.train_loader))
        plan = trainer.batcher.plan(batch, trainer.parts.sampler.next_window_size())
        verdict = trainer.train_step(batch)
        full = trainer.parts.strategy.full_named_parameters(trainer.model)  # a collective under zero3 and fsdp
        results[strategy] = {
            "rows": [len(targets) for _, targets in plan.micro_batches],
            "skipped": verdict.skip,
            "params": torch.cat([p.reshape(-1) for p in full.values()]).float().numpy(),
            "buffers_finite": all(bool(torch.isfinite(b.float()).all()) for b in trainer.module.buffers()),
        }
    return results


def test_zero_row_micro_batches_pass_through_batch_norm(tmp_path):
    strategies = ["ddp", "fsdp"]
    per_rank = run_distributed(batch_norm_step, 3, str(tmp_path), strategies, timeout_s=300)
    for strategy in strategies:
        got = [r[strategy] for r in per_rank]
        assert [r["rows"] for r in got] == [[1, 1], [1, 0], [1, 0]], strategy
        assert not any(r["skipped"] for r in got), f"{strategy}: the step was skipped (a loss or gradient not finite)"
        assert all(r["buffers_finite"] and np.isfinite(r["params"]).all() for r in got), strategy
        for other in got[1:]:
            assert np.array_equal(other["params"], got[0]["params"]), f"{strategy}: ranks disagree"
