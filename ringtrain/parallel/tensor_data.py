"""Tensor parallelism as a transform, then any data-parallel strategy of the registry over the data-parallel
sub-mesh (torchtitan's ``parallelize_fn`` order: tensor split first, one data-parallel wrapper last):

    strategy = TensorBesideData(device, mesh, data=ZeroStrategy(device, stage=2, group=mesh["dp"].get_group()))
    model = strategy.wrap(model)       # the tp plan on mesh["tp"], local parameters, then zero2 over mesh["dp"]
    optimizer = strategy.shard_optimizer(build_optimizer(config, model.parameters()))
    loss_fn(model(x)).backward()       # tp collectives inside the layers; zero2's reduce-scatter over dp

ringtrain's own data-parallel strategies (manual's buckets, zero1/2/3's flat units) and torch's DDP hold
plain tensors: they lay parameters end to end, point them at views of one flat buffer, copy gradients in.
A DTensor cannot be such a view. So after the split each DTensor parameter is replaced by its local shard, a
plain ``nn.Parameter`` (under the same name: checkpoints, digests and the optimizer see the model's names),
and each module that holds one makes a DTensor of it for its own forward (``DTensor.from_local``, what FSDP2
does with its unsharded parameters beside tp). Autograd takes the gradient back through ``from_local``, which
hands it over in the parameter's placement: the shard's gradient for a split layer, and for a replicated
parameter the whole one, a Partial gradient reduced over tp first (the sequence-parallel norms' weights: each
tp rank holds its tokens' share). The data-parallel strategy then averages local gradients over its ranks, as
it would a plain model's.

The global gradient norm counts every element of the unsplit model once: a sharded parameter's squares are
summed over the tp ranks, a replicated one's (the same on every tp rank) weighted 1/tp; under zero the
squares of the rank's gradient shard are summed over the data-parallel ranks too.

Full forms (the checkpoint's model and optimizer state, ``full_named_parameters``) are gathered over tp from
the data-parallel strategy's full form (over dp), qkv rows put back in q | k | v order; loading cuts them the
same way back. A sharded (DCP) checkpoint holds DTensors on the tp mesh made of the local parts (gathered over
dp), qkv re-cut in natural order, in ``get_state_dict``'s keys: it loads into any layout, and any layout's into it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.parallel.base import ReplicatedStrategy
from ringtrain.parallel.tensor import HoldsTensorSplit, TensorParallelStrategy, TensorSplit, _recut, _to_natural

__all__ = ["LocalSpec", "TensorBesideData", "localize_parameters"]


@dataclass(frozen=True)
class LocalSpec:
    """How a local parameter makes its DTensor: the tp mesh, its placements, the unsplit shape and stride."""

    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def dtensor(self, local: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)

    @property
    def split(self) -> bool:
        """Each tp rank holds another part (not a replica of the whole)."""
        return any(p.is_shard() for p in self.placements)


def localize_parameters(model: nn.Module) -> dict[int, LocalSpec]:
    """Every DTensor parameter of ``model`` replaced by a plain parameter holding its local part (one for a
    weight two modules share), each module made to use DTensors of its own in forward; returns the spec of
    each local parameter by ``id``."""
    from torch.distributed.tensor import DTensor

    local_of: dict[int, nn.Parameter] = {}
    specs: dict[int, LocalSpec] = {}
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
        if not names:
            continue
        held: dict[str, nn.Parameter] = {}
        for name in names:
            param = module._parameters[name]
            if id(param) not in local_of:
                local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                local_of[id(param)] = local
                specs[id(local)] = LocalSpec(param.device_mesh, tuple(param.placements), param.shape, param.stride())
            held[name] = module._parameters[name] = local_of[id(param)]
        module.register_forward_pre_hook(_as_dtensors(held, specs))
        module.register_forward_hook(_as_locals(held), always_call=True)
    return specs


def _as_dtensors(held: dict[str, nn.Parameter], specs: dict[int, LocalSpec]) -> Callable:
    def hook(module: nn.Module, args: Any) -> None:
        # For this forward only: the module's split layer computes on DTensors; gradients reach `local`.
        for name, local in held.items():
            module._parameters[name] = specs[id(local)].dtensor(local)
    return hook


def _as_locals(held: dict[str, nn.Parameter]) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for name, local in held.items():
            module._parameters[name] = local
    return hook


class TensorBesideData(HoldsTensorSplit, ReplicatedStrategy):
    """Tensor parallelism over ``mesh['tp']`` (the transform, ``TensorSplit``) with ``data``, a data-parallel
    strategy over plain tensors (manual, zero1/2/3, DDP), on the data-parallel (or dp x cp) ranks it was built
    with: the one wrapper after the split."""

    gradients_replicated = False
    reduces_every_micro_batch = True  # the split layers' all-reduces run in every backward
    forward_is_collective = True
    splits_model = True

    def __init__(self, device: torch.device, mesh: Any, data: Any, **tensor: Any):
        self.device = device
        self.tensor = TensorSplit(device, mesh, **tensor)
        self.mesh = mesh
        self.tp = self.tensor.tp
        self.data = data
        self.name = f"{data.name}+tp"
        self.comm_timer = data.comm_timer
        self.tp_group = mesh["tp"].get_group()
        self._specs: dict[int, LocalSpec] = {}
        """Each local parameter's spec by id (a layer a user's plan leaves whole stays a plain tensor: none)."""
        self._names: dict[str, LocalSpec] = {}
        """Every name a local parameter has (a tied weight under each), to its spec."""
        self._optimizer_params: list[nn.Parameter] = []
        self.step_operation = f"{TensorParallelStrategy.step_operation}; {data.step_operation}"

    # --- the transforms, in order --------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        self.tensor.apply(model)
        self._specs = localize_parameters(model)
        self._names = {name: self._specs[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        self._model_names = list(model.named_parameters())
        self.tensor.index_fused(model)  # the local parameters
        return self.data.wrap(model)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return self.data.no_sync(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.data.unwrap(model)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.data.shard_optimizer(optimizer)

    def take_step_comm_s(self) -> float:
        return self.data.take_step_comm_s()

    def gradient_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return self.data.gradient_parameters(model, optimizer)

    def close(self) -> None:
        self.data.close()

    @property
    def has_rank_state(self) -> bool:
        """DDP's PowerSGD state beside tp x cp: the data-parallel strategy's per-rank state, checkpointed as its own."""
        return self.data.has_rank_state

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.data.load_state_dict(saved)

    # --- the global norm: each element of the unsplit model once ------------------------------------------
    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        squares = torch.zeros((), dtype=torch.float32)
        units = getattr(model, "units", None)
        if units is not None:  # zero: the rank's gradient shard, runs of a unit's flat coordinates
            for unit in units:
                for run in unit.runs:
                    grad = run.param.grad
                    if grad is None:
                        continue
                    for param, offset in zip(unit.params, unit.offsets):
                        a, b = max(offset, run.start), min(offset + param.numel(), run.end)
                        if a < b:
                            squares += self._weight(param) * grad[a - run.start : b - run.start].float().pow(2).sum()
            if dist.get_world_size(model.group) > 1:
                dist.all_reduce(squares, group=model.group)
        else:  # whole gradients, the same on every data-parallel rank
            for param in self.unwrap(model).parameters():
                if param.grad is not None:
                    squares += self._weight(param) * param.grad.float().pow(2).sum()
        dist.all_reduce(squares, group=self.tp_group)
        norm = squares.sqrt()
        grads = [p.grad for p in self.gradient_parameters(model, optimizer) if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def _weight(self, param: nn.Parameter) -> float:
        spec = self._specs.get(id(param))
        return 1.0 if spec is not None and spec.split else 1.0 / self.tp

    # --- full forms: the data-parallel strategy's, gathered over tp ---------------------------------------
    def _gathered(self, name: str, value: Any, spec: LocalSpec | None) -> Any:
        if spec is None or not isinstance(value, torch.Tensor):
            return value
        return self.tensor.natural(name, spec.dtensor(value.detach()).full_tensor())

    def _cut(self, name: str, value: Any, spec: LocalSpec | None) -> Any:
        if spec is None or not isinstance(value, torch.Tensor):
            return value
        from torch.distributed.tensor import distribute_tensor

        ranked = self.tensor.ranked(name, value)
        return distribute_tensor(ranked, spec.mesh, spec.placements, src_data_rank=None).to_local().clone()

    def full_named_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        local = self.data.full_named_parameters(model)
        return {name: self._gathered(name, value, self._names.get(name)) for name, value in local.items()}

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        local = self.data.model_state_dict(model)
        return {key: self._gathered(key, value, self._names.get(key)) for key, value in local.items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.data.load_model_state_dict(model, {key: self._cut(key, value, self._names.get(key))
                                                for key, value in state.items()})

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        full = self.data.optimizer_state_dict(optimizer)
        return {**full, "state": self._map_entries(full["state"], self._gathered)}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        local = {**state, "state": self._map_entries(state["state"], self._cut)}
        return self.data.shard_optimizer_state(optimizer, local)

    def _map_entries(self, state: dict, move: Callable[[str, Any, LocalSpec | None], Any]) -> dict:
        """Each entry's elementwise tensors (shaped like the parameter, local or whole) moved by ``move``, the
        parameters taken by their index in the optimizer's groups, in one order on every rank."""
        names = {id(p): name for name, p in self._model_names}
        mapped = {}
        for index in sorted(state, key=int):
            param = self._optimizer_params[int(index)]
            spec, name = self._specs.get(id(param)), names[id(param)]
            mapped[index] = {key: move(name, value, spec) if _elementwise(value, param, spec) else value
                             for key, value in state[index].items()}
        return mapped

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The sharded (DCP) form in ``get_state_dict``'s keys: every parameter and elementwise optimizer state
        as a DTensor on the tp mesh, made of this rank's local part (gathered over dp where the strategy shards
        it: a collective), qkv ones re-cut in natural order. The dp ranks hold the same DTensors; DCP writes each
        piece once, and reshards it into any layout."""

        def tp_form(name: str, value: Any, spec: LocalSpec | None) -> Any:
            if spec is None or not isinstance(value, torch.Tensor):
                return value
            dtensor = spec.dtensor(value.detach())
            dim = self.tensor.fused_dim(name)
            return dtensor if dim is None else _recut(dtensor, _to_natural(dtensor.full_tensor(), self.tp, dim))

        model_sd = {key: tp_form(key, value, self._names.get(key))
                    for key, value in self.data.model_state_dict(model).items()}
        full = self.data.optimizer_state_dict(optimizer)
        names = {id(p): name for name, p in self._model_names}
        fqn = [names[id(p)] for p in self._optimizer_params]
        state = {fqn[int(index)]: entry for index, entry in self._map_entries(full["state"], tp_form).items()}
        groups = [{**group, "params": [fqn[int(i)] for i in group["params"]]} for group in full["param_groups"]]
        return {"model": model_sd, "optimizer": {"state": state, "param_groups": groups}}

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                              load: Callable[[dict[str, Any]], None]) -> None:
        """Read a sharded checkpoint (any layout's) into ``checkpoint_state``'s form, then set it through the full
        forms (cut over tp, then by the data-parallel strategy); this run's hyperparameters are kept."""
        from ringtrain.parallel.zero_state import materialize_optimizer_state

        materialize_optimizer_state(optimizer)  # the moments to read into (Adam makes them on its first step)
        state = self.checkpoint_state(model, optimizer)
        load(state)
        whole = lambda value: value.full_tensor() if hasattr(value, "full_tensor") else value  # noqa: E731
        self.load_model_state_dict(model, {key: whole(value) for key, value in state["model"].items()})
        current = self.data.optimizer_state_dict(optimizer)
        index = {name: i for i, name in enumerate(
            {id(p): n for n, p in self._model_names}[id(p)] for p in self._optimizer_params)}
        entries = {index[name]: {key: whole(value) for key, value in entry.items()}
                   for name, entry in state["optimizer"]["state"].items()}
        optimizer.load_state_dict(self.shard_optimizer_state(optimizer, {"state": entries,
                                                                         "param_groups": current["param_groups"]}))

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        return self.data.state_tensors(model, optimizer)

    def model_state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        return self.data.model_state_bytes(model, optimizer)

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[nn.Module]:
        with self.data.full_parameters(model) as module:
            yield module


def _elementwise(value: Any, param: nn.Parameter, spec: LocalSpec | None) -> bool:
    """An optimizer state tensor shaped like its parameter: this rank's local part, or the unsplit whole."""
    whole = tuple(param.shape) if spec is None else tuple(spec.shape)
    return isinstance(value, torch.Tensor) and tuple(value.shape) in (tuple(param.shape), whole)
