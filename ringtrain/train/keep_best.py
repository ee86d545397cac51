"""``[train] keep_best`` / ``fit(keep_best="eval.METRIC")``: the model of the best evaluation, kept in the run
directory.

    keeper = BestModel.from_config(config.train, run_dir, rank)
    keeper.check_names(task.eval_metrics(...).keys() | metrics.keys())   # before step 1, where knowable
    keeper.consider(metrics, step, epoch, full_state)                      # after every evaluation, every rank

Each evaluation's metrics are the same on every rank (summed by one all-reduce), so every rank takes the same
decision; the weights are gathered by the strategy (a collective for sharded and split layouts) and rank 0 writes
them as safetensors (plain tensors with the user's module's names, as ``ringtrain export`` does), then
``best.json``. The best value is Stateful (a part of every checkpoint, Lightning's ModelCheckpoint keeps its
``best_model_score`` in its state the same way), so a resumed run judges against the best before the stop.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ringtrain.checkpoint.manifest import write_atomic
from ringtrain.errors import ConfigError

__all__ = ["BestModel", "BEST_DIR", "lower_is_better"]

BEST_DIR = "best"
"""RUN_DIR/best/: model.safetensors and best.json."""

_LOWER_IS_BETTER = ("loss", "error", "perplexity")


def lower_is_better(metric: str) -> bool:
    """'auto' mode: a loss-like metric (its name holds 'loss', 'error' or 'perplexity') is better lower."""
    return any(word in metric.lower() for word in _LOWER_IS_BETTER)


class BestModel:
    """Keeps the best evaluation's weights (nothing when ``metric`` is None: the null keeper)."""

    def __init__(self, metric: str | None, mode: str = "auto", run_dir: str | Path = ".", rank: int = 0):
        self.metric = metric
        """The evaluation metric judged (``keep_best`` without its 'eval.' prefix), or None."""
        self.lower = lower_is_better(metric or "") if mode == "auto" else mode == "min"
        self.directory = Path(run_dir) / BEST_DIR
        self.rank = rank
        self.value: float | None = None
        self.step: int | None = None
        self.epoch: int | None = None

    @classmethod
    def from_config(cls, train_config: Any, run_dir: str | Path, rank: int) -> BestModel:
        keep = train_config.keep_best
        return cls(keep.removeprefix("eval.") if keep else None, train_config.keep_best_mode, run_dir, rank)

    @property
    def enabled(self) -> bool:
        return self.metric is not None

    @property
    def path(self) -> Path:
        return self.directory / "model.safetensors"

    def check_names(self, names: Iterable[str], has_eval_data: bool = True) -> None:
        """Before step 1: ``keep_best`` names a metric the evaluation makes (``names``), and there is one."""
        if not self.enabled:
            return
        if not has_eval_data:
            raise ConfigError(f"train.keep_best = 'eval.{self.metric}' judges evaluations, but this run has no "
                              "evaluation set; pass eval_data (fit) or drop keep_best")
        names = sorted(set(names))
        if self.metric not in names:
            raise ConfigError(f"train.keep_best = 'eval.{self.metric}': the evaluation makes no metric "
                              f"{self.metric!r} (it makes {', '.join(names)}); name one of them, or add it to "
                              "fit(metrics=...)")

    def consider(self, metrics: dict[str, Any], step: int, epoch: int,
                 full_state: Callable[[], dict[str, torch.Tensor]]) -> bool:
        """After an evaluation (every rank: ``full_state`` may gather): keep the model when ``metrics`` beat the
        best so far. Returns whether it was kept."""
        if not self.enabled:
            return False
        if self.metric not in metrics:
            self.check_names(metrics)  # raises: one line naming what the evaluation makes
        value = metrics[self.metric]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"train.keep_best = 'eval.{self.metric}': the metric is {type(value).__name__} "
                              f"({str(value)[:60]}), not a number; name a metric with one value")
        value = float(value)
        if math.isnan(value) or not self._better(value):
            return False
        state = full_state()
        self.value, self.step, self.epoch = value, step, epoch
        if self.rank == 0:
            self._write(state)
        return True

    def _better(self, value: float) -> bool:
        if self.value is None:
            return True
        return value < self.value if self.lower else value > self.value

    def _write(self, state: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save

        # Own, contiguous CPU copies: safetensors refuses tensors that share storage (tied weights).
        tensors = {name: tensor.detach().cpu().clone().contiguous() for name, tensor in state.items()}
        payload = save(tensors, metadata={"format": "pt", "metric": self.metric, "value": repr(self.value),
                                          "step": str(self.step)})
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, lambda f: f.write(payload))
        record = {**self.record(), "sha256": hashlib.sha256(payload).hexdigest()}
        text = (json.dumps(record, indent=2) + "\n").encode()
        write_atomic(self.directory / "best.json", lambda f: f.write(text))

    def record(self) -> dict[str, Any] | None:
        """Where the best model is and what it scored (None before any evaluation, or when nothing is kept)."""
        if not self.enabled or self.value is None:
            return None
        return {"metric": f"eval.{self.metric}", "mode": "min" if self.lower else "max", "value": self.value,
                "step": self.step, "epoch": self.epoch, "path": str(self.path)}

    # --- Stateful: the best so far is part of every checkpoint ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("metric") != self.metric:  # a run resumed with another (or no) keep_best starts afresh
            return
        self.value = None if state.get("value") is None else float(state["value"])
        self.step, self.epoch = state.get("step"), state.get("epoch")
