"""Chaos test 8: a worker SIGKILLed inside ringtrain's own ring and shm all-reduce, mid-training.

The victim dies at a precise point of the real algorithm: a profile hook (as a debugger's breakpoint)
kills the process when the gradient all-reduce of step 3 reaches its all-gather half, after the
reduce-scatter. The survivors then hold partially reduced gradients. They must fail with an error that
names the dead rank, the operation and the step, and must not have applied those gradients: their
parameters are still exactly those of step 2.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from ringtrain.errors import RingtrainError
from ringtrain.train.resume import ResumePlan
from tests.distributed import run_distributed
from tests.trainers import build_test_trainer, params_of

VICTIM = 1
KILL_STEP = 3
TIMEOUT_S = 5.0
# Where each algorithm's all-gather half begins: the ring's step loop (its second half), or shm's gather of
# a staged piece (gradients of 1 MB and more go through the staged reduce-scatter + all-gather).
BREAKPOINTS = {"ring": ("ring.py", "run_step"), "shm": ("shm.py", "gather")}


def kill_when_reached(trainer, algorithm: str) -> None:
    """SIGKILL this process when step KILL_STEP's all-reduce enters its all-gather."""
    filename, function = BREAKPOINTS[algorithm]
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        code = frame.f_code
        if event != "call" or code.co_name != function or not code.co_filename.endswith(filename):
            return
        if trainer.state.step != KILL_STEP - 1:
            return
        calls += 1
        # The ring runs 2(n-1) steps: the first n-1 reduce, the rest gather. shm's gather is its own call.
        if algorithm == "shm" or calls > trainer.ctx.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.setprofile(profile)


def train_until_a_peer_dies(rank: int, world_size: int, algorithm: str, run_dir: str) -> dict:
    # The breakpoint is a Python function of shm.py: its Python path (the native one is C++; a rank killed
    # inside it is tests/dist/test_shm_native.py's).
    os.environ["RINGTRAIN_SHM_NATIVE"] = "0"
    overrides = [f"comm.algorithm={algorithm}", "model.hidden_sizes=[512, 512]", "train.max_steps=10",
                 f"train.global_batch_size={16 * world_size}", "train.local_batch_size=16",
                 f"dist.timeout_s={TIMEOUT_S}", "monitor.log_every_steps=1"]
    trainer = build_test_trainer(rank, world_size, "configs/debug_mlp.toml", overrides, run_dir)
    trainer.resume(ResumePlan.fresh())
    committed = {}
    run_step = trainer.train_step

    def recorded_step(batch):
        verdict = run_step(batch)
        committed["step"], committed["params"] = trainer.state.step, params_of(trainer)
        committed["at"] = time.monotonic()
        return verdict

    trainer.train_step = recorded_step
    if rank == VICTIM:
        kill_when_reached(trainer, algorithm)
    try:
        trainer.fit()
    except RingtrainError as err:
        # Measured from the end of the last committed step: the victim died within the next one.
        return {"error": str(err), "after_s": time.monotonic() - committed["at"], "committed_step": committed["step"],
                "unchanged": all(np.array_equal(committed["params"][k], v) for k, v in params_of(trainer).items())}
    finally:
        threading.setprofile(None)
    return {"error": None}


@pytest.mark.parametrize("algorithm,world_size", [("ring", 2), ("shm", 3)])
def test_sigkill_inside_the_allreduce_names_the_rank_and_applies_no_partial_gradient(tmp_path, algorithm, world_size):
    results = run_distributed(train_until_a_peer_dies, world_size, algorithm, str(tmp_path / "run"),
                              lost_ranks={VICTIM}, timeout_s=120, collective_timeout_s=TIMEOUT_S)
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
