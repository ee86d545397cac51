"""DiLoCo's outer state as a checkpoint part (``diloco.py``'s strategy holds it): the global parameters, the outer
optimizer's momentum, the counts of outer steps and bytes, the mean pseudo-gradients exchanged but not applied yet
and the schedule's place. Two forms:

- full (``state_dict``): one dict, the same on every rank, in rank 0's checkpoint file; each rank's own parameters,
  inner optimizer state and error feedback are gathered beside it (``train/comm_state.py``);
- sharded (``sharded_state_dict``, checkpoint/front.py's ShardedPart): the counts in rank 0's ``extra.pt``, the
  tensors through DCP under shared keys (written once), each rank's error feedback under ``rank_R``; beside a
  split model (tp, pp: ``SplitOuterState``) every rank's parts of the outer state under ``rank_R``, which only the
  layout that wrote them can read back (another is refused in one line).

    parts = strategy.stateful_parts()                 # {"outer": OuterState(strategy)}
    plain, tensors = parts["outer"].sharded_state_dict()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ringtrain.comm.objects import every_rank
from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    from ringtrain.parallel.diloco import DiLoCoStrategy

__all__ = ["OuterState", "SplitOuterState"]


class OuterState:
    """The global parameters, the outer optimizer's state, the counts of outer steps and bytes, and the mean
    pseudo-gradients exchanged but not applied yet (a delay), as a checkpoint part: the same on every rank."""

    def __init__(self, strategy: DiLoCoStrategy):
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        s = self.strategy
        return {"global_params": [g.detach().clone() for g in s.global_params],
                "optimizer": s.outer_optimizer.state_dict(), "outer_steps": s.outer_steps,
                "bytes_sent": s.bytes_sent,
                "in_flight": [s._mean(f).clone() if f.in_flight else None for f in s.fragments],
                # The schedule's place: the last step, each fragment's last outer step, the exchanges a failed
                # group took with it (a heal's new group, and a member that receives this state, skip them alike).
                "step": s._step, "synced_steps": [f.synced_step for f in s.fragments], "dropped": sorted(s._dropped)}

    def absent_from_checkpoint(self) -> None:
        """The checkpoint loaded was saved by another strategy (a DDP run continued with DiLoCo, the paper's warm
        start): the outer loop starts at the model just loaded, with no momentum and no outer step yet."""
        s = self.strategy
        with torch.no_grad():
            for global_, param in zip(s.global_params, s._params, strict=True):
                global_.copy_(param)
        s.outer_optimizer.state.clear()
        s.outer_steps = s.bytes_sent = 0
        for fragment in s.fragments:
            fragment.in_flight, fragment.mean, fragment.work, fragment.error_before = False, None, None, None
            if fragment.error is not None:
                fragment.error.zero_()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.strategy
        with torch.no_grad():
            for global_, saved in zip(s.global_params, state["global_params"], strict=True):
                global_.copy_(saved)
        # The momentum only: outer_lr and outer_momentum follow this run's config.
        current = s.outer_optimizer.state_dict()["param_groups"]
        s.outer_optimizer.load_state_dict({"state": state["optimizer"]["state"], "param_groups": current})
        s.outer_steps = int(state["outer_steps"])
        # A checkpoint from before streaming: one fragment, fp32, nothing in flight.
        s.bytes_sent = int(state.get("bytes_sent", s.outer_steps * s.payload_bytes))
        in_flight = state.get("in_flight", [None] * len(s.fragments))
        if len(in_flight) != len(s.fragments):
            raise ValueError(f"this checkpoint's DiLoCo state has {len(in_flight)} fragments and the run "
                             f"{len(s.fragments)}; resume with diloco.fragments = {len(in_flight)}")
        for fragment, mean in zip(s.fragments, in_flight):
            fragment.work = None
            fragment.in_flight, fragment.mean = mean is not None, None if mean is None else mean.clone()
        s._step = int(state.get("step", 0))
        for fragment, synced in zip(s.fragments, state.get("synced_steps") or [0] * len(s.fragments)):
            fragment.synced_step = int(synced)
        s._dropped = {int(index) for index in state.get("dropped", [])}

    # --- the sharded form (checkpoint/front.py's ShardedPart) --------------------------------------------
    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The counts and the schedule's place (the same on every rank: rank 0's go into ``extra.pt``), and the
        tensors, through DCP: the global parameters, the outer momentum and the means in flight under shared keys
        (the same on every rank: written once), beside a split model under ``rank_R`` (each rank's parts); each
        rank's error feedback (compressed dtypes) under ``rank_R``. Which momentum buffers and error feedback
        before an exchange exist is read back from the keys stored (beside a pipeline each rank has its own
        count of tensors: rank 0's plain values cannot say)."""
        s = self.strategy
        momentum = [s.outer_optimizer.state.get(g, {}).get("momentum_buffer") for g in s.global_params]
        plain = {"outer_steps": s.outer_steps, "bytes_sent": s.bytes_sent, "step": s._step,
                 "synced_steps": [f.synced_step for f in s.fragments], "dropped": sorted(s._dropped),
                 "in_flight": [f.in_flight for f in s.fragments], "errors": s.dtype != "fp32",
                 "world_size": _world_size(), "split_model": s._attached}
        outer = {"global": dict(_keyed(s.global_params)),
                 "momentum": {str(i): m for i, m in enumerate(momentum) if m is not None},
                 "mean": {str(f.index): s._mean(f) for f in s.fragments if f.in_flight}}
        own: dict[str, Any] = {}
        if s.dtype != "fp32":
            own = {"error": {str(f.index): f.error for f in s.fragments},
                   "error_before": {str(f.index): f.error_before for f in s.fragments if f.error_before is not None}}
        rank = f"rank_{_rank()}"
        return plain, ({rank: {**outer, **own}} if s._attached else {**outer, rank: own})

    def load_sharded_state_dict(self, plain: dict[str, Any], shards: Any) -> None:
        """Read back ``sharded_state_dict``'s form (``shards``: the checkpoint under this part's name). Beside a
        split model each rank reads its own parts, which only the layout that wrote them has: another layout is
        refused in one line. Replicated, the outer state loads at any world size; each rank's error feedback at
        the world size that saved it (elsewhere it starts from zero: ``ShardedTensors`` said the workers start
        from the checkpoint's model)."""
        s = self.strategy
        in_flight = plain["in_flight"]
        if len(in_flight) != len(s.fragments):
            raise ValueError(f"this checkpoint's DiLoCo state has {len(in_flight)} fragments and the run "
                             f"{len(s.fragments)}; resume with diloco.fragments = {len(in_flight)}")
        world, saved_world = _world_size(), int(plain["world_size"])
        rank = f"rank_{_rank()}"
        split = s._attached or bool(plain.get("split_model"))
        mine = shards.part(rank)
        stored, own_stored = (shards if not split else mine).stored, mine.stored
        means = {str(f.index): torch.empty(f.numel, dtype=torch.float32, device=s.device)
                 for f, flying in zip(s.fragments, in_flight) if flying}
        momentum = {i: torch.empty_like(g) for i, g in _keyed(s.global_params) if f"momentum.{i}" in stored}
        outer = {"global": dict(_keyed(s.global_params)), "momentum": momentum, "mean": means}
        own: dict[str, Any] = {}
        if s.dtype != "fp32" and plain.get("errors") and saved_world == world:
            own = {"error": {str(f.index): f.error for f in s.fragments},
                   "error_before": {str(f.index): torch.empty_like(f.error) for f in s.fragments
                                    if f"error_before.{f.index}" in own_stored}}
        if split:
            fits = (s._attached and bool(plain.get("split_model")) and saved_world == world
                    and mine.holds({**outer, **own}))
            if not every_rank(fits):  # every rank decides alike: none waits in a load the others left
                held = "another layout" if s._attached else "the whole model"
                raise ConfigError(
                    f"checkpoint step {plain['step']} holds DiLoCo's outer state as {saved_world} ranks' own parts "
                    f"of a model split by tensor or pipeline parallelism (the global model, the outer momentum), and "
                    f"this run's {world} ranks hold other parts ({held}), onto which they cannot map; resume it with "
                    "the layout that saved it (the same [parallel] degrees, stages and number of workers), or start "
                    "a new run")
            mine.load({**outer, **own})
        else:
            shards.load({**outer, **({rank: own} if own else {})})
        with torch.no_grad():
            # The full form's loader does the rest, as a full checkpoint's (the globals are loaded in place).
            OuterState.load_state_dict(self, {
                "global_params": s.global_params, "outer_steps": plain["outer_steps"],
                "bytes_sent": plain["bytes_sent"],
                "optimizer": {"state": {int(i): {"momentum_buffer": m} for i, m in momentum.items()}},
                "in_flight": [means.get(str(f)) for f in range(len(s.fragments))], "step": plain["step"],
                "synced_steps": plain["synced_steps"], "dropped": plain["dropped"]})
            if s.dtype != "fp32" and not own:
                for fragment in s.fragments:  # no error feedback for this run's ranks: it starts from nothing
                    fragment.error.zero_()
            for fragment in s.fragments:
                before = own.get("error_before", {}).get(str(fragment.index))
                fragment.error_before = before if fragment.in_flight else None


