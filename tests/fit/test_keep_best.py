"""``fit(keep_best="eval.METRIC")`` / ``[train] keep_best``: the best evaluation's model kept in RUN_DIR/best/,
its value part of every checkpoint. Real trainers (the one ``fit`` builds) on 2 Gloo workers.

- the kept weights equal the checkpoint of the best epoch (not the last one), and ``best.json`` says so;
- a run stopped after its best epoch and resumed keeps that best (a later, worse epoch does not replace it);
- a metric the evaluation does not make, or no evaluation set, is one line before step 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ringtrain.checkpoint.manager import load_checkpoint_file
from ringtrain.config import load_config_dict
from ringtrain.errors import ConfigError
from ringtrain.group.env import DistEnv
from ringtrain.group.init import DistContext
from ringtrain.train.build import build_trainer
from ringtrain.train.keep_best import lower_is_better
from ringtrain.train.resume import ResumePlan
from ringtrain.train.user_parts import UserParts
from tests.distributed import run_distributed
from tests import user_code

EPOCHS = 6
STEPS_PER_EPOCH = 23  # 1,437 digits, 64 a step
STOP_EPOCH = 4

CONFIG = {"train": {"epochs": EPOCHS, "global_batch_size": 64, "local_batch_size": 32, "lr": 0.4, "seed": 0,
                    "lr_schedule": "constant", "keep_best": "eval.accuracy"},
          "checkpoint": {"every_steps": STEPS_PER_EPOCH, "keep_last": EPOCHS + 1},
          "monitor": {"progress": False, "log_every_steps": 1}}


def train(rank: int, world_size: int, run_dir: str, train_overrides: dict, resume: bool = False):
    ctx = DistContext(DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size),
                      "gloo", torch.device("cpu"), host_rank=rank, host_world_size=world_size)
    with_eval = train_overrides.pop("eval", True)
    raw = {**CONFIG, "train": {**CONFIG["train"], **train_overrides}}
    config = load_config_dict(raw, run_dir=run_dir)
    train_data, eval_data = user_code.digits()
    user = UserParts.checked(user_code.digits_mlp, train_data, eval_data if with_eval else None)
    trainer = build_trainer(config, ctx, parts=user)
    try:
        trainer.resume(ResumePlan(resume=True) if resume else ResumePlan.fresh())
        trainer.fit()
        return trainer.parts.best.record()
    finally:
        trainer.end_threads()


def evaluations(run_dir: Path) -> dict[int, float]:
    """step -> eval accuracy, from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["accuracy"] for r in records if r["type"] == "eval"}


def checkpoint_model(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_checkpoint_file(run_dir / "checkpoints" / f"step_{step:08d}.pt")["model"]


@pytest.mark.ranks
def test_the_kept_model_is_the_best_epochs_and_a_resumed_run_keeps_it(tmp_path):
    whole = tmp_path / "whole"
    record, _ = run_distributed(train, 2, str(whole), {}, timeout_s=240)
    scores = evaluations(whole)
    print("accuracy by step:", scores)
    best_step = max(scores, key=lambda step: (scores[step], -step))  # the first of equal bests
    assert best_step < STOP_EPOCH * STEPS_PER_EPOCH, f"the best epoch must come before the stop: {scores}"
    assert max(scores.values()) > scores[max(scores)], f"the last epoch must not be the best: {scores}"
    assert any(scores[s] < scores[best_step] for s in scores if s > STOP_EPOCH * STEPS_PER_EPOCH), scores
    assert record["step"] == best_step and record["value"] == scores[best_step], record
    assert record["metric"] == "eval.accuracy" and record["mode"] == "max"
    kept = load_file(whole / "best" / "model.safetensors")
    expected = checkpoint_model(whole, best_step)
    assert kept.keys() == expected.keys()
    assert all(torch.equal(kept[name], expected[name]) for name in kept), "the kept model is not the best epoch's"
    # It loads into the user's plain module.
    user_code.digits_mlp().load_state_dict(kept)
    on_disk = json.loads((whole / "best" / "best.json").read_text())
    assert on_disk["step"] == best_step and on_disk["path"] == str(whole / "best" / "model.safetensors")

    # Stopped after epoch STOP_EPOCH (max_steps, constant lr: the same steps), then resumed to the end.
    cut = tmp_path / "cut"
    run_distributed(train, 2, str(cut), {"max_steps": STOP_EPOCH * STEPS_PER_EPOCH}, timeout_s=240)
    record, _ = run_distributed(train, 2, str(cut), {}, True, timeout_s=240)

    assert (record["step"], record["value"]) == (best_step, scores[best_step]), record
    resumed = load_file(cut / "best" / "model.safetensors")
    assert all(torch.equal(resumed[name], kept[name]) for name in kept)


@pytest.mark.unit
def test_keep_best_modes():
    assert lower_is_better("loss") and lower_is_better("val_error") and lower_is_better("perplexity")
    assert not lower_is_better("accuracy") and not lower_is_better("macro_f1")


def check_refused(rank: int, world_size: int, run_dir: str, overrides: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        train(rank, world_size, run_dir, overrides)
    return str(caught.value)


@pytest.mark.ranks
@pytest.mark.parametrize("overrides, message", [
    ({"keep_best": "eval.f1"}, "the evaluation makes no metric 'f1' (it makes accuracy, count, loss"),
    ({"keep_best": "eval.loss", "eval": False}, "this run has no evaluation set; pass eval_data"),
])
def test_a_metric_the_evaluation_does_not_make_is_one_line_before_step_1(tmp_path, overrides, message):
    [line] = run_distributed(check_refused, 1, str(tmp_path / "run"), overrides, timeout_s=120)
    assert message in line and "\n" not in line, line
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"type": "train"' not in metrics.read_text(), "training started"


@pytest.mark.unit
def test_keep_best_is_named_as_eval_metric():
    with pytest.raises(ConfigError, match="'eval.METRIC'"):
        load_config_dict({"train": {"keep_best": "accuracy"}}, run_dir="unused")
