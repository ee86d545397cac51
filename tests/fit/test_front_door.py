"""Issue 22's front door: what a new user trips over around `fit` and `ringtrain run`, one test per row.

1. ranks whose datasets differ in length: one line naming both lengths, before step 1;
2. `ringtrain run` with a bad `--set`: refused before any worker starts; a mistake only the workers see: one line
   from the launcher, exit 2, no torch log lines;
3. an exception on rank 1 only: its type and message in the last line, each rank's traceback in the run directory;
4. `fit` twice in one script (pretrain, fine-tune): both work under `ringtrain run` and torchrun;
5. a torchmetrics metric that does not fit the outputs: one line before step 1; `(metric, inputs)` is the fix;
6. resume and run directory as fit() arguments and environment variables, the errors naming those;
7. `--resume` of a finished run: "nothing to do", every file left as it was;
8. `fit(optimizer=...)`: config.toml records the optimizer that ran;
9. `fit(lr_scheduler=...)`: stepped once per step, recorded, resumed bit for bit;
10. the trained model in hand: ``result.model``.

The rank-consistency checks (lengths, input keys, one eval batch) run in the harness's ranks, as `ringtrain run
--nproc 2` runs the script in its workers (issue 45); test 2 is the launched refusal, the line the launcher relays.
What stays launched proves a launcher: tests 2, 3 (the last line and the kept traceback), 4 and 7.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli, run_main
from tests.distributed import run_distributed
from tests.fit.scripts import SCRIPT, script_alone, script_in_ranks
from tests.fit.test_fit import script_args
from tests.launch.test_cli_train import free_port
from tests.runs import records, summary
from tests.trainers import train_run

QUIET = {"monitor": {"progress": False}}
"""The script's config plus this: no progress bar in the captured output."""


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ringtrain: error:")]


def script_summary(result: subprocess.CompletedProcess) -> dict:
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("SUMMARY "))[8:])


