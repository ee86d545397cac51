"""ringtrain.fit, ringtrain run and config factories, through the commands a user runs.

- the oracle: the built-in MLP trained by name and the same MLP class through fit() give bit-identical
  parameters (and so do dict inputs, model(**x));
- a factory config trains through `ringtrain train`; every mistake in one is one line, exit 2;
- a part that does not fit (an IterableDataset, items that are not pairs, a non-scalar loss, a parameter
  that gets no gradient) is one line, exit 2;
- --resume, SIGKILL + --max-restarts and the exactly-once ledger on a user model through `ringtrain run`.

Where the numbers, the run directory or a worker's own line are what is checked (dict inputs, a user's mean loss,
a resume, the every-feature run, the parts that do not fit), the script runs in the harness's ranks
(``script_in_ranks``: its main() under the variables `ringtrain run`'s flags become, each rank a worker as torchrun
starts one; ``script_alone``: one rank as `python SCRIPT`), compared with the oracle, a real `ringtrain run` job
(issue 45; both in tests/fit/scripts.py). Launched jobs stay for what the launcher, the CLI or a death decide.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.jobs import Job
from tests.conftest import REPO, run_cli, run_main
from tests.distributed import run_distributed
from tests.fit.scripts import SCRIPT, script_alone, script_in_ranks
from tests.fit.test_session_loop import as_launched_worker, free_port
from tests.faults import fault_plan, oom_at
from tests.runs import last_step, losses, records, summary
from tests.trainers import train_run

# configs/debug_mlp.toml is the same job as user_code.CONFIG; its model is user_code.digits_mlp.
BUILT_IN = "configs/debug_mlp.toml"


def script_args(*args: str, case: str = "oracle", config: dict | None = None) -> list[str]:
    """`ringtrain run SCRIPT ARGS -- --case CASE [--config CONFIG]`'s arguments."""
    return ["run", SCRIPT, *args, "--", "--case", case, *(["--config", json.dumps(config)] if config else [])]


