"""The fault-injection facility (ringtrain/testing/faults.py): a plan arms named points; a fault fires once per
job, where its rank, member, step and hit say; an unknown name is one line; nothing but the harness arms.

Launched jobs that reach every declared point: tests/integration/test_fault_points.py; a `ringtrain join`
under an armed --heal job: tests/chaos/test_fault_plan_join.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from ringtrain.group.env import FAULT_PLAN_VAR, DistEnv
from ringtrain.group.init import DistContext
from ringtrain.elastic import JobSpec, join_job
from ringtrain.errors import LaunchError
from ringtrain.launch import Program
from ringtrain.testing import faults
from ringtrain.testing.faults import POINTS, Fault, FaultPlanError
from ringtrain.train.build import arm_fault_plan
from tests.conftest import REPO
from tests.faults import fault_plan

PACKAGE = REPO / "ringtrain"


class Injected(Exception):
    """What the ``raise`` faults of these tests raise."""


INJECTED = f"{__name__}.Injected"


@pytest.fixture(autouse=True)
def _disarmed():
    """Every test leaves this process unarmed, as it found it."""
    faults.disarm()
    yield
    faults.disarm()


def test_a_fault_fires_once_where_its_rank_member_step_and_hit_say(tmp_path):
    plan = fault_plan(tmp_path, Fault("ring.step", action="raise", error=INJECTED, message="third ring step",
                                      member=1, step=2, hit=3))
    faults.arm(plan.path, rank=0, member=0)
    faults.context(step=2)
    for _ in range(5):
        faults.point("ring.step")  # another member: nothing
    faults.arm(plan.path, rank=1, member=1)
    faults.context(step=1)
    for _ in range(5):
        faults.point("ring.step")  # another step: nothing
    faults.context(step=2)
    faults.point("ring.step")
    faults.point("shm.arrive")  # another point: its hits count apart
    faults.point("ring.step")
    with pytest.raises(Injected, match="third ring step"):
        faults.point("ring.step")
    faults.point("ring.step")
    (record,) = plan.fired()
    where = (record["point"], record["member"], record["rank"], record["step"], record["hit"])
    assert where == ("ring.step", 1, 1, 2, 3)

    # Once per job: the same step again (a redone step, a worker its agent restarted and armed anew): nothing.
    faults.arm(plan.path, rank=1, member=1)
    faults.context(step=2)
    for _ in range(5):
        faults.point("ring.step")
    assert len(plan.fired()) == 1
    # The points reached, each one's first reach per arming: what tests/integration/test_fault_points.py reads.
    reached = {(r["point"], r["member"]) for r in plan.reached()}
    assert reached == {("ring.step", 0), ("ring.step", 1), ("shm.arrive", 1)}


def test_a_kill_fires_in_one_process_of_the_job_and_a_restarted_one_survives(tmp_path):
    plan = fault_plan(tmp_path, Fault("checkpoint.save.commit", member=0, step=20))
    code = (f"from ringtrain.testing import faults; faults.arm({str(plan.path)!r}, rank=0, member=0); "
            "faults.context(step=20); faults.point('checkpoint.save.commit'); print('alive')")
    first = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert first.returncode == -signal.SIGKILL and "alive" not in first.stdout, first.stderr
    assert "ringtrain: fault plan: kill at checkpoint.save.commit (hit 1 of step 20, rank 0, member 0)" in first.stderr
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.strip() == "alive", again.stderr
    assert [(r["point"], r["action"]) for r in plan.fired()] == [("checkpoint.save.commit", "kill")]


def test_shm_takes_its_python_path_only_in_a_process_a_fault_waits_for_at_an_shm_barrier(tmp_path):
    plan = fault_plan(tmp_path, Fault("shm.arrive", member=1, step=1))
    assert not faults.armed_at("shm.arrive")  # unarmed
    faults.arm(plan.path, rank=0, member=0)
    assert not faults.armed_at("shm.arrive")
    faults.arm(plan.path, rank=1, member=1)
    assert faults.armed_at("shm.arrive") and not faults.armed_at("ring.step")


def test_an_unknown_point_action_or_error_is_one_line_when_written_and_when_armed(tmp_path):
    for fault, words in ((Fault("ring.stepp"), "unknown fault point 'ring.stepp'; declared points: ring.step"),
                         (Fault("ring.step", action="explode"), "unknown action 'explode'"),
                         (Fault("ring.step", action="raise", error="torch.NoSuchError"), "is not an exception class"),
                         (Fault("ring.step", action="raise"), "action 'raise' and error go together")):
        with pytest.raises(FaultPlanError) as refused:
            faults.write_plan(tmp_path / "plan.json", [fault])
        assert words in str(refused.value) and "\n" not in str(refused.value)
    # A plan written by hand (or by an older test) naming a renamed point is refused as it is armed.
    path = tmp_path / "by_hand.json"
    path.write_text(json.dumps({"faults": [{"point": "ring.run_step", "action": "kill"}]}))
    with pytest.raises(FaultPlanError, match="unknown fault point 'ring.run_step'") as refused:
        faults.arm(path, rank=0)
    assert "\n" not in str(refused.value)
    # An armed process that reaches a point nobody declared says so.
    faults.arm(fault_plan(tmp_path, Fault("ring.step", action="observe")).path, rank=0)
    with pytest.raises(FaultPlanError, match="'ring.stepp' is not declared"):
        faults.point("ring.stepp")


def test_a_flip_corrupts_bytes_passing_through_a_point_once_and_needs_such_a_point(tmp_path):
    data = bytes(range(8))
    assert faults.through("ring.step", data) is data  # unarmed
    plan = fault_plan(tmp_path, Fault("ring.step", action="flip", offset=2, rank=1))
    faults.arm(plan.path, rank=1)
    assert faults.through("ring.step", data) == bytes([0, 1, 2 ^ 0xFF, 3, 4, 5, 6, 7])
    assert faults.through("ring.step", data) == data  # once per job: the next send goes through whole
    assert [(f["point"], f["action"], f["hit"]) for f in plan.fired()] == [("ring.step", "flip", 1)]
    faults.arm(fault_plan(tmp_path, Fault("shm.arrive", action="flip"), name="plain.json").path, rank=0)
    with pytest.raises(FaultPlanError, match="flip needs a point placed as faults.through"):
        faults.point("shm.arrive")  # a plain point passes no value


def test_every_point_in_the_code_is_declared_and_every_declared_point_is_placed_once():
    pattern = re.compile(r"""faults\.(?:point|through)\(\s*["']([^"']+)["']""")
    placed: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "faults.py" and path.parent.name == "testing":
            continue
        for name in pattern.findall(path.read_text()):
            placed.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert set(placed) <= set(POINTS), f"undeclared points: {sorted(set(placed) - set(POINTS))}"
    assert set(POINTS) <= set(placed), f"declared but placed nowhere: {sorted(set(POINTS) - set(placed))}"
    assert all(len(files) == 1 for files in placed.values()), placed
    for name, where in POINTS.items():  # the declaration names the file the point sits in
        assert where.split()[0] == placed[name][0].removeprefix("ringtrain/"), (name, where, placed[name])


def _reach_in_child(queue) -> None:
    faults.point("ring.step")  # armed in the parent with a kill for every process: a forked child is not armed
    queue.put("alive")


def test_the_worker_drops_the_plan_so_no_process_it_starts_is_armed(tmp_path, monkeypatch):
    plan = fault_plan(tmp_path, Fault("ring.step"))  # a kill at the first ring step, anyone
    monkeypatch.setenv(FAULT_PLAN_VAR, str(plan.path))
    env = DistEnv.from_environ()
    assert env.fault_plan == str(plan.path)
    arm_fault_plan(DistContext(env, "gloo", torch.device("cpu"), 0, 1), healing=None)  # as build_trainer does
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({FAULT_PLAN_VAR!r}))"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "None", "a process the armed worker starts inherited its fault plan"
    # A forked child (a DataLoader worker) holds the parent's memory, armed plan included: it must not fire.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    forked = context.Process(target=_reach_in_child, args=(queue,))
    forked.start()
    forked.join(timeout=60)
    assert forked.exitcode == 0 and queue.get(timeout=5) == "alive"
    assert plan.fired() == [] and plan.reached() == []


def test_a_ringtrain_join_never_hands_the_plan_to_its_workers_but_the_launchers_own_agents_do(tmp_path, monkeypatch):
    spec = JobSpec("127.0.0.1:9", "no-such-job", 1, 2, 0, "", Program.worker([]), str(tmp_path))  # nobody listens
    for launched_agent, kept in ((True, True), (False, False)):
        monkeypatch.setenv(FAULT_PLAN_VAR, str(tmp_path / "faults.json"))
        with pytest.raises(LaunchError, match="no job is running"):
            join_job(spec, launched_agent=launched_agent)
        assert (FAULT_PLAN_VAR in os.environ) == kept
