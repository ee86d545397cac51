"""Automatic micro-batch sizing across real Gloo workers: out of memory on one rank, all ranks shrink.

Two real triggers, no mocks: a test's fault plan (tests/faults.py, at the point ``step.micro_batch``) raises
torch's own OutOfMemoryError on one rank, and a CPU memory budget below what the configured micro-batch needs.
"""

from __future__ import annotations

import json

import numpy as np
import psutil

from tests.distributed import run_distributed
from tests.faults import fault_plan, oom_at
from ringtrain.train.resume import ResumePlan
from tests.trainers import build_test_trainer, count_gradient_syncs, flat_params

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
