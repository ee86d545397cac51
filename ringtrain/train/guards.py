"""What every rank must agree on after each step's backward, in one small all-reduce: skip it, or stop.

Skip: a non-finite loss or gradient on any rank. Every rank skips the update of that step together (the
window of samples is consumed, the parameters and optimizer state stay as they were), so parameters stay
identical across ranks. After ``max_consecutive`` bad steps in a row the job stops with an error naming
the ranks and steps.

Stop: SIGTERM or SIGINT on any rank (the elastic agent restarting the group to admit a worker, a scheduler
preempting the job, Ctrl-C). The ranks finish the step together, save a checkpoint and exit, so nothing is lost.

    flags = guard.check(loss_sum, model.parameters())   # local: is this rank's loss or gradient finite?
    verdict = guard.agree(flags)                         # a collective: every rank calls it
    if not verdict.skip:
        optimizer.step()
"""

from __future__ import annotations

import hashlib
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.objects import all_gather_json
from ringtrain.errors import RingtrainError
from ringtrain.train.state import TrainState

__all__ = ["StepGuard", "StopSignal", "Verdict", "NonFiniteSteps", "Stopped", "ReplicasDiverged", "check_replicas"]


class NonFiniteSteps(RingtrainError):
    """Too many consecutive steps with a non-finite loss or gradient."""

    exit_code = 1


class Stopped(RingtrainError):
    """The job stopped on a signal after checkpointing; it continues with --resume (or the agent's restart)."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.exit_code = 128 + signal_number


class ReplicasDiverged(RingtrainError):
    """Ranks hold different parameters: data parallelism's invariant is broken (a bug, not bad input)."""

    exit_code = 1


class StopSignal:
    """Turns SIGTERM, SIGINT and SIGUSR1 into a request to stop at the next step boundary (installed while
    training). SIGUSR1 is SLURM's warning before the time limit (``#SBATCH --signal=USR1@90``), which SLURM sends
    to every process of the job step, the workers included; the launcher stops on it too (launch.py).

    Leaving the block restores the handlers that were there (a hand-written loop's ``StepGuard`` decides itself what
    a stop means). ``absorb_after_stop`` (the Trainer's, whose stop ends the process with ``Stopped``): once a stop
    was requested, or the block is left with ``Stopped`` or after ``mark_stopped()`` (the Session's, whose stop
    ends the process with ``SystemExit``), a signal whose disposition was SIG_DFL stays absorbed, so
    a late copy cannot kill the worker before it says where it stopped."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, absorb_after_stop: bool = False):
        self.absorb_after_stop = absorb_after_stop
        self.signal_number: int | None = None
        self._stopped = False
        self._received = threading.Event()
        self._previous: dict = {}

    def __enter__(self) -> StopSignal:
        # Python delivers signals to the main thread only; elsewhere (a test thread) leave them alone.
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        # this worker's signal, or a peer's
        stopping = self.absorb_after_stop and (self.requested or self._stopped or isinstance(exc_value, Stopped))
        for sig, handler in self._previous.items():
            # After a stop was requested, the process is on its way out (``Stopped`` goes up to the worker's
            # main, which says "stopped at step N after saving ..." and exits 128 + N). A stop signal may still
            # be on its way: SLURM signals every process of the job step and the agent forwards the launcher's
            # own copy to each worker, which can land after this point on a loaded machine (as can the agent's
            # copy to a worker a peer's signal stopped, after its 5 s wait for it). Restoring SIG_DFL here let
            # that copy kill the worker before it said its line (issue 45's flake of test_slurm_signal.py's
            # to-every-process case); this handler keeps absorbing it instead.
            absorb = stopping and handler == signal.SIG_DFL
            signal.signal(sig, self._handle if absorb else handler)
        self._previous = {}

    def mark_stopped(self) -> None:
        """The job agreed to stop (this worker's signal or a peer's) and this process is on its way out."""
        self._stopped = True

    @property
    def requested(self) -> bool:
        return self._received.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait for this process's own signal (the agent sends it to every worker it restarts)."""
        return self._received.wait(timeout_s)

    def _handle(self, signum, frame) -> None:
        self.signal_number = signum
        self._received.set()


