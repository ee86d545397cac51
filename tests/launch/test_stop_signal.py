"""The Trainer's StopSignal after a stop (issue 45: test_slurm_signal.py's to-every-process flake): SLURM signals every process of
the job step and the agent forwards the launcher's copy to each worker, so a worker can get a second SIGUSR1 after its
loop let go of the signals, on its way to saying "stopped at step N after saving ...". That copy must not kill it
(SIGUSR1's default action); without a stop, or in a hand-written loop's StepGuard, leaving the block restores
what was there before."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.distributed import run_distributed
from tests.trainers import build_test_trainer

CHILD = """
import os, signal, sys
from ringtrain.train.guards import StopSignal, Stopped

stop = StopSignal(absorb_after_stop=sys.argv[1] != "hand-written")
try:
    with stop:
        if sys.argv[1] in ("stopped", "hand-written"):
            os.kill(os.getpid(), signal.SIGUSR1)  # the test's (SLURM's) copy: a stop at the next step boundary
            assert stop.wait(10) and stop.requested
        if sys.argv[1] == "session":  # the Session's stop: marked, then SystemExit out of the loop's block
            stop.mark_stopped()
            raise SystemExit(0)
        if sys.argv[1] == "peer":  # the loop's stop agreed on a peer's signal: this worker got none yet
            raise Stopped("stopped at step 3 after saving step_00000003.pt", signal_number=signal.SIGUSR1)
except (Stopped, SystemExit):
    pass
os.kill(os.getpid(), signal.SIGUSR1)  # the agent's copy, after the loop let go of the signals
print("alive after", sys.argv[1], flush=True)
"""


def _child(case: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, case], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


@pytest.mark.job
def test_a_second_stop_signal_after_a_stop_does_not_kill_the_stopping_worker():
    done = _child("stopped")
    assert done.returncode == 0 and done.stdout.strip() == "alive after stopped", (done.returncode, done.stderr)


@pytest.mark.job
def test_the_agents_copy_after_a_peers_stop_does_not_kill_the_worker_either():
    done = _child("peer")
    assert done.returncode == 0 and done.stdout.strip() == "alive after peer", (done.returncode, done.stderr)


@pytest.mark.job
def test_without_a_stop_leaving_the_loop_restores_the_signals_default():
    done = _child("running")
    assert done.returncode == -signal.SIGUSR1 and not done.stdout, (done.returncode, done.stdout, done.stderr)


@pytest.mark.job
def test_a_hand_written_loops_stop_signal_restores_the_default_after_a_stop():
    done = _child("hand-written")
    assert done.returncode == -signal.SIGUSR1 and not done.stdout, (done.returncode, done.stdout, done.stderr)


def _trainers_flag(rank: int, world_size: int, run_dir: str) -> bool:
    return build_test_trainer(rank, world_size, "configs/debug_mlp.toml", [], run_dir).stop_signal.absorb_after_stop


@pytest.mark.ranks
def test_the_trainer_absorbs_stop_signals_after_a_stop(tmp_path):
    assert run_distributed(_trainers_flag, 1, str(tmp_path / "run")) == [True]


@pytest.mark.job
def test_a_sessions_stop_absorbs_the_late_copy_too():
    done = _child("session")
    assert done.returncode == 0 and done.stdout.strip() == "alive after session", (done.returncode, done.stderr)


@pytest.mark.job
def test_the_session_absorbs_stop_signals_after_a_stop(tmp_path):
    code = ("import sys, ringtrain\n"
            "session = ringtrain.Session({'train': {'global_batch_size': 2, 'local_batch_size': 2}}, run_dir=sys.argv[1])\n"
            "print(session.stop_signal.absorb_after_stop, flush=True)\n"
            "session.close()\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "True", (done.returncode, done.stdout, done.stderr)
