"""The workloads' config: model, data and batching choices are validated before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ringtrain.cli import main
from ringtrain.config import load_config
from ringtrain.data import build_datasets
from tests.trainers import make_image_folder

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))

# (config, --set overrides, words the one-line error must contain)
BAD = [
    ("debug_resnet.toml", ["data.dataset=imagefolder", "data.path=no/such/dir"],
     ["data.path 'no/such/dir' not found", "train/<class>/*.jpg"]),
    ("debug_resnet.toml", ["data.dataset=imagefolder"], ["data.path is required", "imagefolder"]),
    ("debug_resnet.toml", ["data.dataset=text"], ["model.name 'resnet18' cannot train on data.dataset 'text'"]),
    ("debug_lm.toml", ["data.dataset=digits"], ["model.name 'transformer'", "'text'"]),
    ("debug_mlp.toml", ["train.max_tokens=512"], ["train.max_tokens", "text"]),
    ("debug_lm.toml", ["data.path='nothing/**/*.txt'"], ["data.path 'nothing/**/*.txt' matched no files"]),
    ("debug_lm.toml", ["data.path='{stdlib}/json/*.py'"], ["0 validation files", "data.test_fraction"]),
    ("debug_lm.toml", ["model.n_heads=3"], ["d_model (64) must be divisible by n_heads (3)"]),
    ("debug_lm.toml", ["train.precision=fp8"], ["train.precision", "'bf16'"]),
    ("debug_lm.toml", ["train.auto_micro_batch=false", "train.memory_budget_mb=900"],
     ["train.memory_budget_mb needs train.auto_micro_batch = true"]),
    # Fault injection is no config field (ringtrain/testing/faults.py): the old one is an unknown key.
    ("debug_lm.toml", ["train.inject_oom_at_step=1"], ["unknown key 'train.inject_oom_at_step'"]),
]


@pytest.mark.parametrize("config,overrides,expected", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_workload_settings_are_one_line_before_any_worker(tmp_path, capsys, config, overrides, expected):
    run_dir = tmp_path / "run"
    argv = ["train", str(REPO / "configs" / config), "--nproc", "2", "--run-dir", str(run_dir)]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: "), lines
    for words in expected:
        assert words in lines[0], f"{words!r} missing from: {lines[0]}"
    assert not run_dir.exists()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    load_config(path)


def test_image_folder_in_imagenet_layout(tmp_path):
    make_image_folder(tmp_path)
    config = load_config(
        REPO / "configs" / "debug_resnet.toml",
        ["data.dataset=imagefolder", f"data.path='{tmp_path}'", "data.image_size=24", "data.eval_crop_fraction=0.875"],
    )
    data = build_datasets(config.data)
    assert data.num_classes == 2 and data.input_shape == (3, 24, 24)
    assert len(data.train) == 6 and len(data.test) == 4
    image, label = data.train[0]
    assert image.shape == (3, 24, 24) and image.dtype == torch.float32 and label == 0
    image, label = data.test[3]
    assert image.shape == (3, 24, 24) and label == 1
    assert image[2].mean() > image[0].mean(), "a blue dog, normalised"


def test_shm_is_refused_when_auto_finds_gpus_and_fp16_is_not_refused_on_cpu():
    from ringtrain.config import validate_for_backend
    from ringtrain.errors import ConfigError

    shm = load_config(REPO / "configs" / "debug_mlp.toml", ["comm.algorithm=shm"])
    validate_for_backend(shm, "gloo")
    with pytest.raises(ConfigError, match="comm.algorithm = 'shm' reduces CPU tensors.*'ring' or 'torch'"):
        validate_for_backend(shm, "nccl")  # dist.backend = 'auto' on a machine with CUDA
    validate_for_backend(load_config(REPO / "configs" / "debug_mlp.toml", ["train.precision=fp16"]), "gloo")
