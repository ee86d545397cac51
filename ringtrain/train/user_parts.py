"""What a run trains: a model factory, data, loss, metrics, optimizer; checked, then handed to the builders.

Every door leads here: ``ringtrain.fit(model=..., train_data=...)`` hands the objects themselves, a config
with ``[model] factory`` / ``[data] factory`` names callables that ``from_config`` imports, and a config
naming a built-in workload (``[model] name``, ``[data] dataset``) gets ringtrain's own factories the same
way (``builtin``): the trainer is built one way whatever the door. Every check gives one line naming the
part and the fix (exit code 2), before any step runs.

    parts = UserParts.checked(model=build_model, train_data=train, eval_data=val, loss="cross_entropy")
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ringtrain.config import Config
from ringtrain.config.schema import BUILTIN_LOSSES
from ringtrain.data.batch import describe
from ringtrain.data.split import DatasetSplit
from ringtrain.errors import ConfigError
from ringtrain.train.tasks import Task, build_task, builtin_task

__all__ = ["UserParts", "import_callable", "check_factories", "describe_callable"]


@dataclass
class UserParts:
    """What the user brings; everything else is built by ringtrain from the config."""

    model: Callable[[], nn.Module] | nn.Module
    train_data: Dataset
    eval_data: Dataset | None
    task: Task
    metrics: dict[str, Any] = field(default_factory=dict)
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    collate_fn: Callable | None = None
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    split: DatasetSplit | None = None
    """A built-in workload's data, with its facts (classes, input shape, the corpus's statistics)."""
    tp_plan: dict[str, Any] | None = None
    """How the model splits over tensor-parallel ranks (``fit(tp_plan=...)``); None: the model's own."""
    pp_split: Callable[[nn.Module, int], list[nn.Module]] | None = None
    """How the model is cut into pipeline stages (``fit(pp_split=...)``); None: the built-in transformer's cut,
    or an nn.Sequential's children in order."""

    @classmethod
    def builtin(cls, config: Config) -> UserParts:
        """The built-in workload ``config`` names: its datasets, its model (built from the data's classes and
        input shape) and cross-entropy (per sample, or per token for text)."""
        # Imported here: the launcher imports this module to check a config's factories, and needs neither.
        from ringtrain.data import build_datasets
        from ringtrain.models import build_model

        data = build_datasets(config.data)
        return cls(lambda: build_model(config.model, data), data.train, data.test, builtin_task(config.data.dataset),
                   collate_fn=data.collate_fn, split=data)

    @classmethod
    def checked(cls, model, train_data, eval_data=None, loss="cross_entropy", loss_reduction="mean",
                count_items=None, metrics=None, optimizer=None, collate_fn=None, lr_scheduler=None,
                tp_plan=None, pp_split=None) -> UserParts:
        """Check each part; raise ConfigError naming the first that does not fit."""
        if not isinstance(model, nn.Module) and not callable(model):
            raise ConfigError(f"model must be an nn.Module or a zero-argument callable returning one, not "
                              f"{type(model).__name__}")
        example = _check_dataset("train_data", train_data)
        if eval_data is not None:
            _check_dataset("eval_data", eval_data)
        if metrics is not None and not isinstance(metrics, Mapping):
            raise ConfigError(f"metrics must be a dict {{name: torchmetrics.Metric}}, not {type(metrics).__name__}")
        metrics, metric_inputs = _split_metrics(metrics or {})
        if optimizer is not None and not callable(optimizer):
            raise ConfigError("optimizer must be a callable taking the model and returning a torch.optim.Optimizer")
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise ConfigError("lr_scheduler must be a callable taking the optimizer and returning a torch LRScheduler, "
                              "e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100)")
        if collate_fn is not None and not callable(collate_fn):
            raise ConfigError("collate_fn must be a callable, as DataLoader's")
        task = build_task(loss, loss_reduction, count_items, example_target=example[1], metric_inputs=metric_inputs)
        taken = {"loss", "count", "accuracy", "top5_accuracy", "ppl"} & set(metrics)
        if taken:
            raise ConfigError(f"metrics[{sorted(taken)[0]!r}] would replace ringtrain's own evaluation result of that "
                              "name; give the metric another name")
        if tp_plan is not None:
            from ringtrain.parallel.tensor import user_plan

            tp_plan = user_plan(tp_plan)
        if pp_split is not None and not callable(pp_split):
            raise ConfigError(f"pp_split must be a callable split(model, stages) returning the stage modules in order, "
                              f"not {type(pp_split).__name__}")
        return cls(model, train_data, eval_data, task, metrics, optimizer, collate_fn, lr_scheduler, tp_plan=tp_plan,
                   pp_split=pp_split)

    @classmethod
    def from_config(cls, config: Config) -> UserParts:
        """Import and call the config's factories ([model] factory, [data] factory, [task]), or build the
        built-in workload it names."""
        if not config.user_parts:
            return cls.builtin(config)
        model_factory = import_callable("model.factory", config.model.factory)
        model_args = dict(config.model.args)
        made = _call("data.factory", import_callable("data.factory", config.data.factory), config.data.args)
        if not isinstance(made, tuple) or len(made) not in (2, 3):
            raise ConfigError(f"data.factory {config.data.factory} returned {describe(made)}; it must return "
                              "(train, eval) or (train, eval, collate_fn), eval may be None")
        train, evaluation, collate = (*made, None)[:3]
        task = config.task
        loss = task.loss if task.loss in BUILTIN_LOSSES else import_callable("task.loss", task.loss)
        count = import_callable("task.count_items", task.count_items) if task.count_items else None
        metrics = None
        if task.metrics:
            metrics = _call("task.metrics", import_callable("task.metrics", task.metrics), {})
            if not isinstance(metrics, Mapping):
                raise ConfigError(f"task.metrics {task.metrics} returned {describe(metrics)}; it must return "
                                  "{name: torchmetrics.Metric}")
        return cls.checked(lambda: _call("model.factory", model_factory, model_args), train, evaluation,
                           loss, task.loss_reduction, count, metrics, None, collate)

    def build_model(self, seed: int) -> nn.Module:
        """The model, built after seeding (every rank builds the same weights), or the module as given."""
        if isinstance(self.model, nn.Module):
            return self.model
        torch.manual_seed(seed)
        model = self.model()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"the model factory returned {describe(model)}, not an nn.Module")
        return model

    def data_split(self) -> DatasetSplit:
        if self.split is not None:
            return self.split
        return DatasetSplit(train=self.train_data, test=self.eval_data, num_classes=0, input_shape=(),
                            collate_fn=self.collate_fn)


