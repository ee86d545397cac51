"""Pipeline parallelism through `ringtrain train` (``[parallel] pp``, ringtrain/parallel/pipeline.py) on real
workers against one worker training the unsplit model on the same batches (the oracle): every schedule at pp = 2,
and two pipelines of two stages on four workers. The loss at every one of 20 steps and the parameters after the
run agree within fp32 rounding (micro-batch gradients add in another order), each sample is dealt once per
pipeline (its stages share their samples), and full checkpoints cross layouts: resumed at the same layout they
go on bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringtrain.data.ledger import check_ledger
from tests.conftest import run_cli, run_clis
from tests.faults import Fault, fault_plan

STEPS = 20
# 30 sequences a step: micro-batches of 8, 8, 7 and 7 (the pipeline pads the short ones to one shape).
COMMON = ["--set", "train.precision='fp32'", "--set", "data.ledger=true", "--set", "monitor.log_every_steps=1",
          "--set", "checkpoint.every_steps=10", "--set", "train.global_batch_size=30"]
INTERLEAVED = ["parallel.stages_per_rank=2", "parallel.pp_microbatches=4"]


def train(run_dir: Path, nproc: int, *settings: str, steps: int = STEPS) -> list[str]:
    return ["train", "configs/debug_pp.toml", "--nproc", str(nproc), "--run-dir", str(run_dir), *COMMON,
            "--set", f"train.max_steps={steps}", *(arg for s in settings for arg in ("--set", s))]


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("type") == kind]


def parameters(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_same_run(run_dir: Path, oracle: Path, steps: range = range(1, STEPS + 1)) -> None:
    mine = {r["step"]: r["loss"] for r in records(run_dir, "train")}
    reference = {r["step"]: r["loss"] for r in records(oracle, "train")}
    assert sorted(mine) == list(steps), sorted(mine)
    for step in steps:
        assert mine[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}: {mine[step]} vs {reference[step]}"
    # The closing evaluation, through the stages: the same loss over the same test set, each sample counted once.
    evaluated, expected = records(run_dir, "eval")[-1], records(oracle, "eval")[-1]
    assert evaluated["count"] == expected["count"] and evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    split, whole = parameters(run_dir), parameters(oracle)
    assert split.keys() == whole.keys()
    worst = max((split[k] - whole[k]).abs().max().item() for k in whole)
    print(f"{run_dir.name}: largest parameter difference from one worker {worst:.2e}")
    assert worst < 1e-5
    assert split["head.weight"].equal(split["token_embedding.weight"])  # the tied weight's two copies stayed one
    # The optimizer state is the unsplit model's too: its parameters numbered alike, AdamW's moments close.
    mine_opt, whole_opt = (torch.load(d / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["optimizer"]
                           for d in (run_dir, oracle))
    assert [g["params"] for g in mine_opt["param_groups"]] == [g["params"] for g in whole_opt["param_groups"]]
    assert mine_opt["state"].keys() == whole_opt["state"].keys()
    assert all((mine_opt["state"][i]["exp_avg"] - whole_opt["state"][i]["exp_avg"]).abs().max() < 1e-6
               for i in whole_opt["state"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The oracle (one worker, unsplit) and the plain pipeline (pp = 2, 1F1B), run side by side."""
    root = tmp_path_factory.mktemp("pp")
    runs = {"oracle": root / "one_worker", "1f1b": root / "pp_1f1b"}
    results = run_clis(train(runs["oracle"], 1, "parallel.pp=1"), train(runs["1f1b"], 2), timeout=400)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    return runs


def test_pp2_1f1b_trains_as_one_worker_step_for_step_holding_half_the_blocks(runs):
    oracle, run_dir = runs["oracle"], runs["1f1b"]
    assert_same_run(run_dir, oracle)
    done, whole = summary(run_dir), summary(oracle)
    assert len(done["param_sha256"]) == 2 and len(set(done["param_sha256"])) == 1  # both gather the same model
    assert done["model_state_mb"] < 0.75 * whole["model_state_mb"]  # two of four blocks a rank
    # Both stages read the same samples: the ledger has one share a step, the oracle's.
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()[1:]]
    assert {r["world_size"] for r in ledger} == {1} and len(ledger) == STEPS
    assert ledger == [json.loads(line) for line in (oracle / "ledger.jsonl").read_text().splitlines()[1:]]
    # The step breakdown has the pipeline's wait (its bubble and the activation transfers) as a phase of its own.
    assert all(r["time/pipeline_wait_s"] > 0 for r in records(run_dir, "train"))
    assert done["pp_microbatches_run"] == {"4": STEPS}  # pp_microbatches, every step


