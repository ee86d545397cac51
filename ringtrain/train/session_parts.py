"""The pieces a ``Session`` hands to a user's loop and the checks around it: the step loader, the optimizer and
scheduler wrappers that commit a step, the evaluation loader, and the start-up helpers (config, resume plan,
one-line usage errors). Split from ``session.py``, which holds the ``Session`` itself."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ringtrain.config import Config
from ringtrain.data.batch import map_tensors
from ringtrain.data.seeding import STEP_STREAM, derive_seed, seed_everything
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.group.env import DistEnv
from ringtrain.train.resume import ResumePlan

if TYPE_CHECKING:
    from ringtrain.train.session import Session


class Samples:
    """The micro-batch plan's task when a user's loop computes the loss: items are samples."""

    items_are_samples = True


class EvalLoader:
    """A rank's evaluation batches, padded with empty ones to ``count`` (the most any rank has)."""

    def __init__(self, loader: Any, count: int, weights: Callable[[], AbstractContextManager] = nullcontext):
        self.loader, self.count, self.weights = loader, count, weights

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        # While the batches are handed out the model holds what evaluation scores (DiLoCo: the global model).
        with self.weights():
            first, count = None, self.count
            for batch in self.loader:
                first = batch if first is None else first
                count -= 1
                yield batch
            while count > 0 and first is not None:
                count -= 1
                inputs, targets = first
                yield map_tensors(inputs, lambda t: t[:0]), targets[:0]


class SessionLoader:
    """This rank's micro-batches of each step of the epoch, from the sampler's cursor (see ``Session``); under a
    pipeline (pp > 1) each step's whole share once, for ``Session.forward_backward``."""

    def __init__(self, session: Session):
        self.session = session
        """The micro-batches' session: its sampler, plan and step."""

    def __len__(self) -> int:
        return self.session.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        s = self.session
        s._ready()
        s._book_outside()  # the loop's own code since the last epoch's batches (its evaluation)
        if s._save_due:  # the last epoch's last step, held back until its end-of-epoch code ran
            with s.clock.phase("checkpoint"):
                s.save()
        batches = iter(s._loader)
        while True:
            with s.clock.phase("data"):  # the wait for the step's batch, as the Trainer books it
                batch = next(batches, None)
                if batch is None:
                    break
                step = s.state.step + 1
                s._window = s.sampler.next_window_size()
                s._batch = batch = batch.to(s.device)
            s._step_loss = torch.zeros(())
            s._stepped = False
            # The model's randomness (dropout) from (seed, step, data-parallel rank): the same after a resume; a
            # tensor-parallel group's ranks drop the same replicated activations.
            seed_everything(derive_seed(STEP_STREAM, s.config.train.seed, step, s.ctx.dp_rank))
            with s.clock.phase("data"):
                plan = s.batcher.plan(batch, s._window)
            if s.strategy.pipelined:  # the step's whole share, for session.forward_backward's schedule
                s._plan, s._micro, s._first = plan, (len(batch), True, plan.global_items), True
                s._yielded = time.perf_counter()
                yield batch.inputs, batch.targets
                if s._plan is not None:
                    usage(f"step {step}: session.forward_backward(batch, loss_fn) was not called for the step's "
                          "batch; call it once per batch, before optimizer.step()")
            last = -1 if s.strategy.pipelined else len(plan.micro_batches) - 1
            for index, (inputs, targets) in enumerate(plan.micro_batches[:last + 1]):
                s._micro = (len(targets), index == last, plan.global_items)
                s._first = index == 0
                # Accumulation micro-batches do not synchronise (their forward and backward in no_sync).
                with contextlib.nullcontext() if index == last else s.strategy.no_sync(s.model):
                    s._yielded = time.perf_counter()  # forward+backward: from here to backward's return
                    yield inputs, targets
            if not s._stepped:
                usage(f"step {step}: optimizer.step() was not called for the step's last micro-batch; "
                                  "call it once per micro-batch, after session.backward(loss)")
            if s.state.step >= s.total_steps or s.sampler.cursor == 0:
                break  # the epoch (or the run) is over: the next epoch starts with a fresh iterator
        s._outside_since = time.perf_counter()


