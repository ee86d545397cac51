"""examples/custom_loop.py, a user's own loop on ringtrain.Session (the middle layer), under real torchrun.

Three jobs of two workers each: an uninterrupted run (A), and the same run stopped by --max-steps 35 (B),
whose newest checkpoint is then corrupted on disk, resumed with --resume (B'). The oracles:
- A learns the digits (test accuracy far above the 10% of chance);
- every epoch of A and of B + B' uses every training sample exactly once (counted here from the ledger the
  example writes, and by ringtrain's own check_ledger), each step dealt evenly over the two ranks;
- one gradient all-reduce per optimizer step, with two micro-batches per step (the strategy's CommTimer);
- B' skips the corrupt checkpoint, resumes mid-epoch from the one before, and ends with A's parameters and
  optimizer state, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import ringtrain
from tests.conftest import run_cli

pytestmark = pytest.mark.job

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 4
TRAIN_SAMPLES = 1437  # 80% of scikit-learn's 1,797 digits
STEPS_PER_EPOCH = 23  # ceil(1437 / 64)
STEPS = EPOCHS * STEPS_PER_EPOCH
STOP_AT = 35  # mid-epoch 1; checkpoints every 10 steps and at the stop


def start_example(run_dir: Path, *args: str) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 examples/custom_loop.py`` as a user starts it."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "examples/custom_loop.py", "--run-dir", str(run_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(job: subprocess.Popen, timeout_s: float = 180) -> tuple[str, str]:
    """The job's stdout and stderr once it exited 0 (killed with its workers if it hangs)."""
    try:
        out, err = job.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        pytest.fail(f"{' '.join(job.args[-6:])} did not finish in {timeout_s} s:\n{err[-3000:]}")
    assert job.returncode == 0, f"{' '.join(job.args[-6:])} exited {job.returncode}:\n{out[-2000:]}{err[-4000:]}"
    return out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("custom_loop")
    whole, stopped = root / "whole", root / "stopped"
    # A and B at once: on a small machine most of a job's time is its workers importing torch.
    jobs = [start_example(whole, "--epochs", str(EPOCHS)),
            start_example(stopped, "--epochs", str(EPOCHS), "--max-steps", str(STOP_AT))]
    (whole_out, _), (stopped_out, _) = [finish(job) for job in jobs]
    checkpoints = ringtrain.CheckpointManager(stopped / "checkpoints")
    stopped_checkpoints = [p.name for p in checkpoints.checkpoints()]
    resume_point = checkpoints.load(checkpoints.path_for(30))["sampler"]
    newest = checkpoints.path_for(STOP_AT)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit flipped on disk
    newest.write_bytes(bytes(data))
    resumed_out, resumed_err = finish(start_example(stopped, "--epochs", str(EPOCHS), "--resume"))
    return {"whole": whole, "stopped": stopped, "whole_out": whole_out, "stopped_out": stopped_out,
            "stopped_checkpoints": stopped_checkpoints, "resume_point": resume_point, "resumed_out": resumed_out, "resumed_err": resumed_err}


def summary_line(out: str) -> re.Match:
    match = re.search(r"step (\d+) \(epoch ([\d.]+)\): test accuracy ([\d.]+) on 360 images; "
                      r"(\d+) gradient all-reduces in (\d+) steps", out)
    assert match, out
    return match


def test_the_example_learns_the_digits(runs):
    line = summary_line(runs["whole_out"])
    print(line.group(0))
    assert int(line.group(1)) == STEPS and float(line.group(2)) == EPOCHS
    assert float(line.group(3)) > 0.8  # chance: 0.1
    assert json.loads((runs["whole"] / "summary.json").read_text())["steps"] == STEPS


def epochs_of(ledger: Path) -> dict[int, list[dict]]:
    steps = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert steps[0] == {"type": "header", "num_samples": TRAIN_SAMPLES}
    by_epoch: dict[int, list[dict]] = {}
    for record in steps[1:]:
        by_epoch.setdefault(record["epoch"], []).append(record)
    return by_epoch