def run_script(*args: str, case: str = "oracle", config: dict | None = None, timeout: float = 240,
               env: dict | None = None):
    return run_cli(*script_args(*args, case=case, config=config), timeout=timeout, env=env)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    """The run directory of the oracle case through `ringtrain run` on 2 workers, run once for the tests that
    compare against it (read only)."""
    run_dir = tmp_path_factory.mktemp("oracle") / "run"
    result = run_script("--nproc", "2", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.mark.job
def test_the_builtin_mlp_and_the_same_class_through_fit_train_bit_identical_parameters(tmp_path, oracle):
    # The built-in by name: the trainer `ringtrain train BUILT_IN --nproc 2` builds in its workers, built in the
    # harness's 2 ranks (issue 45: the launcher adds nothing to the numbers compared; fit()'s side stays a real
    # `ringtrain run` job, whose program.json is checked below).
    run_distributed(train_run, 2, BUILT_IN, [], str(tmp_path / "by_name"), False, timeout_s=240)
    want, got = summary(tmp_path / "by_name"), summary(oracle)
    print(f"oracle: built-in {want['param_sha256'][0][:16]} vs fit {got['param_sha256'][0][:16]} after "
          f"{got['steps']} steps on 2 workers")
    assert got["param_sha256"] == want["param_sha256"], "fit() trained other parameters than the built-in path"
    assert losses(oracle) == losses(tmp_path / "by_name")
    assert got["eval"]["accuracy"] == want["eval"]["accuracy"]
    # The run directory is ringtrain train's, plus what was run.
    program = json.loads((oracle / "program.json").read_text())
    assert program["script"] == str(REPO / SCRIPT) and program["args"] == ["--case", "oracle"]
    config = (oracle / "config.toml").read_text()
    assert 'factory = "tests.user_code:digits_mlp"' in config or 'factory = "__main__:digits_mlp"' in config


@pytest.mark.job
def test_dict_inputs_and_a_user_mean_loss_with_torchmetrics(tmp_path, oracle):
    """model(**input) with dict items trains the same numbers as tensors; a user's mean loss and a
    torchmetrics metric run end to end, and --set (RINGTRAIN_SET) reaches the script's config. In the harness's
    2 ranks, against the oracle job: the launcher adds nothing to the numbers compared (issue 45)."""
    script_in_ranks(tmp_path / "dict", case="dict_inputs")
    script_in_ranks(tmp_path / "mean", "train.epochs=1", case="mean_loss")
    assert losses(tmp_path / "dict") == losses(oracle)
    mean = summary(tmp_path / "mean")
    assert mean["steps"] == 23, "--set train.epochs=1 did not override the script's 2 epochs"
    assert 0.5 < mean["eval"]["macro_accuracy"] <= 1.0 and mean["eval"]["loss"] < 1.0
    assert "accuracy" not in mean["eval"], "accuracy is reported for the built-in cross_entropy only"
    # A mean loss times its samples is the built-in sum, up to float rounding.
    ref_losses, mean_losses = losses(oracle), losses(tmp_path / "mean")
    common = set(mean_losses) & set(ref_losses)
    assert len(common) >= 4 and all(abs(mean_losses[s] - ref_losses[s]) < 1e-4 for s in common)


FACTORY_CONFIG = """
[model]
factory = "tests.user_code:digits_mlp"
[model.args]
hidden = 32
[data]
factory = "tests.user_code:digits"
[task]
loss = "tests.user_code:sum_cross_entropy"
loss_reduction = "sum"
metrics = "tests.user_code:accuracy_metrics"
[train]
epochs = 1
global_batch_size = 64
local_batch_size = 16
lr = 0.1
lr_schedule = "constant"
[monitor]
progress = false
"""


@pytest.mark.ranks
def test_a_factory_config_trains_through_ringtrain_train(tmp_path):
    """The trainer `ringtrain train mine.toml --nproc 2` builds, in the harness's 2 ranks (issue 45): the factories'
    parts, loss and metrics end to end. Launched workers importing a factory config's modules: the next test."""
    config = tmp_path / "mine.toml"
    config.write_text(FACTORY_CONFIG)
    run_distributed(train_run, 2, config, [], str(tmp_path / "run"), False, timeout_s=240)
    got = summary(tmp_path / "run")
    assert got["steps"] == 23 and got["eval"]["macro_accuracy"] > 0.5
    assert len(set(got["param_sha256"])) == 1


@pytest.mark.unit
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('"tests.user_code:digits_mlp"', '"tests.fit.no_such_module:digits_mlp"'),
         "model.factory = 'tests.fit.no_such_module:digits_mlp': cannot import tests.fit.no_such_module"),
        (('"tests.user_code:digits_mlp"', '"tests.user_code:NOT_CALLABLE"'),
         "model.factory = 'tests.user_code:NOT_CALLABLE' is a int, not a callable"),
        (('"tests.user_code:digits_mlp"', '"tests.user_code:no_such_function"'),
         "model.factory = 'tests.user_code:no_such_function': tests.user_code has no attribute"),
        (('"tests.user_code:digits_mlp"', '"digits_mlp"'),
         "model.factory = 'digits_mlp' must be 'package.module:function'"),
        (('factory = "tests.user_code:digits_mlp"', 'factory = "tests.user_code:digits_mlp"\nname = "mlp"'),
         "set model.factory (your own model) or model.name (a built-in one), not both"),
        (('loss = "tests.user_code:sum_cross_entropy"', 'loss = "tests.user_code:missing_loss"'),
         "task.loss = 'tests.user_code:missing_loss': tests.user_code has no attribute"),
    ],
    ids=["import-fails", "not-callable", "no-such-name", "not-an-import-path", "factory-and-name", "bad-loss"],
)
def test_a_factory_mistake_is_one_line_before_any_worker_starts(tmp_path, edit, message):
    config = tmp_path / "mine.toml"
    config.write_text(FACTORY_CONFIG.replace(*edit))
    result = run_main("train", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "run"))  # refused in-process
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert message in lines[0], lines[0]
    assert not (tmp_path / "run").exists(), "a worker started"


def _worker_main(rank: int, world_size: int, port: int, argv: list[str]) -> dict:
    """``python -m ringtrain.worker ARGV`` in this harness rank, as a worker `ringtrain train` starts it (torchrun's
    variables set, the harness's group left); its exit code and what it printed on stderr."""
    from ringtrain import worker

    code = 0
    with as_launched_worker(rank, world_size, port) as stderr:
        try:
            worker.main(argv)
        except SystemExit as exit_:  # one line and exit 2 (a usage error), as the process would end
            code = exit_.code if isinstance(exit_.code, int) else 1
    return {"code": code, "stderr": stderr.getvalue()}


