"""Config rules that span fields, or depend on the world size or the backend: one-line errors with the fix."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ringtrain.config.parallel import check_parallel, resolve_layout
from ringtrain.errors import ConfigError
from ringtrain.strategies import strategy_spec

if TYPE_CHECKING:
    from ringtrain.config.schema import Config, TrainConfig

__all__ = ["outer_step_warning", "check_workload", "grad_accum_steps_for_window", "grad_accum_steps_for", "validate_for_backend", "validate_for_world_size",
           "validate_for_world_sizes"]


def grad_accum_steps_for_window(window: int, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches every rank runs in a step of ``window`` samples dealt round robin over ``world_size``
    ranks: as many as the largest share, ``ceil(window / world_size)``, needs in pieces of at most
    ``micro_batch_size``; at least one. Every rank derives the same count without talking, which the
    collectives of a step need (the gradient all-reduce on the last backward, zero3's gathers per forward).

        >>> grad_accum_steps_for_window(96, 2, 32), grad_accum_steps_for_window(96, 3, 32)   # shares of 48, of 32
        (2, 1)
    """
    if window < 0 or world_size <= 0 or micro_batch_size <= 0:
        raise ValueError(f"need window >= 0 and positive world_size and micro_batch_size, got {window}, "
                         f"{world_size}, {micro_batch_size}")
    return max(1, math.ceil(math.ceil(window / world_size) / micro_batch_size))


def grad_accum_steps_for(train: TrainConfig, world_size: int) -> int:
    """Micro-batches per optimizer step at this world size: ceil(global / (local * world_size)), what the
    largest share of a full window needs in micro-batches of at most local_batch_size samples."""

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
    for world_size in _reachable_sizes(config, min_world_size, max_world_size):
        try:
            check_parallel(config, world_size)
        except ConfigError as error:
            if min_world_size == max_world_size:
                raise
            raise ConfigError(f"{error} (the job runs with {min_world_size} to {max_world_size} workers; this is "
                              f"at {world_size}: -1 takes the rest at every size)") from None
        validate_for_world_size(config, world_size)


def _reachable_sizes(config: Config, min_world_size: int, max_world_size: int) -> range:
    """The numbers of workers the job may run with. Under --heal a split model (tp x cp x pp ranks a replica)
    loses and gains whole replicas only (heal/replicas.py): from the most workers down in steps of a replica,
    and --min-nproc must be a whole number of replicas (one line otherwise)."""
    every = range(min_world_size, max_world_size + 1)
    if not config.dist.heal or min_world_size == max_world_size:
        return every
    check_parallel(config, max_world_size)
    size = resolve_layout(config.parallel, config.comm.strategy, max_world_size).model_parallel
    if size == 1:
        return every
    if min_world_size % size:
        raise ConfigError(f"--min-nproc {min_world_size} with a model split over {size} ranks (tp x cp x pp): a split "
                          f"model heals by whole replicas of {size} workers; set --min-nproc to a multiple of {size}")
    return range(max_world_size, min_world_size - 1, -size)


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
    check_parallel(config, world_size)  # [parallel]'s degrees multiply to world_size; what is not built yet


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


def check_workload(config: Config) -> None:
    """Model, data and batching settings that only make sense together (the files the data names are the data
    package's to check: ``ringtrain.data.check_data``, called by the launcher and by ``build_datasets``)."""
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


def validate_for_backend(config: Config, backend: str) -> None:
    """Check what depends on the device the workers will use (``backend``: ``dist.backend`` resolved).

    fp16 runs on either: torch's GradScaler scales CPU gradients as it does CUDA ones."""
    if config.comm.algorithm == "shm" and backend == "nccl":
        raise ConfigError(
            "comm.algorithm = 'shm' reduces CPU tensors through shared memory but the workers train on GPUs "
            "(dist.backend = 'auto' found CUDA: nccl); use comm.algorithm = 'ring' or 'torch', or "
            "dist.backend = 'gloo' to train on the CPUs"
        )


def outer_step_warning(config: Config, total_steps: int) -> str | None:
    """DiLoCo whose first outer step (``sync_every / fragments`` steps in) comes after the run's last step: the
    warning line (no outer step runs on the way; the run's last step still ends it on one model), else None.
    Asked where the run's length is known (``build_trainer``, the Session's first step)."""
    if strategy_spec(config.comm.strategy).section != "diloco":
        return None
    diloco = config.diloco
    first = diloco.sync_every // diloco.fragments
    if total_steps >= first:
        return None
    every = (f"diloco.sync_every ({diloco.sync_every})" if diloco.fragments == 1 else
             f"diloco.sync_every / fragments ({diloco.sync_every} / {diloco.fragments} = {first})")
    return (f"{every} is more than this run's {total_steps} steps: no outer step runs until the last step (which "
            f"ends the run on one model), so evaluations before it score the initial model; set diloco.sync_every "
            f"to {total_steps} or fewer")
