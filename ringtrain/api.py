"""``ringtrain.fit``: the whole trainer on a user's own model and data.

    import ringtrain

    result = ringtrain.fit(
        model=build_model,                 # zero-argument callable -> nn.Module (or a module)
        train_data=train_ds,               # map-style Dataset of (input, target)
        eval_data=val_ds,
        loss="cross_entropy",
        config={"train": {"epochs": 3, "global_batch_size": 64, "local_batch_size": 32, "lr": 1e-3}},
    )
    result["eval"], result.model          # the summary (a dict), and the trained module

Run it with ``ringtrain run script.py --nproc 2`` (torch's elastic launcher, as ``ringtrain train``),
``torchrun --nproc-per-node 2 script.py``, or ``python script.py`` (one worker). Every rank gets the result;
the run directory is the one ``ringtrain train`` writes (config.toml, metrics.jsonl, summary.json,
checkpoints/, ledger), plus program.json: the script, its arguments and folder. A script may call fit() more
than once (pretrain, then fine-tune): each call meets on the same store under its own prefix, keeps its own
records in the job store and writes its own run directory.
"""

from __future__ import annotations

import dataclasses
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
from ringtrain.config.parallel import resolve_layout
from ringtrain.group.env import DistEnv
from ringtrain.group.init import init_distributed
from ringtrain.group.lifetime import exit_with_parent
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.train.run import FIT_WORDS, RUN_WORDS, FitResult, plan_resume, run_joined_training, run_training
from ringtrain.train.user_parts import UserParts, describe_callable

__all__ = ["fit", "FitResult"]

PROGRAM_FILE = "program.json"

