"""Automatic micro-batch sizing across real Gloo workers: out of memory on one rank, all ranks shrink.

Two real triggers, no mocks: a test's fault plan (tests/faults.py, at the point ``step.micro_batch``) raises
torch's own OutOfMemoryError on one rank, and a CPU memory budget below what the configured micro-batch needs.
"""

from __future__ import annotations

import json

import numpy as np
import psutil
import pytest
import torch

from tests.distributed import run_distributed
from tests.faults import fault_plan, oom_at
from ringtrain.train.resume import ResumePlan
from tests.trainers import build_test_trainer, count_gradient_syncs, flat_params

pytestmark = pytest.mark.ranks

MLP_JOB = ["train.global_batch_size=96", "train.local_batch_size=16", "train.max_steps=5", "train.auto_micro_batch=true",
           "train.lr_schedule=constant", "monitor.log_every_steps=1"]


def with_and_without_oom(rank: int, world_size: int, run_root: str, plan: str) -> dict:
    plain = build_test_trainer(rank, world_size, "configs/debug_mlp.toml", MLP_JOB, f"{run_root}/plain")
    plain.fit()
    hit = build_test_trainer(rank, world_size, "configs/debug_mlp.toml", MLP_JOB, f"{run_root}/oom", fault_plan=plan)
    counter = count_gradient_syncs(hit)
    hit.fit()
    resumed = build_test_trainer(
        rank, world_size, "configs/debug_mlp.toml", [*MLP_JOB, "train.max_steps=6"], f"{run_root}/oom"
    )
    resumed.resume(ResumePlan(resume=True, required=True))
    return {
        "resumed_micro_batch_size": resumed.batcher.micro_batch_size,
        "plain": flat_params(plain.module),
        "oom": flat_params(hit.module),
        "micro_batch_size": (plain.batcher.micro_batch_size, hit.batcher.micro_batch_size),
        "samples_seen": (plain.state.samples_seen, hit.state.samples_seen),
        "steps": hit.state.step,
        "syncs": counter.syncs,
    }


def test_oom_on_one_rank_shrinks_every_rank_and_redoes_the_step(tmp_path):
    plan = fault_plan(tmp_path, oom_at(step=2, member=2))
    results = run_distributed(with_and_without_oom, 3, str(tmp_path), str(plan.path), timeout_s=120)
    assert [(f["point"], f["member"], f["step"]) for f in plan.fired()] == [("step.micro_batch", 2, 2)]
    for rank, result in enumerate(results):
        assert result["micro_batch_size"] == (16, 8), f"rank {rank} did not halve with the others"
        assert result["samples_seen"] == (5 * 96, 5 * 96), "the global batch changed"
        assert result["steps"] == 5
        assert result["syncs"] == 5, "the failed attempt must not have reached the all-reduce"
        assert result["resumed_micro_batch_size"] == 8, "a resumed run must keep the size it shrank to"
        # The failed attempt's gradients were dropped: the redone step matches the run without a failure.
        np.testing.assert_allclose(result["oom"], result["plain"], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result["oom"], results[0]["oom"])
    events = [json.loads(line) for line in (tmp_path / "oom" / "metrics.jsonl").read_text().splitlines()]
    shrinks = [e for e in events if e["type"] == "micro_batch"]
    assert len(shrinks) == 1
    assert shrinks[0]["step"] == 2 and shrinks[0]["failed_ranks"] == [2] and shrinks[0]["micro_batch_size"] == 8
    assert "rank 2: injected out-of-memory" in shrinks[0]["reason"]
    assert [e["step"] for e in events if e["type"] == "train"] == [1, 2, 3, 4, 5]


# 256 sequences of up to 128 bytes per micro-batch need a few hundred MB of activations. fp32: with bf16
# the CPU compiles and caches kernels per tensor shape (megabytes each), so the resident set also grows
# with every new micro-batch shape, and a tight budget would chase it.
LM_JOB = ["train.global_batch_size=512", "train.local_batch_size=256", "train.max_tokens=32768",
          "train.max_steps=3", "train.warmup_steps=0", "train.precision=fp32"]
HEADROOM_MB = 120


def shrink_under_memory_budget(rank: int, world_size: int, run_root: str) -> dict:
    probe = build_test_trainer(rank, world_size, "configs/debug_lm.toml", LM_JOB, f"{run_root}/probe")
    del probe
    # The budget leaves HEADROOM_MB above what a built trainer holds: less than the configured micro-batch
    # needs, more than a quarter of it does.
    budget_mb = psutil.Process().memory_info().rss / 2**20 + HEADROOM_MB
    trainer = build_test_trainer(
        rank, world_size, "configs/debug_lm.toml", [*LM_JOB, f"train.memory_budget_mb={budget_mb:.0f}"], f"{run_root}/run"
    )
    summary = trainer.fit()
    return {
        "micro_batch_size": trainer.batcher.micro_batch_size,
        "max_tokens": trainer.batcher.max_tokens,
        "shrinks": trainer.batcher.shrinks,
        "steps": trainer.state.step,
        "samples_seen": trainer.state.samples_seen,
        "eval_loss": summary["eval"]["loss"],
    }


