"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) as a ringtrain strategy: the reference peer of zero3.

    >>> strategy = FSDPStrategy(torch.device("cpu"))
    >>> model = strategy.wrap(model)     # one FSDP unit per block (units.block_units), then the root
    >>> optimizer = build_optimizer(config, model.parameters())   # over the DTensor shards
    >>> loss_fn(model(x)).backward()     # FSDP all-gathers per unit, reduce-scatters per unit

The device mesh is the whole world: Gloo on CPU, NCCL on CUDA (``torch.distributed`` picks the backend's
collectives), or with ``comm.algorithm = 'shm'`` the ``ringtrain_shm`` backend (CPU workers: every all-gather and
reduce-scatter on the host's shared memory). Gradients are reduce-scattered on every micro-batch and
accumulate in the shards (FSDP's default, what zero2/zero3 do); ``no_sync`` changes nothing. Parameters are
DTensors sharded on dim 0; the checkpoint's full form is gathered with ``full_tensor()`` and cut back with
``distribute_tensor`` (each rank takes its own chunk: no communication).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.parallel.base import ReplicatedStrategy, optimizer_tensors
from ringtrain.parallel.units import block_units

__all__ = ["from_config", "FSDPStrategy", "full_optimizer_state", "load_dtensor_model_state", "local_state_tensors",
           "shard_blocks", "shard_optimizer_state_like"]


class FSDPStrategy(ReplicatedStrategy):
    name = "fsdp"
    gradients_replicated = False
    reduces_every_micro_batch = True
    forward_is_collective = True
    step_operation = "all_gather and reduce_scatter (FSDP2 parameters and gradients)"

    def __init__(self, device: torch.device, mesh: Any = None, algorithm: str = "torch"):
        self.device = device
        self.algorithm = algorithm
        """'shm': the world's mesh is a ``ringtrain_shm`` group (comm/c10d_backend.py: FSDP2's all-gathers and
        reduce-scatters on shared memory; CPU workers of one host, or Gloo's as before where ranks span hosts)."""
        self.comm_timer = CommTimer()
        """FSDP runs its collectives itself: the timer sees none (their time is in forward/backward)."""
        self.mesh = mesh
        """A 2-D (dp_replicate, dp_shard) mesh: HSDP (each replica group shards the state, the replicas
        all-reduce the sharded gradients; ``hsdp_mesh``). None: one dimension, the world."""
        if mesh is not None:
            self.name = "hsdp"
            self.step_operation = "all_gather, reduce_scatter and all_reduce (HSDP parameters and gradients)"

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        model.to(self.device)
        _broadcast_from_rank0(model)  # FSDP shards each rank's own copy: start from one
        mesh = self.mesh
        if mesh is None and self.algorithm == "shm":
            if self.device.type != "cpu":
                raise ConfigError(f"comm.algorithm = 'shm' with comm.strategy = 'fsdp' needs CPU workers, but this "
                                  f"worker trains on {self.device}; set comm.algorithm = 'torch'")
            from ringtrain.comm.c10d_backend import BACKEND

            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",),
                                    backend_override={"dp_shard": BACKEND})
        elif mesh is None:
            mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        return shard_blocks(model, mesh)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def gradient_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        # DTensors: norms over them are global (a collective every rank runs).
        return list(model.parameters())

    def full_named_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: _full(p.detach()) for name, p in model.named_parameters()}

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: _full(v) for k, v in model.state_dict().items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_dtensor_model_state(model, state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(optimizer)

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return shard_optimizer_state_like(optimizer, state)

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        """The local shards (FSDP's transient all-gather buffers are not reachable here: see peak RSS)."""
        return local_state_tensors(model, optimizer)


# --- the full and sharded forms of a model whose parameters are DTensors (FSDP2's, tensor parallelism's) ----------
def shard_blocks(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 over ``mesh``: one unit per block (``units.block_units``), then the root. The model is already on
    its device and the same on every rank of ``mesh`` (its parameters may be tensor-parallel DTensors already:
    FSDP2 shards them on the data-parallel mesh beside tp's)."""
    from torch.distributed.fsdp import fully_shard

    for block in block_units(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def load_dtensor_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A full model state (plain tensors) cut into ``model``'s DTensors (each rank its own part, no
    communication), its plain tensors copied whole; a state of other keys is refused (KeyError)."""
    own = model.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise KeyError(f"the model state does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for key, target in own.items():
            _local(target).copy_(_local(_shard_like(state[key], target)))


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state in torch's form with every DTensor gathered whole (a collective)."""
    local = optimizer.state_dict()
    return {**local, "state": {i: {k: _full(v) for k, v in entry.items()} for i, entry in local["state"].items()}}


def shard_optimizer_state_like(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state cut as the optimizer's parameters are (``full_optimizer_state``'s inverse)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {}
    for i, entry in state["state"].items():
        param = params[int(i)]
        sharded[i] = {k: _shard_like(v, param) if isinstance(v, torch.Tensor) and v.shape == param.shape else v
                      for k, v in entry.items()}
    return {**state, "state": sharded}


def local_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """This rank's local parts of the parameters, gradients and optimizer state."""
    for p in model.parameters():
        yield _local(p)
        if p.grad is not None:
            yield _local(p.grad)
    yield from (_local(t) for t in optimizer_tensors(optimizer))


def _full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` cut as ``like`` (a DTensor) is; a plain tensor stays whole."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    # Every rank holds the full value: each takes its own chunk, nothing is sent.
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def _broadcast_from_rank0(model: nn.Module) -> None:
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def from_config(comm, device: torch.device, *, spec, diloco=None, heal: bool = False, mesh=None) -> FSDPStrategy:
    """``comm.strategy = 'fsdp'`` (the registry's builder): over ``mesh`` (HSDP's 2-D one) or the world."""
    return FSDPStrategy(device, mesh=mesh, algorithm=comm.algorithm)
