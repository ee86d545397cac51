"""``ringtrain.fit``: the whole trainer on a user's own model and data.

    import ringtrain

    summary = ringtrain.fit(
        model=build_model,                 # zero-argument callable -> nn.Module (or a module)
        train_data=train_ds,               # map-style Dataset of (input, target)
        eval_data=val_ds,
        loss="cross_entropy",
        config={"train": {"epochs": 3, "global_batch_size": 64, "local_batch_size": 32, "lr": 1e-3}},
    )

Run it with ``ringtrain run script.py --nproc 2`` (torch's elastic launcher, as ``ringtrain train``),
``torchrun --nproc-per-node 2 script.py``, or ``python script.py`` (one worker). Every rank gets the summary;
the run directory is the one ``ringtrain train`` writes (config.toml, metrics.jsonl, summary.json,
checkpoints/, ledger), plus program.json: the script, its arguments and folder.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from ringtrain.checkpoint.manifest import write_atomic
from ringtrain.config import Config, load_config_dict, validate_for_world_size
from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import init_distributed
from ringtrain.dist.lifetime import exit_with_parent
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.train.guards import Stopped
from ringtrain.train.resume import ResumePlan
from ringtrain.train.run import check_run_dir, run_joined_training, run_training
from ringtrain.train.user_parts import UserParts, describe_callable

__all__ = ["fit"]

PROGRAM_FILE = "program.json"


def fit(
    model: Callable[[], nn.Module] | nn.Module,
    train_data: Dataset,
    eval_data: Dataset | None = None,
    loss: str | Callable[[Any, Any], Any] = "cross_entropy",
    loss_reduction: str = "mean",
    count_items: Callable[[Any], int] | None = None,
    metrics: Mapping[str, Any] | None = None,
    optimizer: Callable[[nn.Module], Any] | None = None,
    collate_fn: Callable | None = None,
    config: Mapping[str, Any] | str | Path | Config | None = None,
) -> dict[str, Any]:
    """Train ``model`` on ``train_data`` with every ringtrain guarantee; return the run's summary (every rank).

    - ``model``: a zero-argument callable returning an ``nn.Module``, called after seeding with
      ``train.seed`` (every rank builds the same weights, as for the built-in models); or a module (then
      rank 0's weights are broadcast).
    - ``train_data`` / ``eval_data``: map-style Datasets whose items are ``(input, target)``; ``input`` a
      tensor, a tuple (``model(*input)``) or a dict of tensors (``model(**input)``). Targets are aligned with
      the outputs (ringtrain never shifts them). Evaluation counts every sample once.
    - ``loss``: ``"cross_entropy"``, ``"mse"`` or ``loss(outputs, targets) -> scalar``; outputs may be a
      tensor or have ``.logits``. ``loss_reduction="mean"``: the loss averages over the micro-batch's samples;
      ``"sum"``: it sums over items, and ``count_items(targets)`` (default: targets not -100) counts them.
    - ``metrics``: ``{name: torchmetrics.Metric}`` computed on ``eval_data``; ``optimizer``:
      ``optimizer(model) -> torch.optim.Optimizer`` (default: ``[train] optimizer``); ``collate_fn`` as
      DataLoader's.
    - ``config``: a dict of sections (``{"train": {...}}``), a TOML path or a ``Config``; under ``ringtrain
      run``, its ``--set`` and ``--run-dir`` override it.

    A bad input (config, part, checkpoint) ends the process with one line, ``ringtrain: error: ...``, and
    exit code 2 (``SystemExit``), as ``ringtrain train`` does.
    """
    env = DistEnv.from_environ()
    exit_with_parent()  # under a launcher: a worker never outlives its agent
    try:
        resolved = _resolve_config(config, env, model, train_data, loss, loss_reduction)
        parts = UserParts.checked(model, train_data, eval_data, loss, loss_reduction, count_items, metrics,
                                  optimizer, collate_fn)
        if env.heal_join:  # `ringtrain join RUN_DIR` of a `ringtrain run --heal` job: admitted, sent the state
            return run_joined_training(resolved, env, user=parts)
        validate_for_world_size(resolved, env.world_size)
        plan = _resume_plan(env)
        if not plan.resume:
            check_run_dir(resolved, resume=False)
        with init_distributed(env, resolved.dist) as ctx:
            if ctx.rank == 0:
                _record_program(resolved)
            return run_training(resolved, ctx, plan, user=parts)
    except RingtrainError as err:
        _exit_with(err, env)
        raise  # unreachable: _exit_with exits


def config_sections(config: Mapping[str, Any] | str | Path | Config | None, caller: str = "fit()") -> tuple[dict, str]:
    """The raw sections of a config given as a dict, a TOML path or a Config, and how to name its source."""
    if isinstance(config, Config):
        raw = config.model_dump(exclude_unset=True)
    elif isinstance(config, (str, Path)):
        import tomllib

        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found; pass a TOML path, a dict of sections or a Config")
        with path.open("rb") as f:
            raw = tomllib.load(f)
    elif config is None or isinstance(config, Mapping):
        raw = json.loads(json.dumps(dict(config or {}), default=str)) if config else {}
    else:
        raise ConfigError(f"config must be a dict of sections, a TOML path or a Config, not {type(config).__name__}")
    return raw, str(config) if isinstance(config, (str, Path)) else f"the config passed to {caller}"


def _resolve_config(config, env: DistEnv, model, train_data, loss, loss_reduction) -> Config:
    raw, source = config_sections(config)
    given = {"model": ("name", "factory"), "data": ("dataset", "factory")}
    for section, keys in given.items():
        for key in keys:
            if key in raw.get(section, {}):
                raise ConfigError(f"fit() gets the {section} from its arguments; remove {section}.{key} from the config")
    if raw.get("task"):
        raise ConfigError("fit() gets the loss and metrics from its arguments; remove [task] from the config")
    # For the record (config.toml): which callables and objects this run trained.
    raw.setdefault("model", {})["factory"] = describe_callable(model)
    raw.setdefault("data", {})["factory"] = describe_callable(train_data)
    raw["task"] = {"loss": loss if isinstance(loss, str) else describe_callable(loss),
                   "loss_reduction": loss_reduction if loss_reduction in ("mean", "sum") else "mean"}
    return load_config_dict(raw, env.overrides, env.run_dir, source=source, name=_script_name())


def _script_name() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path).stem if path else "fit"


def _resume_plan(env: DistEnv) -> ResumePlan:
    """As ``ringtrain.worker``: --resume / --resume-from from ``ringtrain run``; a restarted worker, or one the
    launcher checked the run directory for, continues from the newest checkpoint."""
    if env.resume and env.resume.startswith("from:"):
        return ResumePlan(resume=True, source=Path(env.resume.removeprefix("from:")))
    if env.resume == "resume":
        return ResumePlan(resume=True, required=True)
    if env.is_restart or env.resume == "checked":
        return ResumePlan(resume=True)
    return ResumePlan.fresh()


def _record_program(config: Config) -> None:
    """RUN_DIR/program.json: what was run, from where (restarts and `ringtrain join` start the same)."""
    main = sys.modules.get("__main__")
    record = {
        "script": str(Path(getattr(main, "__file__", "") or "").resolve()) if getattr(main, "__file__", None) else None,
        "args": sys.argv[1:],
        "cwd": os.getcwd(),
        "python": sys.executable,
    }
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(record, indent=2) + "\n").encode()
    write_atomic(run_dir / PROGRAM_FILE, lambda f: f.write(text))


def _exit_with(err: RingtrainError, env: DistEnv) -> None:
    from ringtrain.worker import report_error

    report_error(err, env)
    sys.exit(err.exit_code)