def test_every_other_schedule_trains_as_one_worker(tmp_path, runs):
    schedules = {"gpipe": [], "interleaved_1f1b": INTERLEAVED, "interleaved_zero_bubble": INTERLEAVED,
                 "zbv_zero_bubble": INTERLEAVED}
    dirs = {name: tmp_path / name for name in schedules}
    results = run_clis(*(train(dirs[name], 2, f"parallel.pp_schedule='{name}'", *extra)
                         for name, extra in schedules.items()), timeout=500)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    for run_dir in dirs.values():
        assert_same_run(run_dir, runs["oracle"])


def test_a_token_budget_sets_each_steps_micro_batches_and_the_pipeline_still_trains_as_one_worker(tmp_path, runs):
    # debug_pp's every step holds a whole 128-byte sequence, so all 30 of a step are 128 wide: train.max_tokens = 768
    # is 6 sequences a micro-batch, 5 micro-batches (pp_microbatches = 4 is only the least); the interleaved schedule
    # runs rounds of pp = 2, so 6 there. The loss is a sum over tokens: the cut changes only the rounding.
    dirs = {"1f1b": tmp_path / "budget_1f1b", "interleaved_1f1b": tmp_path / "budget_interleaved"}
    results = run_clis(train(dirs["1f1b"], 2, "train.max_tokens=768"),
                       train(dirs["interleaved_1f1b"], 2, "train.max_tokens=768",
                             "parallel.pp_schedule='interleaved_1f1b'", *INTERLEAVED), timeout=500)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    for run_dir in dirs.values():
        assert_same_run(run_dir, runs["oracle"])
    assert summary(dirs["1f1b"])["pp_microbatches_run"] == {"5": STEPS}
    assert summary(dirs["interleaved_1f1b"])["pp_microbatches_run"] == {"6": STEPS}


def test_two_pipelines_on_four_workers_replicated_or_sharded_train_as_one_worker_and_deal_each_sample_once(
        tmp_path, runs):
    # Replicas (ddp: their gradients averaged) with 16 micro-batches of a share of 15 sequences: 15 of one sequence
    # and one of none (padding only); FSDP2 on the data-parallel dimension (each stage's state sharded over the two
    # pipelines) with 1F1B's interleaved cousin, two stages a rank.
    dirs = {"ddp_pp": tmp_path / "ddp_pp", "fsdp_pp": tmp_path / "fsdp_pp"}
    results = run_clis(train(dirs["ddp_pp"], 4, "parallel.pp_microbatches=16"),
                       train(dirs["fsdp_pp"], 4, "comm.strategy='fsdp'", "parallel.pp_schedule='interleaved_1f1b'",
                             *INTERLEAVED), timeout=500)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    for run_dir in dirs.values():
        assert_same_run(run_dir, runs["oracle"])
        ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()[1:]]
        assert {r["world_size"] for r in ledger} == {2}  # two data-parallel ranks, each a pipeline of two
        reports = check_ledger(run_dir / "ledger.jsonl")
        assert reports and all(r.exactly_once for r in reports)
        done = summary(run_dir)
        assert done["world_size"] == 4 and len(set(done["param_sha256"])) == 1
    # FSDP2 holds half of each stage's parameters, gradients and AdamW moments on each of the two replicas.
    assert summary(dirs["fsdp_pp"])["model_state_mb"] < 0.6 * summary(dirs["ddp_pp"])["model_state_mb"]


