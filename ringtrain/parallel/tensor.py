"""Tensor parallelism for the built-in Transformer LM (Megatron's column / row split, as DTensor's
``parallelize_module``), alone or under FSDP2 on the data-parallel dimension of a 2-D mesh (torchtitan's
layout: ``dp`` outermost, ``tp`` innermost, so one tensor-parallel group is consecutive ranks, one host):

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    strategy = TensorParallelStrategy(torch.device("cpu"), mesh)
    model = strategy.wrap(model)      # the plan below on mesh["tp"]; with dp > 1, fully_shard per block on mesh["dp"]
    optimizer = build_optimizer(config, model.parameters())   # over DTensors
    loss_fn(model(x)).backward()      # every rank of a tp group runs the same samples

The plan, per block: the attention's qkv and the MLP's up projection are split by output features (each rank
computes whole heads and whole hidden units, with no communication), the attention's proj and the MLP's down
by input features, each followed by one all-reduce in forward (and one before the column split in backward).
Embeddings, norms and the tied output layer stay whole on every rank as replicated DTensors (a byte
vocabulary of 256 is not worth splitting, and it is tied to the embedding, so loss_parallel does not apply; for a
model whose output layer is its own, ``loss_parallel`` splits it by vocabulary: ``vocabulary_split_output``).

The fused qkv layer's rows are q | k | v: split by rows as they are, rank 0 would get q and half of k. At wrap
its rows are put in rank order (rank r's rows are q_r | k_r | v_r, its heads), and every full form (the
checkpoint's model and optimizer state, the parameter digests, the model a run returns) puts them back:
checkpoints are the unsplit model's and load into any layout. (DTensor's strided placement would express the
split without moving rows, but FSDP2's sharding on top of it gathers back wrong: measured, torch 2.14.)

Gradients of a tensor-parallel group are not averaged over it: each of its ranks holds the exact gradient of
its own slice (of the replicated parameters, the same gradient as its peers). Across the data-parallel
dimension FSDP2 averages, as the loss is scaled for (``GradientStep``: the data-parallel size). ``split`` is the
transform alone: ``tensor_data.py`` puts any other data-parallel strategy (manual, zero1-3, DDP beside cp) after it.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.parallel.base import ReplicatedStrategy
from ringtrain.parallel.fsdp import (FSDPStrategy, _broadcast_from_rank0, _full, full_optimizer_state,
                                    load_dtensor_model_state, local_state_tensors, shard_blocks,
                                    shard_optimizer_state_like)
from ringtrain.parallel.outer_loop import NO_OUTER_LOOP, OuterLoop
from ringtrain.parallel.sequence_split import sequence_parallel_plan, shard_stream
from ringtrain.parallel.tp_plan_check import check_colwise_partners

__all__ = ["Conv1DColwise", "Conv1DRowwise", "TensorParallelStrategy", "TensorSplit", "apply_plan", "gpt2_plan", "huggingface_plan",
           "parallelize_stage", "parallelize_transformer", "user_plan", "vocabulary_split_output"]

_FUSED = {"attn.qkv.weight": 0, "attn.qkv.bias": 0}
"""Parameters (by name suffix) whose rows are q | k | v, and the dimension that is: put in rank order at wrap,
back in every full form."""
_GPT2_FUSED = {"attn.c_attn.weight": 1, "attn.c_attn.bias": 0}
"""Hugging Face GPT-2's fused c_attn, a ``Conv1D``: its weight is (in, out), so q | k | v are columns."""