def import_callable(field_name: str, path: str | None) -> Callable:
    """``'package.module:function'`` -> the callable, imported from the current directory and PYTHONPATH."""
    if path is None:
        raise ConfigError(f"{field_name} is not set")
    module_name, _, attribute = path.partition(":")
    # `ringtrain train my.toml` run from the user's project imports their modules from there.
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # an ImportError, or anything the module raised while importing
        raise ConfigError(f"{field_name} = '{path}': cannot import {module_name} ({type(err).__name__}: "
                          f"{_first_line(err)}); run from your project's folder or add it to PYTHONPATH") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{field_name} = '{path}': {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{field_name} = '{path}' is a {type(target).__name__}, not a callable")
    return target


def check_factories(config: Config) -> None:
    """What the launcher can know before any worker starts: every named callable imports and is callable."""
    for field_name, path in (("model.factory", config.model.factory), ("data.factory", config.data.factory),
                             ("task.count_items", config.task.count_items), ("task.metrics", config.task.metrics)):
        if path is not None:
            import_callable(field_name, path)
    if config.task.loss not in BUILTIN_LOSSES:
        import_callable("task.loss", config.task.loss)
    if config.model.factory is None or config.data.factory is None:
        missing = "model.factory" if config.model.factory is None else "data.factory"
        raise ConfigError(f"{missing} is not set; a config with your own model or data names both "
                          "([model] factory and [data] factory)")


def describe_callable(value: Any) -> str:
    """'module:qualname' of a callable (or of an object's class), for the record in config.toml."""
    target = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    name = getattr(target, "__qualname__", type(value).__name__).replace("<", "").replace(">", "")
    name = ".".join(part for part in name.split(".") if part.isidentifier()) or "model"
    module = getattr(target, "__module__", None) or "__main__"
    return f"{module}:{name}"


def _split_metrics(metrics: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Callable]]:
    """``{name: metric | (metric, inputs)}`` -> the metrics, and each one's ``inputs(outputs, targets) ->
    (predictions, targets)`` where given (the default hands a metric the logits and the targets)."""
    found, inputs = {}, {}
    for name, value in metrics.items():
        metric, transform = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
        if not (callable(getattr(metric, "update", None)) and callable(getattr(metric, "compute", None))):
            raise ConfigError(f"metrics[{name!r}] is a {type(metric).__name__}, not a torchmetrics Metric "
                              "(it needs update() and compute()), nor a pair (metric, inputs)")
        if transform is not None and not callable(transform):
            raise ConfigError(f"metrics[{name!r}] = (metric, {type(transform).__name__}): the second item must be a "
                              "callable inputs(outputs, targets) -> (predictions, targets)")
        found[name] = metric
        if transform is not None:
            inputs[name] = transform
    return found, inputs


def _check_dataset(name: str, dataset: Any) -> tuple:
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(f"{name} is a {type(dataset).__name__}; ringtrain needs a map-style Dataset (__len__ and "
                          "__getitem__) to deal exactly-once shares and resume mid-epoch; wrap an IterableDataset's "
                          "items in a list or a map-style Dataset")
    if len(dataset) == 0:
        raise ConfigError(f"{name} is empty")
    item = dataset[0]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ConfigError(f"{name}[0] is {describe(item)}; each item must be an (input, target) pair, input a "
                          "tensor, a tuple or a dict of tensors")
    return tuple(item)


def _call(field_name: str, fn: Callable, kwargs: Mapping[str, Any]) -> Any:
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{field_name} cannot be called with {sorted(kwargs) or 'no arguments'} ({err}); "
                          f"match its parameters in [{field_name.split('.')[0]}.args]") from None
    except ValueError:
        pass  # no signature to check (a builtin): let the call say
    return fn(**kwargs)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
