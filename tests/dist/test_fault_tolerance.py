"""Fault tolerance inside the loop, on real Gloo processes: bit-exact resume (chaos 1), every rank skipping a
non-finite step (chaos 9), and a failed collective that names the lost rank.

The trainer here is the one ``ringtrain train`` builds (``build_trainer``); only the task is wrapped, to
inject what a test needs: noise drawn from each rank's RNG (as dropout would) or a NaN loss on one rank.
"""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringtrain.dist.jobstore import JobStore
from ringtrain.dist.watch import CollectiveFailed, CollectiveWatch, Heartbeat
from ringtrain.errors import CheckpointError
from ringtrain.train.resume import ResumePlan
from tests.distributed import DistributedTestError, run_distributed
from tests.trainers import build_test_trainer, params_of, train_uninterrupted

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug_mlp.toml"


class NoisyTask:
    """Scales each loss by a random factor from the rank's torch RNG, as dropout makes training depend on
    every rank's generator: resumes are bit-exact only if every rank's RNG state is restored."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):  # everything but the loss is the wrapped task's
        return getattr(self.task, name)

    def loss_sum(self, outputs, targets):
        return self.task.loss_sum(outputs, targets) * (1 + 0.1 * torch.rand(()))


class NaNTask(NoisyTask):
    """A NaN loss on ``rank`` at the given steps."""

    def __init__(self, task, trainer, rank: int, steps: set[int]):
        super().__init__(task)
        self.trainer, self.rank, self.steps = trainer, rank, steps

    def loss_sum(self, outputs, targets):
        loss = self.task.loss_sum(outputs, targets)
        if dist.get_rank() == self.rank and self.trainer.state.step + 1 in self.steps:
            return loss * math.nan
        return loss


def train(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool, nan: dict | None = None):
    trainer = build_test_trainer(rank, world_size, str(DEBUG), ["monitor.log_every_steps=1", *overrides], run_dir)
    if nan is None:
        trainer.parts.task = NoisyTask(trainer.parts.task)
        torch.manual_seed(100 + rank)  # a different stream per rank; a resume must restore each one
    else:
        trainer.parts.task = NaNTask(trainer.parts.task, trainer, **nan)
    trainer.resume(ResumePlan(resume=resume, required=resume))
    summary = trainer.fit()
    return summary, params_of(trainer), trainer.state.state_dict()


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["type"] == "train"}


@pytest.mark.parametrize("stop", [23, 16], ids=["epoch-boundary", "mid-epoch"])
def test_resume_is_bit_exact(tmp_path, stop):
    """Chaos 1: 2N steps in one run equal N steps, stop, resume, N more: every loss and parameter."""
    total = 2 * stop
    straight, split = tmp_path / "straight", tmp_path / "split"
    ref = run_distributed(train, 2, str(straight), [f"train.max_steps={total}"], False)
    run_distributed(train, 2, str(split), [f"train.max_steps={stop}"], False)
    got = run_distributed(train, 2, str(split), [f"train.max_steps={total}"], True)

    assert losses(split) == losses(straight), "a loss differs after the resume"
    assert sorted(losses(split)) == list(range(1, total + 1))
    differing = [name for name in ref[0][1] if not np.array_equal(ref[0][1][name], got[0][1][name])]
    assert not differing, f"parameters differ after the resume: {differing}"
    assert got[0][2] == ref[0][2]
    assert got[0][0]["param_sha256"] == ref[0][0]["param_sha256"]
    print(f"resume parity at step {stop} of {total}: {total} losses and all parameters bit-identical (atol = rtol = 0)")


def test_a_nan_on_one_rank_is_skipped_by_every_rank(tmp_path):
    """Chaos 9: NaN loss on rank 1 at step 5: both ranks skip step 5, parameters stay identical, and they
    equal those after step 4 (the skipped step changed nothing)."""
    skipped = run_distributed(train, 2, str(tmp_path / "nan"), ["train.max_steps=5"], False,
                              {"rank": 1, "steps": {5}})
    clean = run_distributed(train, 2, str(tmp_path / "clean"), ["train.max_steps=4"], False,
                            {"rank": 1, "steps": set()})
    for summary, params, state in skipped:
        assert state["skipped_steps"] == 1 and state["step"] == 5
        assert summary["param_sha256"][0] == summary["param_sha256"][1]
        for name, tensor in params.items():
            assert np.array_equal(tensor, clean[0][1][name]), f"{name}: the skipped step changed the parameters"
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in records if r["type"] == "skip"]
    assert skips == [{"type": "skip", "step": 5, "reason": "non-finite loss on rank 1"}]
    print("NaN on rank 1 at step 5: skipped on 2/2 ranks, parameters identical on all ranks and equal to step 4's")


def test_consecutive_non_finite_steps_stop_the_job_naming_rank_and_steps(tmp_path):
    with pytest.raises(DistributedTestError) as err:
        run_distributed(train, 2, str(tmp_path / "nan"), ["train.max_steps=20"], False, {"rank": 1, "steps": {5, 6, 7}})
    assert "NonFiniteSteps: steps 5-7: non-finite loss on rank 1 in 3 consecutive steps" in str(err.value)
    assert "train.max_consecutive_nonfinite_steps = 3" in str(err.value)


def leave_or_all_reduce(rank: int, world_size: int, port: int) -> str:
    store = JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=rank == 0)
    with Heartbeat(store, rank, interval_s=0.2):
        if rank == 1:
            time.sleep(0.6)
            return "left"  # leaves the group without joining the collective: its connections close
        watch = CollectiveWatch(store, rank, world_size, timeout_s=30, interval_s=0.2)
        start = time.monotonic()
        try:
            with watch.op("all_reduce (DDP gradient sync)", step=7):
                dist.all_reduce(torch.ones(4))
        except CollectiveFailed as err:
            return f"{err} after {time.monotonic() - start:.1f} s"
        return "no error"


def test_a_rank_that_leaves_a_collective_is_named_with_operation_and_step():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    message, _ = run_distributed(leave_or_all_reduce, 2, server.port)
    print(f"dead peer: {message}")
    assert message.startswith("step 7: all_reduce (DDP gradient sync) failed: rank 1 is gone"), message


def resume_into(rank: int, world_size: int, run_dir: str, overrides: list[str]) -> str:
    trainer = build_test_trainer(rank, world_size, str(DEBUG), overrides, run_dir)
    try:
        trainer.resume(ResumePlan(resume=True, required=True))
    except CheckpointError as err:
        return str(err)
    return "resumed"


def test_a_checkpoint_that_does_not_fit_the_model_names_the_changed_fields(tmp_path):
    run_dir = str(tmp_path / "run")
    run_distributed(train_uninterrupted, 1, str(DEBUG), ["train.max_steps=10"], run_dir)
    [message] = run_distributed(resume_into, 1, run_dir, ["model.hidden_sizes=[64]"])
    assert "step_00000010.pt does not fit this job" in message, message
    assert "its config differs: model.hidden_sizes: [32, 32] -> [64]; train.max_steps: 10 -> unset" in message
