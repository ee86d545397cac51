"""SLURM's warning before the time limit (``#SBATCH --signal=USR1@90``): SIGUSR1 saves the step reached and stops
the job with exit 138 (128 + SIGUSR1), which examples/slurm/train.sbatch answers with ``scontrol requeue``; the
requeued ``--resume`` ends with the same parameters as an uninterrupted run.

SLURM signals every process of the job step (the launcher and, with proctrack/cgroup, the workers it started);
both ways are tested. The launcher knows it is in a SLURM job from SLURM_JOB_ID (cluster.py)."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.jobs import Job, last_step
from tests.conftest import run_cli

pytestmark = pytest.mark.job

CONFIG = "configs/debug_mlp.toml"
OVERRIDES = ["train.epochs=4", "monitor.log_every_steps=1", "checkpoint.every_steps=10"]
JOB = [CONFIG, "--nproc", "2", *(arg for override in OVERRIDES for arg in ("--set", override))]
# A one-node step of `srun --ntasks-per-node=1`: nothing to fill in, but SIGUSR1 means "save and stop".
SLURM = {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
         "SLURM_JOB_NODELIST": "localhost", "SLURM_LOCALID": "0", "SLURM_PROCID": "0"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[str]:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = run_cli("train", *JOB, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return json.loads((run_dir / "summary.json").read_text())["param_sha256"]


def _stop_with_sigusr1(run_dir, every_process: bool) -> tuple[int, Job]:
    with Job("train", *JOB, "--run-dir", str(run_dir), env=SLURM) as job:
        job.wait_for(lambda: last_step(run_dir) >= 15, what="step 15")
        targets = job.tree() if every_process else [job.tree()[0]]
        for process in targets:
            process.send_signal(signal.SIGUSR1)
        code = job.finish()
    return code, job


@pytest.mark.parametrize("every_process", [False, True], ids=["to-the-launcher", "to-every-process"])
def test_sigusr1_in_a_slurm_job_saves_exits_138_and_the_requeued_resume_is_bit_exact(tmp_path, uninterrupted,
                                                                                      every_process):
    run_dir = tmp_path / "run"
    code, job = _stop_with_sigusr1(run_dir, every_process)
    assert code == 128 + signal.SIGUSR1 == 138, job.stderr
    stopped = re.search(r"\[rank 0\] stopped at step (\d+) after saving (step_\d+\.pt) \(SIGUSR1", job.stderr)
    assert stopped, job.stderr
    assert (run_dir / "checkpoints" / stopped.group(2)).exists() and int(stopped.group(1)) == last_step(run_dir) < 92
    assert job.stderr.strip().splitlines()[-1] == (
        "ringtrain: error: stopped by SIGUSR1; workers that were training saved the step they reached (continue "
        "later with --resume)")
    resumed = run_cli("train", *JOB, "--run-dir", str(run_dir), "--resume", env=SLURM)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["param_sha256"] == uninterrupted
