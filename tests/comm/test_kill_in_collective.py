"""Chaos test 8: a worker SIGKILLed inside ringtrain's own ring and shm all-reduce, mid-training.

The victim dies at a precise point of the real algorithm: a fault point (ringtrain/testing/faults.py) kills
the process when the gradient all-reduce of step 3 reaches its all-gather half, after the reduce-scatter. The survivors then hold partially reduced gradients. They must fail with an error that
names the dead rank, the operation and the step, and must not have applied those gradients: their
parameters are still exactly those of step 2.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from ringtrain.errors import RingtrainError
from ringtrain.testing import faults
from ringtrain.train.resume import ResumePlan
from tests.distributed import run_distributed
from tests.faults import Fault, fault_plan
from tests.trainers import build_test_trainer

pytestmark = pytest.mark.ranks

VICTIM = 1
KILL_STEP = 3
TIMEOUT_S = 5.0


def kill_plan(folder: str, algorithm: str, world_size: int) -> str:
    """SIGKILL the victim inside step KILL_STEP's gradient all-reduce (a fault plan, ringtrain/testing/faults.py):
    the ring right after its reduce-scatter half (its first n-1 steps; the all-gather half follows), shm right
    after its second arrival (its reduced shard published; the peers gather from it)."""
    if algorithm == "ring":
        fault = Fault("ring.step", member=VICTIM, step=KILL_STEP, hit=world_size - 1)
    else:
        fault = Fault("shm.arrive", member=VICTIM, step=KILL_STEP, hit=2)
    return str(fault_plan(Path(folder), fault).path)


def train_until_a_peer_dies(rank: int, world_size: int, algorithm: str, run_dir: str, plan: str,
                            settings: tuple[str, ...] = ()) -> dict:
    # A fault waiting at shm.arrive puts the host on shm's Python path, whose barriers a point sits between (the
    # native path is one C++ call; a rank killed inside it is tests/comm/test_shm_native.py's).
    overrides = [f"comm.algorithm={algorithm}", "model.hidden_sizes=[512, 512]", "train.max_steps=10",
                 f"train.global_batch_size={16 * world_size}", "train.local_batch_size=16",
                 f"dist.timeout_s={TIMEOUT_S}", "monitor.log_every_steps=1", *settings]
    trainer = build_test_trainer(rank, world_size, "configs/debug_mlp.toml", overrides, run_dir, fault_plan=plan)
    trainer.resume(ResumePlan.fresh())
    committed = {}
    run_step = trainer.train_step

    def recorded_step(batch):
        verdict = run_step(batch)
        committed["step"], committed["params"] = trainer.state.step, stepped_params(trainer)
        committed["at"] = time.monotonic()
        return verdict

    trainer.train_step = recorded_step
    try:
        trainer.fit()
    except RingtrainError as err:
        # Measured from the end of the last committed step: the victim died within the next one.
        return {"error": str(err), "after_s": time.monotonic() - committed["at"], "committed_step": committed["step"],
                "unchanged": all(np.array_equal(a, b) for a, b in zip(committed["params"], stepped_params(trainer)))}
    return {"error": None}


def stepped_params(trainer) -> list[np.ndarray]:
    """What this rank's optimizer steps: every parameter (DDP, manual), this rank's flat shards (ZeRO) or its
    parts of the sharded parameters (FSDP2)."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().numpy().copy()
            for group in trainer.parts.optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("algorithm,world_size", [("ring", 2), ("shm", 3)])
def test_sigkill_inside_the_allreduce_names_the_rank_and_applies_no_partial_gradient(tmp_path, algorithm, world_size):
    plan = kill_plan(str(tmp_path), algorithm, world_size)
    results = run_distributed(train_until_a_peer_dies, world_size, algorithm, str(tmp_path / "run"), plan,
                              lost_ranks={VICTIM}, timeout_s=120, collective_timeout_s=TIMEOUT_S)
    assert [(f["point"], f["member"], f["step"]) for f in faults.fired(plan)] == [(
        "ring.step" if algorithm == "ring" else "shm.arrive", VICTIM, KILL_STEP)]
    for rank, result in enumerate(results):
        if rank == VICTIM:
            continue
        assert result["error"] is not None, f"rank {rank} finished although rank {VICTIM} died"
        print(f"{algorithm}: rank {rank} failed {result['after_s']:.2f} s after step {KILL_STEP} began: {result['error']}")
        assert result["after_s"] < TIMEOUT_S, "a dead peer is noticed before the timeout"
        assert f"step {KILL_STEP}: all_reduce (DDP gradient sync) failed" in result["error"]
        assert f"rank {VICTIM}" in result["error"]
        assert result["committed_step"] == KILL_STEP - 1
        assert result["unchanged"], "a partially reduced gradient was applied"


STEP_OPERATIONS = {
    "manual": "all_reduce (ringtrain's gradient buckets)",
    "zero1": "reduce_scatter (ZeRO-1 gradient buckets)",
    "zero2": "reduce_scatter (ZeRO-2 gradient buckets)",
    "zero3": "all_gather and reduce_scatter (ZeRO-3 parameter units and gradient buckets)",
    "fsdp": "all_gather and reduce_scatter (FSDP2 parameters and gradients)",
}
"""What a step of each data-parallel strategy waits on, as a failure inside it names it (DDP's is the test above)."""


@pytest.mark.parametrize("strategy", STEP_OPERATIONS)
def test_a_peer_killed_inside_a_step_is_named_with_the_strategys_own_collectives(tmp_path, strategy):
    """A kill between step 3's forward and backward, under each other data-parallel strategy: the survivor fails
    naming the step and what that strategy's step waits on (ZeRO and FSDP2 reduce-scatter
    gradients and gather parameters; none of them runs DDP's all-reduce), and applies nothing."""
    plan = str(fault_plan(tmp_path, Fault("step.micro_batch", action="kill", member=VICTIM, step=KILL_STEP)).path)
    results = run_distributed(train_until_a_peer_dies, 2, "torch", str(tmp_path / "run"), plan,
                              (f"comm.strategy={strategy}",), lost_ranks={VICTIM}, timeout_s=120,
                              collective_timeout_s=TIMEOUT_S)
    assert [(f["point"], f["member"], f["step"]) for f in faults.fired(plan)] == [
        ("step.micro_batch", VICTIM, KILL_STEP)]
    error = results[0]["error"]
    assert error is not None, f"rank 0 finished although rank {VICTIM} died"
    print(f"{strategy}: rank 0 failed {results[0]['after_s']:.2f} s after step {KILL_STEP - 1}: {error}")
    # (Which rank is gone comes from the job store's heartbeats in a launched job: these ranks have none.)
    assert error.startswith(f"step {KILL_STEP}: {STEP_OPERATIONS[strategy]} failed: "), error
    assert results[0]["committed_step"] == KILL_STEP - 1 and results[0]["unchanged"]
