"""Test hooks: a worker SIGKILLs itself at a precise point of a step, as a debugger's breakpoint would.

Chaos tests need a worker to die *inside* something: part-way through ringtrain's gradient all-reduce, after
it has sent some of its pieces (the survivors then hold partially reduced gradients), or part-way through a
checkpoint save. A kill from outside lands anywhere. Two environment variables (read with the rest of the
environment in ``dist/env.py``) place it; they are test hooks, not features:

``RINGTRAIN_TEST_KILL_IN_COLLECTIVE=STEP:RANK:PIECE``
    the worker launched as RANK dies in optimizer step STEP (counted from 1, as in metrics.jsonl) right
    after its PIECE-th piece of ringtrain's collectives in that step: a ring step (``ring.py``: a send to
    the right and a receive from the left) or an arrival at an shm barrier (its data published for the
    peers). shm's native path is one C++ call that cannot be cut between its barriers, so that worker takes
    shm's Python path; the ranks of a host agree on the path, so its first group runs the Python path, and
    the survivors' next group the native one again. PIECE ``ledger``: right after the step's sample-ledger
    gather, its last collective (every rank has committed the step), before the writer writes its line.
``RINGTRAIN_TEST_KILL_IN_SAVE=STEP:RANK:POINT``
    the worker launched as RANK dies in the checkpoint save after step STEP, at POINT ``enter`` (as the save
    starts: a non-writer dies while rank 0 writes) or ``commit`` (the writer, its data file written, fsynced
    and renamed into place, before the manifest that commits it: an uncommitted checkpoint on disk).

Unset, nothing is installed and nothing costs. Set, only the chosen worker wraps two of its trainer's methods,
and only during the chosen step (or save) does a profile function (``sys.setprofile``) watch its calls
(``prepare_kill_hooks`` before the trainer is built, ``arm_kill_hooks`` after)::

    RINGTRAIN_TEST_KILL_IN_COLLECTIVE=1:2:3 ringtrain train ... --heal   # rank 2 dies in step 1's all-reduce
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

from ringtrain.comm.shm_native import ENV_SWITCH as SHM_NATIVE_VAR
from ringtrain.dist.env import KILL_IN_COLLECTIVE_VAR, KILL_IN_SAVE_VAR, DistEnv
from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    from ringtrain.train.loop import Trainer

__all__ = ["prepare_kill_hooks", "arm_kill_hooks", "SAVE_POINTS"]

SAVE_POINTS = ("enter", "commit")

# Python functions whose return is one piece sent: a ring step, an arrival at an shm barrier; and the ledger's
# gather, watched for PIECE ``ledger`` only (never counted as a piece, so the numbers above keep their meaning).
_PIECES = {"run_step": "ring.py", "arrive": "shm_board.py", "_gather_to_writer": "ledger.py"}
LEDGER_PIECE = "ledger"


def prepare_kill_hooks(env: DistEnv, rank: int) -> None:
    """Before the trainer (and its shm workspace) is built: the worker that is to die inside a collective
    takes shm's Python path, whose barriers it can be stopped between."""
    if env.kill_in_collective:
        _, victim, _ = _parse(KILL_IN_COLLECTIVE_VAR, env.kill_in_collective, "PIECE", "3")
        if victim == rank:
            os.environ[SHM_NATIVE_VAR] = "0"  # read once, when shm first sets up (comm/shm_native.py)


def arm_kill_hooks(trainer: Trainer, env: DistEnv) -> None:
    """Arm the test hooks ``env`` asks for on ``trainer`` if this worker is the one to die (see the module)."""
    if env.kill_in_collective:
        step, rank, piece = _parse(KILL_IN_COLLECTIVE_VAR, env.kill_in_collective, "PIECE", "3")
        if rank == trainer.ctx.rank:
            _arm_collective(trainer, step, piece if piece == LEDGER_PIECE else int(piece))
    if env.kill_in_save:
        step, rank, point = _parse(KILL_IN_SAVE_VAR, env.kill_in_save, "POINT", "commit")
        if point not in SAVE_POINTS:
            raise ConfigError(f"{KILL_IN_SAVE_VAR}={env.kill_in_save!r}: POINT must be one of "
                              f"{', '.join(SAVE_POINTS)}, e.g. 20:0:commit")
        if rank == trainer.ctx.rank:
            _arm_save(trainer, step, point)


def _parse(var: str, value: str, last: str, example: str) -> tuple[int, int, str]:
    parts = value.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or int(parts[0]) < 1 or not parts[2]:
        raise ConfigError(f"{var}={value!r}: expected STEP:RANK:{last} (step from 1, e.g. 20:2:{example}); "
                          f"unset it to train without the test hook")
    if last == "PIECE" and parts[2] != LEDGER_PIECE and (not parts[2].isdigit() or int(parts[2]) < 1):
        raise ConfigError(f"{var}={value!r}: PIECE must be a whole number from 1 or {LEDGER_PIECE}, e.g. 20:2:3")
    return int(parts[0]), int(parts[1]), parts[2]


def _die(where: str) -> None:
    print(f"ringtrain: test hook: SIGKILL {where}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_collective(trainer: Trainer, step: int, piece: int | str) -> None:
    rank = trainer.ctx.rank
    train_step = trainer.train_step
    sent = 0

    def profile(frame, event, arg) -> None:
        nonlocal sent
        if event != "return":
            return
        code = frame.f_code
        filename = _PIECES.get(code.co_name)
        if filename is None or not code.co_filename.endswith(filename):
            return
        if code.co_name == "_gather_to_writer":
            if piece == LEDGER_PIECE:
                _die(f"launched rank {rank} in step {step} after the step's ledger gather, before its line")
            return
        if piece == LEDGER_PIECE:
            return
        sent += 1
        if sent == piece:
            what = "a ring step" if code.co_name == "run_step" else "an shm barrier"
            _die(f"launched rank {rank} in step {step} after piece {piece} of its collectives ({what})")

    def killing_step(batch):
        if trainer.state.step + 1 != step:
            return train_step(batch)
        nonlocal sent
        sent = 0
        sys.setprofile(profile)
        try:
            return train_step(batch)
        finally:
            sys.setprofile(None)

    trainer.train_step = killing_step


def _arm_save(trainer: Trainer, step: int, point: str) -> None:
    rank = trainer.ctx.rank
    save = trainer._save_checkpoint
    where = f"launched rank {rank} in the checkpoint save of step {step}"

    def profile(frame, event, arg) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "write_manifest" and code.co_filename.endswith("manifest.py"):
            _die(f"{where}, its data file in place but not committed (no manifest)")

    def killing_save() -> None:
        if trainer.state.step != step:
            return save()
        if point == "enter":
            _die(f"{where}, as it starts")
        sys.setprofile(profile)
        try:
            return save()
        finally:
            sys.setprofile(None)

    trainer._save_checkpoint = killing_save
