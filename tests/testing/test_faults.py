"""The fault-injection facility (ringtrain/testing/faults.py): a plan arms named points; a fault fires once per
job, where its rank, member, step and hit say; an unknown name is one line; nothing but the harness arms.

Launched jobs that reach every declared point: tests/testing/test_fault_points.py; a `ringtrain join`
under an armed --heal job: tests/testing/test_fault_plan_join.py.
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

from ringtrain.group.env import FAULT_PLAN_ARMED_VAR, FAULT_PLAN_VAR, DistEnv
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


Injected = faults.InjectedFault
"""What the ``raise`` faults of these tests raise (a fault raises only errors of the allow-list)."""
INJECTED = "ringtrain.testing.faults.InjectedFault"


@pytest.fixture(autouse=True)
def _disarmed():
    """Every test leaves this process unarmed, as it found it."""
    faults.disarm()
    yield
    faults.disarm()


@pytest.mark.unit
def test_a_fault_fires_once_where_its_rank_member_step_and_hit_say(tmp_path):
    plan = fault_plan(tmp_path, Fault("ring.step", action="raise", error=INJECTED, message="third ring step",
                                      member=1, step=2, hit=3))
    plan.arm(rank=0, member=0)
    faults.context(step=2)
    for _ in range(5):
        faults.point("ring.step")  # another member: nothing
    plan.arm(rank=1, member=1)
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
    plan.arm(rank=1, member=1)
    faults.context(step=2)
    for _ in range(5):
        faults.point("ring.step")
    assert len(plan.fired()) == 1
    # The points reached, each one's first reach per arming: what tests/testing/test_fault_points.py reads.
    reached = {(r["point"], r["member"]) for r in plan.reached()}
    assert reached == {("ring.step", 0), ("ring.step", 1), ("shm.arrive", 1)}


@pytest.mark.job
def test_a_kill_fires_in_one_process_of_the_job_and_a_restarted_one_survives(tmp_path):
    plan = fault_plan(tmp_path, Fault("checkpoint.save.commit", member=0, step=20))
    code = (f"from ringtrain.testing import faults; "
            f"faults.arm({str(plan.path)!r}, opt_in={plan.opt_in!r}, rank=0, member=0); "
            "faults.context(step=20); faults.point('checkpoint.save.commit'); print('alive')")
    first = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert first.returncode == -signal.SIGKILL and "alive" not in first.stdout, first.stderr
    assert "ringtrain: fault plan: kill at checkpoint.save.commit (hit 1 of step 20, rank 0, member 0)" in first.stderr
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.strip() == "alive", again.stderr
    assert [(r["point"], r["action"]) for r in plan.fired()] == [("checkpoint.save.commit", "kill")]


@pytest.mark.unit
def test_shm_takes_its_python_path_only_in_a_process_a_fault_waits_for_at_an_shm_barrier(tmp_path):
    plan = fault_plan(tmp_path, Fault("shm.arrive", member=1, step=1))
    assert not faults.armed_at("shm.arrive")  # unarmed
    plan.arm(rank=0, member=0)
    assert not faults.armed_at("shm.arrive")
    plan.arm(rank=1, member=1)
    assert faults.armed_at("shm.arrive") and not faults.armed_at("ring.step")


@pytest.mark.unit
def test_an_unknown_point_action_or_error_is_one_line_when_written_and_when_armed(tmp_path):
    for fault, words in ((Fault("ring.stepp"), "unknown fault point 'ring.stepp'; declared points: ring.step"),
                         (Fault("ring.step", action="explode"), "unknown action 'explode'"),
                         (Fault("ring.step", action="raise", error="torch.NoSuchError"), "is not one a fault may raise"),
                         (Fault("ring.step", action="raise"), "action 'raise' and error go together")):
        with pytest.raises(FaultPlanError) as refused:
            faults.write_plan(tmp_path / "plan.json", [fault])
        assert words in str(refused.value) and "\n" not in str(refused.value)
    # A plan written by hand (or by an older test) naming a renamed point is refused as it is armed.
    path = tmp_path / "by_hand.json"
    opt_in = faults.OPT_IN_PREFIX + "0" * 32
    path.write_text(json.dumps({"opt_in": opt_in, "faults": [{"point": "ring.run_step", "action": "kill"}]}))
    with pytest.raises(FaultPlanError, match="unknown fault point 'ring.run_step'") as refused:
        faults.arm(path, opt_in=opt_in, rank=0)
    assert "\n" not in str(refused.value)
    # An armed process that reaches a point nobody declared says so.
    fault_plan(tmp_path, Fault("ring.step", action="observe")).arm(rank=0)
    with pytest.raises(FaultPlanError, match="'ring.stepp' is not declared"):
        faults.point("ring.stepp")


@pytest.mark.unit
def test_a_flip_corrupts_bytes_passing_through_a_point_once_and_needs_such_a_point(tmp_path):
    data = bytes(range(8))
    assert faults.through("ring.step", data) is data  # unarmed
    plan = fault_plan(tmp_path, Fault("ring.step", action="flip", offset=2, rank=1))
    plan.arm(rank=1)
    assert faults.through("ring.step", data) == bytes([0, 1, 2 ^ 0xFF, 3, 4, 5, 6, 7])
    assert faults.through("ring.step", data) == data  # once per job: the next send goes through whole
    assert [(f["point"], f["action"], f["hit"]) for f in plan.fired()] == [("ring.step", "flip", 1)]
    fault_plan(tmp_path, Fault("shm.arrive", action="flip"), name="plain.json").arm(rank=0)
    with pytest.raises(FaultPlanError, match="flip needs a point placed as faults.through"):
        faults.point("shm.arrive")  # a plain point passes no value


@pytest.mark.unit
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


@pytest.mark.job
def test_the_worker_drops_the_plan_so_no_process_it_starts_is_armed(tmp_path, monkeypatch):
    plan = fault_plan(tmp_path, Fault("ring.step"))  # a kill at the first ring step, anyone
    for name, value in plan.env.items():
        monkeypatch.setenv(name, value)
    env = DistEnv.from_environ()
    assert env.fault_plan == str(plan.path) and env.fault_plan_opt_in == plan.opt_in
    arm_fault_plan(DistContext(env, "gloo", torch.device("cpu"), 0, 1), healing=None)  # as build_trainer does
    assert faults.is_armed()
    shown = f"import os; print(os.environ.get({FAULT_PLAN_VAR!r}), os.environ.get({FAULT_PLAN_ARMED_VAR!r}))"
    child = subprocess.run([sys.executable, "-c", shown], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "None None", "a process the armed worker starts inherited its fault plan"
    # A forked child (a DataLoader worker) holds the parent's memory, armed plan included: it must not fire.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    forked = context.Process(target=_reach_in_child, args=(queue,))
    forked.start()
    forked.join(timeout=60)
    assert forked.exitcode == 0 and queue.get(timeout=5) == "alive"
    assert plan.fired() == [] and plan.reached() == []


@pytest.mark.unit
def test_a_ringtrain_join_never_hands_the_plan_to_its_workers_but_the_launchers_own_agents_do(tmp_path, monkeypatch):
    spec = JobSpec("127.0.0.1:9", "no-such-job", 1, 2, 0, "", Program.worker([]), str(tmp_path))  # nobody listens
    for launched_agent, kept in ((True, True), (False, False)):
        monkeypatch.setenv(FAULT_PLAN_VAR, str(tmp_path / "faults.json"))
        monkeypatch.setenv(FAULT_PLAN_ARMED_VAR, faults.OPT_IN_PREFIX + "0" * 32)
        with pytest.raises(LaunchError, match="no job is running"):
            join_job(spec, launched_agent=launched_agent)
        assert (FAULT_PLAN_VAR in os.environ) == kept and (FAULT_PLAN_ARMED_VAR in os.environ) == kept


# --- armed only beside a test's opt-in; a raise fault only raises ringtrain's own errors (issue 39, row 10) -----

def _worker_ctx() -> DistContext:
    return DistContext(DistEnv.from_environ(), "gloo", torch.device("cpu"), 0, 1)


def _points_fire_nothing(plan) -> None:
    faults.context(step=1)
    for _ in range(3):
        faults.point("ring.step")
    assert plan.fired() == [] and plan.reached() == []


@pytest.mark.unit
@pytest.mark.parametrize("opt_in", [
    None,                                          # the plan's path alone: a production environment that inherited it
    "i-am-a-test",                                 # not the form write_plan makes
    "1",
    faults.OPT_IN_PREFIX + "0" * 32,               # the form, but another plan's (a stale variable)
    "PLAN'S OWN, UPPER-CASED",
])
def test_a_plan_in_the_environment_without_its_opt_in_arms_nothing_and_warns_once(tmp_path, monkeypatch, capsys, opt_in):
    plan = fault_plan(tmp_path, Fault("ring.step", action="raise", error=INJECTED, message="armed"))
    monkeypatch.setenv(FAULT_PLAN_VAR, str(plan.path))
    if opt_in is not None:
        monkeypatch.setenv(FAULT_PLAN_ARMED_VAR, plan.opt_in.upper() if opt_in.startswith("PLAN") else opt_in)
    capsys.readouterr()
    ctx = _worker_ctx()
    arm_fault_plan(ctx, healing=None)  # as build_trainer does
    arm_fault_plan(ctx, healing=None)  # a heal's rebuild (the same ctx): no second warning
    err = capsys.readouterr().err
    assert not faults.is_armed()
    _points_fire_nothing(plan)  # before: the point raised "armed"
    assert err.splitlines() == [
        f"ringtrain: warning: fault plan {plan.path} ignored: RINGTRAIN_FAULT_PLAN is a test facility and is armed only "
        "beside its test's opt-in (RINGTRAIN_FAULT_PLAN_ARMED, equal to the plan's opt_in); unset RINGTRAIN_FAULT_PLAN"]
    assert FAULT_PLAN_VAR not in os.environ and FAULT_PLAN_ARMED_VAR not in os.environ  # nothing started inherits it


@pytest.mark.unit
def test_a_plan_without_a_proper_opt_in_field_arms_nothing_whatever_the_variable_says(tmp_path, capsys):
    fault = {"point": "ring.step", "action": "raise", "error": INJECTED}
    for name, opt_in, given in (("old_style.json", None, faults.OPT_IN_PREFIX + "0" * 32),
                                ("weak.json", "yes", "yes"),  # a value anyone's environment could hold
                                ("empty.json", "", ""),
                                ("short.json", faults.OPT_IN_PREFIX + "0", faults.OPT_IN_PREFIX + "0")):
        path = tmp_path / name
        path.write_text(json.dumps({**({} if opt_in is None else {"opt_in": opt_in}), "faults": [fault]}))
        assert faults.arm(path, opt_in=given, rank=0) == [] and not faults.is_armed(), name
        faults.point("ring.step")
        assert "ignored" in capsys.readouterr().err, name


@pytest.mark.job
def test_a_stray_plan_path_is_not_even_opened_without_an_opt_in(tmp_path):
    """A FIFO as the plan: opening it would wait for a writer; without an opt-in ``arm`` returns at once."""
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    code = (f"from ringtrain.testing import faults; print(faults.arm({str(fifo)!r}, opt_in=None, rank=0))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


@pytest.mark.unit
def test_with_its_opt_in_beside_it_the_plan_is_armed_and_says_so_on_stderr(tmp_path, monkeypatch, capsys):
    plan = fault_plan(tmp_path, Fault("ring.step", action="raise", error=INJECTED, message="armed", step=1))
    for name, value in plan.env.items():
        monkeypatch.setenv(name, value)
    assert plan.opt_in.startswith(faults.OPT_IN_PREFIX) and len(plan.opt_in) == len(faults.OPT_IN_PREFIX) + 32
    capsys.readouterr()
    arm_fault_plan(_worker_ctx(), healing=None)
    assert capsys.readouterr().err.splitlines() == [f"ringtrain: fault plan {plan.path} armed (test facility)"]
    faults.context(step=1)
    with pytest.raises(Injected, match="armed"):
        faults.point("ring.step")
    # Every plan its own opt-in: one test's variable never arms another test's plan.
    assert fault_plan(tmp_path, Fault("ring.step"), name="other.json").opt_in != plan.opt_in


@pytest.mark.job
@pytest.mark.parametrize("error", [
    "os.system", "subprocess.Popen", "builtins.SystemExit", "builtins.KeyboardInterrupt", "pickle.loads",
    f"{__name__}.Planted", "ringtrain.errors.__builtins__", "ringtrain.errors", "RingtrainError", "",
])
def test_a_raise_fault_naming_anything_but_an_allowed_error_is_refused_in_one_line(tmp_path, error):
    with pytest.raises(FaultPlanError) as refused:
        faults.write_plan(tmp_path / "plan.json", [Fault("ring.step", action="raise", error=error)])
    message = str(refused.value)
    assert f"error {error!r} is not one a fault may raise; use one of " in message and "\n" not in message
    assert "ringtrain.errors.ConfigError" in message and "torch.OutOfMemoryError" in message


class Planted(Exception):
    """An exception class of a module that is not ringtrain's errors: before, a plan could raise it."""


