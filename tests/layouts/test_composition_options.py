"""Beside the composition table (tests/layouts/composition.py): the layouts' options (tp's all-reduces on shm,
activation checkpointing, zero-bubble schedules, loss parallelism, the replicas' ring, empty and uneven
micro-batches) against the same one worker, one run each; and DiLoCo's replica beside a split model, at H = 2."""

from __future__ import annotations

import functools

import pytest

from tests.faults import Fault, fault_plan
from tests.layouts.composition import RTOL, SGD, STEPS, ZBV, Cell, Run, assert_same_run, cell_run, oracle, root, \
    runs_folder, train

pytestmark = pytest.mark.ranks

composition_runs_folder = runs_folder()

# --- the layouts' options, beside the table: same oracle, one run each ------------------------------------------
BLOCKS = 4  # JOB's model.n_layers
SHM, SP = "parallel.tp_algorithm='shm'", "parallel.sequence_parallel=true"
VARIANTS = {  # id: (workers, overrides, the batch (the oracle's too))
    # The split layers' all-reduces on ringtrain's shared memory (a torch.distributed backend of its own).
    "tp2-shm": (2, ["parallel.tp=2", SHM], []),
    "tp2-sp-shm": (2, ["parallel.tp=2", SHM, SP], []),
    "tp2-ac_full": (2, ["parallel.tp=2", "train.activation_checkpointing='full'"], []),
    "pp2-interleaved_zero_bubble": (2, ["parallel.pp=2", "parallel.pp_schedule='interleaved_zero_bubble'",
                                        "parallel.stages_per_rank=2"], []),
    "pp2-zbv_zero_bubble": (2, ZBV, []),
    "tp2-pp2-zbv_zero_bubble-shm": (4, [*ZBV, "parallel.tp=2", SHM], []),
    "tp2-sp-pp2-interleaved_1f1b-shm": (4, ["parallel.pp=2", "parallel.pp_schedule='interleaved_1f1b'",
                                            "parallel.stages_per_rank=2", "parallel.tp=2", SHM, SP], []),
    # loss_parallel inside the pipeline: the last stage's copy of the tied output layer split by vocabulary over tp,
    # the loss on the logits' shards; the tie's gradients added row block by row block.
    "tp2-pp2-1f1b-loss_parallel": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.loss_parallel=true"], []),
    # The pipelines' replicas averaged by ringtrain's ring (ddp's comm hook) or shared memory (manual); the control:
    # the backend's own all-reduce, where the ring is never reached.
    "ddp-dp2-pp2-1f1b-ring": (4, ["parallel.pp=2", "comm.algorithm='ring'"], []),
    "ddp-dp2-pp2-1f1b-torch": (4, ["parallel.pp=2"], []),
    "manual-dp2-pp2-1f1b-shm": (4, ["parallel.pp=2", "comm.strategy='manual'", "comm.algorithm='shm'"], []),
    # 9 micro-batches of a share of 8 sequences: 8 of one, 1 of none (padding only).
    "ddp-dp2-pp2-1f1b-empty_microbatch": (4, ["parallel.pp=2", "parallel.pp_microbatches=9"], []),
    # 14 sequences a step: micro-batches of 4, 4, 3, 3 (the pipeline pads the short ones to one shape).
    "pp2-1f1b-uneven": (2, ["parallel.pp=2"], ["train.global_batch_size=14"]),
    # 20 sequences a step: the token budget (4 a micro-batch) makes 5, which the interleaved schedule runs as 6
    # (rounds of pp = 2).
    "pp2-interleaved_1f1b-budget": (2, ["parallel.pp=2", "parallel.pp_schedule='interleaved_1f1b'",
                                        "parallel.stages_per_rank=2"], ["train.global_batch_size=20"]),
}
OBSERVED = {"ddp-dp2-pp2-1f1b-ring", "ddp-dp2-pp2-1f1b-torch"}
"""Runs with a fault plan that only observes ring.step (tests/faults.py)."""


@functools.cache
def variant_run(name: str) -> Run:
    workers, overrides, data = VARIANTS[name]
    plan = None
    if name in OBSERVED:
        (root() / "plans").mkdir(exist_ok=True)
        plan = fault_plan(root() / "plans", Fault("ring.step", action="observe"), name=f"{name}.json")
    run = train(name, workers, [*SGD, *overrides, *data], fault_plan=None if plan is None else plan.path)
    run.plan = plan
    return run


