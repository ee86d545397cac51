"""Typed, documented, validated configuration.

A run is described by a TOML file with one table per section (``[model]``, ``[data]``, ``[train]``,
``[dist]``, ``[comm]``, ``[checkpoint]``, ``[monitor]``), plus ``--set section.field=value`` overrides.
Every field is declared once below with its type, default and a docstring; ``ringtrain config`` prints them.

Validation happens here, in the launching process, before any worker starts or any port opens. Errors
are one line that names the field, the value and the fix::

    unknown key 'train.lrate' in configs/x.toml; did you mean 'train.lr'?
    train.global_batch_size (96) must be divisible by train.local_batch_size (16) * world_size (4)
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import math
import os
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ringtrain.errors import ConfigError

__all__ = [
    "Config",
    "ModelConfig",
    "DataConfig",
    "TrainConfig",
    "DistConfig",
    "CommConfig",
    "CheckpointConfig",
    "MonitorConfig",
    "load_config",
    "parse_override",
    "validate_for_world_size",
    "validate_for_backend",
    "grad_accum_steps_for",
]


class Section(BaseModel):
    # strict: a string where a number belongs is an error, not a silent conversion.
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, frozen=True)


class ModelConfig(Section):
    name: Literal["mlp", "resnet18", "resnet34", "resnet50", "transformer"] = "mlp"
    """Architecture: 'mlp' (Linear-ReLU-Linear-ReLU-Linear, for the digits data); 'resnet18', 'resnet34',
    'resnet50' (torchvision's, for image datasets); 'transformer' (decoder-only language model, for text)."""

    hidden_sizes: list[int] = Field(default=[128, 64], min_length=1)
    """Widths of the MLP's hidden layers, input side first."""

    small_input_stem: bool = False
    """ResNet: a 3x3 stride-1 first convolution and no max-pool, for images of about 32 px (ImageNet's
    stem would shrink them to 8 px before the first block)."""

    n_layers: int = Field(default=4, gt=0)
    """Transformer: number of blocks."""

    n_heads: int = Field(default=4, gt=0)
    """Transformer: attention heads per block (d_model must be divisible by it)."""

    d_model: int = Field(default=256, gt=0)
    """Transformer: width of the residual stream (embedding size)."""

    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Transformer: dropout rate of embeddings, attention and residual branches."""

    @model_validator(mode="after")
    def _positive_sizes(self) -> ModelConfig:
        for size in self.hidden_sizes:
            if size <= 0:
                raise ValueError(f"hidden_sizes must all be positive, got {self.hidden_sizes}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self


class DataConfig(Section):
    dataset: Literal["digits", "digits_images", "imagefolder", "synthetic_images", "text"] = "digits"
    """Dataset: 'digits' (scikit-learn's bundled 8x8 handwritten digits, 1,797 images, no download, as
    64-pixel vectors for the MLP); 'digits_images' (the same digits as 1-channel images of image_size px);
    'imagefolder' (path/train/<class>/*.jpg and path/val/<class>/*.jpg); 'synthetic_images' (generated,
    for benchmarks); 'text' (a byte-level corpus for the transformer)."""

    path: str | None = None
    """imagefolder: the folder holding train/ and val/. text: a folder, a file or a glob, where '{stdlib}'
    stands for Python's standard library folder; unset: the standard library's own .py sources."""

    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    """Share of the dataset held out for evaluation (stratified by class)."""

    split_seed: int = 0
    """Seed of the fixed train/test split; keep it constant to compare runs."""

    num_workers: int = Field(default=0, ge=0)
    """DataLoader worker processes per training process (0 loads in the training process); they persist
    across epochs."""

    image_size: int = Field(default=32, gt=0)
    """Images: side in px of the training crops and evaluation centre crops fed to the model."""

    crop_scale_min: float = Field(default=0.08, gt=0.0, le=1.0)
    """Images: smallest share of the image a RandomResizedCrop keeps (torchvision's default 0.08)."""

    hflip: bool = True
    """Images: random horizontal flips in training (turn off for digits: a mirrored 3 is no digit)."""

    eval_crop_fraction: float = Field(default=0.875, gt=0.0, le=1.0)
    """Images: evaluation resizes to image_size / eval_crop_fraction, then centre-crops image_size."""

    synthetic_samples: int = Field(default=4096, gt=0)
    """synthetic_images: training samples (the test set has test_fraction as many)."""

    num_classes: int = Field(default=10, gt=1)
    """synthetic_images: number of classes."""

    seq_len: int = Field(default=256, gt=1)
    """text: the longest sequence in bytes (the model's context); files are cut at line ends into
    sequences of at most seq_len + 1 bytes."""

    ledger: bool = False
    """Record in RUN_DIR/ledger.jsonl, per committed step and rank, the sample ids used (one gather per
    step); `ringtrain ledger RUN_DIR` then proves every epoch used each sample exactly once."""


class TrainConfig(Section):
    epochs: int = Field(default=20, gt=0)
    """Passes over the training set."""

    max_steps: int | None = Field(default=None, gt=0)
    """Stop after this many optimizer steps, even mid-epoch (unset: run all epochs)."""

    global_batch_size: int = Field(default=64, gt=0)
    """Samples per optimizer step across all workers: local_batch_size * grad_accum_steps * world_size."""

    local_batch_size: int = Field(default=32, gt=0)
    """Samples per micro-batch on one worker (one forward/backward)."""

    grad_accum_steps: int | None = Field(default=None, gt=0)
    """Micro-batches per optimizer step; unset: derived as global / (local * world_size)."""

    optimizer: Literal["sgd", "adamw"] = "sgd"
    """Optimizer: 'sgd' (with momentum) or 'adamw'."""

    lr: float = Field(default=0.1, gt=0.0, allow_inf_nan=False)
    """Peak learning rate."""

    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    """SGD momentum (ignored by adamw)."""

    weight_decay: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """Weight decay (decoupled for adamw)."""

    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """Learning-rate schedule after warm-up: 'constant' or 'cosine' (decays to 0 at the last step)."""

    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warm-up from 0 to lr."""

    grad_clip_norm: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """Clip the synchronised gradient to this global L2 norm (unset: no clipping)."""

    seed: int = 0
    """Seed of model initialisation and of the data order (the order depends on seed and epoch only)."""

    max_consecutive_nonfinite_steps: int = Field(default=3, gt=0)
    """A step whose loss or gradient is not finite on any rank is skipped by every rank; after this many
    such steps in a row the job stops with an error."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: 'fp32'; 'bf16' (autocast, CPU or GPU); 'fp16' (autocast with a GradScaler, GPU
    only). Weights, gradients and optimizer state stay fp32."""

    max_tokens: int | None = Field(default=None, gt=0)
    """Text: token budget of one micro-batch on one worker (sequences x longest sequence, padding
    included). Micro-batches are filled with sequences up to it and to local_batch_size sequences; a
    sequence longer than the budget gets a micro-batch of its own. Unset: local_batch_size sequences."""

    auto_micro_batch: bool = False
    """On out-of-memory (CUDA) or above memory_budget_mb, every worker halves the micro-batch (and
    max_tokens) and redoes the step with twice the accumulation; the global batch is unchanged. The
    step's gradient all-reduce then follows the last backward instead of overlapping it."""

    memory_budget_mb: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """CPU memory (resident set, MB) one worker may use; going above it counts as out of memory
    (needs auto_micro_batch). Leave room beyond activations: with bf16 the CPU also keeps compiled
    kernels per tensor shape (megabytes each). Unset: no budget."""

    inject_oom_at_step: int | None = Field(default=None, gt=0)
    """Fault injection for tests and drills: raise an out-of-memory error in this optimizer step
    (counted from 1, as in metrics.jsonl; first attempt only) on rank inject_oom_rank. Unset: none."""

    inject_oom_rank: int = Field(default=0, ge=0)
    """The rank that inject_oom_at_step fails."""


class DistConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: 'auto' picks NCCL when CUDA is available, else Gloo."""

    timeout_s: float = Field(default=120.0, gt=0.0, allow_inf_nan=False)
    """Seconds a collective may wait for a peer before failing (a stopped or dead worker)."""

    pin_cpu: bool = True
    """On CPU, pin each worker's compute thread to its own core (round robin when workers outnumber
    cores); Gloo's I/O threads stay free to run anywhere."""

    threads_per_worker: int = Field(default=1, gt=0)
    """Intra-op compute threads per worker (1 avoids oversubscribing the cores)."""


class CommConfig(Section):
    strategy: Literal["ddp", "manual"] = "ddp"
    """Gradient synchronisation: 'ddp' (torch DistributedDataParallel, `algorithm` as its comm hook) or
    'manual' (ringtrain's own: buckets all-reduced during backward as their gradients become ready)."""

    algorithm: Literal["torch", "ring", "ring_chunked", "shm", "fp16", "bf16", "powersgd"] = "torch"
    """How gradient buckets are all-reduced: 'torch' (the backend's own), ringtrain's 'ring',
    'ring_chunked' (pipelined ring) or 'shm' (shared memory between the CPU workers of a host; a ring
    between hosts), or torch's DDP hooks 'fp16' / 'bf16' (compressed) and 'powersgd' (strategy 'ddp' only)."""

    bucket_mb: float = Field(default=25.0, gt=0.0, allow_inf_nan=False)
    """Gradient bucket size in MB (DDP's bucket_cap_mb; the manual strategy's bucket size)."""

    chunk_kb: int = Field(default=1024, gt=0)
    """Chunk size of the pipelined ring (algorithm 'ring_chunked'), in KiB."""

    powersgd_rank: int = Field(default=1, gt=0)
    """PowerSGD's matrix approximation rank (algorithm 'powersgd')."""

    powersgd_start_iter: int = Field(default=10, ge=2)
    """Optimizer steps of plain all-reduce before PowerSGD starts compressing (torch needs at least 2)."""

    @model_validator(mode="after")
    def _strategy_has_algorithm(self) -> CommConfig:
        if self.strategy == "manual" and self.algorithm in ("fp16", "bf16", "powersgd"):
            raise ValueError(
                f"algorithm '{self.algorithm}' is one of torch's DDP hooks; use strategy = 'ddp' with it, "
                "or algorithm 'torch', 'ring', 'ring_chunked' or 'shm' with strategy 'manual'"
            )
        return self


class CheckpointConfig(Section):
    every_steps: int = Field(default=100, gt=0)
    """Save a checkpoint every this many optimizer steps (and always at the end)."""

    keep_last: int = Field(default=3, gt=0)
    """Number of most recent checkpoints kept; older ones are deleted."""

    dir: str = "checkpoints"
    """Checkpoint folder, relative to the run directory (it must stay inside it)."""

    @model_validator(mode="after")
    def _inside_run_dir(self) -> CheckpointConfig:
        path = PurePosixPath(self.dir)
        if not self.dir or path.is_absolute() or ".." in path.parts:
            raise ValueError(
                f"dir must be a relative path inside the run directory, got {self.dir!r} "
                "(use e.g. 'checkpoints')"
            )
        return self


class MonitorConfig(Section):
    log_every_steps: int = Field(default=10, gt=0)
    """Write a metrics record (metrics.jsonl) every this many optimizer steps."""

    progress: bool = True
    """Show a progress bar on rank 0."""

    eval_every_epochs: int = Field(default=1, ge=0)
    """Evaluate on the test split every this many epochs (0: only at the end)."""

    peak_tflops: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """Peak dense TFLOP/s of one worker's device at the run's precision; set, language-model records
    report MFU (model FLOPs utilisation) against it."""

    csv: bool = True
    """Also write the training records as metrics.csv."""

    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (needs: pip install 'ringtrain[tensorboard]')."""

    @model_validator(mode="after")
    def _tensorboard_installed(self) -> MonitorConfig:
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("tensorboard = true needs the tensorboard package: pip install 'ringtrain[tensorboard]'")
        return self


class Config(Section):
    run_dir: str | None = None
    """Where the run writes config.toml, metrics.jsonl, summary.json and checkpoints/
    (unset: runs/<config file name>)."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    dist: DistConfig = DistConfig()
    comm: CommConfig = CommConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    monitor: MonitorConfig = MonitorConfig()

    @model_validator(mode="after")
    def _shm_needs_cpu_workers(self) -> Config:
        if self.comm.algorithm == "shm" and self.dist.backend == "nccl":
            raise ValueError(
                "comm.algorithm = 'shm' reduces CPU tensors through shared memory and dist.backend = 'nccl' "
                "trains on GPUs; use comm.algorithm = 'ring' or 'torch'"
            )
        return self

    @model_validator(mode="after")
    def _workload_fits(self) -> Config:
        _check_workload(self)
        return self

    def to_toml(self) -> str:
        """The resolved config as TOML (unset optional fields are left out)."""
        return tomli_w.dumps(self.model_dump(exclude_none=True))

    def digest(self) -> str:
        """sha256 of the resolved config; a checkpoint records it to detect a changed job."""
        canonical = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def load_config(path: str | Path, overrides: list[str] = (), run_dir: str | None = None) -> Config:
    """Read ``path``, apply ``--set`` overrides and an explicit run directory, and validate.

    Raises ConfigError with a one-line message for anything a user could get wrong.
    """
    path = Path(path)
    raw = _read_toml(path)
    origins: dict[tuple[str, ...], str] = {}
    for override in overrides:
        keys, value = parse_override(override)
        _set_nested(raw, keys, value)
        origins[keys] = f"--set {override}"
    if run_dir is not None:
        raw["run_dir"] = run_dir
    raw.setdefault("run_dir", str(Path("runs") / path.stem))
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, str(path), origins)) from None


def parse_override(override: str) -> tuple[tuple[str, ...], Any]:
    """``'train.lr=0.1'`` -> ``(('train', 'lr'), 0.1)``; the value is read as a TOML value, else a string."""
    key, sep, text = override.partition("=")
    keys = tuple(part.strip() for part in key.split("."))
    if not sep or not all(keys):
        raise ConfigError(f"bad override {override!r}: write it as section.field=value, e.g. train.lr=0.05")
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as mlp or gloo
    return keys, value


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
    if train.inject_oom_at_step is not None and train.inject_oom_rank >= world_size:
        raise ConfigError(
            f"train.inject_oom_rank ({train.inject_oom_rank}) must be below world_size ({world_size}); "
            f"pick a rank from 0 to {world_size - 1}"
        )


_DATASETS_FOR_MODEL = {
    "mlp": ("digits", "digits_images", "synthetic_images"),
    "resnet": ("digits_images", "imagefolder", "synthetic_images"),
    "transformer": ("text",),
}
_IMAGENET_LAYOUT = "a folder holding train/<class>/*.jpg and val/<class>/*.jpg"


def _check_workload(config: Config) -> None:
    """Model, data and batching settings that only make sense together; files that must exist."""
    model, data, train = config.model, config.data, config.train
    family = "resnet" if model.name.startswith("resnet") else model.name
    if data.dataset not in _DATASETS_FOR_MODEL[family]:
        options = " or ".join(f"'{d}'" for d in _DATASETS_FOR_MODEL[family])
        raise ValueError(f"model.name '{model.name}' cannot train on data.dataset '{data.dataset}'; use {options}")
    if train.max_tokens is not None and data.dataset != "text":
        raise ValueError("train.max_tokens batches variable-length text only; unset it or use data.dataset = 'text'")
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
    """Check what depends on the device the workers will use."""
    if config.train.precision == "fp16" and backend != "nccl":
        raise ConfigError(
            f"train.precision = 'fp16' needs CUDA GPUs (GradScaler) but the backend is {backend}; "
            "use 'bf16' on CPU, or dist.backend = 'nccl' on GPUs"
        )


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass a TOML file such as configs/digits_mlp.toml")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None


def _set_nested(raw: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(keys)}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _describe(err: ValidationError, source: str, origins: dict[tuple[str, ...], str]) -> str:
    """One line for the first problem (and a count of the others)."""
    first = err.errors()[0]
    loc = tuple(str(part) for part in first["loc"] if not isinstance(part, int))
    where = next((origins[k] for k in origins if loc[: len(k)] == k), source)
    dotted = ".".join(loc)
    if first["type"] == "extra_forbidden":
        message = f"unknown key '{dotted}' in {where}{_did_you_mean(loc)}"
    elif not loc:  # a whole-model validator
        message = f"{where}: {_plain(first['msg'])}"
    else:
        shown = first["input"]
        value = "" if isinstance(shown, dict) else f" = {_toml_repr(shown)}"
        message = f"{dotted}{value} in {where}: {_plain(first['msg'])}"
    more = len(err.errors()) - 1
    return message + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _did_you_mean(loc: tuple[str, ...]) -> str:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    prefix = ".".join(loc[:-1])
    matches = _closest(loc[-1], list(model.model_fields))
    if not matches:
        known = ", ".join(model.model_fields)
        return f"; known keys{' in [' + prefix + ']' if prefix else ''}: {known}"
    return f"; did you mean '{'.'.join((*loc[:-1], matches[0]))}'?"


def _closest(word: str, known: list[str]) -> list[str]:
    """Known keys that ``word`` is a likely typo of: an abbreviation or extension first, then look-alikes."""
    extended = [k for k in known if len(k) >= 2 and (word.startswith(k) or k.startswith(word))]
    if extended:
        return [max(extended, key=lambda k: (len(os.path.commonprefix([k, word])), -len(k)))]
    return difflib.get_close_matches(word, known, n=1, cutoff=0.6)


def _plain(message: str) -> str:
    return message.replace("Value error, ", "")


def _toml_repr(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return repr(value)
