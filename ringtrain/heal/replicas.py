"""Healing a split model (tp, cp or pp > 1): model-parallel replicas, as torchft's replica groups.

A *replica* is the ``pp x cp x tp`` ranks that share one data-parallel coordinate (consecutive ranks: the
layout's model-parallel dimensions are innermost, ``layout.py``). Each of them holds one part of the model, so a
replica that lost a rank cannot train: its live ranks leave the job with it (``Membership.agree`` keeps whole
replicas only; they exit with one line, ``Spared``). The whole replicas that remain go on at (replicas - 1) x
replica size ranks with the same tp/cp/pp degrees and the data-parallel degree shrunk; every rank keeps its
place inside its replica (its tp/cp/pp coordinate), so it still holds the same model part.

Their group changed size, so the mesh and every split made on it are made again: the trainer is built anew
for the new group through the same path as the start (``build_trainer`` -> ``build_parallel``), and each
rank moves the state it holds (its model part, its optimizer state, the sampler, counters, precision) from
the old trainer into the new one in memory (``move_to_group``): no checkpoint read, no step lost. The rest of
the epoch is dealt over the new data-parallel ranks as for any shrink (the sampler's cursor, the ledger).

    trainer = move_to_group(trainer, generation, rebuild)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringtrain.comm.objects import all_gather_json
from ringtrain.heal.membership import Generation, HealFailed

if TYPE_CHECKING:
    from ringtrain.heal.supervisor import Rebuild
    from ringtrain.train.loop import Trainer

__all__ = ["replica_size", "replica_of", "move_to_group"]

_CARRIED = ("sampler", "train_state", "schedule", "precision", "micro_batch", "best")
"""The trainer's stateful parts (``checkpoint_parts``) moved as they are, besides the model and optimizer."""


def replica_size(trainer: Trainer) -> int:
    """The ranks of one model-parallel replica (pp x cp x tp; 1: every rank holds the whole model)."""
    layout = trainer.ctx.layout
    return layout.model_parallel if layout is not None else 1


def replica_of(rank: int, size: int) -> int:
    """The data-parallel index of ``rank``'s replica (its ranks are ``size`` consecutive ones)."""
    return rank // size


def move_to_group(old: Trainer, generation: Generation, rebuild: Rebuild) -> Trainer:
    """The trainer built again for ``generation``'s group (formed already), holding ``old``'s state: every
    member at the same position, or the heal fails in one line."""
    from ringtrain.heal.supervisor import context_for  # the supervisor imports this module lazily

    positions = {tuple(position) for position in all_gather_json(list(old.position))}
    if len(positions) > 1:
        steps = sorted({step for step, _ in positions})
        raise HealFailed(f"the surviving replicas hold different steps ({steps}) and a split model's parts cannot be "
                         "sent between replicas yet; continue with --resume")
    old.close()
    ctx = context_for(old.ctx, generation)
    old.parts.job_store.is_writer = ctx.rank == 0  # rank 0 lost: this worker now counts the job's progress
    new = rebuild(ctx)
    new.carry_over(old)
    _move_state(old, new)
    return new


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (a DTensor's local shard, or the tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _like(value, param: torch.Tensor):
    """An optimizer state entry of the old trainer for ``param`` of the new one: a DTensor is re-made on the new
    mesh from the same local shard (the rank's place in its replica is the same)."""
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "to_local") and hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.to_local().clone(), param.device_mesh, param.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return _local(value).clone()


@torch.no_grad()
def _move_state(old: Trainer, new: Trainer) -> None:
    before, after = old.module.state_dict(), new.module.state_dict()
    if list(before) != list(after):
        raise HealFailed("the model rebuilt for the healed group has other parameters than the one trained; "
                         "continue with --resume")
    for name, tensor in after.items():
        source, target = _local(before[name]), _local(tensor)
        if source.shape != target.shape:
            raise HealFailed(f"the model part rebuilt for the healed group holds {name} as {tuple(target.shape)}, the "
                             f"trained one as {tuple(source.shape)}; continue with --resume")
        target.copy_(source)
    old_opt, new_opt = old.parts.optimizer, new.parts.optimizer
    if len(old_opt.param_groups) != len(new_opt.param_groups):
        raise HealFailed("the optimizer rebuilt for the healed group has other parameter groups; continue with --resume")
    for old_group, new_group in zip(old_opt.param_groups, new_opt.param_groups):
        new_group.update({key: value for key, value in old_group.items() if key != "params"})
        if len(old_group["params"]) != len(new_group["params"]):
            raise HealFailed("the optimizer rebuilt for the healed group holds other parameters; continue with --resume")
        for old_param, new_param in zip(old_group["params"], new_group["params"]):
            # Every trained parameter, also one outside the module (a pipeline's last stage's own copy of a tied
            # weight: parallel/pipeline.py)
            _local(new_param).copy_(_local(old_param))
            if old_param in old_opt.state:
                new_opt.state[new_param] = {key: _like(value, new_param)
                                            for key, value in old_opt.state[old_param].items()}
    old_parts, new_parts = old.checkpoint_parts(local=True), new.checkpoint_parts(local=True)
    for name in _CARRIED:
        if name in old_parts:  # "best": only under [train] keep_best
            new_parts[name].load_state_dict(old_parts[name].state_dict())
    new.eval_due, new.final_eval_done, new.last_eval = old.eval_due, old.final_eval_done, dict(old.last_eval)