class TensorSplit:
    """The tensor-parallel transform over ``mesh['tp']`` (no data-parallel wrapper: a strategy applies one after
    it): the plan (the built-in transformer's, a Hugging Face model's, or a user's ``plan``) applied to rank 0's
    weights, and what the full forms need from it (which parameters hold fused q | k | v rows in rank order,
    and how to put them back), the loss context of a vocabulary split, the wait on its collectives."""

    def __init__(self, device: torch.device, mesh: Any, plan: Mapping[str, Any] | None = None,
                 sequence_parallel: bool = False, loss_parallel: bool = False):
        self.device = device
        self.mesh = mesh
        self.tp = mesh["tp"].size()
        self.plan = plan
        """A user's plan (``fit(tp_plan=...)``): module paths (``*`` for any one name) to "colwise", "rowwise" or
        a torch ParallelStyle. None: the model's own (the built-in transformer's, or a Hugging Face model's)."""
        self.sequence_parallel = sequence_parallel
        """The norms and residual stream split by sequence over tp: the built-in transformer's
        (``parallelize_transformer``), or derived from another model's plan (``sequence_split.py``)."""
        self.loss_parallel = loss_parallel
        """The model's own output layer split by vocabulary (its logits ``Shard(-1)``), the loss on the shards."""
        self._fused_dims: dict[str, int] = {}
        """Name suffixes of the parameters kept in rank order (fused q | k | v layers), and along which dimension."""
        self._fused: dict[int, int] = {}
        """ids of those parameters, and the dimension."""
        self._shm_group = mesh["tp"].get_group()
        self._waits = CollectiveWaits(self._shm_group)

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` on this rank's device, rank 0's weights cut by the plan over ``mesh['tp']`` (every parameter
        a DTensor: the split ones sharded, the rest replicated)."""
        from ringtrain.models.transformer import TransformerLM

        builtin = self.plan is None and isinstance(model, TransformerLM)
        plan = None if builtin else user_plan(self.plan) if self.plan is not None else huggingface_plan(model, self.tp)
        if self.plan is not None:  # the user's: each colwise layer with its rowwise partner (tp_plan_check.py)
            check_colwise_partners(model, plan)
        if plan is None and not builtin:
            raise ConfigError(f"[parallel] tp = {self.tp}: {type(model).__name__} has no tensor-parallel plan (plans "
                              "are built in for ringtrain's transformer and Hugging Face models that declare one, "
                              "such as Llama); pass fit(..., tp_plan={'layers.*.attn.q': 'colwise', ...}), or set "
                              "tp = 1")
        # Quiet: DTensor warns on every clip that a 2-D norm takes two all-reduces (it does; they are small).
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        model.to(self.device)
        _broadcast_from_rank0(model)  # each rank cuts its slice from one copy
        if builtin:
            parallelize_transformer(model, self.mesh["tp"], self.sequence_parallel)
            self._fused_dims = _FUSED
        else:
            if self.plan is None and _is_gpt2(model):
                self._fused_dims = _GPT2_FUSED
                _gpt2_heads_to_ranks(model, self.tp)
            if self.sequence_parallel:  # the stream between the splits sharded by sequence (sequence_split.py)
                plan = sequence_parallel_plan(plan)
            if self.loss_parallel:
                plan = {**plan, **vocabulary_split_output(model, self.sequence_parallel)}
            apply_plan(model, plan, self.mesh["tp"])
            if self.sequence_parallel:
                shard_stream(model, self.mesh["tp"])
        self.index_fused(model)
        self._waits.install()
        return model

    def index_fused(self, model: nn.Module) -> None:
        """Find the fused parameters of ``model`` again (a wrapper after the split made new parameter objects)."""
        self._fused = {id(p): self.fused_dim(name) for name, p in model.named_parameters()
                       if self.fused_dim(name) is not None}

    def fused_dim(self, name: str) -> int | None:
        return next((dim for suffix, dim in self._fused_dims.items() if name.endswith(suffix)), None)

    def natural(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A full value of parameter ``name`` in the unsplit model's order (qkv rows back in q | k | v order)."""
        dim = self.fused_dim(name)
        return _to_natural(value, self.tp, dim) if dim is not None and isinstance(value, torch.Tensor) else value

    def ranked(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``natural``'s inverse: a full value in the split's order, ready to cut."""
        dim = self.fused_dim(name)
        return _to_ranks(value, self.tp, dim) if dim is not None and isinstance(value, torch.Tensor) else value

    def map_state(self, optimizer: torch.optim.Optimizer, state: dict, move) -> dict:
        """A full optimizer state's fused entries (shaped like their parameter) moved by ``move``
        (``_to_natural`` or ``_to_ranks``)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mapped = {}
        for index, entry in state.items():
            param = params[int(index)]
            if id(param) not in self._fused:
                mapped[index] = entry
                continue
            mapped[index] = {key: move(value, self.tp, self._fused[id(param)]) if isinstance(value, torch.Tensor)
                             and tuple(value.shape) == tuple(param.shape) else value for key, value in entry.items()}
        return mapped

    def loss_context(self) -> AbstractContextManager:
        """torch's ``loss_parallel`` when the output layer is split by vocabulary (``loss_parallel``)."""
        if not self.loss_parallel:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def collective_wait_s(self) -> float:
        """Seconds this rank spent on the split layers' collectives (DTensor's all-reduces in forward and
        backward) since the last call: the waits for asynchronous ones (Gloo's), and the time inside
        synchronous ones (``parallel.tp_algorithm = 'shm'``). The step's ``tp_comm`` phase."""
        return self._waits.take()

    def figures(self) -> dict[str, Any]:
        """With ``parallel.tp_algorithm = 'shm'``: how many of the split layers' all-reduces this rank ran on
        ringtrain's shared memory so far (records and the summary), and every op it ran there by name
        (``tp_shm_ops``: with sequence parallelism the all-gathers and reduce-scatters)."""
        ops = getattr(self._shm_group, "shm_ops", None)  # every op the backend ran on shm, by op
        return {} if ops is None else {"tp_shm_all_reduces": ops["all_reduce"], "tp_shm_ops": dict(ops)}


class HoldsTensorSplit:
    """What a strategy holding a TensorSplit (``self.tensor``) answers from it: the split's options, its timed
    collective wait, its figures and the loss context (mixed in before the strategy's base class)."""

    tensor: TensorSplit

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        return self.tensor.loss_parallel

    def collective_wait_s(self) -> float:
        return self.tensor.collective_wait_s()

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), **self.tensor.figures()}

    def loss_context(self) -> AbstractContextManager:
        return self.tensor.loss_context()


class TensorParallelStrategy(HoldsTensorSplit, ReplicatedStrategy):
    """Tensor parallelism over ``mesh['tp']`` (``TensorSplit``), then at most one data-parallel wrapper on the
    split model's DTensors: FSDP2 (or HSDP) over ``dp_mesh`` when it has more than one rank (``data``, an
    ``FSDPStrategy``), or DiLoCo's outer loop over the tp groups. Its state methods are DTensor's (fsdp.py's
    module functions), with the fused qkv rows put back in the unsplit model's order."""

    gradients_replicated = False
    reduces_every_micro_batch = True
    forward_is_collective = True
    splits_model = True
    step_operation = "all_reduce (tensor-parallel layers in forward and backward, gradient sync)"

    def __init__(self, device: torch.device, mesh: Any, plan: Mapping[str, Any] | None = None,
                 sequence_parallel: bool = False, loss_parallel: bool = False, dp_mesh: Any = None,
                 outer_loop: OuterLoop = NO_OUTER_LOOP):
        self.device = device
        self.comm_timer = CommTimer()
        """FSDP2 and DTensor run their collectives themselves: the timer sees none (``tp_comm`` has tp's waits)."""
        self.tensor = TensorSplit(device, mesh, plan=plan, sequence_parallel=sequence_parallel,
                                  loss_parallel=loss_parallel)
        self.outer_loop = outer_loop
        """DiLoCo's beside tp: a replica is a tp group, the replicas kept together by outer steps over dp (no FSDP2)."""
        self.mesh = mesh
        self.tp = self.tensor.tp
        replicas = "dp_replicate" in mesh.mesh_dim_names
        self.dp_mesh = dp_mesh if dp_mesh is not None else mesh[("dp_replicate", "dp_shard")] if replicas else mesh["dp"]
        """FSDP2's mesh: the data-parallel dimension, or its two (replicas of shard groups: HSDP), or the ranks
        gradients are averaged over beside context parallelism (``dp_cp``: the data-parallel ranks and their cp
        groups, given as ``dp_mesh``)."""
        self.dp = self.dp_mesh.size()
        self.name = ("tp" if self.dp == 1 else "diloco+tp" if outer_loop.syncs_replicas else "fsdp+tp" if not replicas
                     else "ddp+tp" if self.dp_mesh.size(-1) == 1 else "hsdp+tp")  # (its shard groups' size)
        if outer_loop.syncs_replicas:  # DiLoCo's replicas step on their own: averaged over their cp ranks only
            self.dp_mesh = mesh["cp"] if "cp" in mesh.mesh_dim_names else None
        self.data = FSDPStrategy(device, mesh=self.dp_mesh) if self.dp_mesh is not None and self.dp_mesh.size() > 1 \
            and (self.dp > 1 or outer_loop.syncs_replicas) else None
        """The one data-parallel wrapper after the split (DiLoCo's replicas: FSDP2 over each one's cp ranks, which
        read one sequence's parts, or none)."""

    def split(self, model: nn.Module) -> nn.Module:
        """The transform alone (``TensorSplit.apply``)."""
        return self.tensor.apply(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The tensor-parallel transform, then FSDP2 over ``dp_mesh`` (``data``) when there is one."""
        self.split(model)
        if self.data is not None:
            shard_blocks(model, self.dp_mesh)
            self.tensor.index_fused(model)  # FSDP2's parameters are new DTensors
        self.outer_loop.attach(model, list(model.parameters()), self.mesh["dp"].get_group())  # DiLoCo's, or none
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()  # FSDP2 reduces on every micro-batch; the split layers' collectives must run

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """torch's clip over the whole model's gradients, which may mix DTensors (split layers, on the tp or the
        2-D mesh) and plain tensors (the layers a plan leaves whole, the same on every tp rank): the norm is
        taken per mesh (DTensor reduces its shards) and the parts added."""
        groups: dict[Any, list[nn.Parameter]] = {}
        for param in self.unwrap(model).parameters():
            if param.grad is not None:
                groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
        norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in group])) for group in groups.values()]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    # --- the full form: the unsplit model's (qkv rows back in q | k | v order) -----------------------------
    def full_named_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: self.tensor.natural(name, _full(p.detach())) for name, p in model.named_parameters()}

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {key: self.tensor.natural(key, _full(value)) for key, value in model.state_dict().items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_dtensor_model_state(model, {key: self.tensor.ranked(key, value) for key, value in state.items()})

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        full = full_optimizer_state(optimizer)
        return {**full, "state": self.tensor.map_state(optimizer, full["state"], _to_natural)}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        ranked = {**state, "state": self.tensor.map_state(optimizer, state["state"], _to_ranks)}
        return shard_optimizer_state_like(optimizer, ranked)

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        return local_state_tensors(model, optimizer)

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's slices for a sharded (DCP) checkpoint, in the unsplit model's order: every DTensor as it
        is (DCP writes each shard at its offsets, replicated ones once) except the qkv layers' and their
        optimizer moments, whose rows are in rank order here: those are gathered, put back in q | k | v order
        and cut again evenly on the same mesh (a natural-order DTensor each rank writes one stretch of). So a
        tp2 x dp2 checkpoint loads at dp4, pp2 or one worker, and theirs here (DCP reshards)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.unwrap(model), optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        for name, moments, value, dim in _fused_entries(state, self.tensor.fused_dim):
            moments[name] = _recut(value, _to_natural(_full(value), self.tp, dim))
        return state

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                              load: Callable[[dict[str, Any]], None]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.checkpoint_state(model, optimizer)  # natural-order qkv stretches to read into
        load(state)
        for name, moments, value, dim in _fused_entries(state, self.tensor.fused_dim):
            moments[name] = _recut(value, _to_ranks(_full(value), self.tp, dim))
        set_state_dict(self.unwrap(model), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


def parallelize_transformer(model: nn.Module, mesh: Any, sequence_parallel: bool = False) -> None:
    """The tensor-parallel plan of ``models.transformer.TransformerLM`` on the 1-D ``mesh`` (see the module's
    docstring); every parameter becomes a DTensor (the split ones sharded, the rest replicated).
    ``sequence_parallel``: the residual stream between the split layers is sharded by sequence (``Shard(1)``):
    the norms run on each rank's share of the tokens (torch's ``SequenceParallel``), the column splits gather
    the sequence first and the row splits reduce-scatter into it, in place of one all-reduce; the embeddings'
    sum is cut (no communication) before the first block and gathered again for the output layer."""
    tp = mesh.size()
    if model.n_heads % tp:
        raise ConfigError(f"[parallel] tp = {tp} does not divide model.n_heads ({model.n_heads}): each rank computes "
                          f"whole heads; set n_heads to a multiple of {tp}, or tp to a divisor of {model.n_heads}")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
                                                   SequenceParallel, parallelize_module)

    split_blocks(list(model.blocks), mesh, sequence_parallel)
    whole = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate())
    head = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=True)
    outer = {"token_embedding": whole, "position_embedding": whole, "head": head}
    if sequence_parallel and len(model.blocks):
        outer.update({
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
            "norm": SequenceParallel(use_local_output=False),
            "head": PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                             output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                             use_local_output=True),
        })
    parallelize_module(model, mesh, outer)
    replicate_rest(model, mesh)


def parallelize_stage(stage: nn.Module, mesh: Any, replicated: dict[int, nn.Parameter],
                      sequence_parallel: bool = False, vocabulary_split: bool = False) -> None:
    """The built-in transformer's tensor-parallel plan inside one pipeline stage (``pipeline.TransformerStage``)
    on the 1-D ``mesh``: its blocks split as ``parallelize_transformer`` splits them, its edges made to pass
    plain tensors (a stage's schedule sends and receives those): a stage that starts after the embeddings takes
    its input as a DTensor, one that ends before the output layer hands on its local value. That value is the
    whole activation (replicated on the tp ranks), or with ``sequence_parallel`` this rank's share of the
    sequence (``Shard(1)``: each tp rank sends its peer in the next stage 1/tp of it). The rest of its
    parameters replicated; ``replicated`` is shared by the stages of one rank, so a weight two of them hold (the
    tied embedding of a V schedule's first and last stage) stays one parameter. ``vocabulary_split``
    (``loss_parallel``, the last stage holding its own copy of the output layer): that layer split by vocabulary
    (``vocabulary_split_output``'s ColwiseParallel), its logits left sharded on the last dimension."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
                                                   SequenceParallel, parallelize_module)

    split_blocks(list(stage.blocks.values()), mesh, sequence_parallel)
    passed = Shard(1) if sequence_parallel else Replicate()  # what crosses between stages (its local value)
    whole = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate())
    taken = PrepareModuleInput(input_layouts=passed, desired_input_layouts=passed)
    local = PrepareModuleOutput(output_layouts=passed, desired_output_layouts=passed, use_local_output=True)
    first, last = f"blocks.{next(iter(stage.blocks))}", f"blocks.{list(stage.blocks)[-1]}"
    if stage.is_first:
        edges = {"token_embedding": whole, "position_embedding": whole}
        if sequence_parallel:  # the embeddings' sum cut by sequence (no communication)
            edges[first] = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1))
    else:
        edges = {first: taken}
    if stage.is_last:
        edges["head"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                            use_local_output=True)
        if sequence_parallel:
            edges["norm"] = SequenceParallel(use_local_output=False)
            edges["head"] = PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                     output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                                     use_local_output=True)
        if vocabulary_split:
            from torch.distributed.tensor.parallel import ColwiseParallel

            edges["head"] = ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                            output_layouts=Shard(-1), use_local_output=False)
    elif first == last and not stage.is_first:  # one block between two other stages: both of its edges
        edges[last] = PrepareModuleInputOutput(input_layouts=passed, desired_input_layouts=passed,
                                               output_layouts=passed, desired_output_layouts=passed)
    elif first == last and sequence_parallel:  # the first stage's only block: cut its input, hand on its share
        edges[last] = PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                               output_layouts=passed, desired_output_layouts=passed)
    else:
        edges[last] = local
    parallelize_module(stage, mesh, edges)
    if not stage.is_last:
        # to_local() hands on a view, which the zero-bubble schedules' in-place detach of a stage's outputs refuses:
        # the output gets its own storage (one copy of the activation per micro-batch).
        stage.blocks[last[len("blocks."):]].register_forward_hook(lambda module, args, output: output.clone())
    replicate_rest(stage, mesh, replicated)


def split_blocks(blocks: list[nn.Module], mesh: Any, sequence_parallel: bool = False) -> None:
    """Megatron's split of each of the built-in transformer's ``blocks`` over ``mesh``: the qkv rows put in rank
    order, the attention's qkv and the MLP's up split by columns, its proj and down by rows; with
    ``sequence_parallel`` the residual stream between them sharded by sequence and the norms with it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tp = mesh.size()
    with torch.no_grad():
        for block in blocks:
            for param in block.attn.qkv.parameters():
                param.copy_(_to_ranks(param, tp))
    stream = Shard(1) if sequence_parallel else Replicate()
    for block in blocks:
        # The column splits hand on local tensors (whole heads, whole hidden units); the row splits' outputs are
        # DTensors (replicated, or sequence-sharded), so the residual stream stays one.
        plan = {
            "attn.qkv": ColwiseParallel(input_layouts=stream),
            "attn.proj": RowwiseParallel(output_layouts=stream, use_local_output=False),
            "ff.up": ColwiseParallel(input_layouts=stream),
            "ff.down": RowwiseParallel(output_layouts=stream, use_local_output=False),
        }
        if sequence_parallel:
            plan.update({"norm_attn": SequenceParallel(use_local_output=False),
                         "norm_ff": SequenceParallel(use_local_output=False)})
        parallelize_module(block, mesh, plan)


def replicate_rest(module: nn.Module, mesh: Any, replicated: dict[int, nn.Parameter] | None = None) -> None:
    """Every plain parameter under ``module`` made a replicated DTensor on ``mesh`` (the same value on every rank;
    a tied weight stays one parameter: ``replicated`` maps the plain parameter's id to its DTensor)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    replicated = {} if replicated is None else replicated
    for child in module.modules():
        for name, param in list(child._parameters.items()):
            if param is None or hasattr(param, "device_mesh"):
                continue
            if id(param) not in replicated:
                replicated[id(param)] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()]),
                                                     requires_grad=param.requires_grad)
            child._parameters[name] = replicated[id(param)]


class CollectiveWaits:
    """Time spent waiting for torch's functional collectives, which DTensor issues asynchronously and waits
    for at the first use of their result (``_functional_collectives.wait_tensor``, wrapped once per process):
    on Gloo the all-reduce runs on the backend's thread meanwhile, so the wait is its exposed part. With
    ``group`` a process group of ringtrain's shared-memory backend (``parallel.tp_algorithm = 'shm'``), whose
    collectives are synchronous, the time inside them is added."""

    _total = 0.0
    _installed = False

    def __init__(self, group: Any = None) -> None:
        self._taken = CollectiveWaits._total
        self._group = group
        self._shm_taken = getattr(group, "shm_s", 0.0)

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        import torch.distributed._functional_collectives as funcol

        wait = funcol.wait_tensor

        def timed_wait(tensor: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return wait(tensor)
            finally:
                cls._total += time.perf_counter() - start

        funcol.wait_tensor = timed_wait
        cls._installed = True

    def take(self) -> float:
        """Seconds waited since the last take (or since this timer was made)."""
        total = CollectiveWaits._total
        waited, self._taken = total - self._taken, total
        shm_s = getattr(self._group, "shm_s", 0.0)
        inside, self._shm_taken = shm_s - self._shm_taken, shm_s
        return waited + inside


STYLES = ("colwise", "rowwise")
"""A plan's words: "colwise" splits an nn.Linear by output features (its output stays split: the next layer in
the plan takes it whole-row), "rowwise" by input features, its output all-reduced (whole on every rank)."""


def user_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """A user's plan checked: module paths to one of ``STYLES`` or a torch ``ParallelStyle``."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(f"tp_plan must be a dict of module paths to 'colwise', 'rowwise' or a torch ParallelStyle, "
                          f"e.g. {{'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}}; got {plan!r}")
    for path, style in plan.items():
        if not isinstance(path, str) or not (style in STYLES or isinstance(style, ParallelStyle)):
            raise ConfigError(f"tp_plan[{path!r}] = {style!r}: each entry maps a module path to 'colwise', 'rowwise' "
                              "or a torch.distributed.tensor.parallel ParallelStyle")
    return dict(plan)


def huggingface_plan(model: nn.Module, tp: int) -> dict[str, Any] | None:
    """The plan a Hugging Face model's config declares for its base model (``base_model_tp_plan``: Llama,
    Mistral, Qwen2 and their kin), its paths made the whole model's; for GPT-2, which declares none, ringtrain's
    (``gpt2_plan``); None for any other. Its heads (and key-value heads) must divide by ``tp``; the output layer
    stays whole (``vocabulary_split_output`` adds it, split, under ``loss_parallel``)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    base = getattr(model, "base_model_prefix", "")
    prefix = f"{base}." if base and getattr(model, base, None) is not None else ""
    if not plan:
        return gpt2_plan(model, tp, prefix) if _is_gpt2(model) else None
    name = type(model).__name__
    other = sorted({style for style in plan.values() if style not in STYLES})
    if other:
        raise ConfigError(f"[parallel] tp = {tp}: {name}'s tensor-parallel plan uses {', '.join(other)}, which "
                          "ringtrain does not apply yet (it applies 'colwise' and 'rowwise'); pass your own "
                          "fit(..., tp_plan=...), or set tp = 1")
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if heads is not None and heads % tp:
            raise ConfigError(f"[parallel] tp = {tp} does not divide {name}'s {field} ({heads}): each rank computes "
                              f"whole heads; set tp to a divisor of {heads}")
    return {prefix + path: style for path, style in plan.items()}


def vocabulary_split_output(model: nn.Module, sequence_parallel: bool = False) -> dict[str, Any]:
    """The plan entry that splits a model's own output layer by vocabulary (``loss_parallel``): torch's
    ``ColwiseParallel`` with its logits left sharded on the last dimension (a DTensor), which torch's
    ``loss_parallel`` reads. The layer is the model's ``get_output_embeddings()`` (a Hugging Face model's
    ``lm_head``); a model without one, or whose output layer is tied to its input embeddings, is refused in one
    line."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    name = type(model).__name__
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if not isinstance(output, nn.Linear):
        raise ConfigError(f"[parallel] loss_parallel = true: {name} has no output layer to split by vocabulary "
                          "(get_output_embeddings() gives no nn.Linear); leave loss_parallel unset")
    get_input = getattr(model, "get_input_embeddings", None)
    inputs = get_input() if callable(get_input) else None
    if inputs is not None and getattr(inputs, "weight", None) is output.weight:
        raise ConfigError(f"[parallel] loss_parallel = true: {name}'s output layer is tied to its input embeddings "
                          "(tie_word_embeddings), which a vocabulary split would split too; build it with "
                          "tie_word_embeddings=False, or leave loss_parallel unset")
    path = next(path for path, module in model.named_modules() if module is output)
    return {path: ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                  output_layouts=Shard(-1), use_local_output=False)}


def _is_gpt2(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "gpt2"


def gpt2_plan(model: nn.Module, tp: int, prefix: str = "") -> dict[str, Any]:
    """Megatron's split of Hugging Face GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``): per block the fused
    ``attn.c_attn`` (q | k | v) and ``mlp.c_fc`` by output features, ``attn.c_proj`` and ``mlp.c_proj`` by input
    features. Its layers are ``Conv1D``s (a Linear with the weight stored (in, out)), which torch's styles do not
    take: ``Conv1DColwise`` / ``Conv1DRowwise`` shard the other weight dimension. The strategy puts c_attn's
    columns in rank order first (``_gpt2_heads_to_ranks``), as it does the built-in transformer's qkv rows."""
    config = model.config
    if config.n_head % tp:
        raise ConfigError(f"[parallel] tp = {tp} does not divide {type(model).__name__}'s n_head ({config.n_head}): "
                          f"each rank computes whole heads; set tp to a divisor of {config.n_head}")
    if getattr(config, "add_cross_attention", False):
        raise ConfigError(f"[parallel] tp = {tp}: {type(model).__name__} has cross-attention (add_cross_attention), "
                          "which ringtrain's GPT-2 plan does not split; pass your own fit(..., tp_plan=...), or set tp = 1")
    colwise, rowwise = _conv1d_styles()
    return {f"{prefix}h.*.attn.c_attn": colwise(), f"{prefix}h.*.attn.c_proj": rowwise(),
            f"{prefix}h.*.mlp.c_fc": colwise(), f"{prefix}h.*.mlp.c_proj": rowwise()}


def _gpt2_heads_to_ranks(model: nn.Module, tp: int) -> None:
    """Each GPT-2 attention's c_attn columns in rank order (rank r's are q_r | k_r | v_r, its heads), and its
    ``split_size`` (the width of q, k and v it splits c_attn's output into) made this rank's."""
    for module in model.modules():
        if hasattr(module, "c_attn") and hasattr(module, "split_size"):
            with torch.no_grad():
                module.c_attn.weight.copy_(_to_ranks(module.c_attn.weight, tp, 1))
                module.c_attn.bias.copy_(_to_ranks(module.c_attn.bias, tp, 0))
            module.split_size //= tp


@functools.cache
def _conv1d_styles():
    """``Conv1DColwise`` and ``Conv1DRowwise``, made on first use (torch's tensor-parallel styles are imported
    only by a run that splits a model)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def apply(style, module: nn.Module, mesh: Any, weight: Any, bias: Any) -> nn.Module:
        if type(module).__name__ != "Conv1D":
            raise ConfigError(f"{type(style).__name__} splits Hugging Face Conv1D layers, not a {type(module).__name__}")

        def partition(name: str, mod: nn.Module, mesh: Any) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                placement = weight if key == "weight" else bias
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement],
                                                                           src_data_rank=style.src_data_rank)))

        return distribute_module(module, mesh, partition,
                                 functools.partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
                                 functools.partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))

    class Conv1DColwise(ColwiseParallel):
        """torch's ColwiseParallel for a ``Conv1D``: its weight (in, out) sharded by columns, its bias too."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return apply(self, module, device_mesh, Shard(1), Shard(0))

    class Conv1DRowwise(RowwiseParallel):
        """torch's RowwiseParallel for a ``Conv1D``: its weight (in, out) sharded by rows, its bias whole."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            self.desired_input_layouts = (Shard(-1),)
            return apply(self, module, device_mesh, Shard(0), Replicate())

    return Conv1DColwise, Conv1DRowwise


def __getattr__(name: str) -> Any:
    if name in ("Conv1DColwise", "Conv1DRowwise"):
        return _conv1d_styles()[name == "Conv1DRowwise"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply_plan(model: nn.Module, plan: Mapping[str, Any], mesh: Any) -> None:
    """``plan`` on ``model`` over the 1-D ``mesh`` (torch's ``parallelize_module``), each path checked first: it
    names at least one module, and each it names is an ``nn.Linear`` (or the plan gave a ParallelStyle)."""
    import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = dict(model.named_modules())
    styles = {}
    for path, style in plan.items():
        # torch's wildcard: '*' stands for one name (no dots).
        matched = [n for n in names if fnmatch.fnmatchcase(n, path) and n.count(".") == path.count(".")]
        if not matched:
            raise ConfigError(f"tp_plan: {path!r} names no module of {type(model).__name__} (its modules are named like "
                              f"{', '.join(list(names)[1:4])}, ...); fix the path ('*' stands for one name)")
        if isinstance(style, str):
            wrong = [n for n in matched if not isinstance(names[n], nn.Linear)]
            if wrong:
                raise ConfigError(f"tp_plan: {path!r} -> '{style}' needs nn.Linear layers, but {wrong[0]} is a "
                                  f"{type(names[wrong[0]]).__name__}; give that entry a torch ParallelStyle that "
                                  "handles it, or leave the layer whole")
            style = ColwiseParallel() if style == "colwise" else RowwiseParallel()
        styles[path] = style
    parallelize_module(model, mesh, styles)


def _fused_entries(state: dict[str, Any], fused_dim: Callable[[str], int | None]):
    """(key, the dict holding it, value, the fused dimension) for every qkv tensor of a ``get_state_dict`` pair:
    the model's parameters and each of their optimizer entries' tensors (AdamW's moments; ``step`` is a
    scalar)."""
    model_sd, optim_sd = state["model"], state["optimizer"]
    # get_state_dict's optimizer entries are the optimizer's own dicts: the fused ones are copied before their
    # moments are swapped for natural-order ones (else the swap would reach the optimizer's next step).
    optim_sd["state"] = {name: dict(entry) if fused_dim(name) is not None else entry
                         for name, entry in optim_sd["state"].items()}
    found = [(name, model_sd, value, fused_dim(name)) for name, value in model_sd.items() if fused_dim(name) is not None]
    for name, entry in optim_sd["state"].items():
        if fused_dim(name) is not None:
            found += [(key, entry, value, fused_dim(name)) for key, value in entry.items()
                      if isinstance(value, torch.Tensor) and value.dim() > 0]
    return found


def _recut(like: Any, full: torch.Tensor) -> Any:
    """``full`` laid out as the DTensor ``like`` is (same mesh and placements, each rank cutting its own piece,
    no communication), or ``full`` itself where ``like`` is a plain tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.detach(), like.device_mesh, like.placements, src_data_rank=None)


def _to_ranks(full: torch.Tensor, tp: int, dim: int = 0) -> torch.Tensor:
    """q | k | v along ``dim`` (each cut in ``tp`` pieces) -> rank order: q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ..."""
    rows = full.movedim(dim, 0)
    return rows.reshape(3, tp, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape).movedim(0, dim).contiguous()


def _to_natural(ranked: torch.Tensor, tp: int, dim: int = 0) -> torch.Tensor:
    """The inverse of ``_to_ranks``."""
    rows = ranked.movedim(dim, 0)
    return rows.reshape(tp, 3, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape).movedim(0, dim).contiguous()
