"""ringtrain.Session, the middle layer (issue 22): a plain PyTorch script keeps its loop, changes as few lines as
Accelerate's documented conversion does, and keeps every ringtrain guarantee.

- examples/digits_cnn.py (plain, one process) against examples/digits_cnn_session.py (the Session) and
  tests/fit/conversions/digits_cnn_accelerate.py (Accelerate's pattern, with its epoch-level resume): the
  lines changed, counted without docstrings and blank lines;
- the converted script under `ringtrain run --nproc 2`: every sample once per epoch (its ledger), a run stopped
  after step 30 and resumed (`--resume`) ends on the uninterrupted run's parameters bit for bit (the user's own
  cosine schedule is carried in the checkpoint), and Ctrl-C saves the step it reached, from which a resume
  again ends bit-exact;
- a loop that uses the Session wrong gets one line saying what to do.
"""

from __future__ import annotations

import difflib
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.data.ledger import check_ledger
from tests.chaos.jobs import Job, ledger_steps
from tests.conftest import REPO, run_cli
from tests.faults import Fault, fault_plan
from tests.fit.background import Background
from tests.runs import summary

PLAIN = REPO / "examples" / "digits_cnn.py"
SESSION = REPO / "examples" / "digits_cnn_session.py"
ACCELERATE = REPO / "tests" / "fit" / "conversions" / "digits_cnn_accelerate.py"
FIT = REPO / "examples" / "digits_cnn_fit.py"
EPOCHS, STEPS = 2, 46  # 1,437 training samples, 64 a step: 23 steps an epoch
RUN = ["run", str(SESSION), "--nproc", "2", "--set", "data.ledger=true", "--set", "monitor.progress=false"]


def code_lines(path: Path) -> list[str]:
    text = path.read_text()
    if text.startswith('"""'):
        text = text[text.index('"""', 3) + 3:]
    return [line for line in text.splitlines() if line.strip()]


