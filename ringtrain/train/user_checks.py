"""Checks of a user's parts that need the process group or the built model, made before step 1 on every rank.

``UserParts.checked`` looks at each part alone; these look at the parts together, once the trainer is built:

- the ranks' datasets have the same lengths (one all-gather): the epoch's order is dealt from the length, so
  ranks with 256 and 257 samples would deal different steps and hang, or train on different orders;
- a dict input's keys are parameters of the model's ``forward`` (``model(**inputs)``);
- one eval batch (the first samples of ``eval_data``, else of ``train_data``) goes through the model, the loss
  and every metric: a metric that does not fit the outputs fails now, in one line, not after an epoch.

Each problem is one line naming it and the fix (``ConfigError``, exit code 2). An exception raised by the
user's own forward or loss is not turned into a line: it keeps its traceback (RUN_DIR/logs/rank-R.traceback).

    check_lengths(parts)                 # after init_distributed, before anything is built
    check_one_batch(trainer, parts)      # after build_trainer, before training
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from ringtrain.comm.objects import all_gather_json
from ringtrain.data.batch import call_model, describe, to_device
from ringtrain.errors import ConfigError
from ringtrain.train.user_parts import UserParts

__all__ = ["check_lengths", "check_input_keys", "check_one_batch"]


def check_lengths(parts: UserParts) -> None:
    """Every rank's train_data and eval_data have the same lengths (one all-gather of two numbers)."""
    mine = [len(parts.train_data), None if parts.eval_data is None else len(parts.eval_data)]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    every = all_gather_json(mine)
    for index, name in enumerate(("train_data", "eval_data")):
        lengths = [row[index] for row in every]
        if len(set(lengths)) > 1:
            shown = ", ".join(f"{'no ' + name if n is None else n} on rank {rank}" for rank, n in enumerate(lengths))
            raise ConfigError(f"{name} differs between ranks: {shown}; every rank must load the same dataset (the "
                              "epoch's order is dealt from its length), e.g. no per-rank split or random subset")


def check_input_keys(module: torch.nn.Module, inputs: Any, name: str = "train_data") -> None:
    """A dict input's keys are parameters of ``module.forward`` (or it takes ``**kwargs``), and its required
    parameters are among the keys; a tuple fits its positional parameters."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return  # no signature to check (a builtin): the forward says
    where = f"{type(module).__name__}.forward{signature}"
    if isinstance(inputs, Mapping):
        params = signature.parameters.values()
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [str(key) for key in inputs if str(key) not in named and not takes_any]
        missing = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.name not in inputs]
        if unknown or missing:
            problem = (f"key {unknown[0]!r} is not a parameter of {where}" if unknown
                       else f"{where} needs {missing[0]!r}, which is not a key")
            raise ConfigError(f"{name}'s inputs are {describe(inputs)}, called as model(**inputs), but {problem}; name "
                              "the dict's keys after forward's parameters")
    elif isinstance(inputs, tuple):
        try:
            signature.bind(*inputs)
        except TypeError as err:
            raise ConfigError(f"{name}'s inputs are a tuple of {len(inputs)}, called as model(*inputs), but {where} "
                              f"does not take them ({err}); match forward's parameters, or make the input one "
                              "tensor (a list is not unpacked)") from None


def check_one_batch(trainer, parts: UserParts, batch_size: int) -> None:
    """One eval batch through the model (eval mode, no gradient), the loss and every metric, before step 1.
    Every rank runs the same batch (a forward of zero3 or fsdp gathers parameters: a collective; a pipeline's
    passes activations from stage to stage)."""
    data, name = (parts.eval_data, "eval_data") if parts.eval_data is not None else (parts.train_data, "train_data")
    items = [data[i] for i in range(min(len(data), batch_size))]
    inputs, targets = (parts.collate_fn or default_collate)(items)
    module, device, task = trainer.module, trainer.ctx.device, parts.task
    check_input_keys(module, parts.train_data[0][0], "train_data")
    check_input_keys(module, inputs, name)
    was_training = module.training
    module.eval()
    try:
        strategy = trainer.parts.strategy
        with torch.no_grad(), strategy.loss_context(), trainer.precision.autocast():
            if strategy.pipelined:  # through the stages; the outputs on the last one's rank
                outputs = strategy.forward(to_device(inputs, device))
                if outputs is None:
                    return
            else:
                outputs = call_model(module, to_device(inputs, device))
            targets = targets.to(device) if isinstance(targets, torch.Tensor) else targets
            task.eval_sums(outputs, targets)  # the loss (and the built-in accuracy) on these outputs
            for metric_name, metric in trainer.parts.metrics.items():
                _check_metric(metric_name, metric, task, outputs, targets, name)
    finally:
        module.train(was_training)


def _check_metric(name: str, metric: Any, task, outputs: Any, targets: Any, data_name: str) -> None:
    predictions, expected = None, None
    try:
        predictions, expected = task.metric_inputs(outputs, targets, name)
        metric.update(predictions, expected)
    except Exception as err:  # torchmetrics raises ValueError / RuntimeError on inputs that do not fit
        given = "its inputs callable" if name in task.metric_transforms else "ringtrain"
        shown = (f"predictions {describe(predictions)} and targets {describe(expected)}" if predictions is not None
                 else f"the outputs {describe(outputs)}")
        raise ConfigError(
            f"metrics[{name!r}] ({type(metric).__name__}) does not fit one batch of {data_name}: given {shown} by "
            f"{given}, it raised {type(err).__name__}: {_first_line(err)}; pass metrics={{{name!r}: (metric, "
            "lambda outputs, targets: (predictions, targets))} to give it what it needs"
        ) from None
    finally:
        metric.reset()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"
