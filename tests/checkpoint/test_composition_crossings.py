"""Beside the composition table (tests/layouts/composition.py): checkpoints crossing layouts, full and sharded,
saved at step SAVED in one layout and resumed in another, against one worker's uninterrupted AdamW run."""

from __future__ import annotations

import functools
import shutil

import numpy as np
import pytest

from ringtrain.bench.plan_layouts import Layout, ModelShape, layout_memory
from tests.layouts.composition import ADAMW, SAVED, SEQ_LEN, STEPS, ZBV, Run, assert_same_run, oracle, root, \
    runs_folder, train

pytestmark = pytest.mark.ranks

composition_runs_folder = runs_folder()

SHARDED = ["checkpoint.sharded=true", "checkpoint.async=true"]
LAYOUTS = {  # name: (workers, overrides, `ringtrain plan layouts`' model of it, or None)
    "one": (1, [], Layout(1, 1, 1)),
    "ddp-dp2": (2, [], Layout(2, 1, 1)),
    "tp2": (2, ["parallel.tp=2"], Layout(1, 2, 1)),
    "pp2": (2, ["parallel.pp=2"], Layout(1, 1, 2)),
    "pp2-zbv": (2, ZBV, None),
    "tp2-pp2": (4, ["parallel.pp=2", "parallel.tp=2"], Layout(1, 2, 2)),
    "fsdp-dp4": (4, ["comm.strategy='fsdp'"], Layout(4, 1, 1, "fsdp")),
    "fsdp-dp2-tp2": (4, ["comm.strategy='fsdp'", "parallel.tp=2"], Layout(2, 2, 1, "fsdp")),
    "hsdp-dp4": (4, ["comm.strategy='fsdp'", "parallel.dp_replicate=2", "parallel.dp_shard=2"], None),
    # (The planner leaves out zero2's gradient staging, one bucket: here the whole local model, 1.4x its figure.)
    "zero2-dp2-tp2": (4, ["comm.strategy='zero2'", "parallel.tp=2"], None),
    "zero2-dp2-pp2": (4, ["comm.strategy='zero2'", "parallel.pp=2"], None),
}
SHAPE = ModelShape(layers=4, hidden=64, heads=2, seq=SEQ_LEN, vocab=256)  # JOB's model
CROSSINGS = [  # (form, saved by, resumed by): "train at tp2 x dp2, resume at dp4 or pp2, and back", both ways
    ("full", "one", "tp2"), ("full", "tp2", "ddp-dp2"), ("full", "one", "pp2-zbv"), ("full", "pp2", "one"),
    ("full", "pp2", "pp2"),
    ("sharded", "fsdp-dp2-tp2", "fsdp-dp2-tp2"), ("sharded", "fsdp-dp2-tp2", "fsdp-dp4"),
    ("sharded", "fsdp-dp2-tp2", "pp2"), ("sharded", "fsdp-dp2-tp2", "tp2-pp2"), ("sharded", "pp2", "tp2"),
    ("sharded", "pp2", "one"), ("sharded", "pp2", "pp2"), ("sharded", "one", "pp2-zbv"),
    ("sharded", "hsdp-dp4", "fsdp-dp4"), ("full", "one", "zero2-dp2-tp2"),
    ("sharded", "zero2-dp2-tp2", "one"), ("sharded", "fsdp-dp2-tp2", "zero2-dp2-tp2"),
    ("full", "zero2-dp2-pp2", "one"), ("sharded", "zero2-dp2-pp2", "one"),
]


def _layout_job(layout: str, form: str) -> tuple[int, list[str]]:
    workers, overrides, _ = LAYOUTS[layout]
    return workers, [*ADAMW, *overrides, *(SHARDED if form == "sharded" else [])]


@functools.cache
def saved_run(layout: str, form: str) -> Run:
    """The layout's uninterrupted run, AdamW, saving at step SAVED (and at the end)."""
    if (layout, form) == ("one", "full"):
        return oracle(tuple(ADAMW))
    workers, overrides = _layout_job(layout, form)
    return train(f"saved-{form}-{layout}", workers, overrides)


def assert_model_state_planned(run: Run, layout: str) -> None:
    """The fullest rank's parameters, gradients and AdamW moments against `ringtrain plan layouts`' figure."""
    planned_layout = LAYOUTS[layout][2]
    if planned_layout is None:
        return
    planned = layout_memory(SHAPE, planned_layout, global_batch=16)["state_bytes"] / 2**20
    measured = run.summary["model_state_mb"]
    assert abs(measured / planned - 1) < 0.10, (layout, measured, planned)


@pytest.mark.parametrize("form, source, into", CROSSINGS, ids=lambda v: v)
def test_a_checkpoint_crosses_layouts(form, source, into):
    reference, saved = oracle(tuple(ADAMW)), saved_run(source, form)
    assert_same_run(saved, reference)
    assert_model_state_planned(saved, source)
    run_dir = root() / f"{form}-{source}-into-{into}"
    (run_dir / "checkpoints").mkdir(parents=True)
    for entry in (saved.run_dir / "checkpoints").glob(f"step_{SAVED:08d}*"):
        (shutil.copytree if entry.is_dir() else shutil.copy)(entry, run_dir / "checkpoints" / entry.name)
    workers, overrides = _layout_job(into, form)
    resumed = train("", workers, overrides, resume=True, run_dir=run_dir)
    assert resumed.ranks[0]["resumed_at"] == SAVED
    assert_same_run(resumed, reference, steps=range(SAVED + 1, STEPS + 1))
    assert_model_state_planned(resumed, into)
    if into == source:  # at its own layout the resume is the uninterrupted run, bit for bit
        assert resumed.summary["param_sha256"] == saved.summary["param_sha256"]
        assert all(np.array_equal(resumed.params[k], saved.params[k]) for k in saved.params)
    if source == "hsdp-dp4":  # each HSDP rank holds its shard group's half (the replicas hold the same shards)
        whole = reference.summary["model_state_mb"]
        assert 0.45 * whole < saved.summary["model_state_mb"] < 0.55 * whole