@pytest.mark.parametrize("name", VARIANTS)
def test_a_layouts_options_train_as_one_worker(name):
    run, reference = variant_run(name), oracle(tuple(SGD), (), tuple(VARIANTS[name][2]))
    assert_same_run(run, reference)
    for result in run.ranks:
        assert result["norms"] == pytest.approx(reference.ranks[0]["norms"], rel=RTOL)
    summary = run.summary
    if name == "tp2-shm":
        # 4 blocks x (2 forward + 2 backward) all-reduces a micro-batch, at least, went to shm.
        assert summary["tp_shm_all_reduces"] >= STEPS * BLOCKS * 4
        assert "tp_shm_all_reduces" not in cell_run(Cell(tp=2)).summary
    if name == "tp2-sp-shm":
        # Sequence parallel: each split layer's all-reduce became an all-gather or a reduce-scatter (on shm too, counted
        # apart). Measured: 10 fewer a step (66 -> 56) and 6 in the closing evaluation. The bound, 2 a block a step, was
        # 4 when the evaluation (runners.py, three times as many batches) made up half of the difference.
        fewer = variant_run("tp2-shm").summary["tp_shm_all_reduces"] - summary["tp_shm_all_reduces"]
        assert fewer >= STEPS * BLOCKS * 2, fewer
    if name == "tp2-ac_full":
        # Recompute on CPU is deterministic: checkpointed blocks under TP end on the plain tp run's very bits.
        assert summary["activation_checkpointing"]["blocks"] == BLOCKS
        assert summary["param_sha256"] == cell_run(Cell(tp=2)).summary["param_sha256"]
    if name == "tp2-pp2-zbv_zero_bubble-shm":
        # Each rank's 2 blocks x (2 forward + 2 backward) x 4 micro-batches a step, at least.
        assert summary["tp_shm_all_reduces"] >= STEPS * 2 * 4 * 4
    if name == "tp2-sp-pp2-interleaved_1f1b-shm":
        fewer = variant_run("tp2-pp2-zbv_zero_bubble-shm").summary["tp_shm_all_reduces"] - summary["tp_shm_all_reduces"]
        assert fewer >= STEPS * 2 * 4 * 4 // 2, fewer
    if name in OBSERVED:
        assert set(run.plan.fired_points()) == ({"ring.step"} if name.endswith("ring") else set())
    if name == "ddp-dp2-pp2-1f1b-empty_microbatch":
        assert summary["pp_microbatches_run"] == {"9": STEPS}
    if name == "pp2-interleaved_1f1b-budget":
        assert summary["pp_microbatches_run"] == {"6": STEPS}
# --- DiLoCo's replica beside a split model: its model-parallel group ---------------------------------------------
# At H = 1 the table cannot tell what a replica is (SGD is linear: any split of the batch averages to the one
# worker's step). At H = 2 it can: with a replica its whole model-parallel group, dp 2 x (cp 2, tp 2 or pp 2) trains
# as 2 DiLoCo workers that each hold the whole model (diloco-dp2), inner steps and all.
H2 = ["diloco.sync_every=2"]
REPLICAS = {"cp2": ["parallel.cp=2"], "tp2": ["parallel.tp=2"], "pp2-1f1b": ["parallel.pp=2"],
            # 8 ranks: each replica a pipeline split over tp, whose clip norm is summed over its own 4 ranks; a
            # model split by cp and tp (or pp), whose gradients are averaged over the replica's cp ranks only.
            "tp2-pp2-1f1b": ["parallel.tp=2", "parallel.pp=2"], "cp2-tp2": ["parallel.cp=2", "parallel.tp=2"],
            "cp2-pp2-1f1b": ["parallel.cp=2", "parallel.pp=2"]}


@functools.cache
def diloco_dp2_h2() -> Run:
    """2 DiLoCo workers at H = 2, each holding the whole model."""
    return train("diloco-dp2-h2", 2, [*SGD, "comm.strategy='diloco'", *H2])


@pytest.mark.parametrize("split", REPLICAS)
def test_a_diloco_replica_is_its_model_parallel_group(split):
    size = 2 * 2 ** split.count("2")
    run, workers = train(f"diloco-dp2-{split}-h2", size, [*SGD, "comm.strategy='diloco'", *H2, *REPLICAS[split]]), diloco_dp2_h2()
    assert run.summary["world_size"] == size
    assert_same_run(run, workers)
    # Each rank's gradient norm is its replica's own (replica r: ranks r * size / 2 ...), as DiLoCo worker r's.
    for rank, result in enumerate(run.ranks):
        expected = workers.ranks[rank // (size // 2)]["norms"]
        assert result["norms"] == pytest.approx(expected, rel=RTOL), f"rank {rank}'s gradient norms"
