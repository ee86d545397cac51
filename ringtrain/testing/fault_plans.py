"""Fault plans for the tests (ringtrain/testing/faults.py): write one, hand its path to a job beside the
test's opt-in (the two variables a worker reads: a path alone arms nothing), and read back what fired and
which points were reached.

    plan = fault_plan(tmp_path, Fault("ring.step", member=2, step=1, hit=3))
    run_cli("train", ..., env=plan.env)                          # a launched job
    run_distributed(fn, 2, str(plan.path))                       # in-process: build_test_trainer(..., fault_plan=)
    plan.arm(rank=0, member=0)                                   # this process
    assert plan.fired_points() == ["ring.step"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringtrain.group.env import FAULT_PLAN_ARMED_VAR, FAULT_PLAN_VAR
from ringtrain.testing import faults
from ringtrain.testing.faults import Fault

__all__ = ["Fault", "Plan", "fault_plan", "oom_at", "opt_in_of"]


class Plan:
    """A fault plan written to ``path``: the environment that arms a launched job, and its records."""

    def __init__(self, path: Path, fault_list: list[Fault]):
        self.path = faults.write_plan(path, fault_list)
        self.faults = fault_list

    @property
    def opt_in(self) -> str:
        """The plan's opt-in (``write_plan`` made it): what arms it beside its path."""
        return faults.plan_opt_in(self.path)

    @property
    def env(self) -> dict[str, str]:
        """What a launched job (``run_cli``, ``Job``) needs in its environment to be armed: the path and the
        test's opt-in beside it."""
        return {FAULT_PLAN_VAR: str(self.path), FAULT_PLAN_ARMED_VAR: self.opt_in}

    def arm(self, **where: int) -> list[Fault]:
        """Arm this process with the plan (an in-process test), at ``where`` (rank, member, generation)."""
        return faults.arm(self.path, opt_in=self.opt_in, **where)

    def fired(self) -> list[dict[str, Any]]:
        return faults.fired(self.path)

    def fired_points(self) -> list[str]:
        return [record["point"] for record in self.fired()]

    def reached(self) -> list[dict[str, Any]]:
        return faults.reached(self.path)


def fault_plan(folder: str | Path, *fault_list: Fault, name: str = "faults.json") -> Plan:
    """A plan of ``fault_list`` in ``folder`` (a test's tmp_path)."""
    return Plan(Path(folder) / name, list(fault_list))


def opt_in_of(path: str | Path | None) -> str | None:
    """The opt-in of the plan at ``path`` (None: no plan), for a harness that builds a worker's DistEnv itself
    (tests/trainers.py)."""
    return None if path is None else faults.plan_opt_in(path)


def oom_at(step: int, member: int) -> Fault:
    """torch's out-of-memory error in the first micro-batch forward of ``step`` on the worker launched as
    ``member`` (once per job: the redone step fits)."""
    return Fault("step.micro_batch", action="raise", error="torch.OutOfMemoryError", member=member, step=step,
                 message=f"injected out-of-memory (test fault plan) at step {step}")
