"""ringtrain: distributed data-parallel training for PyTorch, and why it is fast or slow.

Train your own model and data with every ringtrain guarantee (exactly-once data, full-batch-exact
accumulation, verified checkpoints and resume, elastic restarts)::

    import ringtrain
    result = ringtrain.fit(model=build_model, train_data=train_ds, eval_data=val_ds, loss="cross_entropy",
                           config={"train": {"epochs": 3, "global_batch_size": 64, "local_batch_size": 32}})
    result["eval"], result.model        # the summary (summary.json's dict) and the trained module

and launch the script with ``ringtrain run script.py --nproc 2``.

Or keep your own loop and use the building blocks ``fit`` is made of (``examples/custom_loop.py`` is a
whole loop in under 100 lines, run with ``torchrun``)::

    with ringtrain.init_distributed(ringtrain.DistEnv.from_environ(), ringtrain.DistConfig()) as ctx:
        strategy = ringtrain.DDPStrategy(ctx.device)                 # wrap / no_sync / unwrap
        model = strategy.wrap(build_model())
        sampler = ringtrain.ResumableSampler(len(train_ds), global_batch_size=64)
        loader = ringtrain.build_train_loader(train_ds, sampler, ctx.rank, ctx.world_size)
        checkpoints = ringtrain.CheckpointManager("run/checkpoints", is_writer=ctx.rank == 0)
        guard = ringtrain.StepGuard(ctx.rank, ctx.world_size, ctx.device)
        ...

- data: ``ResumableSampler`` (the epoch's order and a cursor of committed samples), ``build_train_loader``
  (one ``StepBatch`` per optimizer step), ``Ledger`` / ``check_ledger`` (prove every sample was used once);
- processes: ``DistEnv`` (what torchrun's environment says), ``init_distributed`` (the process group),
  ``DistConfig`` (its backend, timeout, threads);
- gradients: ``DDPStrategy``, ``ManualStrategy`` (``wrap``, ``no_sync``, ``unwrap``, ``comm_timer``);
- safety: ``CheckpointManager`` (atomic, verified, keep-last-K), ``ShardedCheckpointer`` (each rank its shard,
  verified, resharded on load, saved in the background), ``StepGuard`` (skip non-finite steps and
  stop on SIGTERM together), ``TrainState`` (step, epoch, samples seen, skips);
- monitoring: ``StepClock`` (time per phase, throughput), ``RunDirLogger`` / ``NullLogger`` (metrics.jsonl
  on rank 0, nothing elsewhere).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it; imported on first use, so `import ringtrain` (and
# `ringtrain --help`) does not pay for importing torch.
_LAZY = {
    "fit": "ringtrain.api",
    "Session": "ringtrain.train.session",
    "FitResult": "ringtrain.api",
    "DistEnv": "ringtrain.group.env",
    "DistConfig": "ringtrain.config",
    "init_distributed": "ringtrain.group.init",
    "ResumableSampler": "ringtrain.data.sampler",
    "StepBatch": "ringtrain.data.loader",
    "build_train_loader": "ringtrain.data.loader",
    "Ledger": "ringtrain.data.ledger",
    "check_ledger": "ringtrain.data.ledger",
    "DDPStrategy": "ringtrain.parallel.ddp",
    "ManualStrategy": "ringtrain.parallel.manual",
    "CheckpointManager": "ringtrain.checkpoint.manager",
    "ShardedCheckpointer": "ringtrain.checkpoint.sharded",
    "StepGuard": "ringtrain.train.guards",
    "TrainState": "ringtrain.train.state",
    "StepClock": "ringtrain.monitor.metrics",
    "RunDirLogger": "ringtrain.monitor.loggers",
    "NullLogger": "ringtrain.monitor.loggers",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from ringtrain.train.session import Session
    from ringtrain.api import FitResult, fit
    from ringtrain.checkpoint.manager import CheckpointManager
    from ringtrain.checkpoint.sharded import ShardedCheckpointer
    from ringtrain.config import DistConfig
    from ringtrain.data.ledger import Ledger, check_ledger
    from ringtrain.data.loader import StepBatch, build_train_loader
    from ringtrain.data.sampler import ResumableSampler
    from ringtrain.group.env import DistEnv
    from ringtrain.group.init import init_distributed
    from ringtrain.monitor.loggers import NullLogger, RunDirLogger
    from ringtrain.monitor.metrics import StepClock
    from ringtrain.parallel.ddp import DDPStrategy
    from ringtrain.parallel.manual import ManualStrategy
    from ringtrain.train.guards import StepGuard
    from ringtrain.train.state import TrainState


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
