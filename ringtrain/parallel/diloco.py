"""DiLoCo (Douillard et al., arXiv 2311.08105): workers train alone for H steps, then average what they learned.

Each worker runs the configured (inner) optimizer on its own shares of the data with no gradient sync at all.
Every ``sync_every`` (H) optimizer steps, and at the run's last step, each worker computes its pseudo-gradient
``global - local`` (fp32), the workers average it with ringtrain's collectives (``comm.all_reduce``, the same
call and algorithms as the manual strategy: torch, ring, ring_chunked, shm, hierarchical across hosts), an outer
SGD (momentum, Nesterov) steps the global parameters by it, and every worker takes the new global parameters.
LocalSGD is ``outer_lr=1, outer_momentum=0``: the new global parameters are then the workers' mean.

    >>> strategy = DiLoCoStrategy(torch.device("cpu"), sync_every=50, outer_lr=0.7, outer_momentum=0.9)
    >>> model = strategy.wrap(model)                 # rank 0's weights everywhere; the fp32 global copy
    >>> optimizer = strategy.shard_optimizer(inner)  # kept: its per-rank state goes into checkpoints
    >>> loss_fn(model(x)).backward(); optimizer.step()    # local: nothing is communicated
    >>> if strategy.sync_due(step, last=step == total_steps):
    ...     strategy.outer_step()                    # one all-reduce of the pseudo-gradients

What a checkpoint holds beyond the model and optimizer (rank 0's): ``outer`` (``stateful_parts``: the global
parameters, the outer optimizer's momentum, the count of outer steps, identical on every rank) and, through
``has_rank_state`` (``train/comm_state.py``), every rank's own parameters and inner optimizer state, which
differ between outer steps: a checkpoint taken inside an interval resumes bit for bit.

Buffers (BatchNorm statistics) are not averaged: they follow rank 0 at each outer step (one broadcast, counted
in the bytes). Inside an interval every worker evaluates with its own parameters.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.comm import shm
from ringtrain.comm.groups import resolve_group
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.parallel.base import ReplicatedStrategy, optimizer_tensors
from ringtrain.parallel.buckets import broadcast_from_rank0, live_group

__all__ = ["DiLoCoStrategy", "OuterState"]


class DiLoCoStrategy(ReplicatedStrategy):
    """Inner steps without communication; every ``sync_every`` steps one outer step on the averaged
    pseudo-gradient (module docstring)."""

    name = "diloco"
    gradients_replicated = False
    """Each worker's gradient is its own (no sync): the step agreement carries every rank's gradient flag."""
    has_rank_state = True
    """Every rank's own parameters and inner optimizer state are checkpointed (``state_dict``)."""

    def __init__(self, device: torch.device, sync_every: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, algorithm: str = "torch", chunk_kb: int | None = None):
        if sync_every <= 0:
            raise ValueError(f"sync_every must be positive, got {sync_every}")
        self.device = device
        self.sync_every = sync_every
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb if algorithm == "ring_chunked" else None
        self.comm_timer = CommTimer()
        self.outer_steps = 0
        """Outer steps taken over the whole run (checkpointed): the all-reduces each worker has sent."""
        self._module: nn.Module | None = None
        self._inner: torch.optim.Optimizer | None = None

    # --- set-up ---------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """Rank 0's weights on every rank, the fp32 global copy and the outer optimizer; the module itself is
        returned (nothing to synchronise in backward)."""
        model.to(self.device)
        group = resolve_group(None)
        self._group = weakref.ref(group)  # never keep a destroyed group alive
        with torch.no_grad():
            broadcast_from_rank0([p.data for p in model.parameters()] + list(model.buffers()), group)
        self._module = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.global_params = [p.detach().to(torch.float32, copy=True) for p in self._params]
        # torch's SGD refuses nesterov without momentum; with none the two are the same step anyway.
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=self.outer_lr, momentum=self.outer_momentum,
                                               nesterov=self.nesterov and self.outer_momentum > 0)
        numel = sum(p.numel() for p in self.global_params)
        if self.algorithm == "shm":
            self._flat = shm.shared_empty(numel, torch.float32, group)  # peers reduce it in place
        else:
            self._flat = torch.empty(numel, dtype=torch.float32, device=self.device)
        return model

    @property
    def group(self) -> dist.ProcessGroup:
        return live_group(self._group)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()  # inner steps never synchronise

    def unwrap(self, model: nn.Module, release: bool = False) -> nn.Module:
        return model

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The inner optimizer, whole; kept, so that its per-rank state goes into checkpoints."""
        self._inner = optimizer
        return optimizer

    # --- the outer step -------------------------------------------------------------------------------
    @property
    def payload_bytes(self) -> int:
        """Bytes each worker sends per outer step: the fp32 pseudo-gradient all-reduced, plus rank 0's buffers."""
        buffers = sum(b.numel() * b.element_size() for b in self._module.buffers())
        return self._flat.numel() * self._flat.element_size() + buffers

    def sync_due(self, step: int, last: bool = False) -> bool:
        """An outer step follows optimizer step ``step`` (every ``sync_every`` steps, and the run's last)."""
        return step % self.sync_every == 0 or last

    def outer_step(self) -> None:
        """Average the pseudo-gradients, step the global parameters, and make them every worker's."""
        called = time.perf_counter()
        with torch.no_grad():
            views = self._views()
            for view, global_, local in zip(views, self.global_params, self._params):
                torch.sub(global_, local.detach().to(torch.float32), out=view)  # this worker's pseudo-gradient
            comm.all_reduce(self._flat, op="avg", algorithm=self.algorithm, group=self.group, chunk_kb=self.chunk_kb)
            for view, global_ in zip(views, self.global_params):
                global_.grad = view
            self.outer_optimizer.step()
            for global_, local in zip(self.global_params, self._params):
                local.copy_(global_)
            broadcast_from_rank0(list(self._module.buffers()), self.group)
        self.outer_steps += 1
        self.comm_timer.completed(called)  # time/comm_s; the loop books the wait as phase outer_sync

    def _views(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for global_ in self.global_params:
            views.append(self._flat[offset : offset + global_.numel()].view_as(global_))
            offset += global_.numel()
        return views

    def figures(self) -> dict[str, Any]:
        """For records and the summary: outer steps so far and the bytes each worker sent in them."""
        return {"outer_steps": self.outer_steps, "outer_payload_bytes": self.payload_bytes,
                "comm_bytes_per_worker": self.outer_steps * self.payload_bytes}

    # --- state ----------------------------------------------------------------------------------------
    def stateful_parts(self) -> dict[str, Any]:
        """The checkpoint's parts beyond the model and optimizer: the outer state, the same on every rank."""
        return {"outer": OuterState(self)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's own state (gathered by ``train/comm_state.py``): its parameters and inner optimizer state."""
        return {"params": [p.detach().clone() for p in self._params],
                "inner_optimizer": self._inner.state_dict() if self._inner is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for param, saved in zip(self._params, state["params"], strict=True):
                param.copy_(saved)
        if self._inner is not None and state["inner_optimizer"]:
            # The state only: hyperparameters follow this run's config (the lr schedule is positioned already).
            current = self._inner.state_dict()
            self._inner.load_state_dict({"state": state["inner_optimizer"]["state"],
                                         "param_groups": current["param_groups"]})

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        yield from super().state_tensors(model, optimizer)
        yield from self.global_params
        yield self._flat
        yield from optimizer_tensors(self.outer_optimizer)


class OuterState:
    """The global parameters, the outer optimizer's state and the count of outer steps, as a checkpoint part."""

    def __init__(self, strategy: DiLoCoStrategy):
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        s = self.strategy
        return {"global_params": [g.detach().clone() for g in s.global_params],
                "optimizer": s.outer_optimizer.state_dict(), "outer_steps": s.outer_steps}

    def absent_from_checkpoint(self) -> None:
        """The checkpoint loaded was saved by another strategy (a DDP run continued with DiLoCo, the paper's warm
        start): the outer loop starts at the model just loaded, with no momentum and no outer step yet."""
        s = self.strategy
        with torch.no_grad():
            for global_, param in zip(s.global_params, s._params, strict=True):
                global_.copy_(param)
        s.outer_optimizer.state.clear()
        s.outer_steps = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.strategy
        with torch.no_grad():
            for global_, saved in zip(s.global_params, state["global_params"], strict=True):
                global_.copy_(saved)
        # The momentum only: outer_lr and outer_momentum follow this run's config.
        current = s.outer_optimizer.state_dict()["param_groups"]
        s.outer_optimizer.load_state_dict({"state": state["optimizer"]["state"], "param_groups": current})
        s.outer_steps = int(state["outer_steps"])