@dataclass(frozen=True)
class Verdict:
    """What all ranks agreed on for one step."""

    loss_ranks: tuple[int, ...]
    """Ranks whose loss was not finite."""
    grad_ranks: tuple[int, ...]
    """Ranks whose gradient was not finite (after synchronisation: usually all, when any)."""
    stop: bool
    """Some rank was asked to stop (SIGTERM, SIGINT)."""
    synchronised: bool = False
    """The gradients were checked after synchronisation, where every rank holds the same gradient."""

    @property
    def skip(self) -> bool:
        return bool(self.loss_ranks or self.grad_ranks)

    def describe(self) -> str:
        if self.loss_ranks:
            return f"non-finite loss on {_ranks(self.loss_ranks)}"
        if self.synchronised:
            return "non-finite gradient after synchronisation"
        return f"non-finite gradient on {_ranks(self.grad_ranks)}"


@dataclass
class PendingVerdict:
    """``StepGuard.start``'s all-reduce in flight; ``StepGuard.finish`` turns it into a Verdict."""

    flags: torch.Tensor
    work: Any


class StepGuard:
    """The per-step agreement, and the count of consecutive skipped steps.

    In a hand-written loop, after the step's backward (``with guard:`` turns SIGTERM / SIGINT into
    ``verdict.stop`` at the next step boundary, on every rank)::

        guard = StepGuard(rank, world_size, device)          # a StopSignal of its own unless given one
        with guard:
            ...
            verdict = guard.agree(guard.check(loss_sum, model.parameters()))
            if not verdict.skip:
                optimizer.step()
            guard.count(verdict, state, step)                  # raises after max_consecutive bad steps
            if verdict.stop:
                ...save a checkpoint, exit...
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, max_consecutive: int = 3,
                 stop_signal: StopSignal | None = None):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.max_consecutive = max_consecutive
        self.stop_signal = stop_signal if stop_signal is not None else StopSignal()
        self.last_problem = ""

    def __enter__(self) -> StepGuard:
        """Install the stop signal's SIGTERM / SIGINT handlers (the main thread's) until the block ends."""
        self.stop_signal.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_signal.__exit__(*exc)

    def check(self, loss_sum: torch.Tensor, parameters: Iterable[torch.nn.Parameter], gradients: bool = True) -> torch.Tensor:
        """This rank's flags: [loss bad per rank, gradient bad per rank, stop] (only its own slots set).
        ``gradients=False`` leaves the gradients to someone else (fp16's scaler skips overflows itself)."""
        size = self.world_size
        flags = torch.zeros(2 * size + 1, device=self.device)
        flags[self.rank] = float(not torch.isfinite(loss_sum.detach()).all())
        flags[size + self.rank] = float(gradients and not _grads_finite(parameters))
        flags[2 * size] = float(self.stop_signal.requested)
        return flags

    def agree(self, flags: torch.Tensor) -> Verdict:
        """One all-reduce of every rank's ``check()`` flags; every rank must call it."""
        size = self.world_size
        if dist.is_initialized() and size > 1:
            dist.all_reduce(flags)
        values = flags.tolist()
        return Verdict(
            loss_ranks=tuple(r for r in range(size) if values[r]),
            grad_ranks=tuple(r for r in range(size) if values[size + r]),
            stop=values[2 * size] > 0,
        )

    def start(self, loss_sum: torch.Tensor) -> PendingVerdict:
        """The overlapped form of ``check`` + ``agree`` that ringtrain's trainer uses: call it before the
        backward that synchronises the gradients, with the step's loss sum; it starts the all-reduce of the
        loss and stop flags, which runs beside that backward. After the backward, ``gradients_finite`` checks
        the synchronised gradient on this rank alone and ``finish`` waits for the all-reduce (usually done by
        then) and makes the verdict.

        That local check is the same on every rank because the synchronised gradient is (bit-identical on
        every rank: a gradient all-reduce ends with every rank holding the same sum, which is also what
        PyTorch's GradScaler relies on under DDP), and a non-finite gradient on any rank makes the sum
        non-finite. Only use it where the gradients are synchronised by the time ``finish`` runs."""
        size = self.world_size
        flags = torch.zeros(size + 1, device=self.device)
        flags[self.rank] = float(not torch.isfinite(loss_sum.detach()).all())
        flags[size] = float(self.stop_signal.requested)
        work = dist.all_reduce(flags, async_op=True) if dist.is_initialized() and size > 1 else None
        return PendingVerdict(flags, work)

    @staticmethod
    def gradients_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
        """Whether every gradient element is finite (one fused norm); run it on the synchronised gradient
        and hand the answer to ``finish``."""
        return _grads_finite(parameters)

    def finish(self, pending: PendingVerdict, gradient_finite: bool = True) -> Verdict:
        """Wait for ``start``'s all-reduce; with ``gradient_finite``, this rank's check of the synchronised
        gradient (``gradients_finite``: the same answer on every rank), make the step's verdict."""
        grad_bad = not gradient_finite
        if pending.work is not None:
            pending.work.wait()
        size = self.world_size
        values = pending.flags.tolist()
        return Verdict(
            loss_ranks=tuple(r for r in range(size) if values[r]),
            grad_ranks=tuple(range(size)) if grad_bad else (),
            stop=values[size] > 0,
            synchronised=True,
        )

    def count(self, verdict: Verdict, state: TrainState, step: int) -> None:
        """Update the run's skip counters; raise NonFiniteSteps after too many bad steps in a row."""
        if not verdict.skip:
            state.consecutive_skips = 0
            return
        state.skipped_steps += 1
        state.consecutive_skips += 1
        self.last_problem = verdict.describe()
        if state.consecutive_skips >= self.max_consecutive:
            first = step - state.consecutive_skips + 1
            raise NonFiniteSteps(
                f"steps {first}-{step}: {self.last_problem} in {state.consecutive_skips} consecutive steps "
                f"(train.max_consecutive_nonfinite_steps = {self.max_consecutive}, StepGuard's max_consecutive); every one was skipped and the "
                f"parameters are those of step {first - 1}: lower train.lr or set train.grad_clip_norm"
            )


def _grads_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:  # by mesh: a tensor-parallel model mixes DTensors and plain tensors
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    # One fused norm over each group's gradients: non-finite if any element is.
    return all(bool(torch.isfinite(torch.nn.utils.get_total_norm(grads))) for grads in groups.values())


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def check_replicas(module: torch.nn.Module | dict[str, torch.Tensor], step: int) -> list[str]:
    """Every rank's parameter sha256 (one all_gather); raise ReplicasDiverged unless all are equal.
    ``module``: the module, or its parameters by name (a sharded strategy's gathered full parameters)."""
    digest = hashlib.sha256()
    for name, param in module.items() if isinstance(module, dict) else module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    mine = digest.hexdigest()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    digests = all_gather_json(mine)
    if len(set(digests)) > 1:
        shown = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        raise ReplicasDiverged(f"after step {step} the ranks hold different parameters ({shown})")
    return digests


def check_every_parameter_has_a_gradient(module: torch.nn.Module, step: int) -> None:
    """After the first step's backward: a trainable parameter the forward never used has no gradient. The
    gradient sync waits for every parameter, so DDP would fail one step later with a generic message (or the
    manual strategy wait); name the parameters now, on every rank alike."""
    missing = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise RingtrainError(
            f"step {step}: {len(missing)} trainable parameter(s) got no gradient ({shown}): the forward does not "
            "use them; freeze them (param.requires_grad_(False)) or remove them from the model"
        )
