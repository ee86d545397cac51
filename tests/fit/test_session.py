"""ringtrain.Session, the middle layer (issue 22): a plain PyTorch script keeps its loop, changes as few lines as
Accelerate's documented conversion does, and keeps every ringtrain guarantee.

- examples/digits_cnn.py (plain, one process) against examples/digits_cnn_session.py (the Session) and
  tests/fit/conversions/digits_cnn_accelerate.py (Accelerate's pattern, with its epoch-level resume): the
  lines changed, counted without docstrings and blank lines;
- the converted script as `ringtrain run --nproc 2` runs it: every sample once per epoch (its ledger), a run
  stopped after step 30 and resumed (`--resume`) ends on the uninterrupted run's parameters bit for bit (the
  user's own cosine schedule is carried in the checkpoint), and Ctrl-C saves the step it reached, from which a
  resume again ends bit-exact;
- a loop that uses the Session wrong gets one line saying what to do.

Where the numbers, the run directory or the script's own lines are what is checked (the fit conversion, the
uninterrupted, stopped and resumed runs, the wrong uses), the script runs in the harness's ranks (``in_ranks``:
the script's code in each rank under the variables `ringtrain run`'s flags become, as torchrun starts a worker;
``alone``: one rank as `python SCRIPT`), issue 45. Ctrl-C stays a launched job: the signal goes to the launcher
and its workers, as a terminal sends it.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from ringtrain.data.ledger import check_ledger
from ringtrain.group.env import RESUME_VAR, RUN_DIR_VAR, SET_VAR
from tests.jobs import Job, ledger_steps
from tests.conftest import REPO
from tests.distributed import run_distributed
from tests.faults import Fault, fault_plan
from tests.fit.scripts import as_lone_process
from tests.fit.test_session_loop import as_launched_worker, free_port
from tests.runs import summary

PLAIN = REPO / "examples" / "digits_cnn.py"
SESSION = REPO / "examples" / "digits_cnn_session.py"
ACCELERATE = REPO / "tests" / "fit" / "conversions" / "digits_cnn_accelerate.py"
FIT = REPO / "examples" / "digits_cnn_fit.py"
EPOCHS, STEPS = 2, 46  # 1,437 training samples, 64 a step: 23 steps an epoch
RUN = ["run", str(SESSION), "--nproc", "2", "--set", "data.ledger=true", "--set", "monitor.progress=false"]
SETTINGS = ("data.ledger=true", "monitor.progress=false")  # RUN's --set, for in_ranks


def _run_in_rank(rank: int, world_size: int, port: int | None, script: str, argv: list[str],
                 variables: dict[str, str]) -> dict:
    """``script`` with ``argv`` as __main__ in this harness rank, as a worker `ringtrain run` starts it (the
    launcher's variables set), or, with no ``port``, as `python SCRIPT` alone; its Session closed at the end, as
    its atexit hook would. Returns its exit code, stdout, and stderr (what Python code wrote to sys.stderr, then
    what reached file descriptor 2 from below: torch's C++ log lines)."""
    import ringtrain

    saved_argv, saved_fd = sys.argv, os.dup(2)
    sys.argv = [script, *argv]
    os.environ.update(variables)
    namespace = {"__name__": "__main__", "__file__": script}
    code, stdout = 0, io.StringIO()
    with tempfile.TemporaryFile() as below:
        os.dup2(below.fileno(), 2)
        try:
            with ((as_launched_worker(rank, world_size, port) if port else as_lone_process()) as stderr,
                  contextlib.redirect_stdout(stdout)):
                try:
                    exec(compile(Path(script).read_text(), script, "exec"), namespace)
                except SystemExit as exit_:  # one line and exit 2 (a usage error), as the process would end
                    code = exit_.code if isinstance(exit_.code, int) else 1
                finally:
                    for value in list(namespace.values()):
                        if isinstance(value, ringtrain.Session):
                            value.close()
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sys.argv = saved_argv
            for name in variables:
                os.environ.pop(name, None)
        below.seek(0)
        written = stderr.getvalue() + below.read().decode(errors="replace")
    return {"code": code, "stdout": stdout.getvalue(), "stderr": written}


def in_ranks(script: Path, run_dir: Path, *settings: str, resume: bool = False, args: tuple[str, ...] = ()) -> dict:
    """What `ringtrain run SCRIPT --nproc 2 --run-dir RUN_DIR [--set S ...] [--resume] -- ARGS` runs in its
    workers, in the harness's 2 ranks (the flags as the variables ringtrain.cli sets from them), each of which
    must end well; rank 0's exit code, stdout and stderr."""
    variables = {RUN_DIR_VAR: str(Path(run_dir).resolve()), RESUME_VAR: "resume" if resume else "checked"}
    if settings:
        variables[SET_VAR] = json.dumps(list(settings))
    ranks = run_distributed(_run_in_rank, 2, free_port(), str(script), list(args), variables, timeout_s=240)
    for rank, got in enumerate(ranks):
        assert got["code"] == 0, f"rank {rank} exited {got['code']}: {got['stderr']}"
    return ranks[0]


def alone(script: Path, *argv: str) -> dict:
    """`python SCRIPT ARGV` (one process, no launcher) in a harness rank: its exit code, stdout and stderr. A loop
    the Session fails to stop never ends: the rank fails after 120 s, as the process it replaces did."""
    [got] = run_distributed(_run_in_rank, 1, None, str(script), list(argv), {}, timeout_s=120)
    return got


def code_lines(path: Path) -> list[str]:
    text = path.read_text()
    if text.startswith('"""'):
        text = text[text.index('"""', 3) + 3:]
    return [line for line in text.splitlines() if line.strip()]


def changed_lines(before: Path, after: Path) -> tuple[int, int]:
    diff = [line for line in difflib.unified_diff(code_lines(before), code_lines(after), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return sum(line[0] == "+" for line in diff), sum(line[0] == "-" for line in diff)


@pytest.mark.unit
def test_the_plain_script_converts_in_no_more_lines_than_accelerate_takes():
    session, accelerate = changed_lines(PLAIN, SESSION), changed_lines(PLAIN, ACCELERATE)
    print(f"{len(code_lines(PLAIN))} lines of code; ringtrain.Session +{session[0]}/-{session[1]}, "
          f"Accelerate's pattern +{accelerate[0]}/-{accelerate[1]}")
    assert sum(session) <= sum(accelerate), (session, accelerate)
    assert sum(session) <= 16  # the bound: Accelerate's +11/-5 on its 74-line script


@pytest.mark.ranks
def test_the_fit_conversion_hands_the_loop_over_and_trains_on_two_workers(tmp_path):
    """examples/digits_cnn_fit.py: the same model, Dataset, AdamW and cosine schedule through fit (the loop and
    the evaluation are fit's); the README quotes its line count beside the Session's."""
    added, removed = changed_lines(PLAIN, FIT)
    print(f"ringtrain.fit +{added}/-{removed} of {len(code_lines(PLAIN))} lines ({len(code_lines(FIT))} left)")
    assert len(code_lines(FIT)) < len(code_lines(PLAIN)) and added <= 12, (added, removed)
    run_dir = tmp_path / "fit"
    # In the harness's 2 ranks, as `ringtrain run FIT --nproc 2 --run-dir RUN_DIR --set monitor.progress=false --
    # --epochs 2` runs it in its workers (issue 45: the launcher adds nothing to what is checked here).
    in_ranks(FIT, run_dir, "monitor.progress=false", args=("--epochs", str(EPOCHS)))
    recorded = (run_dir / "config.toml").read_text()
    assert 'optimizer = "torch.optim.adamw:AdamW"' in recorded and "lr = 0.003" in recorded, recorded
    result = summary(run_dir)
    assert result["steps"] == STEPS and len(set(result["param_sha256"])) == 1, result
    assert result["eval"]["accuracy"] > 0.8  # chance: 0.1


def assert_every_sample_once(run_dir: Path) -> None:
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert len(reports) == EPOCHS and all(r.exactly_once and r.complete for r in reports), reports
    assert [r["step"] for r in ledger_steps(run_dir)] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, dict]:
    """The converted script's uninterrupted run, in the harness's 2 ranks, run once for the tests that compare a
    stopped and resumed run against it (read only): (run directory, rank 0's output)."""
    run_dir = tmp_path_factory.mktemp("session") / "whole"
    return run_dir, in_ranks(SESSION, run_dir, *SETTINGS, args=("--epochs", str(EPOCHS)))


@pytest.mark.ranks
def test_the_converted_script_deals_every_sample_once_and_resumes_bit_exact(tmp_path, whole):
    """`ringtrain run SESSION --set train.max_steps=30`, then `--resume`: the variables those flags set, in the
    harness's 2 ranks (issue 45)."""
    stopped = tmp_path / "stopped"
    in_ranks(SESSION, stopped, *SETTINGS, "train.max_steps=30", args=("--epochs", str(EPOCHS)))
    whole, done = whole
    assert summary(stopped)["steps"] == 30
    resumed = in_ranks(SESSION, stopped, *SETTINGS, resume=True, args=("--epochs", str(EPOCHS)))
    assert "resumed from step_00000030.pt" in resumed["stderr"], resumed["stderr"]
    accuracy = [line for line in done["stdout"].splitlines() if "validation accuracy" in line]
    print(f"{accuracy[-1]}; param_sha256 {summary(whole)['param_sha256'][0][:16]} whole, "
          f"{summary(stopped)['param_sha256'][0][:16]} stopped at 30 and resumed")
    assert len(accuracy) == EPOCHS and float(accuracy[-1].rsplit(" ", 1)[1]) > 0.8  # chance: 0.1
    assert summary(whole)["steps"] == summary(stopped)["steps"] == STEPS
    assert summary(whole)["param_sha256"] == summary(stopped)["param_sha256"]
    for run_dir in (whole, stopped):
        assert_every_sample_once(run_dir)


@pytest.mark.job
def test_ctrl_c_saves_the_step_it_reached_and_a_resume_ends_bit_exact(tmp_path, whole):
    """Paced (every step 0.2 s longer: a fault plan's delay), so that Ctrl-C lands mid-run. The stopped job is a
    launched one (the signal reaches the launcher and its workers); its resume runs in the harness's 2 ranks."""
    plan = fault_plan(tmp_path, Fault("ledger.gathered", action="delay", seconds=0.2))
    stopped = tmp_path / "stopped"
    with Job(*RUN, "--run-dir", str(stopped), "--", "--epochs", str(EPOCHS), env=plan.env,
             worker_command=str(SESSION)) as job:
        job.wait_for(lambda: len(ledger_steps(stopped)) >= 10, what="step 10")
        for proc in job.tree():  # Ctrl-C in a terminal: every process of the foreground group gets SIGINT
            proc.send_signal(signal.SIGINT)
        code = job.finish(timeout=120)
    whole, _ = whole
    reached = summary_free_step(stopped)
    print(f"Ctrl-C at step {reached}: exit {code}")
    assert code != 0 and "stopped at step" in job.stderr, job.stderr
    assert (stopped / "checkpoints" / f"step_{reached:08d}.pt").exists()
    resumed = in_ranks(SESSION, stopped, *SETTINGS, resume=True, args=("--epochs", str(EPOCHS)))
    assert f"resumed from step_{reached:08d}.pt" in resumed["stderr"], resumed["stderr"]
    assert summary(whole)["param_sha256"] == summary(stopped)["param_sha256"]
    assert_every_sample_once(stopped)


def summary_free_step(run_dir: Path) -> int:
    """The last step the stopped run's ledger committed (it wrote no summary)."""
    assert not (run_dir / "summary.json").exists()
    return ledger_steps(run_dir)[-1]["step"]


MISUSE = """
import sys, torch
from torch import nn
from torch.utils.data import TensorDataset
import ringtrain
session = ringtrain.Session({"train": {"global_batch_size": 8, "local_batch_size": 4}}, run_dir=sys.argv[1])
data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
case = sys.argv[2]
if case == "no-setup":
    for _ in session.epochs(1):
        pass
model, optimizer, loader = session.setup(nn.Linear(3, 2), torch.optim.SGD(nn.Linear(3, 2).parameters(), 0.1), data=data)
if case == "setup-twice":
    session.setup(nn.Linear(3, 2))
for _ in session.epochs(1):
    for x, y in loader:
        session.backward(nn.functional.cross_entropy(model(x), y))
"""


@pytest.mark.ranks
def test_a_loop_that_uses_the_session_wrong_gets_one_line_naming_the_fix(tmp_path):
    """`python misuse.py RUN_DIR CASE` for each case, each in a harness rank as a lone process (issue 45: the line
    and the exit code are the Session's own; a new interpreter per case only waited on its imports)."""
    script = tmp_path / "misuse.py"
    script.write_text(MISUSE)
    lines = {}
    for case in ("no-setup", "setup-twice", "no-step"):
        result = alone(script, str(tmp_path / case), case)
        errors = [line for line in result["stderr"].splitlines() if line.startswith("ringtrain: error:")]
        assert result["code"] == 2 and len(errors) == 1 and "Traceback" not in result["stderr"], (case, result)
        lines[case] = errors[0]
    print("\n".join(lines.values()))
    assert "call both first" in lines["no-setup"] and "session.setup" in lines["no-setup"]
    assert "setup was called twice" in lines["setup-twice"]
    assert "optimizer.step() was not called" in lines["no-step"]