def test_replicas_of_a_pipeline_average_their_gradients_with_ringtrains_own_collectives(tmp_path, runs):
    # comm.algorithm beside a pipeline: the replicas' one all-reduce after the schedule runs on ringtrain's ring
    # (ddp) or shared memory (manual). Each trains as one worker; the ring's steps are reached (a fault plan that
    # only observes), which they are not when the backend's own all-reduce averages them (the control).
    dirs = {"ring": tmp_path / "ddp_ring_pp", "shm": tmp_path / "manual_shm_pp", "torch": tmp_path / "ddp_torch_pp"}
    plans = {name: fault_plan(tmp_path, Fault("ring.step", action="observe"), name=f"{name}.json") for name in ("ring", "torch")}
    results = run_clis(train(dirs["ring"], 4, "comm.algorithm='ring'"),
                       train(dirs["shm"], 4, "comm.strategy='manual'", "comm.algorithm='shm'"), timeout=500,
                       env=plans["ring"].env)
    control = run_cli(*train(dirs["torch"], 4, "train.max_steps=2"), env=plans["torch"].env, timeout=300)
    for result in (*results, control):
        assert result.returncode == 0, result.stderr[-2000:]
    for name in ("ring", "shm"):
        assert_same_run(dirs[name], runs["oracle"])
        assert len(set(summary(dirs[name])["param_sha256"])) == 1
    assert set(plans["ring"].fired_points()) == {"ring.step"} and plans["torch"].fired_points() == []


def test_full_checkpoints_cross_layouts_and_resume_bit_for_bit_at_their_own(tmp_path, runs):
    # The one worker's step 10 resumed as a V-shaped pipeline (first and last stage on one rank), the pipeline's
    # step 10 resumed by one worker and by the same pipeline: all end where the one worker did, the last on the
    # uninterrupted pipeline's very bits.
    oracle, pipeline = runs["oracle"], runs["1f1b"]
    into_v, into_one, into_same = tmp_path / "into_v", tmp_path / "into_one", tmp_path / "into_same"
    middle = "step_00000010.pt"
    results = run_clis(
        [*train(into_v, 2, "parallel.pp_schedule='zbv_zero_bubble'", *INTERLEAVED),
         "--resume-from", str(oracle / "checkpoints" / middle)],
        [*train(into_one, 1, "parallel.pp=1"), "--resume-from", str(pipeline / "checkpoints" / middle)],
        [*train(into_same, 2), "--resume-from", str(pipeline / "checkpoints" / middle)], timeout=500)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "resumed from step_00000010.pt (step 10)" in result.stderr
    for run_dir in (into_v, into_one, into_same):
        assert_same_run(run_dir, oracle, steps=range(11, STEPS + 1))
    assert summary(into_same)["param_sha256"] == summary(pipeline)["param_sha256"]
    resumed, uninterrupted = torch.load(into_same / "checkpoints" / "step_00000020.pt", weights_only=True), \
        torch.load(pipeline / "checkpoints" / "step_00000020.pt", weights_only=True)
    for index, entry in uninterrupted["optimizer"]["state"].items():  # AdamW's moments too
        assert all(entry[key].equal(resumed["optimizer"]["state"][index][key]) for key in ("exp_avg", "exp_avg_sq"))


def test_a_layout_pipeline_parallelism_cannot_run_is_one_line_before_any_worker(tmp_path):
    result = run_cli("train", "configs/debug_lm.toml", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                     "--set", "parallel.pp=2", "--set", "model.n_layers=4")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    # debug_lm shrinks its micro-batches when memory runs out, which a pipeline's schedule cannot.
    assert len(lines) == 1 and "pp = 2 with train.auto_micro_batch" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


SEQUENTIAL = """
[model]
factory = "tests.fit.user_code:dropout_mlp"
[model.args]
p = 0.0
[data]
factory = "tests.fit.user_code:digits"
[train]
max_steps = 12
global_batch_size = 60
local_batch_size = 15
lr = 0.1
precision = "fp32"
[parallel]
pp_microbatches = 4
[checkpoint]
every_steps = 12
[monitor]
progress = false
log_every_steps = 1
"""


