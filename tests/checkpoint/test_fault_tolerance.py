"""Fault tolerance inside the loop, on real Gloo processes: bit-exact resume (chaos 1), every rank skipping a
non-finite step (chaos 9), and a failed collective that names the lost rank.

The trainer here is the one ``ringtrain train`` builds (``build_trainer``); only the task is wrapped, to
inject what a test needs: noise drawn from each rank's RNG (as dropout would) or a NaN loss on one rank. The
resume test itself trains a user's model with real dropout, its samples loaded by DataLoader workers.
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

from ringtrain.group.jobstore import JobStore
from ringtrain.group.watch import CollectiveFailed, CollectiveWatch, Heartbeat
from ringtrain.errors import CheckpointError
from ringtrain.train.resume import ResumePlan
from tests.distributed import DistributedTestError, run_distributed
from tests.runs import losses, records
from tests.trainers import build_test_trainer, params_of, train_uninterrupted

pytestmark = pytest.mark.ranks

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug_mlp.toml"

# debug_mlp.toml with a user's model that has dropout (and the user's digits, as factories), and one DataLoader
# worker per rank: the samples are loaded (and the generators seeded per sample, data/seeding.py) in the worker,
# so in the training process nothing but the loop's per-step reseed makes a step's dropout masks the same after a
# resume. (With samples loaded in the training process, the last sample's seed would hide a missing reseed.)
DROPOUT_WITH_LOADER_WORKERS = """
[model]
factory = "tests.user_code:dropout_mlp"

[data]
factory = "tests.user_code:digits"
num_workers = 1

[train]
epochs = 2
global_batch_size = 64
local_batch_size = 16
lr = 0.1
seed = 0

[checkpoint]
every_steps = 10

[monitor]
progress = false
"""


class NoisyTask:
    """Scales each loss by a random factor from the rank's torch RNG, as dropout makes training depend on
    every rank's generator: resumes are bit-exact only if each step's randomness is the same after a resume."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):  # everything but the loss is the wrapped task's
        return getattr(self.task, name)

    def loss_sum(self, outputs, targets):
        return self.task.loss_sum(outputs, targets) * (1 + 0.1 * torch.rand(()))


class NaNTask(NoisyTask):
    """A NaN loss on ``rank`` at the given steps; ``where="gradient"``: a finite loss whose gradient is
    infinite on that rank (an overflow in the backward)."""

    def __init__(self, task, trainer, rank: int, steps: set[int], where: str = "loss"):
        super().__init__(task)
        self.trainer, self.rank, self.steps, self.where = trainer, rank, steps, where

    def loss_sum(self, outputs, targets):
        if dist.get_rank() == self.rank and self.trainer.state.step + 1 in self.steps:
            if self.where == "gradient":
                outputs.register_hook(lambda grad: grad * math.inf)
            else:
                return self.task.loss_sum(outputs, targets) * math.nan
        return self.task.loss_sum(outputs, targets)


def train(rank: int, world_size: int, run_dir: str, overrides: list[str], resume: bool, nan: dict | None = None,
          stop_at: int | None = None, config: str = str(DEBUG)):
    """Train; ``stop_at``: end (with a checkpoint) after that step, as an interrupted run of the same plan
    would, while the lr schedule still plans the whole run."""
    trainer = build_test_trainer(rank, world_size, config, ["monitor.log_every_steps=1", *overrides], run_dir)
    if stop_at is not None:
        trainer.total_steps = stop_at
    if nan is None:
        if config == str(DEBUG):  # the debug MLP draws nothing itself (DROPOUT_WITH_LOADER_WORKERS's model does)
            trainer.parts.task = NoisyTask(trainer.parts.task)
        # Whatever the global stream was before, each step reseeds it (data/seeding.py): a resume is exact.
        torch.manual_seed(100 + rank + 1000 * resume)
    else:
        trainer.parts.task = NaNTask(trainer.parts.task, trainer, **nan)
    trainer.resume(ResumePlan(resume=resume, required=resume))
    summary = trainer.fit()
    return summary, params_of(trainer), trainer.state.state_dict()


def lrs(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in records(run_dir, "train")}


