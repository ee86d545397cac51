"""The image pipelines other than the digits, through the real trainer on 2 Gloo workers."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.trainers import build_test_trainer, make_image_folder

pytestmark = pytest.mark.ranks

SMALL = ["data.image_size=24", "train.global_batch_size=8", "train.local_batch_size=2", "train.max_steps=2",
         "train.precision=fp32"]


def train_briefly(rank: int, world_size: int, run_dir: str, overrides: list[str]) -> dict:
    trainer = build_test_trainer(rank, world_size, "configs/debug_resnet.toml", [*SMALL, *overrides], run_dir)
    summary = trainer.fit()
    return {"steps": summary["steps"], "eval": summary["eval"], "classes": trainer.module.fc.out_features,
            "in_channels": trainer.module.conv1.in_channels}


def test_image_folder_trains_and_evaluates(tmp_path):
    make_image_folder(tmp_path / "images", train_per_class=8, val_per_class=3)
    overrides = ["data.dataset=imagefolder", f"data.path='{tmp_path / 'images'}'", "model.small_input_stem=false"]
    results = run_distributed(train_briefly, 2, str(tmp_path / "run"), overrides, timeout_s=120)
    for result in results:
        assert result["steps"] == 2 and result["classes"] == 2 and result["in_channels"] == 3
        assert "top5_accuracy" not in result["eval"]  # two classes: both are always in the top 5
        assert result["eval"] == results[0]["eval"]


def test_synthetic_images_train_and_evaluate(tmp_path):
    overrides = ["data.dataset=synthetic_images", "data.synthetic_samples=64", "data.num_classes=4"]
    results = run_distributed(train_briefly, 2, str(tmp_path / "run"), overrides, timeout_s=120)
    assert results[0]["classes"] == 4 and results[0]["in_channels"] == 3
    assert 0.0 <= results[0]["eval"]["accuracy"] <= 1.0 and results[0]["eval"] == results[1]["eval"]