def fingerprint(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a run directory (the lock's holder line aside): its mtime and bytes."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[list[dict], float, Path]]:
    """`ringtrain run SCRIPT --nproc 2` of every case a worker refuses, in the harness's 2 ranks (issue 45: the
    line is the workers'; how the launcher relays it: test 2's launched job), one after another: (what each rank
    ended with, seconds, run dir)."""
    root = tmp_path_factory.mktemp("refused")
    refusals = {}
    for case in ("lengths_differ", "wrong_keys", "metric_misfit"):
        started = time.monotonic()
        # dist.timeout_s: without the check, 256 vs 257 samples hang in a collective (as before issue 22's fix); a
        # regression then fails in 10 s, not 120.
        ranks = script_in_ranks(root / case, "dist.timeout_s=10", case=case, refused=True)
        refusals[case] = (ranks, time.monotonic() - started, root / case)
    return refusals


def assert_each_rank_refused_before_step_1(ranks: list[dict], run_dir: Path, message: str) -> str:
    """Every rank: exit 2, one line `ringtrain: error: [rank R] ...` holding ``message``; no step ran. Rank 0's line."""
    for rank, got in enumerate(ranks):
        lines = got["stderr"].strip().splitlines()
        assert got["code"] == 2 and len(lines) == 1, got["stderr"]
        assert lines[0].startswith(f"ringtrain: error: [rank {rank}] ") and message in lines[0], lines[0]
    assert not records(run_dir, "train") if (run_dir / "metrics.jsonl").exists() else True, "a step ran"
    return ranks[0]["stderr"].strip()


def assert_one_line_before_step_1(result: subprocess.CompletedProcess, run_dir: Path, message: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert message in lines[0], lines[0]
    assert not records(run_dir, "train") if (run_dir / "metrics.jsonl").exists() else True, "a step ran"
    return lines[0]


@pytest.mark.ranks
def test_1_datasets_of_different_lengths_are_one_line_before_step_1(refused):
    ranks, took, run_dir = refused["lengths_differ"]
    line = assert_each_rank_refused_before_step_1(ranks, run_dir,
                                                  "train_data differs between ranks: 256 on rank 0, 257 on rank 1")
    print(f"256 vs 257 samples: refused in {took:.1f} s (2 harness ranks): {line}")


@pytest.mark.ranks
def test_input_keys_that_forward_does_not_take_are_one_line_before_step_1(refused):
    ranks, _, run_dir = refused["wrong_keys"]
    assert_each_rank_refused_before_step_1(ranks, run_dir, "train_data's inputs are dict(pixel), called as "
                                           "model(**inputs), but key 'pixel' is not a parameter of DictMLP.forward(pixels")


@pytest.mark.unit
def test_2_a_bad_override_is_refused_before_any_worker_starts(tmp_path):
    run_dir = tmp_path / "run"
    result = run_main("run", SCRIPT, "--nproc", "2", "--set", "train.lrate=0.1", "--run-dir", str(run_dir))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "ringtrain: error: unknown key 'train.lrate' in --set train.lrate=0.1; did you mean 'train.lr'?"], result.stderr
    assert not run_dir.exists(), "a worker started"
    typed = run_main("run", SCRIPT, "--nproc", "2", "--set", "train.lr=fast")
    assert typed.returncode == 2 and "train.lr = 'fast' in --set train.lr=fast" in typed.stderr, typed.stderr


@pytest.mark.job
def test_2_a_mistake_only_the_workers_see_is_one_line_from_the_launcher_and_exit_2(tmp_path):
    """The one launched refusal of this file: the launcher relays its workers' line (the other refusals' lines are
    checked in the harness's ranks: the refused fixture)."""
    run_dir = tmp_path / "run"
    result = run_cli(*script_args("--nproc", "2", "--run-dir", str(run_dir), "--set", "dist.timeout_s=10",
                                  case="iterable"))
    line = assert_one_line_before_step_1(result, run_dir, "train_data is a Stream; ringtrain needs a map-style Dataset")
    assert line.startswith("ringtrain: error: [rank "), line  # the workers' message, once, without torch's E/W lines


@pytest.mark.job
def test_3_an_exception_on_one_rank_is_named_in_the_last_line_with_its_traceback_kept(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(*script_args("--nproc", "2", "--run-dir", str(run_dir), case="raises_on_rank_1",
                                  config=QUIET))
    last = result.stderr.strip().splitlines()[-1]
    print(f"rank 1 raised: exit {result.returncode}; {len(result.stderr.splitlines())} lines; last: {last}")
    traceback = run_dir / "logs" / "rank-1.traceback"
    assert result.returncode == 1
    assert last.startswith("ringtrain: error: worker rank 1 ") and "KeyError: 'logit'" in last, result.stderr
    assert f"(traceback: {traceback})" in last
    kept = traceback.read_text()
    assert kept.startswith("Traceback (most recent call last)") and "user_code.py" in kept and "in loss" in kept, kept
    assert kept.rstrip().endswith("KeyError: 'logit'")
    # The console: at most one line per rank, then the launcher's; no traceback, no torch log lines.
    assert "Traceback" not in result.stderr and len(errors(result.stderr)) <= 3, result.stderr
    assert len(result.stderr.strip().splitlines()) == len(errors(result.stderr)), result.stderr


@pytest.mark.job
def test_4_fit_twice_in_one_script_under_ringtrain_run_and_torchrun(tmp_path):
    # 5 steps a fit(): the launchers, not the training, are the point (an epoch, 23 steps, before).
    config = {**QUIET, "train": {"max_steps": 5}}
    under_run = run_cli(*script_args("--nproc", "2", "--run-dir", str(tmp_path / "run"), case="pretrain_then_fine_tune",
                                     config=config))
    under_torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         SCRIPT, "--case", "pretrain_then_fine_tune", "--config", json.dumps({**config, "run_dir": str(tmp_path / "tr")})],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=240)
    for result, run_dir in ((under_run, tmp_path / "run"), (under_torchrun, tmp_path / "tr")):
        assert result.returncode == 0, result.stderr
        second = Path(f"{run_dir}-2")  # the second call's own run directory (the first's was named once)
        assert summary(run_dir)["steps"] == 5 and summary(second)["steps"] == 5
        assert "fit() call 2 writes" in result.stderr
        got = script_summary(result)
        # A second fit() is a run of its own: no restart of the first, no steps lost, no resume record.
        assert summary(second)["restarts"] == 0 and not records(second, "resume"), summary(second)
        assert got["same_module"] and got["model"] == got["second"] != got["first"]


@pytest.mark.ranks
def test_5_a_metric_that_does_not_fit_is_one_line_before_step_1_and_inputs_fix_it(refused, tmp_path):
    ranks, _, run_dir = refused["metric_misfit"]
    line = assert_each_rank_refused_before_step_1(
        ranks, run_dir, "metrics['binary_acc'] (BinaryAccuracy) does not fit one batch of eval_data: given "
        "predictions tensor[16, 10] and targets tensor[16] by ringtrain, it raised")
    assert "pass metrics={'binary_acc': (metric, lambda outputs, targets: (predictions, targets))}" in line
    # The fix, as `python SCRIPT` runs it, in a harness rank (issue 45).
    fixed = script_alone("--case", "metric_inputs", "--config",
                         json.dumps({**QUIET, "run_dir": str(tmp_path / "run"), "train": {"epochs": 1}}))
    assert fixed["code"] == 0, fixed["stderr"]
    assert 0.8 < fixed["summary"]["zero_acc"] <= 1.0


@pytest.mark.ranks
def test_6_resume_and_run_dir_are_fit_arguments_and_environment_variables(tmp_path):
    """fit(run_dir=..., resume=...) and RINGTRAIN_RUN_DIR / RINGTRAIN_RESUME decide where a run writes and whether
    it resumes (the variable wins), a fresh run over checkpoints is one line naming fit's words (not flags), and
    a resume ends bit-identical to a whole run. Each run as `python SCRIPT` runs it (one process, no launcher), in
    a harness rank (issue 45): only fit() and the variables decide, no launcher is involved."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    short = json.dumps({**QUIET, "train": {"max_steps": 10}})

    def run(config: str, **env: str) -> dict:
        return script_alone("--case", "fit_arguments", "--config", config, variables=env)

    first = run(short, USER_RUN_DIR=str(run_dir))
    assert first["code"] == 0, first["stderr"]
    assert summary(run_dir)["steps"] == 10, "fit(run_dir=...) was not used"
    again = run(short, USER_RUN_DIR=str(run_dir))
    line = again["stderr"].strip()
    print(f"a fresh run over checkpoints under python: {line}")
    assert again["code"] == 2 and "already holds checkpoints" in line
    assert "fit(resume=True)" in line and "RINGTRAIN_RESUME=resume" in line and "fit(run_dir=NEW_DIR)" in line
    assert "--resume" not in line and "--run-dir" not in line, "names flags python does not have"
    # The environment (the script names another folder; RINGTRAIN_RUN_DIR wins), then fit(resume=True).
    middle = run(json.dumps({**QUIET, "train": {"max_steps": 20}}), USER_RUN_DIR=str(tmp_path / "elsewhere"),
                 RINGTRAIN_RUN_DIR=str(run_dir), RINGTRAIN_RESUME="resume")
    assert middle["code"] == 0, middle["stderr"]
    assert summary(run_dir)["steps"] == 20 and not (tmp_path / "elsewhere").exists()
    last, whole = (run(json.dumps(QUIET), USER_RUN_DIR=str(directory), USER_RESUME=resume)
                   for directory, resume in ((run_dir, "true"), (reference, "")))
    for result in (last, whole):
        assert result["code"] == 0, result["stderr"]
    assert last["summary"]["steps"] == 46
    assert last["summary"]["param_sha256"] == whole["summary"]["param_sha256"], "the resume was not exact"
    # Row 7 for fit(): resuming the finished run returns its summary and writes nothing.
    before = fingerprint(run_dir)
    done = run(json.dumps(QUIET), USER_RUN_DIR=str(run_dir), USER_RESUME="true")
    assert done["code"] == 0 and "already finished at step 46 (summary.json); nothing to do" in done["stderr"]
    assert done["summary"] == last["summary"] and fingerprint(run_dir) == before


@pytest.mark.job
def test_7_resume_of_a_finished_run_has_nothing_to_do_and_leaves_every_file(tmp_path):
    run_dir = tmp_path / "run"
    # The finished run: what `ringtrain train configs/debug_mlp.toml --nproc 2` leaves, trained in the harness's
    # 2 ranks (issue 45); the --resume below is the real command, whose workers find it done.
    run_distributed(train_run, 2, "configs/debug_mlp.toml", [], str(run_dir), False, timeout_s=240)
    before = fingerprint(run_dir)
    again = run_cli("train", "configs/debug_mlp.toml", "--nproc", "2", "--run-dir", str(run_dir), "--resume")
    assert again.returncode == 0, again.stderr
    assert f"ringtrain: run directory {run_dir} already finished at step 46 (summary.json); nothing to do" in again.stderr
    assert fingerprint(run_dir) == before, "a file changed (summary.json rewritten, an eval record appended, ...)"
    assert summary(run_dir)["wall_s"] > 0 and summary(run_dir)["final_loss"] is not None


@pytest.fixture(scope="module")
def one_worker_adamw(tmp_path_factory):
    """`python tests/user_code.py --case own_optimizer` (one worker, the user's AdamW), run once in a harness
    rank (issue 45) for tests 8 and 10, which only read it: (what it ended with, its run directory)."""
    run_dir = tmp_path_factory.mktemp("own_optimizer") / "run"
    return script_alone("--case", "own_optimizer", "--config", json.dumps({**QUIET, "run_dir": str(run_dir)})), run_dir


@pytest.mark.ranks
def test_8_the_run_directory_records_the_users_optimizer(one_worker_adamw):
    result, run_dir = one_worker_adamw
    assert result["code"] == 0, result["stderr"]
    train = tomllib.loads((run_dir / "config.toml").read_text())["train"]
    print(f"config.toml [train] of fit(optimizer=AdamW(lr=3e-3, weight_decay=0.01)): {train}")
    assert train["optimizer"] == "torch.optim.adamw:AdamW" and train["lr"] == 0.003
    assert train["optimizer_args"]["weight_decay"] == 0.01 and train["optimizer_args"]["betas"] == [0.9, 0.999]
    assert "momentum" not in train and "weight_decay" not in train
    # The record builds the same optimizer (`ringtrain train` reads it so).
    import torch

    from ringtrain.config import load_config
    from ringtrain.train.optim import build_optimizer

    built = build_optimizer(load_config(run_dir / "config.toml").train, [torch.nn.Parameter(torch.zeros(1))])
    assert type(built) is torch.optim.AdamW and built.defaults["weight_decay"] == 0.01 and built.defaults["lr"] == 0.003


@pytest.mark.ranks
def test_9_the_users_lr_scheduler_is_stepped_recorded_and_resumed_bit_exact(tmp_path):
    """fit(lr_scheduler=...): config.toml names it, each step's lr is StepLR's, and a run stopped at step 12 and
    resumed ends bit-identical to a whole run, lr for lr. The script in the harness's 2 ranks, as `ringtrain run
    --set train.max_steps=12`, then `--resume`, runs it in its workers (issue 45: the numbers are fit's)."""
    split, whole = tmp_path / "split", tmp_path / "whole"
    script_in_ranks(split, "train.max_steps=12", case="own_scheduler", config=QUIET)
    script_in_ranks(whole, case="own_scheduler", config=QUIET)
    script_in_ranks(split, resume=True, case="own_scheduler", config=QUIET)
    train = tomllib.loads((whole / "config.toml").read_text())["train"]
    assert train["lr_schedule"].endswith(":halve_every_5") and "warmup_steps" not in train
    lrs = {r["step"]: r["lr"] for r in records(whole, "train")}
    assert lrs[5] == pytest.approx(0.1 * 0.5) and lrs[20] == pytest.approx(0.1 * 0.5 ** 4), lrs  # StepLR, not cosine
    resumed_lrs = {r["step"]: r["lr"] for r in records(split, "train")}
    assert all(resumed_lrs[step] == lr for step, lr in lrs.items()), (resumed_lrs, lrs)
    assert summary(split)["param_sha256"] == summary(whole)["param_sha256"], "the scheduler did not resume exactly"


@pytest.mark.ranks
def test_10_fit_hands_back_the_trained_model(tmp_path, one_worker_adamw):
    """One worker (the module itself), two under zero3 (a new module from the factory with the gathered weights):
    the script in harness ranks, as `python SCRIPT` and as `ringtrain run --nproc 2` run it (issue 45)."""
    zero3 = script_in_ranks(tmp_path / "zero3", "comm.strategy=zero3", "train.max_steps=8", case="own_optimizer",
                            config=QUIET)
    alone, _ = one_worker_adamw
    assert alone["code"] == 0, alone["stderr"]
    for got in (alone["summary"], *(rank["summary"] for rank in zero3)):
        assert got["model"] == got["param_sha256"][0], "result.model is not the trained model"