@pytest.mark.parametrize("stop", [23, 16], ids=["epoch-boundary", "mid-epoch"])
def test_resume_is_bit_exact(tmp_path, stop):
    """Chaos 1: 2N steps in one run equal N steps, stop, resume, N more: every loss and parameter, with the
    warm-up + cosine schedule of the real configs, a model with dropout and loader workers. The training
    process's generators start from a different seed in the resumed run (``train``), and no sample is loaded
    in it (the loader's worker seeds its own), so only the step's reseed makes the dropout masks match."""
    total = 2 * stop
    straight, split = tmp_path / "straight", tmp_path / "split"
    config = tmp_path / "dropout.toml"
    config.write_text(DROPOUT_WITH_LOADER_WORKERS)
    plan = [f"train.max_steps={total}", "train.lr_schedule='cosine'", "train.warmup_steps=4"]
    ref = run_distributed(train, 2, str(straight), plan, False, None, None, str(config))
    run_distributed(train, 2, str(split), plan, False, None, stop, str(config))
    got = run_distributed(train, 2, str(split), plan, True, None, None, str(config))

    assert losses(split) == losses(straight), "a loss differs after the resume"
    assert sorted(losses(split)) == list(range(1, total + 1))
    assert lrs(split) == lrs(straight), "the lr schedule differs after the resume"
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


def test_a_non_finite_gradient_on_one_rank_is_skipped_by_every_rank(tmp_path):
    """A finite loss with an infinite gradient on rank 1 at step 3: the step agreement's all-reduce no longer
    carries gradient flags (it runs beside the backward); each rank checks the synchronised gradient, which
    every rank holds bit-identical, so both skip step 3 and the parameters stay those of step 2."""
    skipped = run_distributed(train, 2, str(tmp_path / "inf"), ["train.max_steps=3"], False,
                              {"rank": 1, "steps": {3}, "where": "gradient"})
    clean = run_distributed(train, 2, str(tmp_path / "clean"), ["train.max_steps=2"], False,
                            {"rank": 1, "steps": set()})
    for summary, params, state in skipped:
        assert state["skipped_steps"] == 1 and state["step"] == 3
        assert summary["param_sha256"][0] == summary["param_sha256"][1]
        for name, tensor in params.items():
            assert np.array_equal(tensor, clean[0][1][name]), f"{name}: the skipped step changed the parameters"
    skips = records(tmp_path / "inf", "skip")
    assert skips == [{"type": "skip", "step": 3, "reason": "non-finite gradient after synchronisation"}]
    print("infinite gradient on rank 1 at step 3: skipped on 2/2 ranks, parameters equal to step 2's")


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


def test_a_resume_follows_the_new_config_s_lr_and_schedule(tmp_path):
    """A cosine schedule planned for 40 steps, stopped at 30, resumed with max_steps=100 and lr=0.2: the lr
    at every later step equals a fresh run's under the new config (not 0 after the old end, not the old lr),
    the resume says so, and the momentum buffers still come from the checkpoint."""
    old = ["train.epochs=5", "train.max_steps=40", "train.lr_schedule='cosine'", "train.lr=0.1"]
    new = ["train.epochs=5", "train.max_steps=100", "train.lr_schedule='cosine'", "train.lr=0.2"]
    run = tmp_path / "run"
    run_distributed(train, 1, str(run), old, False, None, 30)
    run_distributed(train, 1, str(run), new, True)
    run_distributed(train, 1, str(tmp_path / "fresh"), new, False)

    resumed, fresh = lrs(run), lrs(tmp_path / "fresh")
    after = {step: lr for step, lr in resumed.items() if step > 30}
    assert sorted(after) == list(range(31, 101))
    assert after == {step: fresh[step] for step in after}, "the resumed lr differs from a fresh run's"
    assert min(after[s] for s in range(31, 100)) > 0 and after[41] > 0.05, "the old schedule's end leaked into the resume"
    [warning] = [r["message"] for r in records(run, "warning") if "changed config" in r["message"]]
    assert "train.lr: 0.1 -> 0.2" in warning and "train.max_steps: 40 -> 100" in warning, warning
    assert f"lr {fresh[30]:.6g} at step 30" in warning, warning
    [resume] = records(run, "resume")
    assert resume["lr"] == fresh[30]


def optimizer_state_after_resume(rank: int, world_size: int, run_dir: str, overrides: list[str]):
    trainer = build_test_trainer(rank, world_size, str(DEBUG), overrides, run_dir)
    trainer.resume(ResumePlan(resume=True, required=True))
    optimizer = trainer.parts.optimizer
    buffers = [optimizer.state[p]["momentum_buffer"].clone() for p in trainer.module.parameters()]
    return optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["momentum"], [b.numpy() for b in buffers]


