"""Config rules that span fields, or depend on the world size or the backend: one-line errors with the fix."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    from ringtrain.config.schema import Config, TrainConfig

__all__ = ["check_workload", "grad_accum_steps_for", "validate_for_backend", "validate_for_world_size",
           "validate_for_world_sizes"]


def grad_accum_steps_for(train: TrainConfig, world_size: int) -> int:
    """Micro-batches per optimizer step at this world size: ceil(global / (local * world_size)), what the
    largest share of a full window needs in micro-batches of at most local_batch_size samples."""
    from ringtrain.data.sampler import grad_accum_steps_for_window  # here: the data package imports this module

    return grad_accum_steps_for_window(train.global_batch_size, world_size, train.local_batch_size)


def validate_for_world_sizes(config: Config, min_world_size: int, max_world_size: int) -> None:
    """The launcher's check: the job may run with any number of workers from ``min_world_size`` to
    ``max_world_size`` (--min-nproc to --nproc, times the nodes); ConfigError naming the numbers and a value
    that works at every one of them.

    The global batch need not divide: a window is dealt round robin and every rank runs as many micro-batches
    as the largest share needs, so a config valid at the most workers is valid at fewer. ``grad_accum_steps``
    (if set) states the count at the most workers; at fewer it is derived (more micro-batches).
    """
    train = config.train
    _check_every_worker_gets_samples(train, max_world_size, (min_world_size, max_world_size))
    if train.grad_accum_steps is not None:
        derived = grad_accum_steps_for(train, max_world_size)
        if train.grad_accum_steps != derived:
            fewer = "" if min_world_size == max_world_size else (
                f" (at fewer workers the count is derived: {grad_accum_steps_for(train, min_world_size)} at "
                f"{min_world_size})")
            raise ConfigError(
                f"train.grad_accum_steps ({train.grad_accum_steps}) disagrees with ceil(global_batch_size "
                f"({train.global_batch_size}) / (local_batch_size ({train.local_batch_size}) * world_size "
                f"({max_world_size}))) = {derived}; set it to {derived} or leave it unset{fewer}"
            )
    for world_size in range(min_world_size, max_world_size + 1):
        validate_for_world_size(config, world_size)


def validate_for_world_size(config: Config, world_size: int) -> None:
    """Check what depends on the number of workers, ``world_size`` now (a worker's check: the job's range
    is not known here, see ``validate_for_world_sizes``); raise ConfigError naming the numbers and the fix."""
    train = config.train
    _check_every_worker_gets_samples(train, world_size, (world_size, world_size))
    # grad_accum_steps is the count at the job's most workers, which may be more than now (an elastic job that
    # lost some): at most this size's count, as the count only grows when workers are lost.
    derived = None if train.grad_accum_steps is None else grad_accum_steps_for(train, world_size)
    if derived is not None and train.grad_accum_steps > derived:
        raise ConfigError(
            f"train.grad_accum_steps ({train.grad_accum_steps}) is more micro-batches than a step takes at "
            f"world_size ({world_size}): ceil(global_batch_size ({train.global_batch_size}) / (local_batch_size "
            f"({train.local_batch_size}) * {world_size})) = {derived}; set it to {derived} (or to the count at the "
            "job's most workers) or leave it unset"
        )


def _check_every_worker_gets_samples(train: TrainConfig, world_size: int, job_range: tuple[int, int]) -> None:
    """Fewer samples than workers would leave a worker without a sample in every step: correct (it runs
    forwards of 0 rows) but idle, so refused, with a value that deals at least one to each of the most workers."""
    if train.global_batch_size < world_size:
        low, high = job_range
        sizes = f"world_size {high}" if low == high else f"every world_size from {low} to {high}"
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) is below world_size ({world_size}): a worker "
            f"would get no sample in any step; try global_batch_size = {_suggest(train, job_range)} "
            f"(it works at {sizes})"
        )


def _suggest(train: TrainConfig, job_range: tuple[int, int]) -> int:
    """A global batch that gives every worker a sample at every world size of the range: the smallest that
    also divides evenly by each of them when that fits one micro-batch per worker, else the most workers."""
    low, high = job_range
    even = math.lcm(*range(low, high + 1))
    return even if even <= train.local_batch_size * high else high


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
