"""The config's sections: every field once, with its type, default and a docstring."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import PurePosixPath
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ringtrain.config.checks import check_workload
from ringtrain.config.parallel import ParallelConfig, check_strategy_agrees
from ringtrain.config.section import Section
from ringtrain.strategies import HEALABLE_ALGORITHMS, strategy_spec
from ringtrain.redact import redact

__all__ = [
    "CheckpointConfig",
    "CommConfig",
    "Config",
    "DataConfig",
    "DiLoCoConfig",
    "DistConfig",
    "ModelConfig",
    "MonitorConfig",
    "ParallelConfig",
    "Section",
    "TaskConfig",
    "TrainConfig",
]

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
BUILTIN_LOSSES = ("cross_entropy", "mse", "model")
"""Losses by name ('model': the model's own outputs.loss); any other is 'package.module:function'."""
BUILTIN_OPTIMIZERS = ("sgd", "adamw")
BUILTIN_SCHEDULES = ("constant", "cosine")


def _check_import_path(field: str, value: str | None, builtins: tuple[str, ...] = ()) -> None:
    if value is None or value in builtins or _IMPORT_PATH.match(value):
        return
    choices = f"one of {', '.join(repr(b) for b in builtins)} or " if builtins else ""
    raise ValueError(f"{field} = {value!r} must be {choices}'package.module:function' (an importable callable)")


def _check_factory(section: BaseModel, name: str, builtin: str, what: str) -> None:
    """``[name] factory`` is an import path, replaces ``builtin`` (not both), and owns ``[name.args]``."""
    factory = section.factory
    _check_import_path(f"{name}.factory", factory)
    if factory is not None and builtin in section.model_fields_set:
        raise ValueError(f"set {name}.factory (your own {what}) or {name}.{builtin} (a built-in one), not both")
    if section.args and factory is None:
        raise ValueError(f"[{name}.args] are keyword arguments of {name}.factory, which is not set")


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

    factory: str | None = None
    """Your own model: 'package.module:function', called with [model.args] as keyword arguments after
    seeding (identical weights on every rank); it returns an nn.Module. Replaces name. Imported from the
    current directory and PYTHONPATH."""

    args: dict[str, Any] = Field(default_factory=dict)
    """[model.args]: keyword arguments of model.factory."""

    @model_validator(mode="after")
    def _factory_or_name(self) -> ModelConfig:
        _check_factory(self, "model", "name", "model")
        return self

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

    factory: str | None = None
    """Your own data: 'package.module:function', called with [data.args] as keyword arguments; it returns
    (train, eval) or (train, eval, collate_fn): map-style Datasets whose items are (input, target), eval
    may be None. Replaces dataset."""

    args: dict[str, Any] = Field(default_factory=dict)
    """[data.args]: keyword arguments of data.factory."""

    @model_validator(mode="after")
    def _factory_or_dataset(self) -> DataConfig:
        _check_factory(self, "data", "dataset", "data")
        return self

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
    """Samples per optimizer step across all workers, dealt round robin: it need not divide by the world
    size (shares then differ by one sample); at least one sample per worker. The gradient is the whole
    batch's at any world size, so an elastic job keeps it as workers come and go."""

    local_batch_size: int = Field(default=32, gt=0)
    """Most samples per micro-batch on one worker (one forward/backward). Every worker runs
    ceil(global_batch_size / (local_batch_size * world_size)) micro-batches a step, smaller ones (even of
    0 samples) where its share is smaller."""

    grad_accum_steps: int | None = Field(default=None, gt=0)
    """Micro-batches per optimizer step at the job's most workers, a check of the sizes above:
    ceil(global_batch_size / (local_batch_size * world_size)). Unset: derived. At fewer workers (an elastic
    job that lost some) the count is derived from local_batch_size."""

    optimizer: str = "sgd"
    """Optimizer: 'sgd' (with momentum) or 'adamw'; or 'package.module:Class', any torch.optim.Optimizer class,
    called with (parameters, lr=lr, **optimizer_args) (momentum and weight_decay then go in optimizer_args).
    fit(optimizer=...) records the class of the optimizer it was given here, its lr and optimizer_args."""

    optimizer_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of an optimizer named by its class, e.g. {betas = [0.9, 0.95], weight_decay = 0.1}."""

    lr: float = Field(default=0.1, gt=0.0, allow_inf_nan=False)
    """Peak learning rate."""

    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    """SGD momentum (ignored by adamw)."""

    weight_decay: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """Weight decay (decoupled for adamw)."""

    lr_schedule: str = "cosine"
    """Learning-rate schedule after warm-up: 'constant' or 'cosine' (decays to 0 at the last step); or
    'package.module:function' taking the optimizer and returning a torch LRScheduler, stepped once per
    optimizer step (warmup_steps then does not apply). fit(lr_scheduler=...) records its function here."""

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
    """Compute precision: 'fp32'; 'bf16' (autocast, CPU or GPU); 'fp16' (autocast with torch's GradScaler,
    CPU or GPU, every strategy). Weights, gradients and optimizer state stay fp32."""

    max_tokens: int | None = Field(default=None, gt=0)
    """Text: token budget of one micro-batch on one worker (sequences x longest sequence, padding
    included). Micro-batches are filled with sequences up to it and to local_batch_size sequences; a
    sequence longer than the budget gets a micro-batch of its own. Unset: local_batch_size sequences. Under a
    pipeline (parallel.pp > 1) every micro-batch of a step is as wide as the share's longest sequence, and the
    budget sets how many there are (at least parallel.pp_microbatches)."""

    auto_micro_batch: bool = False
    """On out-of-memory (CUDA) or above memory_budget_mb, every worker halves the micro-batch (and
    max_tokens) and redoes the step with twice the accumulation; the global batch is unchanged. The
    step's gradient all-reduce then follows the last backward instead of overlapping it."""

    memory_budget_mb: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """CPU memory (resident set, MB) one worker may use; going above it counts as out of memory
    (needs auto_micro_batch). Leave room beyond activations: with bf16 the CPU also keeps compiled
    kernels per tensor shape (megabytes each). Unset: no budget."""

    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of keeping them, block by block (the Transformer's blocks, a
    ResNet's stages, the MLP's body; your model's first nn.ModuleList): 'none'; 'full' (a block keeps only its
    input and runs its forward again in backward); 'selective' (torchtitan's op-level policy: a block keeps
    its attention outputs and every other matmul's, and recomputes the rest). Every strategy; results are
    bit-identical to 'none', the step takes longer (docs/workloads.md: Activation checkpointing)."""

    keep_best: str | None = None
    """Keep the model of the best evaluation: 'eval.METRIC' (e.g. 'eval.accuracy', 'eval.loss', or a metric
    fit(metrics=...) names), judged at every evaluation; its weights go to RUN_DIR/best/model.safetensors
    (plain tensors with the model's own names: ``model.load_state_dict(safetensors.torch.load_file(path))``)
    and RUN_DIR/best/best.json (the metric, its value, the step and epoch, the file's sha256). The best value
    is part of every checkpoint: a resumed run keeps judging against it. Unset: nothing kept."""

    keep_best_mode: Literal["auto", "min", "max"] = "auto"
    """Whether keep_best's metric is better lower ('min') or higher ('max'), as Lightning's ModelCheckpoint
    ``mode``; 'auto': lower for a metric whose name holds 'loss', 'error' or 'perplexity', higher otherwise."""

    @model_validator(mode="after")
    def _optimizer_and_schedule(self) -> TrainConfig:
        _check_import_path("train.optimizer", self.optimizer, BUILTIN_OPTIMIZERS)
        _check_import_path("train.lr_schedule", self.lr_schedule, BUILTIN_SCHEDULES)
        if self.keep_best is not None and (not self.keep_best.startswith("eval.") or self.keep_best == "eval."):
            raise ValueError(f"train.keep_best = {self.keep_best!r} names an evaluation metric as 'eval.METRIC', "
                             "e.g. 'eval.accuracy' or 'eval.loss'")
        if self.optimizer_args and self.optimizer in BUILTIN_OPTIMIZERS:
            raise ValueError(f"train.optimizer_args are keyword arguments of an optimizer class; train.optimizer = "
                             f"'{self.optimizer}' takes lr, momentum and weight_decay from [train]")
        return self




class DistConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: 'auto' picks NCCL when CUDA is available, else Gloo."""

    timeout_s: float = Field(default=120.0, gt=0.0, allow_inf_nan=False)
    """Seconds a collective may wait for a peer before failing (a stopped or dead worker)."""

    pin_cpu: bool = True
    """On CPU, pin each worker's compute threads (threads_per_worker of them, torch's OpenMP team) to their
    own cores (shared, with a warning, when workers x threads outnumber the cores); Gloo's I/O threads stay
    free to run anywhere."""

    threads_per_worker: int = Field(default=1, gt=0)
    """Intra-op compute threads per worker (1 avoids oversubscribing the cores)."""

    flight_recorder: int = Field(default=2000, ge=0)
    """Collectives each rank remembers (the flight recorder; 0: off). On a failed collective, and on request
    (SIGUSR1 to the launcher), each rank writes them to RUN_DIR/flight/rank-R.json; `ringtrain diagnose
    RUN_DIR` lines the ranks up."""

    heal: bool = False
    """Heal in place (``ringtrain train ... --nproc N --min-nproc M --heal`` sets it; so can a config for
    ``fit`` / ``ringtrain run ... --heal``): when a worker dies, or stops answering for timeout_s, the others
    do not exit. They agree in the job store on who is left and on a new generation, build a new process
    group, bring each other to the same step (from a peer, never from disk) and redo the failed step's window
    of samples among themselves (re-dealt; accumulation keeps global_batch_size). The job goes on while M
    workers remain; below that the survivors save the step they reached and exit with one line. Each heal is
    a 'heal' record in metrics.jsonl. Needs one agent per worker (--min-nproc below --nproc) and a replicated
    strategy ('ddp' or 'manual', or 'diloco': its survivors go back to the last outer step's model) with
    algorithm 'torch', 'ring', 'ring_chunked', 'shm' (each generation sets
    up a fresh workspace, named for it; the broken group's is unmapped, and what a dead peer left in /dev/shm
    unlinked), 'fp16' or 'bf16'. A worker killed inside a ring or shm all-reduce or inside a checkpoint save
    is healed like any other: no partial gradient is applied, no half-written checkpoint is committed.
    'zero1', 'zero2' and 'zero3' heal too, with checkpoint.sharded = true: the lost worker held the only copy
    of its shards, so the survivors, regrouped, build the trainer again over the new group and reload the
    newest sharded checkpoint resharded to them (no process restart); the steps since it are redone, every
    sample still once, and the heal record reports them as steps_lost (no checkpoint yet, or below M: the
    job ends with one line)."""

    keep_freed_memory: bool = True
    """On CPU, fix glibc malloc's mmap and trim thresholds so that buffers freed in one step are reused in
    the next instead of being returned to the OS and faulted in again (ResNet-18: 8% of the step). RSS
    then stays near its peak. Skipped when MALLOC_*_ variables or LD_PRELOAD (jemalloc, tcmalloc) are set."""


class TaskConfig(Section):
    """What a user model optimises and how it is evaluated (with model.factory / data.factory, or fit())."""

    loss: str = "cross_entropy"
    """'cross_entropy' (classification; next-token with ignore index -100 for 3-D logits), 'mse', 'model' (the
    model's own outputs.loss, e.g. a Hugging Face model given 'labels' in its inputs), or
    'package.module:function' taking (outputs, targets) and returning a scalar."""

    loss_reduction: Literal["mean", "sum"] = "mean"
    """'mean': the loss is the mean over the micro-batch's samples (ringtrain weights it by their count);
    'sum': the sum over items, divided by the step's global item count (see count_items)."""

    count_items: str | None = None
    """With loss_reduction = 'sum': 'package.module:function' taking the targets, returning the number of
    items the loss sums over (unset: the targets' elements that are not -100)."""

    metrics: str | None = None
    """'package.module:function' returning {name: torchmetrics.Metric}, evaluated on the eval set."""

    @model_validator(mode="after")
    def _callables(self) -> TaskConfig:
        _check_import_path("task.loss", self.loss, BUILTIN_LOSSES)
        _check_import_path("task.count_items", self.count_items)
        _check_import_path("task.metrics", self.metrics)
        if self.count_items is not None and self.loss_reduction != "sum":
            raise ValueError("task.count_items goes with task.loss_reduction = 'sum' (a 'mean' loss counts samples)")
        return self


class CommConfig(Section):
    strategy: Literal["ddp", "manual", "zero1", "zero2", "zero3", "fsdp", "diloco"] = "ddp"
    """Data parallelism: 'ddp' (torch DistributedDataParallel, `algorithm` as its comm hook) or
    'manual' (ringtrain's own: buckets all-reduced during backward as their gradients become ready), each
    rank holding everything; or sharded over the ranks with ringtrain's collectives (`algorithm`): 'zero1'
    (optimizer state), 'zero2' (+ gradients), 'zero3' (+ parameters, gathered per block); or 'fsdp'
    (PyTorch's FSDP2 fully_shard, one unit per block, the backend's own collectives); or 'diloco' (across
    slow links: no gradient sync, every [diloco] sync_every steps the workers' parameter changes are averaged
    with `algorithm` and applied by an outer optimizer; see [diloco])."""

    algorithm: Literal["torch", "ring", "ring_chunked", "shm", "fp16", "bf16", "powersgd"] = "torch"
    """How gradient buckets are all-reduced: 'torch' (the backend's own), ringtrain's 'ring',
    'ring_chunked' (pipelined ring) or 'shm' (shared memory between the CPU workers of a host; a ring
    between hosts), or torch's DDP hooks 'fp16' / 'bf16' (compressed) and 'powersgd' (strategy 'ddp' only)."""

    bucket_mb: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """Gradient bucket size in MB (DDP's bucket_cap_mb; the manual and zero1/zero2 strategies' bucket size).
    Unset: 25 for 'ddp' and 'manual', 4 for 'zero1'/'zero2' (a bucket of staging is what zero2 holds beyond
    its shards, so it stays well below a small model's whole gradient)."""

    chunk_kb: int | None = Field(default=None, gt=0)
    """Chunk size of the pipelined ring (algorithm 'ring_chunked'), in KiB (unset: its measured default,
    4096; see docs/benchmarks.md)."""

    powersgd_rank: int = Field(default=1, gt=0)
    """PowerSGD's matrix approximation rank (algorithm 'powersgd')."""

    powersgd_start_iter: int = Field(default=10, ge=2)
    """Optimizer steps of plain all-reduce before PowerSGD starts compressing (torch needs at least 2)."""

    prefetch: bool = True
    """zero3: gather the next block's parameters on a communication thread while the current block computes
    (forward and backward), and reduce-scatter a block's gradient while the next one's backward runs; at most
    two blocks gathered at once. False: every collective runs in turn on the training thread."""

    @model_validator(mode="after")
    def _strategy_has_algorithm(self) -> CommConfig:
        spec = strategy_spec(self.strategy)
        if self.algorithm in spec.algorithms:
            return self
        if self.strategy == "fsdp":
            raise ValueError(
                f"strategy 'fsdp' runs PyTorch's FSDP2 on the backend's own collectives (algorithm 'torch') or on "
                f"shared memory (algorithm 'shm': the ringtrain_shm backend), not algorithm '{self.algorithm}'; "
                "choose one of those, or use strategy 'zero3' for ringtrain's"
            )
        raise ValueError(
            f"algorithm '{self.algorithm}' is one of torch's DDP hooks; use strategy = 'ddp' with it, "
            f"or algorithm {', '.join(repr(a) for a in spec.algorithms)} with strategy '{self.strategy}'"
        )

    @property
    def resolved_bucket_mb(self) -> float:
        """``bucket_mb``, or the strategy's default when unset."""
        if self.bucket_mb is not None:
            return self.bucket_mb
        return strategy_spec(self.strategy).default_bucket_mb


class DiLoCoConfig(Section):
    """DiLoCo (arXiv 2311.08105) with comm.strategy = 'diloco': each worker takes sync_every optimizer steps of
    the configured (inner) optimizer on its own shares of the data with no communication; then the workers
    average their pseudo-gradients (global parameters minus their own) with comm.algorithm and an outer SGD
    steps the global parameters, which every worker then takes. LocalSGD is outer_lr = 1, outer_momentum = 0."""

    sync_every: int = Field(default=50, gt=0)
    """H: optimizer (inner) steps between two outer steps, and at the run's last step. 50 by default (the paper
    uses 500 on large models; ringtrain's CPU-sized jobs run hundreds of steps, so 50 keeps several outer steps
    per run while cutting communication 50 times)."""

    outer_lr: float = Field(default=0.7, gt=0.0, allow_inf_nan=False)
    """The outer SGD's learning rate, applied to the averaged pseudo-gradient (0.7 as in the paper)."""

    outer_momentum: float = Field(default=0.9, ge=0.0, lt=1.0, allow_inf_nan=False)
    """The outer SGD's momentum (0.9 as in the paper; 0: plain averaging steps, as LocalSGD)."""

    nesterov: bool = True
    """Nesterov momentum for the outer SGD, as in the paper. With outer_momentum = 0 there is no momentum to
    look ahead with, and the outer step is plain SGD either way."""

    fragments: int = Field(default=1, gt=0)
    """F (streaming DiLoCo, arXiv 2501.18512): the parameters are cut in model order into F fragments of about
    equal size, which sync in turn, one every sync_every / F steps, each every sync_every steps: the peak
    bandwidth falls F times. sync_every must be divisible by F; F at most the model's trainable tensors."""

    delay: int = Field(default=0, ge=0)
    """tau: a fragment's pseudo-gradient is taken and exchanged tau inner steps before its outer step is applied
    (below sync_every / fragments); the inner steps in between are then overwritten by the new global values.
    With comm.algorithm = 'torch' those steps overlap the exchange (an asynchronous op); ringtrain's own
    algorithms exchange at once (the same numbers, no overlap yet)."""

    dtype: Literal["fp32", "bf16", "int8", "int4"] = "fp32"
    """The dtype the pseudo-gradients travel in: 'fp32' (all-reduced, exact), or 'bf16', 'int8', 'int4'
    (ringtrain/comm/codec.py: 2, ~1.02 and ~0.53 bytes a value; all-gathered and summed in fp32 in rank order,
    the same bits on every rank) with error feedback: what a worker's packet lost is added to its next
    pseudo-gradient of that fragment, so it is delayed, never dropped."""

    inner: Literal["auto", "worker", "host"] = "auto"
    """What one DiLoCo replica is. 'worker': every worker (no gradient sync between outer steps). 'host': the
    workers of one host, data-parallel among themselves every step (torch DDP over the host's ranks, its
    all-reduce comm.algorithm: 'shm' keeps it in shared memory), only the hosts' first ranks exchanging
    pseudo-gradients between hosts (INTELLECT-1's shape). 'auto': 'host' when the job spans hosts and some host
    runs more than one worker, else 'worker'."""

    @model_validator(mode="after")
    def _streaming_fits(self) -> DiLoCoConfig:
        if self.sync_every % self.fragments:
            raise ValueError(f"diloco.sync_every ({self.sync_every}) must be divisible by diloco.fragments "
                             f"({self.fragments}): each fragment syncs every sync_every / fragments steps in turn")
        if self.delay >= self.sync_every // self.fragments:
            raise ValueError(f"diloco.delay ({self.delay}) must be below diloco.sync_every / fragments "
                             f"({self.sync_every} / {self.fragments} = {self.sync_every // self.fragments}): a "
                             "fragment's all-reduce must land before its next sync")
        return self


class CheckpointConfig(Section):
    model_config = ConfigDict(**Section.model_config, populate_by_name=True)

    every_steps: int = Field(default=100, gt=0)
    """Save a checkpoint every this many optimizer steps (and always at the end)."""

    sharded: bool = False
    """Each rank writes its own shard with torch.distributed.checkpoint (step_N.dcp/, committed by a sha256
    manifest of every file), instead of rank 0 writing the gathered state (step_N.pt); loads reshard to
    another number of workers or another strategy. Every strategy (zero1/2/3: each rank its own stretch)."""

    async_: bool = Field(default=False, alias="async")
    """Save sharded checkpoints in the background: the state is copied in memory and written while training
    goes on; committed (manifest) only when every rank's write has finished. Implies sharded."""

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
    """Also write TensorBoard event files to RUN_DIR/tensorboard (needs: pip install 'ringtrain[tensorboard]').
    The same as listing "tensorboard" in trackers (kept: older configs set it)."""

    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    """Experiment trackers rank 0 also writes to: the config, every record's numbers, the summary and the step
    breakdown. "mlflow": a local store (sqlite:///RUN_DIR/mlflow.db unless mlflow_tracking_uri); "wandb": offline
    only, into RUN_DIR/wandb. Needs pip install 'ringtrain[trackers]'; a tracker that cannot start is one warning
    and the training goes on."""

    mlflow_tracking_uri: str | None = None
    """MLflow's store, e.g. sqlite:////shared/mlflow.db (unset: sqlite:///RUN_DIR/mlflow.db; read it with
    mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db). A server URI would reach the network: ringtrain
    means a local store."""

    mlflow_experiment: str = "ringtrain"
    """The MLflow experiment a run is filed under."""

    wandb_project: str = "ringtrain"
    """The W&B project of the offline run (used when you `wandb sync` it)."""

    @model_validator(mode="after")
    def _tensorboard_installed(self) -> MonitorConfig:
        wanted = self.tensorboard or "tensorboard" in self.trackers
        if wanted and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("tensorboard = true needs the tensorboard package: pip install 'ringtrain[tensorboard]'")
        return self

    @model_validator(mode="after")
    def _trackers_once(self) -> MonitorConfig:
        repeated = sorted({name for name in self.trackers if self.trackers.count(name) > 1})
        if repeated:
            raise ValueError(f"monitor.trackers names {', '.join(repeated)} more than once; list each tracker once")
        return self


class Config(Section):
    run_dir: str | None = None
    """Where the run writes config.toml, metrics.jsonl, summary.json and checkpoints/
    (unset: runs/<config file name>)."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    task: TaskConfig = TaskConfig()
    train: TrainConfig = TrainConfig()
    dist: DistConfig = DistConfig()
    comm: CommConfig = CommConfig()
    diloco: DiLoCoConfig = DiLoCoConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    monitor: MonitorConfig = MonitorConfig()
    parallel: ParallelConfig = ParallelConfig()

    @model_validator(mode="after")
    def _shm_needs_cpu_workers(self) -> Config:
        if self.comm.algorithm == "shm" and self.dist.backend == "nccl":
            raise ValueError(
                "comm.algorithm = 'shm' reduces CPU tensors through shared memory and dist.backend = 'nccl' "
                "trains on GPUs; use comm.algorithm = 'ring' or 'torch'"
            )
        return self

    @model_validator(mode="after")
    def _sharding_fits(self) -> Config:
        strategy = self.comm.strategy
        if strategy_spec(strategy).gathers_in_forward and self.train.auto_micro_batch:
            raise ValueError(
                f"train.auto_micro_batch needs a step without collectives until its end, but comm.strategy = "
                f"'{strategy}' gathers parameters in every forward; set train.auto_micro_batch = false or use "
                "strategy 'zero1' or 'zero2'"
            )
        return self

    @model_validator(mode="after")
    def _diloco_fits(self) -> Config:
        if strategy_spec(self.comm.strategy).section != "diloco":
            if "diloco" in self.model_fields_set and self.diloco.model_fields_set:
                raise ValueError(f"[diloco] is set but comm.strategy = '{self.comm.strategy}'; set comm.strategy = "
                                 "'diloco' to train with it, or remove [diloco]")
        return self

    @model_validator(mode="after")
    def _sharded_checkpoints_fit(self) -> Config:
        if (self.checkpoint.sharded or self.checkpoint.async_) and not strategy_spec(self.comm.strategy).sharded_checkpoints:
            raise ValueError(f"comm.strategy = '{self.comm.strategy}' writes full checkpoints only; set "
                             "checkpoint.sharded = false and checkpoint.async = false")
        return self

    @model_validator(mode="after")
    def _heal_fits(self) -> Config:
        if not self.dist.heal:
            return self
        strategy, algorithm = self.comm.strategy, self.comm.algorithm
        spec = strategy_spec(strategy)
        if spec.reloads:
            if not (self.checkpoint.sharded or self.checkpoint.async_):
                raise ValueError(
                    f"dist.heal = true with comm.strategy = '{strategy}' reloads the lost worker's shards from the "
                    "newest sharded checkpoint: set checkpoint.sharded = true (or checkpoint.async = true, saved in "
                    "the background), or use strategy 'ddp' or 'manual' (healed without a reload)"
                )
        elif not spec.heals:
            raise ValueError(
                f"dist.heal = true needs every worker to hold the whole model, but comm.strategy = '{strategy}' "
                "holds the only copy of each shard on one worker; use strategy 'ddp' or 'manual', or set "
                "dist.heal = false (a lost worker then restarts the group from the last checkpoint)"
            )
        if algorithm not in HEALABLE_ALGORITHMS:  # powersgd
            raise ValueError(
                f"dist.heal = true does not work with comm.algorithm = '{algorithm}' (it keeps per-worker error "
                f"feedback that a new group cannot rebuild); use {', '.join(repr(a) for a in HEALABLE_ALGORITHMS)}, "
                "or set dist.heal = false"
            )
        if not spec.reloads and (self.checkpoint.sharded or self.checkpoint.async_):
            raise ValueError(
                "dist.heal = true writes full checkpoints (each rank's shard would be bound to a group that healing "
                "replaces); set checkpoint.sharded = false and checkpoint.async = false, or dist.heal = false"
            )
        return self

    @model_validator(mode="after")
    def _parallel_fits(self) -> Config:
        check_strategy_agrees(self.parallel, self.comm.strategy)
        if self.comm.strategy == "fsdp" and self.comm.algorithm == "shm":
            others = {name: getattr(self.parallel, name) for name in ("dp_replicate", "cp", "tp", "pp")
                      if getattr(self.parallel, name) not in (None, 1)}
            if others:
                name, value = next(iter(others.items()))
                raise ValueError(
                    f"comm.algorithm = 'shm' with comm.strategy = 'fsdp' runs FSDP2 over every rank on shared memory, "
                    f"one dimension only, not beside [parallel] {name} = {value}; leave comm.algorithm = 'torch' there "
                    "(tensor parallelism's collectives take parallel.tp_algorithm = 'shm')")
        return self

    @model_validator(mode="after")
    def _workload_fits(self) -> Config:
        check_workload(self)
        return self

    @property
    def user_parts(self) -> bool:
        """The model or the data is the user's (a factory, or ringtrain.fit), not a built-in one."""
        return self.model.factory is not None or self.data.factory is not None

    def to_toml(self) -> str:
        """The resolved config as TOML (unset optional fields, and the built-in name a factory replaces, are
        left out: the file loads back as the same config), credentials redacted (ringtrain/redact.py: a URI's
        ``user:token@``, fields named like tokens or keys): what goes to RUN_DIR/config.toml and checkpoints."""
        values = self.model_dump(exclude_none=True, by_alias=True)  # [checkpoint] async, a keyword in Python
        # A factory replaces the built-in model's or dataset's fields; only those that still apply stay.
        if self.model.factory is not None:
            values["model"] = {k: v for k, v in values["model"].items() if k in ("factory", "args")}
        if self.data.factory is not None:
            values["data"] = {k: v for k, v in values["data"].items() if k in ("factory", "args", "num_workers", "ledger")}
        if not self.user_parts:
            values.pop("task")
        if strategy_spec(self.comm.strategy).section != "diloco":
            values.pop("diloco")  # only a DiLoCo run has a [diloco] to record
        for section in ("model", "data"):
            if not values[section].get("args"):
                values[section].pop("args", None)
        train = values["train"]
        # Only the fields the optimizer in use takes (an optimizer class takes its own in optimizer_args).
        if train["optimizer"] != "sgd":
            train.pop("momentum")
        if train["optimizer"] not in BUILTIN_OPTIMIZERS:
            train.pop("weight_decay")
        else:
            train.pop("optimizer_args")
        if train["lr_schedule"] not in BUILTIN_SCHEDULES:
            train.pop("warmup_steps")
        return tomli_w.dumps(redact(values))

    def digest(self) -> str:
        """sha256 of the resolved config; a checkpoint records it to detect a changed job."""
        values = self.model_dump()
        if strategy_spec(self.comm.strategy).section != "diloco":
            values.pop("diloco")  # unused: a config's digest stays what it was before [diloco] existed
        canonical = json.dumps(values, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()
