"""Config rules that span fields, or depend on the world size or the backend: one-line errors with the fix."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    from ringtrain.config.schema import Config, TrainConfig

__all__ = ["check_workload", "grad_accum_steps_for", "validate_for_backend", "validate_for_world_size"]


def grad_accum_steps_for(train: TrainConfig, world_size: int) -> int:
    """Micro-batches per optimizer step at this world size (validated by validate_for_world_size)."""
    return train.global_batch_size // (train.local_batch_size * world_size)


def validate_for_world_size(config: Config, world_size: int) -> None:
    """Check what depends on the number of workers; raise ConfigError naming the numbers and the fix."""
    train = config.train
    per_step = train.local_batch_size * world_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) must be divisible by "
            f"train.local_batch_size ({train.local_batch_size}) * world_size ({world_size}); "
            f"try global_batch_size = {max(1, round(train.global_batch_size / per_step)) * per_step}"
        )
    derived = train.global_batch_size // per_step
    if train.grad_accum_steps is not None and train.grad_accum_steps != derived:
        raise ConfigError(
            f"train.grad_accum_steps ({train.grad_accum_steps}) disagrees with global_batch_size "
            f"({train.global_batch_size}) / (local_batch_size ({train.local_batch_size}) * world_size "
            f"({world_size})) = {derived}; set it to {derived} or leave it unset"
        )


_DATASETS_FOR_MODEL = {
    "mlp": ("digits", "digits_images", "synthetic_images"),
    "resnet": ("digits_images", "imagefolder", "synthetic_images"),
    "transformer": ("text",),
}
_IMAGENET_LAYOUT = "a folder holding train/<class>/*.jpg and val/<class>/*.jpg"


def check_workload(config: Config) -> None:
    """Model, data and batching settings that only make sense together; files that must exist."""
    model, data, train = config.model, config.data, config.train
    if model.factory is None and data.factory is None:
        family = "resnet" if model.name.startswith("resnet") else model.name
        if data.dataset not in _DATASETS_FOR_MODEL[family]:
            options = " or ".join(f"'{d}'" for d in _DATASETS_FOR_MODEL[family])
            raise ValueError(f"model.name '{model.name}' cannot train on data.dataset '{data.dataset}'; use {options}")
        if "task" in config.model_fields_set:
            raise ValueError("[task] applies to your own model or data (model.factory / data.factory); the built-in "
                             "workloads choose their loss from data.dataset")
    if train.max_tokens is not None and data.dataset != "text" and data.factory is None:
        raise ValueError("train.max_tokens batches variable-length sequences: use data.dataset = 'text' or your own "
                         "data (data.factory, or ringtrain.fit) whose targets are padded sequences; or unset it")
    if train.memory_budget_mb is not None and not train.auto_micro_batch:
        raise ValueError("train.memory_budget_mb needs train.auto_micro_batch = true (going over the budget shrinks the micro-batch)")
    if data.dataset == "imagefolder":
        if data.path is None:
            raise ValueError(f"data.path is required for data.dataset = 'imagefolder'; set it to {_IMAGENET_LAYOUT}")
        root = Path(data.path).expanduser()
        if not root.is_dir():
            raise ValueError(f"data.path '{data.path}' not found; set it to {_IMAGENET_LAYOUT}")
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise ValueError(f"data.path '{data.path}' has no {split}/ folder; it must be {_IMAGENET_LAYOUT}")
    if data.dataset == "text":
        from ringtrain.data.text import corpus_files, split_files  # here: the data package imports this module

        files = corpus_files(data.path)
        if not files:
            raise ValueError(
                f"data.path '{data.path}' matched no files; give a folder, a file or a glob such as "
                "'corpus/**/*.txt' ('{stdlib}' is Python's standard library folder)"
            )
        train_files, val_files = split_files(files, data.test_fraction)
        if not train_files or not val_files:
            raise ValueError(
                f"data.path '{data.path}' splits into {len(train_files)} training and {len(val_files)} "
                "validation files; both need one at least (match more files or change data.test_fraction)"
            )


def validate_for_backend(config: Config, backend: str) -> None:
    """Check what depends on the device the workers will use (``backend``: ``dist.backend`` resolved).

    fp16 runs on either: torch's GradScaler scales CPU gradients as it does CUDA ones."""
    if config.comm.algorithm == "shm" and backend == "nccl":
        raise ConfigError(
            "comm.algorithm = 'shm' reduces CPU tensors through shared memory but the workers train on GPUs "
            "(dist.backend = 'auto' found CUDA: nccl); use comm.algorithm = 'ring' or 'torch', or "
            "dist.backend = 'gloo' to train on the CPUs"
        )