def _keyed(tensors: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(str(i), tensor)``: a list as DCP's keys."""
    return ((str(i), t) for i, t in enumerate(tensors))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class SplitOuterState(OuterState):
    """DiLoCo's outer state beside a split model (tp, pp). Each rank holds its parts of the global model and of the
    outer momentum, and each replica its own inner optimizer state: a sharded checkpoint holds them (``OuterState``'s
    sharded form, each rank's under keys of its own). A full checkpoint holds rank 0's replica only (the unsplit
    model): its part records the counts, and a resume from it refuses in one line rather than step from a wrong
    anchor. A checkpoint another strategy wrote (no outer state) is the paper's warm start, as ``OuterState``'s."""

    def state_dict(self) -> dict[str, Any]:
        s = self.strategy
        return {"split_model": True, "outer_steps": s.outer_steps, "step": s._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ConfigError(
            f"checkpoint step {state.get('step')} is a full checkpoint of DiLoCo beside tensor or pipeline "
            "parallelism: a full checkpoint holds rank 0's replica only, and DiLoCo's outer state (the global model, "
            "the outer momentum) and each replica's inner optimizer state are every rank's own parts; write sharded "
            "checkpoints (checkpoint.sharded = true), which hold them, or resume this one under comm.strategy = "
            "'ddp' or 'fsdp' (its model and optimizer state load)")