def changed_lines(before: Path, after: Path) -> tuple[int, int]:
    diff = [line for line in difflib.unified_diff(code_lines(before), code_lines(after), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return sum(line[0] == "+" for line in diff), sum(line[0] == "-" for line in diff)


def test_the_plain_script_converts_in_no_more_lines_than_accelerate_takes():
    session, accelerate = changed_lines(PLAIN, SESSION), changed_lines(PLAIN, ACCELERATE)
    print(f"{len(code_lines(PLAIN))} lines of code; ringtrain.Session +{session[0]}/-{session[1]}, "
          f"Accelerate's pattern +{accelerate[0]}/-{accelerate[1]}")
    assert sum(session) <= sum(accelerate), (session, accelerate)
    assert sum(session) <= 16  # the bound: Accelerate's +11/-5 on its 74-line script


def test_the_fit_conversion_hands_the_loop_over_and_trains_on_two_workers(tmp_path):
    """examples/digits_cnn_fit.py: the same model, Dataset, AdamW and cosine schedule through fit (the loop and
    the evaluation are fit's); the README quotes its line count beside the Session's."""
    added, removed = changed_lines(PLAIN, FIT)
    print(f"ringtrain.fit +{added}/-{removed} of {len(code_lines(PLAIN))} lines ({len(code_lines(FIT))} left)")
    assert len(code_lines(FIT)) < len(code_lines(PLAIN)) and added <= 12, (added, removed)
    run_dir = tmp_path / "fit"
    done = run_cli("run", str(FIT), "--nproc", "2", "--run-dir", str(run_dir), "--set", "monitor.progress=false",
                   "--", "--epochs", str(EPOCHS))
    assert done.returncode == 0, done.stderr
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
def whole(tmp_path_factory):
    """The converted script's uninterrupted run, started once for the tests that compare a stopped and resumed
    run against it (read only); each test runs its own job beside it and then waits for it: (run directory,
    the running job)."""
    run_dir = tmp_path_factory.mktemp("session") / "whole"
    job = Background.cli(*RUN, "--run-dir", str(run_dir), "--", "--epochs", str(EPOCHS))
    yield run_dir, job
    job.stop()


def finished(whole) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir, job = whole
    done = job.result()
    assert done.returncode == 0, done.stderr
    return run_dir, done


def test_the_converted_script_deals_every_sample_once_and_resumes_bit_exact(tmp_path, whole):
    stopped = tmp_path / "stopped"
    cut = run_cli(*RUN, "--run-dir", str(stopped), "--set", "train.max_steps=30", "--", "--epochs", str(EPOCHS))
    assert cut.returncode == 0, cut.stderr
    whole, done = finished(whole)
    assert summary(stopped)["steps"] == 30
    resumed = run_cli(*RUN, "--run-dir", str(stopped), "--resume", "--", "--epochs", str(EPOCHS))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step_00000030.pt" in resumed.stderr, resumed.stderr
    accuracy = [line for line in done.stdout.splitlines() if "validation accuracy" in line]
    print(f"{accuracy[-1]}; param_sha256 {summary(whole)['param_sha256'][0][:16]} whole, "
          f"{summary(stopped)['param_sha256'][0][:16]} stopped at 30 and resumed")
    assert len(accuracy) == EPOCHS and float(accuracy[-1].rsplit(" ", 1)[1]) > 0.8  # chance: 0.1
    assert summary(whole)["steps"] == summary(stopped)["steps"] == STEPS
    assert summary(whole)["param_sha256"] == summary(stopped)["param_sha256"]
    for run_dir in (whole, stopped):
        assert_every_sample_once(run_dir)


def test_ctrl_c_saves_the_step_it_reached_and_a_resume_ends_bit_exact(tmp_path, whole):
    """Paced (every step 0.2 s longer: a fault plan's delay), so that Ctrl-C lands mid-run."""
    plan = fault_plan(tmp_path, Fault("ledger.gathered", action="delay", seconds=0.2))
    stopped = tmp_path / "stopped"
    with Job(*RUN, "--run-dir", str(stopped), "--", "--epochs", str(EPOCHS), env=plan.env,
             worker_command=str(SESSION)) as job:
        job.wait_for(lambda: len(ledger_steps(stopped)) >= 10, what="step 10")
        for proc in job.tree():  # Ctrl-C in a terminal: every process of the foreground group gets SIGINT
            proc.send_signal(signal.SIGINT)
        code = job.finish(timeout=120)
    whole, _ = finished(whole)
    reached = summary_free_step(stopped)
    print(f"Ctrl-C at step {reached}: exit {code}")
    assert code != 0 and "stopped at step" in job.stderr, job.stderr
    assert (stopped / "checkpoints" / f"step_{reached:08d}.pt").exists()
    resumed = run_cli(*RUN, "--run-dir", str(stopped), "--resume", "--", "--epochs", str(EPOCHS))
    assert resumed.returncode == 0, resumed.stderr
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


def test_a_loop_that_uses_the_session_wrong_gets_one_line_naming_the_fix(tmp_path):
    script = tmp_path / "misuse.py"
    script.write_text(MISUSE)
    lines = {}
    for case in ("no-setup", "setup-twice", "no-step"):
        result = subprocess.run([sys.executable, str(script), str(tmp_path / case), case], cwd=REPO, text=True,
                                capture_output=True, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                                          "PATH": "/usr/bin:/bin"}, timeout=120)
        errors = [line for line in result.stderr.splitlines() if line.startswith("ringtrain: error:")]
        assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, (case, result.stderr)
        lines[case] = errors[0]
    print("\n".join(lines.values()))
    assert "call both first" in lines["no-setup"] and "session.setup" in lines["no-setup"]
    assert "setup was called twice" in lines["setup-twice"]
    assert "optimizer.step() was not called" in lines["no-step"]
