"""Chaos 3 for sharded checkpoints: SIGKILL a process while it saves sharded checkpoints back to back, in
the background (async) and synchronously; after every kill the newest committed checkpoint verifies and
holds exactly its own step's tensors, and it is never older than one committed before the kill."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from ringtrain.checkpoint.sharded import ShardedCheckpointer, checkpoint_step_of, committed, verify

pytestmark = pytest.mark.ranks

_CONTEXT = mp.get_context("forkserver")


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((300_000,), float(step)), "b": torch.full((7,), float(step))}}


def _save_forever(directory: str, async_save: bool, first: int) -> None:
    ckpt = ShardedCheckpointer(directory, rank=0, world_size=1, keep_last=2)
    step = first
    while True:
        ckpt.save(step, _state(step), async_save=async_save, extra={"step": step})
        step += 1


def _newest_loads(directory: Path) -> int:
    kept = committed(directory)
    assert kept, "no committed checkpoint after the kill"
    newest = kept[-1]
    verify(newest)
    step = checkpoint_step_of(newest)
    state = {"model": {"w": torch.zeros(300_000), "b": torch.zeros(7)}}
    ShardedCheckpointer(directory, rank=0, world_size=1).load(newest, state)
    assert torch.all(state["model"]["w"] == step) and torch.all(state["model"]["b"] == step), f"{newest.name} holds another step"
    assert ShardedCheckpointer.load_extra(newest) == {"step": step}
    return step


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_kill_at_a_random_moment_never_commits_a_corrupt_sharded_checkpoint(tmp_path, async_save):
    directory = tmp_path / "checkpoints"
    rng = random.Random(7)
    newest, kills = 0, 6
    for kill in range(kills):
        before = {checkpoint_step_of(p) for p in committed(directory)}
        process = _CONTEXT.Process(target=_save_forever, args=(str(directory), async_save, 1000 * (kill + 1)))
        process.start()
        deadline = time.monotonic() + 60
        first = 1000 * (kill + 1)
        while not any(checkpoint_step_of(p) >= first for p in committed(directory)) and time.monotonic() < deadline:
            time.sleep(0.01)  # this process's first commit, so that every kill lands among saves
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        step = _newest_loads(directory)
        assert step >= max(before, default=0), f"lost committed checkpoint {max(before)}: newest is {step}"
        newest = step
    print(f"{'async' if async_save else 'sync'}: {kills} kills at random moments; newest committed each time "
          f"verified and loaded its own step (last: {newest})")