def test_memory_budget_shrinks_the_micro_batch_on_every_rank(tmp_path):
    results = run_distributed(shrink_under_memory_budget, 2, str(tmp_path), timeout_s=240)
    first = results[0]
    assert first["shrinks"] >= 1, "the budget never bit: the micro-batch needs less than HEADROOM_MB"
    assert 8 <= first["micro_batch_size"] < 256
    assert first["max_tokens"] == 32768 * first["micro_batch_size"] // 256
    for result in results:
        assert result == first, "ranks ended with different micro-batches"
    assert first["steps"] == 3 and first["samples_seen"] == 3 * 512
    assert np.isfinite(first["eval_loss"])
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    reasons = [e["reason"] for e in events if e["type"] == "micro_batch"]
    assert len(reasons) == first["shrinks"] and all("train.memory_budget_mb" in r for r in reasons)


# Two steps of two micro-batches per rank (64 samples, 2 ranks, 16 per micro-batch); fp32 is the faster on CPU.
BN_JOB = ["train.max_steps=2", "train.precision=fp32", "train.warmup_steps=0", "checkpoint.every_steps=100"]


def batchnorm_counts(rank: int, world_size: int, run_root: str) -> dict:
    counts = {}
    for recoverable in (False, True):
        trainer = build_test_trainer(rank, world_size, "configs/debug_resnet.toml",
                                     [*BN_JOB, f"train.auto_micro_batch={str(recoverable).lower()}"], f"{run_root}/{recoverable}")
        trainer.fit()
        counts[recoverable] = sorted({int(buffer) for name, buffer in trainer.module.named_buffers()
                                      if name.endswith("num_batches_tracked")})
    return counts


def test_the_closing_pass_of_a_recoverable_step_is_not_a_batch_for_batchnorm(tmp_path):
    for rank, counts in enumerate(run_distributed(batchnorm_counts, 2, str(tmp_path), timeout_s=120)):
        # Every BatchNorm counts the real micro-batch forwards, 2 steps x 2; the zero-sample pass that makes
        # the strategy synchronise is not one.
        assert counts[False] == [4], f"rank {rank}: a plain run counted {counts[False]} batches"
        assert counts[True] == counts[False], f"rank {rank}: a recoverable run counted {counts[True]} batches"


def pipeline_cut(rank: int, world_size: int, width: int, multiple: int) -> dict:
    """A pipeline's micro-batches under train.max_tokens = 256 on two data-parallel ranks whose shares are 10
    sequences each, rank 0's 64 tokens wide and rank 1's ``width`` wide (real Gloo: the plan's all-reduce)."""
    from ringtrain.config import load_config_dict
    from ringtrain.data.loader import StepBatch
    from ringtrain.train.batch_size import MicroBatcher
    from ringtrain.train.tasks import builtin_task

    train = load_config_dict({"model": {"name": "transformer"}, "data": {"dataset": "text"},
                              "train": {"max_tokens": 256, "global_batch_size": 20}}).train
    share = 64 if rank == 0 else width
    targets = torch.arange(10 * share).reshape(10, share) + 1000 * rank
    targets[:, share - 3:] = -100  # each sequence 3 tokens short of the share's width
    batch = StepBatch(torch.arange(10) + 10 * rank, targets.clone(), targets)
    batcher = MicroBatcher(train, builtin_task("text"), rank, world_size, torch.device("cpu"), count=4,
                           count_multiple=multiple)
    plan = batcher.plan(batch, window=20)
    return {"own": batcher.pipeline_count(batch), "global_items": plan.global_items,
            "shapes": [tuple(t.shape) for _, t in plan.micro_batches],
            "rows": torch.cat([t for _, t in plan.micro_batches]).tolist(), "share": targets.tolist()}


@pytest.mark.parametrize("width, multiple, own, count", [(128, 1, (4, 5), 5), (128, 2, (4, 6), 6), (32, 1, (4, 4), 4)])
def test_a_pipelines_token_budget_cuts_each_share_into_the_busiest_replicas_count_of_one_shape(
        width, multiple, own, count):
    """256 tokens: 4 rows of 64 (3 micro-batches, at least pp_microbatches = 4) or 2 of 128 (5); the replicas run
    the busiest count (FSDP2 gathers each stage once per micro-batch), the other's share cut finer, every
    micro-batch within the budget, as wide as its share, every sequence once and in order."""
    results = run_distributed(pipeline_cut, 2, width, multiple)
    assert tuple(r["own"] for r in results) == own
    for rank, result in enumerate(results):
        shapes = result["shapes"]
        assert len(shapes) == count, shapes
        assert all(rows * wide <= 256 and wide == (64 if rank == 0 else width) for rows, wide in shapes), shapes
        rows = [rows for rows, _ in shapes]
        assert max(rows) - min(rows) <= 1, shapes  # cut finer, not padded with empty micro-batches
        assert result["rows"] == result["share"]
        assert result["global_items"] == 10 * 61 + 10 * (width - 3)  # the step's real tokens on both ranks