@pytest.mark.ranks
def test_what_a_factory_returns_is_checked_on_the_workers_in_one_line(tmp_path):
    """What the launcher cannot check (it imports the factories, it does not call them): each worker's line. The
    workers of `ringtrain train mine.toml --nproc 2` in the harness's 2 ranks (issue 45: the line is the workers';
    how the launcher relays a usage error every worker reports, once and exit 2: test_front_door's test 2)."""
    config = tmp_path / "mine.toml"
    config.write_text(FACTORY_CONFIG.replace('"tests.user_code:digits"', '"tests.user_code:data_as_list"')
                      .replace("[model.args]\nhidden = 32", "[model.args]\nwidth = 32"))
    ranks = run_distributed(_worker_main, 2, free_port(), [str(config), "--run-dir", str(tmp_path / "run")],
                            timeout_s=240)
    for rank, got in enumerate(ranks):
        errors = [line for line in got["stderr"].splitlines() if line.startswith("ringtrain: error:")]
        assert got["code"] == 2 and len(errors) == 1, got
        assert errors[0].startswith(f"ringtrain: error: [rank {rank}] ") and "data.factory tests.user_code:" \
            "data_as_list returned list of 2; it must return (train, eval)" in errors[0], got["stderr"]
        assert "Traceback" not in got["stderr"]


MISFITS = {
    "iterable": "train_data is a Stream; ringtrain needs a map-style Dataset",
    "triples": "train_data[0] is tuple of 3; each item must be an (input, target) pair",
    "non_scalar_loss": "loss 'per_sample_loss' returned tensor[16], not a scalar",
    "unused_parameter": "step 1: 2 trainable parameter(s) got no gradient (unused.weight, unused.bias)",
}


@pytest.fixture(scope="module")
def misfits(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """`python script.py --case CASE` (one worker, no launcher) for every case of MISFITS, each in a harness rank
    (issue 45: what fit() checks itself needs no new interpreter); (exit code, stderr) by case."""
    results = {}
    for case in MISFITS:
        got = script_alone("--case", case, "--config", json.dumps({"run_dir": str(tmp_path_factory.mktemp(case))}))
        results[case] = (got["code"], got["stderr"])
    return results


@pytest.mark.ranks
@pytest.mark.parametrize(("case", "message"), list(MISFITS.items()), ids=list(MISFITS))
def test_a_part_that_does_not_fit_is_one_line_and_exit_2(misfits, case, message):
    """Plain `python script.py` (one worker): what fit() checks itself."""
    returncode, stderr = misfits[case]
    lines = stderr.strip().splitlines()
    assert returncode == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("ringtrain: error: [rank 0] ") and message in lines[0], lines[0]


@pytest.mark.ranks
def test_a_parameter_without_gradient_is_named_under_ddp_on_two_workers(tmp_path):
    """Under DDP on two workers, a parameter without gradient is named by fit's check, not met as DDP's own
    "Expected to have finished reduction". The script in the harness's 2 ranks, as `ringtrain run --nproc 2` runs it
    in its workers (issue 45: the line is the workers'; how the launcher relays a worker's line: test_front_door's
    test 2)."""
    ranks = script_in_ranks(tmp_path / "run", case="unused_parameter", refused=True)
    for got in ranks:
        assert got["code"] != 0
        assert "got no gradient (unused.weight, unused.bias)" in got["stderr"], got["stderr"]
        assert "Expected to have finished reduction" not in got["stderr"]


@pytest.mark.job
def test_resume_of_a_user_model_through_ringtrain_run_is_bit_exact(tmp_path, oracle):
    """A user's script stopped at step 20 and resumed (`--set train.max_steps=20`, then `--resume`: the
    variables those flags set, in the harness's 2 ranks; issue 45) ends bit-identical to the oracle job, loss
    for loss; a fresh `ringtrain run` over its checkpoints is refused before any launch."""
    script_in_ranks(tmp_path / "split", "train.max_steps=20")
    # A fresh run over checkpoints: refused before any launch (ringtrain.cli.main in this process).
    again = run_main(*script_args("--nproc", "2", "--run-dir", str(tmp_path / "split")))
    script_in_ranks(tmp_path / "split", resume=True)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr, again.stderr
    assert summary(tmp_path / "split")["param_sha256"] == summary(oracle)["param_sha256"]
    assert losses(tmp_path / "split") == losses(oracle)


@pytest.mark.job
def test_sigkill_of_a_user_model_worker_restarts_and_every_sample_is_used_once(tmp_path):
    run_dir = tmp_path / "chaos"
    config = json.dumps({"train": {"epochs": 4}, "monitor": {"log_every_steps": 1}, "data": {"ledger": True}})
    with Job("run", SCRIPT, "--nproc", "2", "--run-dir", str(run_dir), "--max-restarts", "1", "--", "--case", "oracle",
             "--config", config, worker_command=SCRIPT) as job:
        victim = job.worker(1)
        job.wait_for(lambda: last_step(run_dir) >= 25, what="step 25")
        victim.kill()
        assert job.finish() == 0, job.stderr
    [resumed] = records(run_dir, "resume")
    assert resumed["restart"] == 1 and summary(run_dir)["restarts"] == 1
    ledger = run_main("ledger", str(run_dir))
    assert ledger.returncode == 0, ledger.stdout + ledger.stderr
    print(f"SIGKILL of a user model's worker: restart {resumed['restart_s']:.1f} s, {resumed['steps_lost']} steps "
          f"lost; ledger: {ledger.stdout.strip().splitlines()[-1]}")


@pytest.mark.job
def test_bench_train_measures_a_factory_config_against_bare_ddp_on_the_same_parts(tmp_path):
    config = tmp_path / "mine.toml"
    # The trained parts (model, data and loss factories) without the metrics factory: metrics only join the
    # evaluation, not the weights the bench compares (the factory config test above runs them), and importing
    # torchmetrics costs ~6 CPU-seconds in each of the four workers (ringtrain's two and the bare loop's two).
    trained_parts = FACTORY_CONFIG.replace('metrics = "tests.user_code:accuracy_metrics"\n', "")
    assert trained_parts != FACTORY_CONFIG
    config.write_text(trained_parts.replace('loss = "tests.user_code:sum_cross_entropy"\nloss_reduction = "sum"\n',
                                            'loss = "tests.user_code:mean_cross_entropy"\n'))
    result = run_cli("bench", "train", str(config), "--nproc", "2", "--steps", "6", "--interval", "2",
                     "--out", str(tmp_path / "bench"))
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "bench" / "train_bench.json").read_text())
    [ours] = [r for r in rows if r["runner"] == "ringtrain"]
    assert ours["bit_identical_to_bare"], "ringtrain and the bare DDP loop trained different weights on the user's parts"
    assert ours["overhead_vs_bare"] > 0


