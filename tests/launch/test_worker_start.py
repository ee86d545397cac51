"""How `ringtrain train` starts its workers (launch.py `_entrypoint`): two or more on a node fork from one
forkserver that imported torch and the trainer once; each names itself and its rank in ps; they train bit for
bit as workers in interpreters of their own (`RINGTRAIN_WORKER_START=spawn`); a factory module in the folder
the job was started from imports as it did under `python -m ringtrain.worker`, and a user's atexit handlers
run at a forked worker's end.

SLURM's SIGUSR1 to every process of the step (the forkserver too) is tests/launch/test_slurm_signal.py's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli
from tests.faults import Fault, fault_plan
from tests.jobs import Job

pytestmark = pytest.mark.job

CONFIG = "configs/debug_mlp.toml"


def test_workers_fork_from_one_forkserver_named_by_rank_and_train_bit_for_bit_as_interpreters_do(tmp_path):
    plan = fault_plan(tmp_path, *(Fault("step.micro_batch", member=m, step=2, action="stop") for m in range(3)))
    with Job("train", CONFIG, "--nproc", "3", "--run-dir", str(tmp_path / "forked"), env=plan.env) as job:
        held = job.wait_for(lambda: (h := job.held_workers()) and len(h) == 3 and h,
                            what="three workers to hold at step 2")
        parents = {process.ppid() for process in held.values()}
        assert len(parents) == 1, parents
        forkserver = psutil.Process(parents.pop())
        assert "multiprocessing.forkserver" in " ".join(forkserver.cmdline())
        assert forkserver.ppid() == job.process.pid  # the launcher's own child
        for rank, process in held.items():
            title = " ".join(process.cmdline())
            assert re.match(rf"ringtrain\.worker rank {rank}/3: \S*{re.escape(CONFIG)} --run-dir ", title), title
        job.resume_workers()
        code = job.finish()
    assert code == 0, job.stderr
    spawned = run_cli("train", CONFIG, "--nproc", "3", "--run-dir", str(tmp_path / "spawned"),
                      env={"RINGTRAIN_WORKER_START": "spawn"})
    assert spawned.returncode == 0, spawned.stderr
    forked_sha, spawned_sha = (json.loads((tmp_path / name / "summary.json").read_text())["param_sha256"]
                               for name in ("forked", "spawned"))
    assert forked_sha == spawned_sha


def test_a_factory_module_in_the_folder_the_job_starts_from_imports_in_forked_workers_and_their_atexit_runs(
        tmp_path):
    (tmp_path / "my_factories.py").write_text(textwrap.dedent('''
        import atexit
        import os
        from pathlib import Path

        import torch
        from sklearn.datasets import load_digits


        def model():
            # What a user's atexit handler does at a worker's end (here: a file per rank) still happens in a
            # forked worker, which multiprocessing ends with os._exit (worker.forked runs the handlers first).
            atexit.register(Path(f"exited-{os.environ['RANK']}").write_text, "atexit ran")
            return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


        def data():
            digits = load_digits()
            inputs = torch.tensor(digits.data, dtype=torch.float32) / 16
            dataset = torch.utils.data.TensorDataset(inputs, torch.tensor(digits.target))
            return dataset, dataset
    '''))
    (tmp_path / "job.toml").write_text(textwrap.dedent('''
        [model]
        factory = "my_factories:model"

        [data]
        factory = "my_factories:data"

        [train]
        epochs = 1
        global_batch_size = 64
        local_batch_size = 32

        [monitor]
        progress = false
    '''))
    # The `ringtrain` command as installed: its interpreter's sys.path starts with the script's folder, not the
    # working folder (as `python -m ringtrain`'s does), and the forkserver is given that sys.path.
    command = Path(sys.executable).with_name("ringtrain")
    done = subprocess.run([str(command), "train", "job.toml", "--nproc", "2", "--run-dir", str(tmp_path / "run")],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2
    assert [(tmp_path / f"exited-{rank}").read_text() for rank in (0, 1)] == ["atexit ran"] * 2


def test_a_worker_start_that_is_neither_spawn_nor_forkserver_is_refused_in_one_line(tmp_path):
    done = run_cli("train", CONFIG, "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                   env={"RINGTRAIN_WORKER_START": "fork"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "ringtrain: error: RINGTRAIN_WORKER_START='fork': set it to 'spawn' (every worker an interpreter of its own) "
        "or 'forkserver' (the default: workers fork from one warm process), or unset it"]
