"""Chaos 3: SIGKILL a process while it saves a checkpoint; the next load is never corrupt.

Fixed points: the saving process kills itself at each file-system step of a save (every write burst,
fsync, rename and unlink of the data file, its manifest and the pruning). Random moments: a process saving
checkpoints back to back is killed from outside after a random delay, 20 times. After every kill the
newest valid checkpoint must load, and hold exactly the state of the step its manifest names.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.manifest import manifest_path
from tests import distributed  # noqa: F401 - sets the forkserver's preload

pytestmark = pytest.mark.ranks

_CONTEXT = mp.get_context("forkserver")
"""The test process's one forkserver, with the harness's preload (tests/distributed.py): a list set here would
replace it for every later rank of the test process (each would import torch._dynamo and ringtrain on its own)."""


def state_for(step: int, numel: int) -> dict:
    return {"model": {"w": torch.full((numel,), float(step))}, "train_state": {"step": step}}


def assert_loads_consistently(directory: Path, saved_before: int) -> int:
    """The newest valid checkpoint loads, holds its own step's state, and is not older than the last
    checkpoint committed before the kill. Returns its step."""
    found = CheckpointManager(directory).load_latest(lambda message: None)
    assert found is not None, "no loadable checkpoint after the kill"
    path, state = found
    step = state["train_state"]["step"]
    assert path.name == f"step_{step:08d}.pt"
    assert torch.all(state["model"]["w"] == float(step)), f"{path.name} holds another step's tensors"
    assert step >= saved_before, f"lost committed checkpoint {saved_before}: newest valid is {step}"
    return step


# --- fixed points: the process dies at the n-th file-system call of a save ---------------------------

_FS_CALLS = [(os, "fsync"), (os, "replace"), (Path, "unlink")]


def _instrument(on_call) -> None:
    """Route every file-system call a save makes (and every write of the data) through on_call(name)."""
    import ringtrain.checkpoint.manifest as manifest

    def wrap(original, name):
        def call(*args, **kwargs):
            on_call(name)
            return original(*args, **kwargs)
        return call

    for owner, name in [*_FS_CALLS, (manifest.HashingWriter, "write")]:
        setattr(owner, name, wrap(getattr(owner, name), name))


def _save_and_die_at(directory: str, die_at: int, numel: int) -> None:
    calls = {"n": 0}

    def count_and_maybe_die(name: str) -> None:
        calls["n"] += 1
        if calls["n"] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    _instrument(count_and_maybe_die)
    CheckpointManager(directory, keep_last=2).save(3, state_for(3, numel))
    os.kill(os.getpid(), signal.SIGKILL)  # past the last call: the save completed, die anyway


def _count_calls(directory: str, numel: int, calls) -> None:
    _instrument(calls.put)
    CheckpointManager(directory, keep_last=2).save(3, state_for(3, numel))


def _run(target, *args) -> None:
    process = _CONTEXT.Process(target=target, args=args)
    process.start()
    process.join(timeout=60)
    assert process.exitcode in (0, -signal.SIGKILL), f"saver exited with {process.exitcode}"


def prepared(directory: Path, numel: int) -> Path:
    manager = CheckpointManager(directory, keep_last=2)
    for step in (1, 2):
        manager.save(step, state_for(step, numel))
    return directory


def test_sigkill_at_every_step_of_a_save_never_leaves_a_corrupt_load(tmp_path):
    numel = 50_000  # small: a few write bursts, so the points are few and each one is a different moment
    queue = _CONTEXT.Queue()
    _run(_count_calls, str(prepared(tmp_path / "count", numel)), numel, queue)
    time.sleep(0.2)
    calls = []
    while not queue.empty():
        calls.append(queue.get())
    assert {"fsync", "replace", "unlink"} <= set(calls), f"the instrumentation missed calls: {calls}"
    # Every fsync, rename and unlink; of the data writes (dozens) the first, a middle one and the last.
    writes = [i for i, name in enumerate(calls) if name == "write"]
    points = sorted({i for i, name in enumerate(calls) if name != "write"} | {writes[0], writes[len(writes) // 2], writes[-1]})
    outcomes = []
    for die_at in [p + 1 for p in points] + [len(calls) + 1]:
        directory = prepared(tmp_path / f"point{die_at}", numel)
        _run(_save_and_die_at, str(directory), die_at, numel)
        outcomes.append(assert_loads_consistently(directory, saved_before=2))
    print(f"kill during save, fixed points: {len(outcomes)} kill points, 0 corrupt loads "
          f"(newest valid step after each: {outcomes})")
    assert outcomes[0] == 2 and outcomes[-1] == 3, "the kill points did not span the commit"


# --- random moments: a saving loop killed from outside --------------------------------------------------

def _save_forever(directory: str, numel: int) -> None:
    manager = CheckpointManager(directory, keep_last=2)
    step = 1
    while True:
        manager.save(step, state_for(step, numel))
        step += 1


def test_sigkill_at_random_moments_of_back_to_back_saves_never_leaves_a_corrupt_load(tmp_path):
    rng = random.Random(0)
    numel = 1_000_000  # 4 MB: a save takes milliseconds, so kills land inside writes too
    steps = []
    interrupted = 0
    for trial in range(20):
        directory = tmp_path / f"trial{trial}"
        CheckpointManager(directory, keep_last=2).save(0, state_for(0, numel))
        process = _CONTEXT.Process(target=_save_forever, args=(str(directory), numel))
        process.start()
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
        # A temp file or a data file without a manifest: the kill landed inside a save.
        interrupted += any(p.name.startswith(".") or not manifest_path(p).exists()
                           for p in directory.iterdir() if not p.name.endswith(".json"))
        steps.append(assert_loads_consistently(directory, saved_before=0))
    print(f"kill during save, 20 random moments: 0 corrupt loads, {interrupted} kills inside a save; "
          f"newest valid steps {steps}")
    assert max(steps) > 0, "the saver never committed a checkpoint: the kills came too early to test anything"