def test_a_users_sequential_model_is_cut_into_stages_and_trains_as_one_worker(tmp_path):
    # dropout_mlp with p = 0: Flatten, Linear, ReLU, Dropout, Linear, ReLU, Dropout, Linear; its 8 children cut
    # in order into 2 stages of 4, or (V) 4 stages of 2.
    config = tmp_path / "sequential.toml"
    config.write_text(SEQUENTIAL)
    runs = {"one": (1, []), "pp": (2, ["parallel.pp=2"]),
            "zbv": (2, ["parallel.pp=2", "parallel.pp_schedule='zbv_zero_bubble'", "parallel.stages_per_rank=2"])}
    results = run_clis(*(["train", str(config), "--nproc", str(nproc), "--run-dir", str(tmp_path / name),
                          *(arg for s in settings for arg in ("--set", s))] for name, (nproc, settings) in runs.items()),
                       timeout=400)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    oracle = tmp_path / "one"
    for name in ("pp", "zbv"):
        run_dir = tmp_path / name
        mine = {r["step"]: r["loss"] for r in records(run_dir, "train")}
        reference = {r["step"]: r["loss"] for r in records(oracle, "train")}
        assert sorted(mine) == list(range(1, 13)) and all(mine[s] == pytest.approx(reference[s], rel=1e-5) for s in mine)
        assert records(run_dir, "eval")[-1]["count"] == records(oracle, "eval")[-1]["count"]
        split, whole = parameters(run_dir, 12), parameters(oracle, 12)
        assert split.keys() == whole.keys()  # the Sequential's own names: "1.weight", "4.weight", "7.weight"
        assert max((split[k] - whole[k]).abs().max().item() for k in whole) < 1e-5


def test_a_model_a_pipeline_cannot_cut_is_one_line(tmp_path):
    config = tmp_path / "mlp.toml"
    config.write_text(SEQUENTIAL.replace("tests.fit.user_code:dropout_mlp", "tests.fit.user_code:digits_mlp")
                      .replace("[model.args]\np = 0.0\n", ""))
    result = run_cli("train", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--set", "parallel.pp=2")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert ("pipeline parallelism cuts the built-in transformer or an nn.Sequential into stages, and this model is a "
            "MLP; build it as an nn.Sequential") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_sharded_checkpoints_reshard_across_layouts_and_resume_bit_for_bit_at_their_own(tmp_path, runs):
    # Sharded (DCP) checkpoints, saved in the background by a pipeline and by one worker: each pipeline rank writes
    # its own stages under the whole model's names. The pipeline's step 10 resumed by one worker and by the same
    # pipeline, the one worker's as a V: all end where the full-checkpoint oracle did, the same pipeline on the
    # uninterrupted run's bits.
    import shutil

    sharded = ["checkpoint.sharded=true", "checkpoint.async=true"]
    base = {"pp": tmp_path / "pp_base", "one": tmp_path / "one_base"}
    results = run_clis(train(base["pp"], 2, *sharded), train(base["one"], 1, "parallel.pp=1", *sharded), timeout=400)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    resumes = {"into_one": ("pp", 1, ["parallel.pp=1"]), "into_same": ("pp", 2, []),
               "into_v": ("one", 2, ["parallel.pp_schedule='zbv_zero_bubble'", *INTERLEAVED])}
    commands = []
    for name, (source, nproc, settings) in resumes.items():
        shutil.copytree(base[source], tmp_path / name)
        for later in (tmp_path / name / "checkpoints").glob("step_00000020.dcp*"):
            shutil.rmtree(later) if later.is_dir() else later.unlink()
        commands.append([*train(tmp_path / name, nproc, *sharded, *settings), "--resume"])
    for result in run_clis(*commands, timeout=500):
        assert result.returncode == 0, result.stderr[-2000:]
        assert "resumed from step_00000010.dcp (step 10)" in result.stderr
    for name in resumes:
        mine = {r["step"]: r["loss"] for r in records(tmp_path / name, "train") if r["step"] > 10}
        reference = {r["step"]: r["loss"] for r in records(runs["oracle"], "train") if r["step"] > 10}
        assert sorted(mine) == sorted(reference)
        assert all(mine[s] == pytest.approx(reference[s], rel=1e-5) for s in mine), name
    assert summary(tmp_path / "into_same")["param_sha256"] == summary(base["pp"])["param_sha256"]
    assert len(set(summary(tmp_path / "into_v")["param_sha256"])) == 1