_run_dirs: list[str] = []
"""The run directory of each fit() call this process made, in order (a later call never reuses one)."""


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
    lr_scheduler: Callable[[Any], Any] | None = None,
    run_dir: str | Path | None = None,
    resume: bool | str | Path = False,
    tp_plan: Mapping[str, Any] | None = None,
    pp_split: Callable[[nn.Module, int], list[nn.Module]] | None = None,
    keep_best: str | None = None,
) -> FitResult:
    """Train ``model`` on ``train_data`` with every ringtrain guarantee; return the run's summary with the
    trained model (``FitResult``: the summary dict, ``.model``, and ``.rank`` / ``.is_main``: this worker's
    rank, and whether it is rank 0), on every rank.

    - ``model``: a zero-argument callable returning an ``nn.Module``, called after seeding with
      ``train.seed`` (every rank builds the same weights, as for the built-in models); or a module (then
      rank 0's weights are broadcast, and the module is trained in place).
    - ``train_data`` / ``eval_data``: map-style Datasets whose items are ``(input, target)``; ``input`` a
      tensor, a tuple (``model(*input)``) or a dict of tensors (``model(**input)``). Targets are aligned with
      the outputs (ringtrain never shifts them). Evaluation counts every sample once.
    - ``loss``: ``"cross_entropy"``, ``"mse"`` or ``loss(outputs, targets) -> scalar``; outputs may be a
      tensor or have ``.logits``. ``loss_reduction="mean"``: the loss averages over the micro-batch's samples;
      ``"sum"``: it sums over items, and ``count_items(targets)`` (default: targets not -100) counts them.
    - ``metrics``: ``{name: torchmetrics.Metric}`` computed on ``eval_data``, each given the logits and the
      targets, or ``{name: (metric, inputs)}`` with ``inputs(outputs, targets) -> (predictions, targets)``.
    - ``optimizer``: ``optimizer(model) -> torch.optim.Optimizer`` (default: ``[train] optimizer``);
      ``lr_scheduler``: ``lr_scheduler(optimizer) -> LRScheduler``, stepped once per optimizer step (default:
      ringtrain's linear warm-up over ``train.warmup_steps``, then ``train.lr_schedule``: cosine decay to 0 at
      the last step, or constant, of the optimizer's own lr); ``collate_fn`` as DataLoader's.
    - ``config``: a dict of sections (``{"train": {...}}``), a TOML path or a ``Config``; under ``ringtrain
      run``, its ``--set`` and ``--run-dir`` override it. ``{"train": {"activation_checkpointing": "full"}}``
      checkpoints the entries of the model's first ``nn.ModuleList`` (else its direct ``nn.Sequential``
      children) one by one.
    - ``run_dir``: where the run writes (default: the config's, else ``runs/<script name>``); the variable
      ``RINGTRAIN_RUN_DIR`` (``ringtrain run --run-dir``) overrides it.
    - ``resume``: ``True`` continues the run directory's newest valid checkpoint (``--resume``), a checkpoint
      path starts this run from it (``--resume-from``); the variable ``RINGTRAIN_RESUME`` (``resume`` or
      ``from:PATH``) asks the same. A run that finished already is left as it is: its summary is returned.
    - ``tp_plan``: with ``{"parallel": {"tp": N}}``, how the model splits over N ranks: module paths (``*`` for
      any one name) to ``"colwise"`` (an ``nn.Linear`` split by output features), ``"rowwise"`` (by input
      features, its output all-reduced) or a torch ``ParallelStyle``, as ``parallelize_module`` takes them.
      Default: the model's own plan (ringtrain's transformer; a Hugging Face model whose config declares
      ``base_model_tp_plan``, such as Llama).
    - ``pp_split``: with ``{"parallel": {"pp": N}}``, how a model that is not an ``nn.Sequential`` is cut into
      stages: ``pp_split(model, stages) -> [stage_0, ...]``, ``stages`` modules built from the model's own
      submodules (not copies), each taking the previous stage's output (the first: the batch's input tensor)
      and returning one tensor (the last: the outputs the loss takes). Every parameter and buffer of the model
      belongs to one stage; ringtrain names them as the model does, so checkpoints load into any layout.
      ``ringtrain.hf.decoder_stages`` is one for Hugging Face decoder models (Llama, Mistral, Qwen2, ...).
    - ``keep_best``: ``"eval.METRIC"`` (``"eval.accuracy"``, ``"eval.loss"`` or one of ``metrics``) keeps the
      model of the best evaluation in ``RUN_DIR/best/model.safetensors`` (``[train] keep_best``; lower is better
      for a loss-like name, higher otherwise, or as ``[train] keep_best_mode`` says); ``result.best`` says where
      it is, its value, step and epoch. The best value is in every checkpoint: a resumed run keeps it.

    A bad input (config, part, checkpoint) ends the process with one line, ``ringtrain: error: ...``, and
    exit code 2 (``SystemExit``), as ``ringtrain train`` does; an exception of the user's own code ends it
    with one line too, its traceback kept in ``RUN_DIR/logs/rank-R.traceback`` (a lone ``python script.py``
    also shows it).
    """
    env = DistEnv.from_environ()
    exit_with_parent()  # under a launcher: a worker never outlives its agent
    _run_dirs.append("")  # this call's place; its run directory once resolved
    call = len(_run_dirs)
    if call > 1:  # the job store keeps each call's progress apart: fit() again is not a restart of the first
        env = dataclasses.replace(env, run_id=f"{env.run_id or 'job'}/fit-{call}")
    words = RUN_WORDS if env.launched_by_ringtrain else FIT_WORDS
    resolved: Config | None = None
    try:
        if call > 1 and env.heal_min_workers is not None:
            # A --heal job ends when its members mark it done; a second fit() would be cut off by its launcher.
            raise ConfigError("a `ringtrain run --heal` script calls fit() once (this is call 2); run the second "
                              "training as a job of its own, or drop --heal")
        resolved = _resolve_config(config, env, model, train_data, loss, loss_reduction, run_dir, call, keep_best)
        parts = UserParts.checked(model, train_data, eval_data, loss, loss_reduction, count_items, metrics,
                                  optimizer, collate_fn, lr_scheduler, tp_plan, pp_split)
        if env.heal_join:  # `ringtrain join RUN_DIR` of a `ringtrain run --heal` job: admitted, sent the state
            return run_joined_training(resolved, env, user=parts)
        validate_for_world_size(resolved, env.world_size)
        if tp_plan is not None and resolve_layout(resolved.parallel, resolved.comm.strategy, env.world_size).tp == 1:
            raise ConfigError("fit(tp_plan=...) splits the model over tensor-parallel ranks, but parallel.tp is 1 "
                              "here; pass config={'parallel': {'tp': 2}} (or more), or leave tp_plan out")
        if pp_split is not None and resolve_layout(resolved.parallel, resolved.comm.strategy, env.world_size).pp == 1:
            raise ConfigError("fit(pp_split=...) cuts the model into pipeline stages, but parallel.pp is 1 here; pass "
                              "config={'parallel': {'pp': 2}} (or more), or leave pp_split out")
        plan = plan_resume(env, resume, resolved, words)
        with init_distributed(env, resolved.dist) as ctx:
            on_start = (lambda: _record_program(resolved)) if ctx.rank == 0 else None
            return run_training(resolved, ctx, plan, user=parts, on_start=on_start, keep_model=True)
    except RingtrainError as err:
        _exit_with(err, env)
        raise  # unreachable: _exit_with exits
    except Exception as err:  # the user's own code (or a bug): one line, the traceback in the run directory
        from ringtrain.worker import report_exception

        report_exception(err, env, resolved.run_dir if resolved is not None else None)
        raise  # unreachable under a launcher: report_exception exits (a lone process re-raises there)


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


def _resolve_config(config, env: DistEnv, model, train_data, loss, loss_reduction, run_dir, call: int,
                    keep_best: str | None = None) -> Config:
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
    if run_dir is not None:
        raw["run_dir"] = str(run_dir)
    if keep_best is not None:
        raw.setdefault("train", {})["keep_best"] = keep_best
    resolved = load_config_dict(raw, env.overrides, env.run_dir, source=source, name=_script_name())
    return _own_run_dir(resolved, call, env.rank)


def _own_run_dir(config: Config, call: int, rank: int) -> Config:
    """A second fit() call whose run directory an earlier call of this process wrote (the default, or
    ``ringtrain run --run-dir``) writes RUN_DIR-2 instead (-3 for a third ...): each call is a run of its own,
    so pretraining and fine-tuning keep their files, and a restarted script finds each where it left it."""
    earlier = _run_dirs[: call - 1]
    run_dir = config.run_dir
    if str(Path(run_dir).resolve()) in earlier:
        run_dir = f"{config.run_dir}-{call}"
        if rank == 0:
            print(f"ringtrain: fit() call {call} writes {run_dir} ({config.run_dir} is an earlier call's); name each "
                  "call's run directory with fit(run_dir=...) to choose", file=sys.stderr, flush=True)
        config = config.model_copy(update={"run_dir": run_dir})
    _run_dirs[call - 1] = str(Path(run_dir).resolve())
    return config


def _script_name() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path).stem if path else "fit"


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
