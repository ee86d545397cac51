"""Tensor parallelism through `ringtrain train` (``[parallel] tp``, ringtrain/parallel/tensor.py) on real workers
against one worker training the unsplit model on the same batches (the oracle): tp = 2 alone (with its
all-reduces on Gloo or shm, with activation checkpointing, with sequence parallelism), and a 2-D mesh of
FSDP2 (dp_shard = 2) x tp = 2 on four workers, FSDP2's HSDP (dp_replicate = 2 x dp_shard = 2) and whole replicas
beside tp (dp_replicate = 2 x tp = 2). The loss at every step and the parameters after the run agree
within fp32 rounding (the split matmuls add in another order), each sample is dealt once per data-parallel
rank (the ranks of one tensor-parallel group share theirs), and full checkpoints cross layouts both ways."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ringtrain.data.ledger import check_ledger
from tests.conftest import run_cli, run_clis

STEPS = 8
COMMON = ["--set", "train.precision='fp32'", "--set", "train.auto_micro_batch=false", "--set", "data.ledger=true",
          "--set", "monitor.log_every_steps=1", "--set", "checkpoint.every_steps=4"]


def train(run_dir: Path, nproc: int, *settings: str, steps: int = STEPS) -> list[str]:
    return ["train", "configs/debug_lm.toml", "--nproc", str(nproc), "--run-dir", str(run_dir), *COMMON,
            "--set", f"train.max_steps={steps}", *(arg for s in settings for arg in ("--set", s))]


def losses(run_dir: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r.get("type") == "train"}


def last_eval(run_dir: Path) -> dict:
    records = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r.get("type") == "eval"][-1]


def parameters(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"]


def assert_same_run(run_dir: Path, oracle: Path, steps: range = range(1, STEPS + 1), full: bool = True) -> None:
    """``full``: the run saved full checkpoints, whose parameters are compared too."""
    mine, reference = losses(run_dir), losses(oracle)
    assert sorted(mine) == list(steps), sorted(mine)
    for step in steps:
        assert mine[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}: {mine[step]} vs {reference[step]}"
    # The closing evaluation: the same loss over the same test set, each sample counted once (not once a tp rank).
    evaluated, expected = last_eval(run_dir), last_eval(oracle)
    assert evaluated["count"] == expected["count"] and evaluated["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    if not full:
        return
    split, whole = parameters(run_dir), parameters(oracle)
    assert split.keys() == whole.keys()
    worst = max((split[k] - whole[k]).abs().max().item() for k in whole)
    print(f"{run_dir.name}: largest parameter difference from one worker {worst:.2e}")
    assert worst < 1e-5


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tp") / "one_worker"
    result = run_cli(*train(run_dir, 1))
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def test_tp2_trains_as_one_worker_step_for_step_with_half_the_block_weights_each(tmp_path, oracle):
    runs = {"tp": tmp_path / "tp", "tp_ac": tmp_path / "tp_ac", "tp_shm": tmp_path / "tp_shm", "tp_sp": tmp_path / "tp_sp"}
    results = run_clis(train(runs["tp"], 2, "parallel.tp=-1"),
                       train(runs["tp_ac"], 2, "parallel.tp=-1", "train.activation_checkpointing='full'"),
                       train(runs["tp_shm"], 2, "parallel.tp=-1", "parallel.tp_algorithm='shm'"),
                       train(runs["tp_sp"], 2, "parallel.tp=-1", "parallel.tp_algorithm='shm'",
                             "parallel.sequence_parallel=true"))
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    assert_same_run(runs["tp"], oracle)
    # The split layers' all-reduces on ringtrain's shared memory (a torch.distributed backend of its own): the
    # same run; 2 blocks x (2 forward + 2 backward) a micro-batch went there, the rest (gathers) to Gloo.
    assert_same_run(runs["tp_shm"], oracle)
    shm_summary = json.loads((runs["tp_shm"] / "summary.json").read_text())
    assert shm_summary["tp_shm_all_reduces"] >= STEPS * 2 * 4
    # Sequence parallel: the same run; each split layer's all-reduce became an all-gather or a reduce-scatter (on
    # Gloo): 2 blocks x 4 a step fewer on shm (what is left there: the clip's norms, the norm layers' gradients).
    assert_same_run(runs["tp_sp"], oracle)
    sp_reduces = json.loads((runs["tp_sp"] / "summary.json").read_text())["tp_shm_all_reduces"]
    print(f"all-reduces on shm: {shm_summary['tp_shm_all_reduces']} (tp), {sp_reduces} (tp + sequence parallel)")
    assert shm_summary["tp_shm_all_reduces"] - sp_reduces >= STEPS * 2 * 4
    assert "tp_shm_all_reduces" not in json.loads((runs["tp"] / "summary.json").read_text())
    summaries = {name: json.loads((run / "summary.json").read_text()) for name, run in runs.items()}
    whole = json.loads((oracle / "summary.json").read_text())
    digests = summaries["tp"]["param_sha256"]
    assert len(digests) == 2 and len(set(digests)) == 1  # both ranks gather the same full model
    # Recompute on CPU is deterministic: checkpointed blocks under TP end on the same parameters.
    assert summaries["tp_ac"]["param_sha256"] == digests
    assert summaries["tp_ac"]["activation_checkpointing"]["blocks"] == 2
    # Each rank holds half of every block's matrices (and the whole embeddings and norms).
    assert summaries["tp"]["model_state_mb"] < 0.75 * whole["model_state_mb"]
    # The step breakdown books the split layers' all-reduces as their own phase, taken out of forward+backward.
    trained = [json.loads(line) for line in (runs["tp"] / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in trained if r.get("type") == "train"]
    assert all(0 < r["time/tp_comm_s"] < r["step_time_s"] for r in trained)
    assert all("time/tp_comm_s" not in r for r in map(json.loads, (oracle / "metrics.jsonl").read_text().splitlines()))
    # Both ranks read the same samples: the ledger has one share a step, every sample once.
    ledger = [json.loads(line) for line in (runs["tp"] / "ledger.jsonl").read_text().splitlines()[1:]]
    assert {r["world_size"] for r in ledger} == {1} and len(ledger) == STEPS
    assert ledger == [json.loads(line) for line in (oracle / "ledger.jsonl").read_text().splitlines()[1:]]


def test_fsdp_by_tp_on_four_workers_trains_as_one_worker_and_deals_each_sample_once(tmp_path, oracle):
    run_dir = tmp_path / "fsdp_tp"
    result = run_cli(*train(run_dir, 4, "parallel.tp=2", "comm.strategy='fsdp'"), timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_run(run_dir, oracle)
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()[1:]]
    assert {r["world_size"] for r in ledger} == {2}  # two data-parallel ranks, each a tp group of two
    reports = check_ledger(run_dir / "ledger.jsonl")
    assert reports and all(r.exactly_once for r in reports)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and len(set(summary["param_sha256"])) == 1


def test_replicas_of_shard_groups_hsdp_and_whole_replicas_beside_tp_train_as_one_worker(tmp_path, oracle):
    # dp_replicate > 1: FSDP2's HSDP on four workers (2 replicas of a 2-rank shard group), and DDP beside tensor
    # parallelism (2 whole replicas of a tp pair: FSDP2's replicate dimension with shard groups of one). HSDP saves
    # sharded checkpoints, which two FSDP2 workers resume.
    hsdp, ddp_tp = tmp_path / "hsdp", tmp_path / "ddp_tp"
    results = run_clis(train(hsdp, 4, "comm.strategy='fsdp'", "parallel.dp_replicate=2", "checkpoint.sharded=true"),
                       train(ddp_tp, 4, "parallel.tp=2", "parallel.dp_replicate=2"), timeout=400)
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
    for run_dir, data_ranks in ((hsdp, 4), (ddp_tp, 2)):
        assert_same_run(run_dir, oracle, full=run_dir is ddp_tp)  # HSDP's parameters: through its resume below
        ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()[1:]]
        assert {r["world_size"] for r in ledger} == {data_ranks}
        reports = check_ledger(run_dir / "ledger.jsonl")
        assert reports and all(r.exactly_once for r in reports)
        assert len(set(json.loads((run_dir / "summary.json").read_text())["param_sha256"])) == 1
    whole = json.loads((oracle / "summary.json").read_text())["model_state_mb"]
    # Each HSDP rank holds half the state (its shard group of 2's share, not a quarter: the replicas hold the same
    # shards), a ddp x tp rank half the blocks' matrices.
    assert 0.45 * whole < json.loads((hsdp / "summary.json").read_text())["model_state_mb"] < 0.55 * whole
    assert json.loads((ddp_tp / "summary.json").read_text())["model_state_mb"] < 0.75 * whole
    into = tmp_path / "hsdp_into_fsdp2"
    (into / "checkpoints").mkdir(parents=True)
    for saved in (hsdp / "checkpoints").glob("step_00000004.dcp*"):
        (shutil.copytree if saved.is_dir() else shutil.copy)(saved, into / "checkpoints" / saved.name)
    result = run_cli(*train(into, 2, "comm.strategy='fsdp'"), "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from step_00000004.dcp (step 4)" in result.stderr
    assert_same_run(into, oracle, steps=range(5, STEPS + 1))


def test_full_checkpoints_cross_layouts_both_ways(tmp_path, oracle):
    # The one worker's step 4 resumed at tp = 2, and a tp = 2 run's step 4 resumed by two DDP workers: both end
    # where the one worker did.
    half = tmp_path / "tp_half"
    result = run_cli(*train(half, 2, "parallel.tp=-1", steps=4))
    assert result.returncode == 0, result.stderr[-2000:]
    into_tp, into_ddp = tmp_path / "into_tp", tmp_path / "into_ddp"
    results = run_clis(
        [*train(into_tp, 2, "parallel.tp=-1"), "--resume-from", str(oracle / "checkpoints" / "step_00000004.pt")],
        [*train(into_ddp, 2), "--resume-from", str(half / "checkpoints" / "step_00000004.pt")])
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "resumed from step_00000004.pt (step 4)" in result.stderr
    for run_dir in (into_tp, into_ddp):
        assert_same_run(run_dir, oracle, steps=range(5, STEPS + 1))


def test_a_layout_tensor_parallelism_cannot_run_is_one_line_before_any_worker(tmp_path):
    result = run_cli("train", "configs/debug_lm.toml", "--nproc", "2", "--min-nproc", "1", "--heal",
                     "--run-dir", str(tmp_path / "run"), "--set", "parallel.tp=-1", "--set", "train.auto_micro_batch=false")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tp = 2 with --heal: healing a split model is not built yet" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