@pytest.mark.unit
def test_a_raise_fault_never_imports_the_module_it_names(tmp_path, monkeypatch):
    """A plan written by hand (past write_plan's check) naming a module planted on sys.path: refused as it is
    armed, and the module is never imported (before: importlib.import_module ran it)."""
    (tmp_path / "planted_fault_module.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\nclass Boom(Exception):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = fault_plan(tmp_path, Fault("ring.step", action="raise", error=INJECTED))
    entries = json.loads(plan.path.read_text())
    entries["faults"][0]["error"] = "planted_fault_module.Boom"
    plan.path.write_text(json.dumps(entries))
    with pytest.raises(FaultPlanError, match="'planted_fault_module.Boom' is not one a fault may raise"):
        plan.arm(rank=0)
    assert not (tmp_path / "imported").exists() and "planted_fault_module" not in sys.modules


@pytest.mark.unit
def test_ringtrains_own_errors_and_torchs_out_of_memory_may_be_raised(tmp_path):
    allowed = faults.raisable_errors()
    for name in ("ringtrain.errors.ConfigError", "ringtrain.errors.CheckpointError", "ringtrain.comm.errors.PeerDiedError",
                 "ringtrain.comm.errors.PeerDataError", "torch.OutOfMemoryError", INJECTED):
        assert name in allowed
        faults.write_plan(tmp_path / "plan.json", [Fault("ring.step", action="raise", error=name)])
    assert all(issubclass(cls, BaseException) and not issubclass(cls, (SystemExit, KeyboardInterrupt))
               for cls in allowed.values())