@pytest.mark.parametrize("run", ["whole", "stopped"])
def test_every_sample_exactly_once_per_epoch_also_across_a_resume(runs, run):
    ledger = runs[run] / "ledger.jsonl"
    by_epoch = epochs_of(ledger)
    assert sorted(by_epoch) == list(range(EPOCHS))
    assert [r["step"] for e in sorted(by_epoch) for r in by_epoch[e]] == list(range(1, STEPS + 1))
    for epoch, records in by_epoch.items():
        for record in records:
            shares = record["ids"]
            assert len(shares) == 2 and not set(shares[0]) & set(shares[1])
            assert abs(len(shares[0]) - len(shares[1])) <= 1 and len(shares[0]) + len(shares[1]) <= 64
        used = Counter(i for record in records for share in record["ids"] for i in share)
        assert used == Counter(range(TRAIN_SAMPLES)), f"epoch {epoch}: {sum(used.values())} uses of {len(used)} samples"
    assert all(r.exactly_once and r.complete for r in ringtrain.check_ledger(ledger))


def test_one_gradient_all_reduce_per_optimizer_step(runs):
    records = [r for r in map(json.loads, (runs["whole"] / "metrics.jsonl").read_text().splitlines())
               if r["type"] == "train"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 for r in records)
    # Two micro-batches per step, the first inside no_sync: one synchronisation (one bucket) per step.
    line = summary_line(runs["whole_out"])
    assert line.group(4) == line.group(5) == str(STEPS)
    line = summary_line(runs["resumed_out"])
    assert line.group(4) == line.group(5) == str(STEPS - 30)  # the resumed run: its own steps only


def test_resume_skips_a_corrupt_checkpoint_and_ends_bit_exact(runs):
    assert runs["stopped_checkpoints"][-1] == f"step_{STOP_AT:08d}.pt"
    assert summary_line(runs["stopped_out"]).group(1) == str(STOP_AT)
    assert f"step_{STOP_AT:08d}.pt does not match the sha256 in its manifest" in runs["resumed_err"]
    assert "resuming from step_00000030.pt" in runs["resumed_err"]
    assert runs["resume_point"]["epoch"] == 1 and runs["resume_point"]["cursor"] == 7 * 64  # mid-epoch
    whole = ringtrain.CheckpointManager(runs["whole"] / "checkpoints").load_latest()[1]
    resumed = ringtrain.CheckpointManager(runs["stopped"] / "checkpoints").load_latest()[1]
    assert whole["train_state"] == resumed["train_state"] and whole["train_state"]["step"] == STEPS
    assert whole["sampler"] == resumed["sampler"]
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    for param, state in whole["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, resumed["optimizer"]["state"][param][key]), (param, key)


def test_the_loop_trains_bit_identically_to_ringtrain_train_on_the_same_parts(runs, tmp_path):
    """The middle layer and the trainer are one stack: `ringtrain train` with the example's model and data as
    factories, the same [train] settings, ends on the example's parameters, bit for bit."""
    config = tmp_path / "custom_loop.toml"
    config.write_text(f"""
[model]
factory = "examples.custom_loop:build_model"
[data]
factory = "examples.custom_loop:load_data"
[train]
epochs = {EPOCHS}
global_batch_size = 64
local_batch_size = 16
optimizer = "adamw"
lr = 0.003
lr_schedule = "constant"
[monitor]
progress = false
""")
    result = run_cli("train", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "train"))
    assert result.returncode == 0, result.stderr
    trained = json.loads((tmp_path / "train" / "summary.json").read_text())
    looped = json.loads((runs["whole"] / "summary.json").read_text())
    print(f"ringtrain train {trained['param_sha256'][0][:16]}, the example's loop {looped['param_sha256'][0][:16]}")
    assert trained["steps"] == looped["steps"] == STEPS
    assert trained["param_sha256"] == looped["param_sha256"]
