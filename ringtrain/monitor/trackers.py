"""Experiment trackers: MLflow (a local store) and Weights & Biases (offline), as rank-0 loggers.

``[monitor] trackers = ["tensorboard", "mlflow", "wandb"]`` adds them beside metrics.jsonl; each gets the
config (MLflow: the settings that applied to the run, ``applied_params``; W&B: all of it), every record's numbers as metrics.jsonl has them (``train/loss``, ``eval/accuracy``,
``train/time/comm_s``; the step as the step), and at the end the summary and the step breakdown (mean seconds
per step of each phase, as ``ringtrain report`` splits the step: ``breakdown/forward_backward_s``); MLflow also
the run's config.toml, summary.json and final model (exported as safetensors) as artifacts, kept under
``RUN_DIR/mlflow-artifacts`` with the default store.

Nothing here reaches the network: MLflow writes to ``sqlite:///RUN_DIR/mlflow.db`` unless
``monitor.mlflow_tracking_uri`` names another store (read it with ``mlflow ui --backend-store-uri
sqlite:///RUN_DIR/mlflow.db``), with its telemetry off; W&B runs offline only (``WANDB_MODE=offline``) into
``RUN_DIR/wandb/offline-run-*`` (``wandb sync`` uploads it later, if you wish).

A tracker is optional and never holds the training up: its calls run on a thread of its own behind a bounded
queue; one that cannot start (not installed, a bad URI), fails later, or does not answer (a server that is down:
the closing flush waits 10 s at most) is one warning line, and training goes on without it (``Guarded``).
Credentials (``http://user:token@host``, fields named like tokens, keys, passwords) are redacted from what
the trackers get, as from config.toml and the records (ringtrain/redact.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ringtrain.config import Config
from ringtrain.monitor.loggers import Logger
from ringtrain.redact import redact

__all__ = ["Guarded", "MlflowLogger", "WandbLogger", "build_trackers", "numbers_of", "flat_params", "applied_params",
           "step_breakdown"]

# Set before either package is imported; what they read at import or start.
_OFFLINE_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "WANDB_MODE": "offline",
                "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def numbers_of(record: dict[str, Any]) -> dict[str, float]:
    """A record's numeric fields as ``{type}/{key}`` (as TensorBoard names them); lists, text and flags stay in
    metrics.jsonl."""
    group = record.get("type", "train")
    return {f"{group}/{key}": float(value) for key, value in record.items()
            if key not in ("type", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)}


def flat_params(config: Config) -> dict[str, str]:
    """The resolved config as 'section.field' -> text (MLflow parameters are text)."""
    flat: dict[str, str] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = json.dumps(value) if not isinstance(value, str) else value

    walk(redact(config.model_dump(mode="json", by_alias=True)), "")
    return flat


_MODEL_FIELDS = {"mlp": ("hidden_sizes",), "resnet18": ("small_input_stem",), "resnet34": ("small_input_stem",),
                 "resnet50": ("small_input_stem",), "transformer": ("n_layers", "n_heads", "d_model", "dropout")}
"""The [model] fields each built-in model reads (besides its name)."""
_DATA_FIELDS = {"imagefolder": ("path", "image_size", "crop_scale_min", "hflip", "eval_crop_fraction"),
                "synthetic_images": ("image_size", "crop_scale_min", "hflip", "eval_crop_fraction",
                                     "synthetic_samples", "num_classes"),
                "text": ("path", "seq_len")}
"""The [data] fields only some built-in datasets read."""


def applied_params(config: Config) -> dict[str, str]:
    """``flat_params`` without the settings that did not apply to this run: the built-in model's and dataset's
    fields beside a factory (``fit``'s model and data), another built-in model's or dataset's fields, DiLoCo's
    section under another strategy, PowerSGD's and the chunked ring's knobs under another algorithm, SGD's
    momentum under another optimizer, keep_best_mode without keep_best, the trackers' settings of trackers that
    are off."""
    model, data, comm, train, monitor = config.model, config.data, config.comm, config.train, config.monitor
    skipped = {f"model.{field}" for fields in _MODEL_FIELDS.values() for field in fields}
    if model.factory is None:
        skipped -= {f"model.{field}" for field in _MODEL_FIELDS[model.name]}
    else:
        skipped.add("model.name")
    shown_data = () if data.factory is not None else _DATA_FIELDS.get(data.dataset, ())
    skipped |= {f"data.{field}" for fields in _DATA_FIELDS.values() for field in fields if field not in shown_data}
    if data.factory is not None:
        skipped.add("data.dataset")
    if comm.algorithm != "powersgd":
        skipped |= {"comm.powersgd_rank", "comm.powersgd_start_iter"}
    if comm.algorithm != "ring_chunked":
        skipped.add("comm.chunk_kb")
    if train.optimizer != "sgd":
        skipped.add("train.momentum")
    if train.keep_best is None:
        skipped.add("train.keep_best_mode")
    if "mlflow" not in monitor.trackers:
        skipped |= {"monitor.mlflow_tracking_uri", "monitor.mlflow_experiment"}
    if "wandb" not in monitor.trackers:
        skipped.add("monitor.wandb_project")
    return {key: value for key, value in flat_params(config).items()
            if key not in skipped and not (key.startswith("diloco.") and comm.strategy != "diloco")}


def step_breakdown(run_dir: Path) -> dict[str, float]:
    """Mean seconds per step of each phase over the run's steady steps, and the mean step: the split
    ``ringtrain report`` prints (``breakdown/<phase>_s``, ``breakdown/step_s``)."""
    from ringtrain.monitor.report import load_run

    run = load_run(run_dir)
    breakdown = {f"breakdown/{phase}_s": seconds for phase, seconds in run.phase_means().items()}
    breakdown["breakdown/step_s"] = run.mean("step_time_s")
    return breakdown


def _flat_summary(summary: dict[str, Any], prefix: str = "summary/") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            flat.update(_flat_summary(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = float(value)
    return flat


class Guarded(Logger):
    """A tracker that can neither block nor fail the training: its calls go through a bounded queue to one
    daemon thread of its own, so a call here returns at once whatever the tracker does (a server that does not
    answer, MLflow's HTTP retries). When the queue is full the call is dropped and counted. The first call that
    raises is one warning line, and the tracker is dropped; the closing flush (``finish`` / ``close``) waits
    while the tracker makes progress, and gives up (one warning line, the run ends without it) once no call has
    completed for ``stall_s``, or after ``flush_limit_s`` in all. Progress, not a clock: a healthy tracker on a
    busy machine can take tens of seconds for one call (MLflow creating its database: over 10 s at load 10),
    while one whose server does not answer completes nothing. What a tracker gets is redacted first
    (ringtrain/redact.py). One warning line per tracker at most."""

    def __init__(self, name: str, tracker: Logger, queue_size: int = 10_000, stall_s: float = 60.0,
                 flush_limit_s: float = 300.0):
        self.name, self.tracker = name, tracker
        self.stall_s, self.flush_limit_s = stall_s, flush_limit_s
        self._completed = 0
        """Calls the tracker's thread finished (made or failed): the flush's measure of progress."""
        self.dropped = 0
        """Calls not made because the queue was full (the tracker lagging behind)."""
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._doing: str | None = None
        """The call the thread is in (for the warning when the flush times out)."""
        self._closed = False
        self._warned = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"ringtrain-tracker-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._closed:  # the flush could not queue its last items: end once the rest is done
                    return
                continue
            if item is _STOP:
                return
            method, args = item
            if self.tracker is None:
                continue  # dropped: the rest of its calls are skipped
            self._doing = method
            try:
                getattr(self.tracker, method)(*args)
            except Exception as err:  # an optional sink's failure never ends the training
                self.tracker = None
                first = (str(err).strip().splitlines() or [""])[0][:300]
                self._warn(f"tracker {self.name!r} failed and is off for this run ({type(err).__name__}: {first}); "
                           "training goes on")
            self._doing = None
            self._completed += 1

    def _warn(self, line: str) -> None:
        if self._warned.acquire(blocking=False):  # one line per tracker, whoever comes first
            print(f"ringtrain: warning: {redact(line)}", file=sys.stderr, flush=True)

    def _call(self, method: str, *args) -> None:
        if self._closed or self.tracker is None:
            return
        try:
            self._queue.put_nowait((method, redact(args)))  # redact: a copy, and no credential leaves
        except queue.Full:
            self.dropped += 1

    def _flush(self, last: tuple[str, tuple] | None) -> None:
        """The closing flush: ``last`` (the finish) and the tracker's close, waited for while the tracker makes
        progress (see the class)."""
        if self._closed:
            return
        self._closed = True
        started = time.monotonic()
        progress, progress_at = self._completed, started
        pending = [item for item in (last, ("close", ()), _STOP) if item is not None]
        while self._thread.is_alive():
            now = time.monotonic()
            if self._completed != progress:
                progress, progress_at = self._completed, now
            if now - progress_at > self.stall_s or now - started > self.flush_limit_s:
                break
            while pending:  # the last items, as the queue has room
                try:
                    self._queue.put_nowait(pending[0])
                except queue.Full:
                    break
                pending.pop(0)
            self._thread.join(0.1)
        dropped = f"; {self.dropped} of its calls were dropped (its queue was full)" if self.dropped else ""
        if self._thread.is_alive():
            self.tracker = None
            doing = f"still in its {self._doing}" if self._doing else "still busy"
            why = (f"no call of it completed for {self.stall_s:g} s" if time.monotonic() - progress_at > self.stall_s
                   else f"it was not done {self.flush_limit_s:g} s after the run")
            self._warn(f"tracker {self.name!r} is left behind: {why} ({doing}; a server that does not answer?)"
                       f"{dropped}; the run's own records are complete")
        elif self.dropped:
            self._warn(f"tracker {self.name!r} fell behind{dropped}; the run's own records are complete")

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        self._call("start", total_steps, start_step, steps_per_epoch)

    def log(self, record: dict[str, Any]) -> None:
        self._call("log", record)

    def finish(self, summary: dict[str, Any]) -> None:
        self._flush(("finish", (redact(summary),)) if self.tracker is not None else None)

    def close(self) -> None:
        self._flush(None)


_STOP = object()
"""The last item of a tracker's queue: its thread ends."""


class MlflowLogger(Logger):
    """One MLflow run per run directory (a resumed run continues it: its id is kept in
    RUN_DIR/trackers/mlflow_run_id), in the experiment ``monitor.mlflow_experiment``."""

    def __init__(self, run_dir: str | Path, config: Config):
        self.run_dir = Path(run_dir).resolve()
        self.config = config
        monitor = config.monitor
        self.uri = monitor.mlflow_tracking_uri or f"sqlite:///{self.run_dir / 'mlflow.db'}"
        self.experiment = monitor.mlflow_experiment
        self.client = None
        self.run_id: str | None = None

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        os.environ.update(_OFFLINE_ENV)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # After the import (mlflow sets its own logger to INFO there): its table set-up lines ("Creating initial
        # MLflow database tables", alembic's "Context impl SQLiteImpl") and run links stay off the console.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        id_file = self.run_dir / "trackers" / "mlflow_run_id"
        if id_file.is_file():  # --resume, or a restart: the same run goes on
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(self.experiment)
        # Artifacts of a new experiment in the run directory (MLflow's default root is ./mlruns, wherever the job
        # was started); an existing experiment (a tracking server's) keeps its own.
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            self.experiment, artifact_location=(self.run_dir / "mlflow-artifacts").as_uri())
        run = self.client.create_run(experiment_id, run_name=self.run_dir.name,
                                     tags={"ringtrain.run_dir": str(self.run_dir)})
        self.run_id = run.info.run_id
        id_file.parent.mkdir(exist_ok=True)
        id_file.write_text(self.run_id + "\n")
        params = [Param(key, value[:6000]) for key, value in applied_params(self.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log(self, record: dict[str, Any]) -> None:
        if "step" in record:
            self._metrics(numbers_of(record), int(record["step"]))

    def finish(self, summary: dict[str, Any]) -> None:
        step = int(summary.get("steps", 0))
        self._metrics({**_flat_summary(summary), **step_breakdown(self.run_dir)}, step)
        # The rest of the summary (the digests) as tags, to compare runs by.
        for key, value in summary.items():
            if not isinstance(value, (int, float, dict)) or isinstance(value, bool):
                self.client.set_tag(self.run_id, f"summary/{key}", json.dumps(value)[:5000])
        self._artifacts()
        self.client.set_terminated(self.run_id, status="FINISHED")
        self.run_id = None

    def _artifacts(self) -> None:
        """The run's config.toml and summary.json, the final model exported as safetensors (``ringtrain export``
        of the last checkpoint: ``model/model.safetensors``) and ``[train] keep_best``'s best model (``best/``)."""
        import tempfile

        from ringtrain.checkpoint.export import export_model
        from ringtrain.checkpoint.manager import CheckpointManager

        for name in ("config.toml", "summary.json"):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        with tempfile.TemporaryDirectory(prefix="ringtrain-mlflow-") as folder:
            out = Path(folder) / "model.safetensors"
            checkpoints = CheckpointManager(self.run_dir / self.config.checkpoint.dir, is_writer=False)
            export_model(checkpoints, out, warn=lambda message: None)
            self.client.log_artifact(self.run_id, str(out), "model")
        if (self.run_dir / "best").is_dir():
            self.client.log_artifacts(self.run_id, str(self.run_dir / "best"), "best")

    def close(self) -> None:
        if self.run_id is not None:  # stopped or failed before the end
            self.client.set_terminated(self.run_id, status="KILLED")
            self.run_id = None


class WandbLogger(Logger):
    """A W&B run in offline mode, written under RUN_DIR/wandb (a resumed run continues the same run id)."""

    def __init__(self, run_dir: str | Path, config: Config):
        self.run_dir = Path(run_dir).resolve()
        self.config = config
        self.run = None

    def start(self, total_steps: int, start_step: int, steps_per_epoch: int) -> None:
        os.environ.update(_OFFLINE_ENV)
        import wandb

        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha256(str(self.run_dir).encode()).hexdigest()[:16]
        config = redact(self.config.model_dump(mode="json", by_alias=True))
        self.run = wandb.init(project=self.config.monitor.wandb_project, dir=str(self.run_dir), id=run_id,
                              name=self.run_dir.name, config=config, mode="offline", resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        if "step" in record:
            self.run.log(numbers_of(record), step=int(record["step"]))

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({**summary, **step_breakdown(self.run_dir)})
        self.run.finish()
        self.run = None

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None


def build_trackers(config: Config, run_dir: str | Path) -> list[Logger]:
    """The trackers ``[monitor] trackers`` names (TensorBoard too: ``tensorboard = true`` is the same as
    ``trackers = ["tensorboard"]``); MLflow and W&B each guarded (one warning line if it fails)."""
    from ringtrain.monitor.sinks import TensorBoardLogger

    monitor = config.monitor
    trackers: list[Logger] = []
    if monitor.tensorboard or "tensorboard" in monitor.trackers:
        trackers.append(TensorBoardLogger(Path(run_dir) / "tensorboard"))
    if "mlflow" in monitor.trackers:
        trackers.append(Guarded("mlflow", MlflowLogger(run_dir, config)))
    if "wandb" in monitor.trackers:
        trackers.append(Guarded("wandb", WandbLogger(run_dir, config)))
    return trackers