class SessionOptimizer:
    """The optimizer, stepped once a step: ``step()`` on a step's last micro-batch commits the step (on the
    others it does nothing), ``zero_grad()`` clears the gradients on a step's first micro-batch only."""

    def __init__(self, session: Session, optimizer: torch.optim.Optimizer):
        self.session, self.optimizer = session, optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        if getattr(self.session, "_first", True):
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        s = self.session
        if not s._micro[1]:
            return
        if s._stepped:
            usage("optimizer.step() was called twice on a step's last micro-batch")
        if s._plan is not None:  # under pp: the step's batch has not been through the schedule
            usage("optimizer.step() before session.forward_backward(batch, loss_fn) in this step: run the step's "
                  "batch through the pipeline first")
        verdict = s._commit_step()
        s._stepped = True
        s._after_step(verdict, s._step_loss)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class SessionScheduler:
    """The lr scheduler, stepped by the session once a step as it commits the step (so a checkpoint made then
    holds it stepped); the loop's own ``step()`` calls do nothing."""

    def __init__(self, session: Session, scheduler: Any):
        self.session, self.scheduler = session, scheduler

    def step(self, *args: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def follow_parameters(optimizer: torch.optim.Optimizer, names: dict[int, str], now: dict[str, torch.nn.Parameter]) -> None:
    """Point ``optimizer`` (made by the user's script before ``setup``) at the module's parameters as the layout
    left them: a tensor-parallel split or FSDP2 puts new (DTensor) parameters in the old ones' places, under the
    same names (``names``: each old parameter's id -> its name). A parameter that stayed is left as it is."""
    moved = {}
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            new = now.get(names.get(id(param), ""), param)
            moved[param] = new
            params.append(new)
        group["params"] = params
    for old in [p for p in optimizer.state if moved.get(p, p) is not p]:
        optimizer.state[moved[old]] = optimizer.state.pop(old)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return optimizer.param_groups[0]["lr"]


def planned_steps(config: Config, steps_per_epoch: int, epochs: int | None = None) -> int:
    planned = (config.train.epochs if epochs is None else epochs) * steps_per_epoch
    return min(planned, config.train.max_steps) if config.train.max_steps else planned


def resolve_config(config: Any, env: DistEnv, run_dir: str | Path | None) -> Config:
    from ringtrain.api import config_sections
    from ringtrain.config import load_config_dict

    raw, source = config_sections(config, caller="Session()")
    for section, keys in {"model": ("name", "factory"), "data": ("dataset", "factory"), "task": ("loss",)}.items():
        for key in keys:
            if key in raw.get(section, {}):
                usage(f"a Session trains the model and data you set up; remove {section}.{key} from the config")
    # The model is the user's own (its name is recorded by setup): the layout checks treat it as fit's model.
    raw = {**raw, "model": {**raw.get("model", {}), "factory": "__main__:session_model"}}
    return load_config_dict(raw, env.overrides, env.run_dir or (str(run_dir) if run_dir else None), source=source,
                            name=script_name())


def script_name() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path).stem if path else "session"


def resume_plan(resume: bool | str | Path | None, env: DistEnv, config: Config) -> ResumePlan:
    """As ``fit``'s: ``ringtrain run --resume`` / RINGTRAIN_RESUME, else ``resume``; a fresh run is refused over
    a run directory with checkpoints, in words that name what works in the launch mode in use."""
    from ringtrain.train.run import FIT_WORDS, RUN_WORDS, ResumeWords, plan_resume

    fit_words = dataclasses.asdict(FIT_WORDS)
    words = RUN_WORDS if env.launched_by_ringtrain else ResumeWords(
        **{field: text.replace("fit(", "Session(") for field, text in fit_words.items()})
    return plan_resume(env, resume if resume is not None else False, config, words)


def usage(message: str) -> None:
    """A loop that uses the Session wrong: one line naming the fix, exit code 2 (as every usage error)."""
    exit_with(ConfigError(message), DistEnv.from_environ())


def exit_with(err: RingtrainError, env: DistEnv) -> None:
    from ringtrain.worker import report_error

    report_error(err, env)
    sys.exit(err.exit_code)


RESERVED_PARTS = ("run", "model", "optimizer", "sampler", "micro_batch", "train_state", "precision", "scheduler", "comm")
"""The names of what a Session's checkpoint holds itself (``Session.parts``): ``register`` takes none of them."""

PLAIN_TYPES = (type(None), bool, int, float, str)


def check_plain_value(name: str, value: Any) -> None:
    """``value`` is data a checkpoint keeps as JSON: None, a bool, number or string, or lists and dicts (string
    keys) of them; anything else (an object, a tensor, a tuple that would come back a list) is one line."""
    stack = [(value, name)]
    while stack:  # iterative: a deep value is bounded by check_json when it is read back, never by recursion
        item, where = stack.pop()
        if isinstance(item, PLAIN_TYPES):
            continue
        if isinstance(item, list):
            stack.extend((entry, f"{where}[{i}]") for i, entry in enumerate(item))
        elif isinstance(item, dict):
            bad = [key for key in item if not isinstance(key, str)]
            if bad:
                usage(f"session.register({name!r}, ...): {where} has the key {bad[0]!r}, not a string; a registered "
                      "value is kept as JSON, whose keys are strings: use string keys")
            stack.extend((entry, f"{where}[{key!r}]") for key, entry in item.items())
        else:
            usage(f"session.register({name!r}, ...): {where} is a {type(item).__name__}; register takes an object "
                  "with state_dict/load_state_dict, or a plain value kept as JSON (None, bool, int, float, str, "
                  "and lists and dicts of them)" + ("; pass a list" if isinstance(item, tuple) else
                                                     "; pass .item() or .tolist()" if isinstance(item, torch.Tensor)
                                                     else ""))


class PlainValue:
    """A plain value registered with the Session (``session.values[name]``), kept in each checkpoint as JSON
    text (data, never a pickle): ``{"json": "..."}``, read back bounded (decode_limits.check_json)."""

    def __init__(self, values: dict[str, Any], name: str):
        self.values, self.name = values, name

    def state_dict(self) -> dict[str, Any]:
        value = self.values[self.name]
        check_plain_value(self.name, value)  # what the loop stored since it registered it
        return {"json": json.dumps(value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from ringtrain.decode_limits import Refused, check_json
        from ringtrain.errors import CorruptCheckpoint

        text = state.get("json") if isinstance(state, dict) else None
        if not isinstance(text, str):
            raise CorruptCheckpoint(f"the checkpoint's {self.name!r} is not a registered plain value (it was saved "
                                    "from an object with state_dict); register the same kind of thing under that name")
        try:
            check_json(text)
            self.values[self.name] = json.loads(text)
        except (Refused, ValueError) as err:
            raise CorruptCheckpoint(f"the checkpoint's {self.name!r} is no JSON value ({err})") from None
