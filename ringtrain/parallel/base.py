"""What every strategy answers besides wrap / no_sync / unwrap: where the gradients live, how to clip them,
how the model and optimizer state look in full (the checkpoint's form), and how much memory they take.

``ReplicatedStrategy`` holds the answers of strategies whose ranks keep full, identical copies (ddp,
manual); the sharded ones (zero1/2/3, fsdp) override them.

    optimizer = strategy.shard_optimizer(optimizer)     # the same optimizer over this rank's shard
    norm = strategy.clip_grad_norm_(model, optimizer, 1.0)   # the global norm, across shards
    full = strategy.optimizer_state_dict(optimizer)      # torch's form, as a single process holds it
    optimizer.load_state_dict(strategy.shard_optimizer_state(optimizer, full))
    state = strategy.checkpoint_state(model, optimizer)   # this rank's tensors, for a sharded checkpoint
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ringtrain.parallel.outer_loop import NO_OUTER_LOOP, OuterLoop

__all__ = ["ReplicatedStrategy", "unique_storage_bytes", "optimizer_tensors"]


class ReplicatedStrategy:
    """Defaults for strategies whose every rank holds the full parameters, gradients and optimizer state."""

    gradients_replicated = True
    """After the synchronising backward every rank holds the same full gradient (so a non-finite gradient is
    seen by all ranks alike, and the step agreement can check it locally)."""
    reduces_every_micro_batch = False
    """Backward communicates on every micro-batch (zero2/zero3/fsdp), so every rank must run one on each."""
    forward_is_collective = False
    """The bare module's forward runs collectives (zero3/fsdp gather parameters): every rank must run as many."""
    step_operation = "all_reduce (DDP gradient sync)"
    """What a step's forward and backward wait on, as a rank that stops answering there is reported and the flight
    recorder files it (``ringtrain: error: [rank 0] step 6: OPERATION failed: rank 1 did not respond ...``)."""
    splits_model = False
    """The bare module is not the model a run trains (tensor and pipeline parallelism split it): its whole form is
    ``model_state_dict``'s."""
    pipelined = False
    """A step is a pipeline schedule (``pipeline.py``): the step runs ``step`` through the stages, not forward and
    backward per micro-batch, and the loss sums live on the last stages."""
    has_rank_state = False
    """The strategy keeps per-rank state a checkpoint must hold (PowerSGD's error feedback, DiLoCo's replicas)."""
    microbatches: int | None = None
    """The micro-batches a step must be cut into (a pipeline's schedule); None: the batcher decides."""
    microbatch_multiple = 1
    """The micro-batch count is a multiple of this (the interleaved schedules: pp)."""
    outer_loop: OuterLoop = NO_OUTER_LOOP
    """The outer loop over the inner optimizer steps (``outer_loop.py``): DiLoCo's; a null one for the others."""

    def collective_wait_s(self) -> float:
        """Seconds waited for collectives inside forward and backward since the last call (tensor parallelism's
        split layers: the step's ``tp_comm`` phase); 0 for strategies whose passes run none."""
        return 0.0

    def close(self) -> None:
        """Release what the strategy runs beside training (zero3's prefetch thread); nothing for most."""

    def unwrap(self, model: nn.Module) -> nn.Module:  # overridden
        return model

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer that steps this rank's part of the parameters: all of them here."""
        return optimizer

    def loss_context(self) -> AbstractContextManager:
        """Where a step's forward, loss and backward (and an evaluation's forward and loss) run: torch's
        ``loss_parallel`` under tensor parallelism with a vocabulary-split output layer (``tensor.py``), so the
        cross-entropy reads the logits' shards; nothing for the others."""
        return nullcontext()

    def figures(self) -> dict[str, Any]:
        """The strategy's own figures for records and the summary: its outer loop's (DiLoCo: outer steps, bytes per
        worker, beside a split model too)."""
        return self.outer_loop.figures()

    def stateful_parts(self) -> dict[str, Any]:
        """Checkpoint parts of the strategy's own beyond model, optimizer and per-rank comm state: its outer loop's
        (DiLoCo's outer state, beside a split model too): ``{name: Stateful}``."""
        return self.outer_loop.stateful_parts()

    def take_step_comm_s(self) -> float:
        """Seconds of communication inside the optimizer step since the last call (zero1/2's all-gather)."""
        return 0.0

    def gradient_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters whose ``.grad`` holds this rank's (synchronised) gradient."""
        return list(self.unwrap(model).parameters())

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most ``max_norm``; return the norm."""
        return torch.nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm)

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[nn.Module]:
        """The bare module with full parameters inside the block (sharded strategies gather them)."""
        yield self.unwrap(model)

    def full_named_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full parameters by name (sharded strategies gather them; a collective then)."""
        with self.full_parameters(model) as module:
            return {name: p.detach().clone() for name, p in module.named_parameters()}

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full model state, as the bare module's ``state_dict()`` (every rank gets it)."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state in torch's form (state by parameter index, param_groups)."""
        return optimizer.state_dict()

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """A full optimizer state (``optimizer_state_dict``'s form) as ``optimizer.load_state_dict`` takes it."""
        return state

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model and optimizer state in this rank's layout for a sharded (DCP) checkpoint, in torch's
        ``get_state_dict`` keys: ``{"model": ..., "optimizer": ...}``. Replicated tensors here (DCP writes each
        once), DTensor shards under FSDP2, each rank's stretches under zero1/2/3; any of them loads into any
        other (DCP reshards)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.unwrap(model), optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                              load: Callable[[dict[str, Any]], None]) -> None:
        """Fill the model and optimizer from a sharded checkpoint: ``load(state)`` reads it in place into the
        tensors of ``checkpoint_state``'s form (resharded), which are then set."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.checkpoint_state(model, optimizer)  # the layout to fill (and AdamW's moments, created)
        load(state)
        set_state_dict(self.unwrap(model), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        """Every tensor of the model state this rank holds: parameters, gradients, optimizer state, buffers
        of the strategy (``model_state_bytes`` counts their storage once each)."""
        module = self.unwrap(model)
        yield from module.parameters()
        yield from (p.grad for p in module.parameters() if p.grad is not None)
        yield from optimizer_tensors(optimizer)

    def model_state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Unique storage bytes of ``state_tensors`` (views of one bucket count once)."""
        return unique_storage_bytes(self.state_tensors(model, optimizer))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