def test_only_the_optimizer_state_comes_from_the_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    run_distributed(train_uninterrupted, 1, str(DEBUG), ["train.max_steps=10", "train.momentum=0.9"], run)
    lr, momentum, buffers = run_distributed(
        optimizer_state_after_resume, 1, run, ["train.max_steps=20", "train.momentum=0.5", "train.lr=0.3"])[0]
    assert (lr, momentum) == (0.3, 0.5), "the checkpoint's hyperparameters overrode the config's"
    assert all(np.abs(b).sum() > 0 for b in buffers), "the momentum buffers were not restored"


def test_a_changed_optimizer_type_is_refused_in_one_line(tmp_path):
    run = str(tmp_path / "run")
    run_distributed(train_uninterrupted, 1, str(DEBUG), ["train.max_steps=5"], run)
    [message] = run_distributed(resume_into, 1, run, ["train.optimizer='adamw'"])
    assert "the checkpoint's optimizer is torch.optim.sgd.SGD but this run builds torch.optim.adamw.AdamW" in message
    assert "\n" not in message


def test_resume_with_powersgd_is_bit_exact(tmp_path):
    """PowerSGD's per-rank error feedback, factors and iteration are checkpointed (gathered to rank 0), and
    the buckets they are keyed by stay the same across the resume: 12 steps straight equal 6 + 6."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    plan = ["train.max_steps=12", "comm.algorithm='powersgd'", "comm.powersgd_start_iter=2", "train.lr_schedule='cosine'"]
    ref = run_distributed(train, 2, str(straight), plan, False)
    run_distributed(train, 2, str(split), plan, False, None, 6)
    got = run_distributed(train, 2, str(split), plan, True)
    assert losses(split) == losses(straight), "a loss differs after the resume"
    for name, tensor in ref[1][1].items():
        assert np.array_equal(tensor, got[1][1][name]), f"{name} differs after the resume"
    assert not [r for r in records(split, "warning") if "PowerSGD" in r["message"]]


def train_split(rank: int, world_size: int, run_dir: str, config: str, overrides: list[str], nan: dict):
    """Train a split model (a pipeline or a tensor-parallel pair) with ``NaNTask``; its parameters by digest (each
    rank holds a part; the summary's digest is the whole model's)."""
    trainer = build_test_trainer(rank, world_size, config, ["monitor.log_every_steps=1", "train.precision='fp32'",
                                                            *overrides], run_dir)
    trainer.parts.task = NaNTask(trainer.parts.task, trainer, **nan)
    trainer.resume(ResumePlan.fresh())
    return trainer.fit()["param_sha256"], trainer.state.state_dict()


SPLIT = {"pp": ("configs/debug_pp.toml", []),
         "tp": ("configs/debug_lm.toml", ["parallel.tp=-1", "train.auto_micro_batch=false"])}
# A pipeline's loss is its last stage's, handed to every rank of the pipeline: a NaN there is both ranks' loss. A
# tensor-parallel pair computes the loss on each rank; the bad gradient reaches the other rank through the split
# layers' all-reduces (and through the stages' activation gradients).
REASONS = {("pp", "loss"): "non-finite loss on ranks 0, 1", ("tp", "loss"): "non-finite loss on rank 1",
           ("pp", "gradient"): "non-finite gradient on ranks 0, 1", ("tp", "gradient"): "non-finite gradient on ranks 0, 1"}


@pytest.mark.parametrize("layout", SPLIT)
@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_non_finite_step_of_a_split_model_is_skipped_by_every_rank(tmp_path, layout, where):
    """Through a pipeline (rank 1 holds the last stage, where the loss is) and a tensor-parallel pair: a NaN loss or
    an infinite gradient on rank 1 at step 4 makes both ranks skip step 4, so the model they hold is step 3's."""
    config, overrides = SPLIT[layout]
    skipped = run_distributed(train_split, 2, str(tmp_path / "bad"), config, ["train.max_steps=4", *overrides],
                              {"rank": 1, "steps": {4}, "where": where}, timeout_s=240)
    clean = run_distributed(train_split, 2, str(tmp_path / "clean"), config, ["train.max_steps=3", *overrides],
                            {"rank": 1, "steps": set()}, timeout_s=240)
    for digests, state in skipped:
        assert state["skipped_steps"] == 1 and state["step"] == 4
        assert digests == clean[0][0], "the skipped step changed the parameters"
    skips = records(tmp_path / "bad", "skip")
    print(f"{layout}, non-finite {where} on rank 1 at step 4: {skips}")
    assert skips == [{"type": "skip", "step": 4, "reason": REASONS[layout, where]}]