@pytest.mark.ranks
def test_every_feature_on_a_user_model_manual_shm_bf16_oom_shrink_export_report(tmp_path):
    """A user's model (dict inputs) under the manual strategy over shm, bf16 and auto micro-batching: an OOM on
    member 1 at step 3 halves the micro-batch on every rank, the run ends with equal parameters, and `ringtrain
    export` and `ringtrain report` read its run directory. The script in the harness's 2 ranks, armed with the
    fault plan, as `ringtrain run --nproc 2 --set ...` runs it in its workers (issue 45: no launcher in the case)."""
    run_dir = tmp_path / "run"
    plan = fault_plan(tmp_path, oom_at(step=3, member=1))
    script_in_ranks(run_dir, "comm.strategy=manual", "comm.algorithm=shm", "train.precision=bf16",
                    "train.auto_micro_batch=true", "train.epochs=1", case="dict_inputs", env=plan.env)
    assert plan.fired_points() == ["step.micro_batch"]
    [shrunk] = records(run_dir, "micro_batch")
    assert shrunk["step"] == 3 and shrunk["failed_ranks"] == [1] and shrunk["micro_batch_size"] == 8
    got = summary(run_dir)
    assert got["micro_batch_size"] == 8 and len(set(got["param_sha256"])) == 1 and got["eval"]["accuracy"] > 0.5
    exported = run_main("export", str(run_dir))
    assert exported.returncode == 0 and (run_dir / "model.safetensors").is_file(), exported.stderr
    report = run_main("report", str(run_dir))
    assert report.returncode == 0 and (run_dir / "report" / "report.md").is_file(), report.stderr


@pytest.mark.job
def test_an_elastic_ringtrain_run_records_the_program_for_join(tmp_path):
    run_dir = tmp_path / "run"
    without = run_main("run", SCRIPT, "--nproc", "2", "--min-nproc", "1")  # refused before any launch
    assert without.returncode == 2 and "ringtrain run with --min-nproc needs --run-dir" in without.stderr
    result = run_script("--nproc", "2", "--min-nproc", "1", "--run-dir", str(run_dir), "--set", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    assert summary(run_dir)["world_size"] == 2
    program = json.loads((run_dir / "job.json").read_text())["program"]
    assert program["args"] == [str(REPO / SCRIPT), "--case", "oracle"] and program["cwd"] == str(REPO)
    assert program["env"]["RINGTRAIN_RUN_DIR"] == str(run_dir)
    late = run_main("join", str(run_dir))  # the job is over: one line, nothing started
    assert late.returncode == 2 and "no job is running" in late.stderr
