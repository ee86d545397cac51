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
Under DiLoCo the replicas are these model-parallel groups: each survivor has gone back to the last outer step's
model (``abandon_interval``) and its outer state (its parts of the global model and momentum) goes on in the
new trainer's outer loop (``take_over``).

    trainer = move_to_group(trainer, generation, rebuild)

Joiners restore a replica only whole (``admit_whole_replicas``: rank 0 holds them until a replica's worth
asked). At their admission every member calls ``move_to_group`` at once, a joiner with no trainer (its mesh
needs the group): the survivors move their own parts as above, and over each ``dp`` group (the ranks of one
tp/cp/pp coordinate) the first rank that trained sends its part (``_part_state``: the one form a rank's part
takes, moved in memory or sent) to the joiners, checked against its sha256 and read weights-only.
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ringtrain.comm.errors import PeerDataError
from ringtrain.comm.objects import all_gather_json, broadcast_bytes
from ringtrain.decode_limits import load_weights_only
from ringtrain.heal.membership import Generation, HealFailed
from ringtrain.parallel.outer_loop import NO_OUTER_LOOP

if TYPE_CHECKING:
    from ringtrain.group.init import DistContext
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


def move_to_group(old: Trainer | None, generation: Generation, rebuild: Rebuild,
                  ctx: DistContext | None = None) -> Trainer:
    """The trainer built again for ``generation``'s group (formed already), holding ``old``'s state: every
    member at the same position, or the heal fails in one line. ``old`` None: a worker admitted with a whole
    replica (``ctx``: its context before the group formed); every member calls this at once, and rank r of
    each new replica receives its model part, optimizer state and the rest from rank r of a replica that
    trained (its counterpart over the ``dp`` dimension: the same tp/cp/pp coordinate, the same part), DiLoCo's
    outer state with it."""
    from ringtrain.heal.supervisor import context_for  # the supervisor imports this module lazily

    positions = all_gather_json(list(old.position) if old is not None else None)
    held = {tuple(position) for position in positions if position is not None}
    if len(held) > 1:
        steps = sorted({step for step, _ in held})
        raise HealFailed(f"the surviving replicas hold different steps ({steps}) and a split model's parts are sent "
                         "between replicas only to joiners; continue with --resume")
    if old is not None:
        old.close()
        ctx = context_for(old.ctx, generation)
        old.parts.job_store.is_writer = ctx.rank == 0  # rank 0 lost: this worker now counts the job's progress
    else:
        ctx = context_for(ctx, generation)
    new = rebuild(ctx)
    if old is not None:
        new.carry_over(old)
        _load_part(new, _part_state(old))
        # DiLoCo: the outer state goes on (each rank's parts of the global model and momentum; back at the last
        # outer step already: ``abandon_interval``).
        new.parts.strategy.outer_loop.take_over(old.parts.strategy.outer_loop, new.parts.optimizer)
    if None in positions:  # joiners among the members: each receives its part from its counterpart
        _send_parts(new, has_state=[position is not None for position in positions])
    return new


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (a DTensor's local shard, or the tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _like(value, param: torch.Tensor, sharded: bool):
    """An optimizer state entry (this rank's local part) for ``param`` of the new trainer: one that was a
    DTensor (``sharded``) is re-made on the new mesh from the same local shard (the rank's place in its replica
    is the same)."""
    if not isinstance(value, torch.Tensor):
        return value
    if sharded and hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.clone(), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value.clone()


def _part_state(trainer: Trainer) -> dict[str, Any]:
    """What this rank holds of its replica, as local tensors and plain values: its model part, every trained
    parameter and its optimizer state (entries that were DTensors named in ``sharded``), the optimizer's
    hyper-parameters, the stateful parts carried as they are and the evaluations' progress. The one form a
    rank's part takes, moved in memory (a heal) or sent to a joiner (an admission)."""
    optimizer = trainer.parts.optimizer
    params = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            params.append({"value": _local(param).detach(),
                           "state": {key: _local(value) if isinstance(value, torch.Tensor) else value
                                     for key, value in state.items()},
                           "sharded": [key for key, value in state.items() if hasattr(value, "to_local")],
                           "has_state": param in optimizer.state})
    parts = trainer.checkpoint_parts(local=True)
    return {"module": {name: _local(tensor).detach() for name, tensor in trainer.module.state_dict().items()},
            "groups": [{key: value for key, value in group.items() if key != "params"}
                       for group in optimizer.param_groups],
            "group_sizes": [len(group["params"]) for group in optimizer.param_groups],
            "params": params,
            "carried": {name: parts[name].state_dict() for name in _CARRIED if name in parts},
            "outer": {name: part.state_dict() for name, part in trainer.parts.strategy.outer_loop.transfer_parts().items()},
            "progress": {"eval_due": trainer.eval_due, "final_eval_done": trainer.final_eval_done,
                         "last_eval": dict(trainer.last_eval)}}


@torch.no_grad()
def _load_part(new: Trainer, part: dict[str, Any]) -> None:
    """``part`` (``_part_state``'s form) into ``new``, checked against what ``new`` holds."""
    after = new.module.state_dict()
    if list(part["module"]) != list(after):
        raise HealFailed("the model rebuilt for the healed group has other parameters than the one trained; "
                         "continue with --resume")
    for name, tensor in after.items():
        source, target = part["module"][name], _local(tensor)
        if source.shape != target.shape:
            raise HealFailed(f"the model part rebuilt for the healed group holds {name} as {tuple(target.shape)}, the "
                             f"trained one as {tuple(source.shape)}; continue with --resume")
        target.copy_(source)
    new_opt = new.parts.optimizer
    if part["group_sizes"] != [len(group["params"]) for group in new_opt.param_groups]:
        raise HealFailed("the optimizer rebuilt for the healed group holds other parameters; continue with --resume")
    for hyper, new_group in zip(part["groups"], new_opt.param_groups):
        new_group.update(hyper)
    new_params = [param for group in new_opt.param_groups for param in group["params"]]
    for entry, new_param in zip(part["params"], new_params):
        # Every trained parameter, also one outside the module (a pipeline's last stage's own copy of a tied
        # weight: parallel/pipeline.py)
        _local(new_param).copy_(entry["value"])
        if entry["has_state"]:
            new_opt.state[new_param] = {key: _like(value, new_param, key in entry["sharded"])
                                        for key, value in entry["state"].items()}
    new_parts = new.checkpoint_parts(local=True)
    for name, state in part["carried"].items():
        new_parts[name].load_state_dict(state)
    progress = part["progress"]
    new.eval_due, new.final_eval_done = bool(progress["eval_due"]), bool(progress["final_eval_done"])
    new.last_eval = dict(progress["last_eval"])


def _send_parts(new: Trainer, has_state: list[bool]) -> None:
    """Over each ``dp`` group (the ranks of one tp/cp/pp coordinate, one per replica), the first rank that
    trained sends its part (``_part_state``) to the ranks that hold none (joiners): ``torch.save`` bytes
    beside their sha256, checked, then read weights-only (heal/transfer.py's rule: nothing a peer sent is
    unpickled as objects)."""
    group = new.ctx.dp_group
    ranks = dist.get_process_group_ranks(group)
    source = next((rank for rank in ranks if has_state[rank]), None)
    if source is None:
        raise HealFailed(f"no worker that trained holds the part of ranks {ranks} (only joiners are there); "
                         "continue with --resume")
    payload = None
    if dist.get_rank() == source:
        buffer = io.BytesIO()
        torch.save(_part_state(new), buffer)
        payload = buffer.getvalue()
    sent_sha = broadcast_bytes(hashlib.sha256(payload).digest() if payload is not None else None, src=source,
                               group=group)
    data = broadcast_bytes(payload, src=source, group=group)
    if has_state[dist.get_rank()]:
        return
    if hashlib.sha256(data).digest() != sent_sha:
        raise PeerDataError(f"the model part received from rank {source} does not match its sha256; refused")
    try:
        part = load_weights_only(data, map_location=new.ctx.device)
    except Exception as err:  # noqa: BLE001 - Refused, or pickle's errors for objects and junk
        raise PeerDataError(f"rank {source} sent a model part that is not tensors and plain values ({err}); "
                            "refused") from None
    _load_part(new, part)
    new.parts.strategy.outer_loop.take_over(NO_OUTER_LOOP, new.parts.optimizer, part["outer"] or None)
