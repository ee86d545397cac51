"""Pipeline parallelism for the built-in Transformer LM (``torch.distributed.pipelining``'s stages and
schedules), alone or with data-parallel replicas of the pipeline on a 2-D mesh (``dp`` outermost, ``pp``
innermost: one pipeline is consecutive ranks):

    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    strategy = PipelineStrategy(torch.device("cpu"), mesh, schedule="1f1b", microbatches=4)
    model = strategy.wrap(model)          # this rank's stages: blocks [i*L/S, (i+1)*L/S) of stage i
    optimizer = strategy.shard_optimizer(build_optimizer(config, model.parameters()))   # its stages' parameters
    loss_sum = strategy.pipeline_step(micro_batches, loss_fn, autocast)   # the schedule's forward and backward
    strategy.synchronize_gradients()      # the tied embedding's two halves, then the mean over dp replicas

Stage ``i`` of ``S = pp x stages_per_rank`` holds ``L / S`` consecutive blocks; the first also the embeddings,
the last the final norm and the output layer. Stages sit on pipeline ranks in a loop (stage i on rank i mod pp:
gpipe, 1f1b and the interleaved schedules) or a V (rank r holds r and 2pp-1-r: zbv_zero_bubble). Every
submodule keeps the whole model's name, so checkpoints are the unsplit model's and load into any layout.

The output layer is tied to the token embedding. When the first and last stages are on different ranks each
holds its own copy of the weight (the last stage's is a clone made at wrap), and after every backward the two
ranks add their gradients (Megatron's embedding group): both copies then take the same update and stay equal
bit for bit. The global norm counts the weight once.

The pipeline's micro-batches are ringtrain's: a step's batch is cut into ``microbatches`` near-equal parts,
each padded to the largest with rows that the loss does not read (a schedule's stages exchange activations of
one shape). The loss of each micro-batch is the task's sum over its items times the step's scale (the
data-parallel size over the step's items), so the accumulated gradient is the full batch's mean, as for every
other strategy; the schedule does not scale gradients again. Under a token budget (``train.max_tokens``) the
count follows the step: as many micro-batches as keep each within the budget (every one as wide as the share's
longest sequence), at least ``microbatches`` (``MicroBatcher.pipeline_count``). Each activation shape and count
(the last, smaller window of an epoch; text of another width) gets its own stages and schedule, built once and
kept (the most recent eight).

With ``tp`` > 1 the mesh is 3-D, ``(dp, pp, tp)`` with tp innermost, and each of the built-in transformer's
stages is split over ``mesh['tp']`` (``tensor.parallelize_stage``) before FSDP2, if any, shards it over dp:

    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))

With ``cp`` > 1 (the mesh ``(dp, pp, cp)``) every stage's ranks split each micro-batch's sequence
(``SequenceSplit``): the first stage keeps each cp rank's chunks of the tokens at their global positions, the
stages pass the chunks on, the last gathers the logits; the gradients are averaged over dp x cp.

Limits (refused in one line before any worker starts, config/parallel.py): the built-in transformer or a user's
nn.Sequential (tp inside stages: the built-in transformer only, sequence parallel or not; cp: the built-in
transformer, beside tp too: cp splits the sequence first, sp each cp part), ddp, manual, zero1-3 (each stage
wrapped by ringtrain's ZeRO over dp, ``pipeline_zero.py``; not beside tp or cp) or FSDP2 beside it (HSDP too, its
stages split by tp or not: FSDP2's 2-D mesh ``(dp_replicate, dp_shard)``; under FSDP2 and zero3 the dp ranks agree
on each step's micro-batch shapes, ``pipeline_schedule.agree_shapes``), DiLoCo's replicas of whole pipelines,
loss_parallel with tp (the last stage's own copy of the tied output layer split by vocabulary; not under zbv or
FSDP2), no --heal, no automatic micro-batch shrinking. Every rank builds the whole model, keeps its stages and
moves the rest to the meta device (shapes without memory).

The pieces, each its own module: the stages and the cut (``pipeline_stages.py``), the schedule and its
micro-batches' shapes (``pipeline_schedule.py``), what ranks pass outside a schedule (``pipeline_wire.py``), ZeRO
on each stage (``pipeline_zero.py``). This module is the strategy that puts them together.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import comm
from ringtrain.errors import ConfigError
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.parallel.base import ReplicatedStrategy, optimizer_tensors
from ringtrain.parallel.fsdp import _broadcast_from_rank0, _full, _local, _shard_like
from ringtrain.parallel.outer_loop import NO_OUTER_LOOP, OuterLoop
from ringtrain.parallel.pipeline_schedule import _SCHEDULES_KEPT, SCHEDULES, agree_shapes, make_schedule, pad_rows
from ringtrain.parallel.pipeline_stages import (SequenceSplit, SequentialStage, TransformerStage, UserStage,
                                                describe_stages, merge_into, sequential_cut, stage_indices)
from ringtrain.parallel.pipeline_wire import _all_gather_tensors, _recv_tensor, _send_tensor, _to_cpu
from ringtrain.parallel.tensor import _FUSED, CollectiveWaits, _fused_entries, _recut, _to_natural, _to_ranks

__all__ = ["PipelineStrategy", "TransformerStage", "UserStage", "stage_indices", "SCHEDULES"]
class PipelineStrategy(ReplicatedStrategy):
    """The model's stages over ``mesh['pp']``; gradients averaged over ``mesh['dp']`` when it has more than one
    rank (each pipeline a replica)."""

    gradients_replicated = False
    pipelined = True
    splits_model = True
    step_operation = "pipeline schedule (activations and gradients between stages)"

    def __init__(self, device: torch.device, mesh: Any, schedule: str = "1f1b", microbatches: int | None = None,
                 stages_per_rank: int = 1, shard: bool = False, algorithm: str = "torch", chunk_kb: int | None = None,
                 sequence_parallel: bool = False, split: Callable[[nn.Module, int], list[nn.Module]] | None = None,
                 outer_loop: OuterLoop = NO_OUTER_LOOP, zero: Any = None, loss_parallel: bool = False):
        self.device = device
        self.outer_loop = outer_loop
        """DiLoCo's beside pp: a replica is a pipeline, the replicas kept together by outer steps over dp (their
        gradients never averaged)."""
        self.split = split
        """A user's split function (``fit(pp_split=...)``): ``split(model, stages)`` -> the stage modules, in order."""
        self.algorithm, self.chunk_kb = algorithm, chunk_kb
        """How the replicas' gradients are averaged over dp (``comm.all_reduce``'s algorithm; 'torch': the
        backend's own)."""
        self.mesh = mesh
        self.pp, self.dp = mesh["pp"].size(), mesh["dp"].size()
        self.tp = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
        """Tensor parallelism inside every stage (the built-in transformer), over mesh['tp']."""
        self.cp = mesh["cp"].size() if "cp" in mesh.mesh_dim_names else 1
        self.context = SequenceSplit(mesh.get_group("cp")) if self.cp > 1 else None
        """Context parallelism inside every stage (the built-in transformer): each micro-batch's sequence split over
        mesh['cp'] (``SequenceSplit``)."""
        self.grad_group = mesh.get_group("dp_cp") if self.cp > 1 else mesh.get_group("dp")
        self.grad_ranks = self.dp * self.cp
        """The ranks the gradients are averaged over: the replicas and, with cp, each one's cp ranks (each holds its
        tokens' share: the step scales the loss by dp x cp, ``DistContext.gradient_ranks``, so the average over dp x
        cp is the sum over cp and the mean over dp). DiLoCo's replicas step on their own: over their cp ranks only
        (the loss's dp scale makes that average each replica's own mean)."""
        if outer_loop.syncs_replicas:
            self.grad_group, self.grad_ranks = (mesh.get_group("cp") if self.cp > 1 else None), self.cp
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.loss_parallel = loss_parallel and self.tp > 1
        """The last stage's own copy of the tied output layer split by vocabulary over tp, the loss computed on the
        logits' shards (torch's ``loss_parallel`` around the schedule)."""
        """The stages' residual stream split by sequence over tp (and passed between stages so)."""
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.pp_rank = mesh.get_local_rank("pp")
        self.schedule = schedule
        self.stages = self.pp * stages_per_rank
        self.stages_per_rank = stages_per_rank
        self.microbatches = microbatches or self.stages
        """Micro-batches a step (with a token budget: the fewest; the budget may ask for more)."""
        self.microbatch_multiple = self.pp if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") else 1
        """The interleaved schedules run micro-batches in rounds of pp."""
        self.indices = stage_indices(self.pp_rank, self.pp, stages_per_rank, schedule)
        self.shard = shard and self.dp > 1
        """FSDP2 over mesh['dp'] on every stage (each replica holds 1/dp of its stages' state)."""
        self.replicas = mesh["dp_replicate"].size() if self.shard and "dp_replicate" in mesh.mesh_dim_names else 1
        """HSDP: FSDP2's replicas of each stage's shard groups (its 2-D mesh, dp_replicate x dp_shard)."""
        from ringtrain.parallel.pipeline_zero import StageZero

        self.zero = StageZero(zero, self.dp_group) if zero is not None and self.dp > 1 else None
        """The registry's zero strategy on every stage over mesh['dp'] (``pipeline_zero.py``)."""
        self.forward_is_collective = self.shard or (self.zero is not None and self.zero.stage == 3)
        """Across the replicas (FSDP2 gathers each block's parameters); a pipeline's own ranks always pass
        activations, which ``forward`` arranges."""
        data = ("" if self.dp == 1 else "hsdp+" if self.replicas > 1 else "fsdp+" if self.shard
                else f"{zero.name}+" if self.zero else "diloco+" if outer_loop.syncs_replicas else "ddp+")
        self.name = f"{data}pp" + ("+tp" if self.tp > 1 else "") + ("+cp" if self.cp > 1 else "")
        self.comm_timer = zero.comm_timer if self.zero is not None else CommTimer()
        """The pipeline's sends and receives are not hook-timed: they are the step's ``pipeline_wait`` phase."""
        self._waits = CollectiveWaits(mesh["tp"].get_group()) if self.tp > 1 else None
        """The split layers' collectives under tp (their ``tp_comm`` phase)."""
        self.modules: list[nn.Module] = []
        self._full: nn.Module | None = None
        self._tied = False
        """The built-in transformer: its output layer is its token embedding."""
        self._parameter_names: list[str] = []
        self._clone: nn.Parameter | None = None
        """The last stage's copy of the tied embedding weight, when the first stage is on another rank."""
        self._tie_group: dist.ProcessGroup | None = None
        self._tie_src: int | None = None
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        """Built schedules by micro-batch shape and count, the most recently used last (at most _SCHEDULES_KEPT)."""
        self._compute_s = 0.0
        self._counts: dict[int, int] = {}
        """Steps run by micro-batch count."""
        self._groups: list[list[str]] = []
        """The optimizer's parameter groups by whole-model parameter name (the full form's order)."""

    # --- building ------------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        from ringtrain.models.transformer import TransformerLM

        where = f"[parallel] pp = {self.pp} x stages_per_rank = {self.stages_per_rank}"
        if self.split is None and not isinstance(model, (TransformerLM, nn.Sequential)):
            raise ConfigError(f"{where}: pipeline parallelism cuts the built-in transformer or an nn.Sequential into "
                              f"stages, and this model is a {type(model).__name__}; build it as an nn.Sequential "
                              "(its children are cut in order), pass fit(..., pp_split=split) with split(model, "
                              "stages) returning the stage modules, or set pp = 1")
        if isinstance(model, nn.Sequential) and len(model) < self.stages:
            raise ConfigError(f"{where}: {self.stages} stages, but the nn.Sequential has {len(model)} children; "
                              "lower pp or stages_per_rank, or split the model into more children")
        if self.cp > 1 and not (isinstance(model, TransformerLM) and self.split is None):
            raise ConfigError(f"{where} with cp = {self.cp}: context parallelism inside pipeline stages splits the "
                              "built-in transformer's sequence (its first stage shards the tokens, its last gathers the "
                              f"logits), and a {type(model).__name__}'s stages are its own; set cp = 1 or pp = 1")
        model.to(self.device)
        _broadcast_from_rank0(model)  # every rank keeps its stages of one copy
        self._full = model
        self._parameter_names = [name for name, _ in model.named_parameters()]  # the tied weight once
        self._tied = isinstance(model, TransformerLM) and self.split is None
        if (self.shard or self.zero) and self._tied and 0 in self.indices and self.stages - 1 in self.indices:
            raise ConfigError(f"{where} with a sharding comm.strategy and pp_schedule = '{self.schedule}': the first "
                              "and last stages on one rank share the tied embedding, which cannot be sharded in two "
                              "modules; use another schedule (1f1b, interleaved_1f1b), or comm.strategy = 'ddp'")
        if self._tied:
            head = None
            if self.stages - 1 in self.indices and 0 not in self.indices:
                head = nn.Linear(model.d_model, model.head.out_features, bias=False, device=self.device)
                head.weight = self._clone = nn.Parameter(model.token_embedding.weight.detach().clone())
            self.modules = [TransformerStage(model, index, self.stages, head, self.context) for index in self.indices]
            self._make_tie_groups()
        elif self.split is not None:
            stages = self._user_stages(model, where)
            self.modules = [stages[index] for index in self.indices]
        else:
            self._check_no_shared_parameters(model, where)
            self.modules = [SequentialStage(model, index, self.stages) for index in self.indices]
        self._release_other_stages()
        if self.tp > 1:
            self._split_stages(where)
        if self.shard:
            self._fully_shard()
        self._runs = self.zero.wrap(self.modules) if self.zero is not None else self.modules
        """What the schedule runs, one a stage: the stages, or their zero wrappers."""
        if self.tp > 1:
            self._waits.install()
        stages = nn.ModuleList(self._runs)
        self.outer_loop.attach(stages, self._own_parameters(), self.dp_group)
        return stages

    def _split_stages(self, where: str) -> None:
        """Tensor parallelism inside each of this rank's stages over mesh['tp'] (``tensor.parallelize_stage``):
        every parameter becomes a DTensor, so the tied copies are looked up again."""
        from ringtrain.models.transformer import TransformerLM
        from ringtrain.parallel.tensor import parallelize_stage

        if not isinstance(self._full, TransformerLM):
            raise ConfigError(f"{where} with tp = {self.tp}: tensor parallelism inside pipeline stages is built for the "
                              "built-in transformer, not a user's nn.Sequential; set tp = 1 or pp = 1")
        if self._full.n_heads % self.tp:
            raise ConfigError(f"[parallel] tp = {self.tp} does not divide model.n_heads ({self._full.n_heads}): each "
                              f"rank computes whole heads; set n_heads to a multiple of {self.tp}")
        if self.loss_parallel and not (self._tied and self._stage_rank(0) != self._stage_rank(self.stages - 1)):
            raise ConfigError(f"{where} with loss_parallel = true: the vocabulary split is of the last stage's own "
                              "copy of the built-in transformer's tied output layer, which a rank holding the first "
                              "stage too does not have; use pp_schedule = '1f1b' or 'interleaved_1f1b', or leave "
                              "loss_parallel unset")
        replicated: dict[int, nn.Parameter] = {}
        for module in self.modules:
            parallelize_stage(module, self.mesh["tp"], replicated, self.sequence_parallel,
                              vocabulary_split=self.loss_parallel and module.is_last)
        self._relink_tied()

    def _relink_tied(self) -> None:
        """After the stages' parameters were replaced (DTensors): the last stage's copy of the tied weight found
        again, or the whole model's output layer pointed at its embedding again."""
        if self._clone is not None:
            self._clone = next(m for m in self.modules if m.is_last).head.weight
        elif self._tied and 0 in self.indices:
            self._full.head.weight = self._full.token_embedding.weight

    def _fully_shard(self) -> None:
        """FSDP2 per block, then per stage, over mesh['dp'] (with cp: ``dp_cp``, each replica's cp ranks too: their
        gradients are its tokens' shares) (the pipeline's schedule drives its gradient sync: torch's stages know
        FSDP modules). Sharding makes new parameters: the tied copy is looked up again."""
        from torch.distributed.fsdp import fully_shard

        if self.replicas > 1:
            mesh = self.mesh[("dp_replicate", "dp_shard")]
        else:
            mesh = self.mesh["dp_cp"] if self.cp > 1 else self.mesh["dp"]
        for module in self.modules:
            # A user's stage runs its own module: which of its submodules are called is its business, so it is one
            # FSDP2 unit (gathered whole for its forward and backward).
            blocks = (module.blocks.values() if isinstance(module, TransformerStage)
                      else () if isinstance(module, UserStage) else module.children())
            for block in blocks:
                if any(True for _ in block.parameters()):
                    fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
        self._relink_tied()

    def _user_stages(self, model: nn.Module, where: str) -> list[UserStage]:
        """Every stage the user's split function makes (each rank builds all of them, keeps its own), checked: as
        many as the pipeline has, modules of this model (not copies), every parameter and state entry of the model
        in exactly one stage."""
        made = self.split(model, self.stages)
        if not isinstance(made, (list, tuple)) or len(made) != self.stages or not all(
                isinstance(m, nn.Module) for m in made):
            raise ConfigError(f"{where}: pp_split(model, {self.stages}) must return a list of {self.stages} nn.Modules "
                              f"(one a stage, in order), and it returned {describe_stages(made)}")
        stages = [UserStage(model, module, index, self.stages) for index, module in enumerate(made)]
        names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        owner: dict[int, int] = {}
        for index, (module, stage) in enumerate(zip(made, stages)):
            held = {id(p) for p in stage.parameters()}
            foreign = next((p for p in module.parameters() if id(p) not in held), None)
            if foreign is not None:
                raise ConfigError(f"{where}: stage {index} of pp_split uses a parameter of shape {tuple(foreign.shape)} "
                                  "that is not the model's; build the stages from the model's own modules (not copies "
                                  "or new layers)")
            for param in module.parameters():
                if owner.setdefault(id(param), index) != index:
                    raise ConfigError(f"{where}: {names[id(param)]} is in stages {owner[id(param)]} and {index} of "
                                      "pp_split; a pipeline keeps one copy a stage, so keep tied weights in one stage "
                                      "(or untie them), or set pp = 1")
        missing = [name for name, p in model.named_parameters() if id(p) not in owner]
        held_state = {key for stage in stages for key in stage.state_dict()}
        missing += [key for key in model.state_dict() if key not in held_state and key not in missing]
        if missing:
            raise ConfigError(f"{where}: no stage of pp_split holds {missing[0]}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; every parameter and "
                              "buffer of the model belongs to one stage")
        return stages

    def _check_no_shared_parameters(self, model: nn.Sequential, where: str) -> None:
        owner: dict[int, int] = {}
        for index, (start, stop) in enumerate(sequential_cut(len(model), self.stages)):
            for child in list(model)[start:stop]:
                for param in child.parameters():
                    if owner.setdefault(id(param), index) != index:
                        raise ConfigError(f"{where}: a parameter is shared by stages {owner[id(param)]} and {index} of "
                                          "the nn.Sequential; a pipeline keeps one copy a stage, so tie weights within a "
                                          "stage, or set pp = 1")

    def _release_other_stages(self) -> None:
        """The whole model's parameters that no stage here holds move to the meta device: their memory goes,
        their names and shapes stay (the full forms are named after them, FLOPs count them)."""
        own = {id(p) for p in self._own_parameters()}
        moved: dict[int, nn.Parameter] = {}  # by id: the tied weight stays one parameter
        for module in self._full.modules():
            for name, param in list(module._parameters.items()):
                if param is None or id(param) in own:
                    continue
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                    requires_grad=param.requires_grad)
                module._parameters[name] = moved[id(param)]

    def _make_tie_groups(self) -> None:
        """One group per pipeline (per data-parallel and tensor-parallel coordinate) of the ranks holding the first
        and last stages (every rank makes every group, in the same order, as ``new_group`` asks); none when one
        rank holds both."""
        first = self._stage_rank(0)
        last = self._stage_rank(self.stages - 1)
        if first == last:
            return
        pipelines = self.mesh.mesh.movedim(self.mesh.mesh_dim_names.index("pp"), -1).reshape(-1, self.pp)
        for pipeline in pipelines.tolist():  # each pipeline's ranks, by pipeline rank
            ranks = [pipeline[first], pipeline[last]]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                self._tie_group, self._tie_src = group, ranks[0]

    def _stage_rank(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return next(r for r in range(self.pp) if stage in stage_indices(r, self.pp, self.stages_per_rank, self.schedule))

    def _own_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (the tied weight once when both its ends are here)."""
        seen, params = set(), []
        for module in self.modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
        return params

    @property
    def _names(self) -> dict[int, str]:
        names = {id(p): name for name, p in self._full.named_parameters()}
        if self._clone is not None:
            names[id(self._clone)] = "head.weight"
        return names

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer over this rank's stages: each group keeps its own parameters that are here (the last
        stage's copy of the tied weight joins the embedding's group)."""
        names = self._names
        own = {id(p) for p in self._own_parameters()}
        self._groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if id(p) in own]
            if self._clone is not None and any(names[id(p)] == "token_embedding.weight" for p in group["params"]):
                kept.append(self._clone)
            group["params"] = kept
        return self.zero.shard_optimizer(optimizer) if self.zero is not None else optimizer

    def take_step_comm_s(self) -> float:
        """zero1/2's all-gather of the stepped shards (0 for the other data-parallel strategies)."""
        return self.zero.take_step_comm_s() if self.zero is not None else 0.0

    def collective_wait_s(self) -> float:
        """Seconds this rank spent in the split layers' collectives since the last call (tp > 1; 0 without):
        the step's ``tp_comm`` phase, taken out of the stages' compute."""
        return self._waits.take() if self._waits is not None else 0.0

    def figures(self) -> dict[str, Any]:
        """``pp_microbatches_run``: how many steps this rank's schedule ran with each micro-batch count (one count
        without a token budget); with ``parallel.tp_algorithm = 'shm'``, ``tp_shm_all_reduces``: the split
        layers' all-reduces this rank ran on shared memory."""
        figures: dict[str, Any] = {**super().figures(),  # DiLoCo's beside the pipeline
                                   "pp_microbatches_run": {str(k): v for k, v in sorted(self._counts.items())}}
        ops = getattr(self.mesh["tp"].get_group(), "shm_ops", None) if self.tp > 1 else None
        calls = None if ops is None else ops["all_reduce"]  # the backend counts every op it runs on shm, by op
        return figures if calls is None else {**figures, "tp_shm_all_reduces": calls}

    # --- a step --------------------------------------------------------------------------------------------
    def pipeline_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      autocast: Callable[[], AbstractContextManager] = nullcontext) -> float:
        """Run the schedule's forward and backward over ``micro_batches`` (every rank of the pipeline passes
        the same ones); ``loss_fn(outputs, targets)`` is called on the last stage with each micro-batch's real
        rows. Returns the seconds this rank computed (the rest of the step it waited on its neighbours)."""
        if not isinstance(micro_batches[0][0], torch.Tensor):
            raise ConfigError(f"a pipeline's first stage takes one tensor, and this data's inputs are a "
                              f"{type(micro_batches[0][0]).__name__}; make each sample's input one tensor, or set pp = 1")
        rows = max(1, max(len(targets) for _, targets in micro_batches))
        if self.forward_is_collective and self.dp > 1:
            micro_batches, rows = agree_shapes(micro_batches, rows, self.dp_group)
        inputs = [pad_rows(x, rows) for x, _ in micro_batches]
        if self.context is not None:  # the whole sequences' length, which the last stage's gathered logits keep
            self.context.length = inputs[0].shape[1]
        key = (tuple(inputs[0].shape), inputs[0].dtype, len(inputs))
        schedule = self._schedules.get(key) or self._build_schedule(key, loss_fn)
        self._schedules.move_to_end(key)
        self._counts[len(inputs)] = self._counts.get(len(inputs), 0) + 1
        schedule._loss_fn = loss_fn  # this step's scale
        first = 0 in self.indices
        last = self.stages - 1 in self.indices
        self._compute_s = 0.0
        with autocast(), self.loss_context():
            schedule.step(arg_mbs=[(x,) for x in inputs] if first else None,
                          kwarg_mbs=[{} for _ in inputs] if first else None,
                          target_mbs=[t for _, t in micro_batches] if last else None,
                          return_outputs=False)
        return self._compute_s

    def _build_schedule(self, key: tuple, loss_fn: Callable) -> Any:
        from torch.distributed.pipelining import PipelineStage

        stages = [PipelineStage(run, module.index, self.stages, self.device, group=self.pp_group)
                  for run, module in zip(self._runs, self.modules)]
        for stage, run in zip(stages, self._runs):
            self._time_chunks(stage, run)
        schedule = make_schedule(self.schedule, stages, key[-1], loss_fn)
        # Token budgets make many (shape, count) pairs; each schedule keeps receive buffers for its micro-batches.
        # Every rank of a pipeline sees the same keys in the same order, so all drop the same one.
        while len(self._schedules) >= _SCHEDULES_KEPT:
            self._schedules.popitem(last=False)
        self._schedules[key] = schedule
        return schedule

    def _time_chunks(self, stage: Any, run: nn.Module) -> None:
        """Count the seconds the stage computes (its forward, input-gradient and weight-gradient chunks); the
        schedule's sends and receives run between them. Under zero each backward is told whether it is the stage's
        last of the step (zero1 reduces then)."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            method = getattr(stage, name)

            def timed(*args, _method=method, _name=name, **kwargs):
                backward = self.zero is not None and _name == "backward_one_chunk"
                last = backward and kwargs.get("last_backward", False)
                if backward:
                    self.zero.before_backward(run, last)
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self._compute_s += time.perf_counter() - start
                    if backward:
                        self.zero.after_backward(run, last)

            setattr(stage, name, timed)

    def synchronize_gradients(self) -> float:
        """After the schedule: the tied weight's two gradients added, then every gradient averaged over the
        data-parallel replicas. Returns the seconds it took (exposed communication)."""
        start = time.perf_counter()
        params = self._own_parameters()
        if self.zero is not None:  # the replicas' sums were zero's reduce-scatters, in the schedule's backwards
            if self._tie_group is not None:
                self.zero.sum_tied(self._clone if self._clone is not None else self._full.token_embedding.weight,
                                   self._tie_group)
            return time.perf_counter() - start
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if self._tie_group is not None:
            tied = self._clone if self._clone is not None else self._full.token_embedding.weight
            if self.loss_parallel:
                self._sum_vocabulary_split_tie(tied)
            else:
                dist.all_reduce(_local(tied.grad), group=self._tie_group)  # under FSDP2: the same shard on both
        # (FSDP2 reduce-scattered them in the schedule's last backward; DiLoCo's replicas: over their cp ranks.)
        if self.grad_ranks > 1 and not self.shard:
            grads = [_local(p.grad) for p in params]  # (with tp: each rank its slice, like its replicas')
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.algorithm == "torch":
                dist.all_reduce(flat, group=self.grad_group)
                flat /= self.grad_ranks
            else:  # ringtrain's collectives over the replicas (shm inside a host, ring across)
                comm.all_reduce(flat, op="avg", algorithm=self.algorithm, group=self.grad_group, chunk_kb=self.chunk_kb)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        return time.perf_counter() - start

    def _sum_vocabulary_split_tie(self, tied: nn.Parameter) -> None:
        """``loss_parallel``: the last stage's copy holds tp rank t's rows of the vocabulary, the first stage's
        embedding all of them (replicated over tp). Rank t's rows are added over the tie group, then the first
        stage's tp ranks put their rows together (each its own, disjoint) into the whole gradient."""
        grad = _local(tied.grad)
        if tied is self._clone:
            dist.all_reduce(grad, group=self._tie_group)
            return
        t = self.mesh.get_local_rank("tp")
        rows = grad.chunk(self.tp)[t].clone()  # DTensor's Shard(0) cut: torch.chunk's
        dist.all_reduce(rows, group=self._tie_group)
        whole = torch.zeros_like(grad)
        whole.chunk(self.tp)[t].copy_(rows)
        dist.all_reduce(whole, group=self.mesh["tp"].get_group())
        grad.copy_(whole)

    def loss_context(self) -> AbstractContextManager:
        """torch's ``loss_parallel`` (the logits split by vocabulary): around the schedule, whose last stage computes
        each micro-batch's loss and its backward."""
        if not self.loss_parallel:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def share_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The step's loss sum (known on the last stage) on every rank of the pipeline."""
        if hasattr(loss_sum, "full_tensor"):  # loss_parallel's losses are DTensors (replicated over tp)
            loss_sum = loss_sum.full_tensor()
        dist.broadcast(loss_sum, group_src=self._stage_rank(self.stages - 1), group=self.pp_group)
        return loss_sum

    # --- the strategy's answers ------------------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self._full if self._full is not None else model

    def gradient_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return self.zero.gradient_parameters(optimizer) if self.zero is not None else self._own_parameters()

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The whole model's gradient norm: each rank's squares (the tied weight counted on the first stage
        only), summed over the pipeline (replicas hold the same gradients; DiLoCo's each its own: summed over the
        replica's ranks only). A gradient that is a DTensor
        replicated over some mesh dimensions (tensor parallelism's whole layers) is counted once: its squares
        divided by the ranks holding the same copy."""
        if self.zero is not None:  # each rank's shards of its stages (the tied copy's stretch left out), over all
            squares = self.zero.squares(self._clone)
            dist.all_reduce(squares)
            norm = squares.sqrt().float()
            self.zero.scale(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
            return norm
        params = self._own_parameters()
        counted = [p for p in params if p is not self._clone and p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in counted:
            grad = _reduced(param.grad.detach())
            squares += _local(grad).double().pow(2).sum() / _copies(grad)
        # Replicas hold the same gradients (the pipeline's ranks); shards hold parts of them (every rank).
        if self.tp == 1:
            dist.all_reduce(squares, group=None if self.shard else self.pp_group)  # (HSDP's replicas: _copies)
        elif self.outer_loop.syncs_replicas:  # DiLoCo: each replica's own gradient, over its own tp x pp ranks
            dist.all_reduce(squares, group=self.mesh["tp"].get_group())
            dist.all_reduce(squares, group=self.pp_group)
        else:  # the pipeline's and its tensor-parallel ranks: every rank, each replica's sum once
            dist.all_reduce(squares)
            squares /= 1 if self.shard else self.grad_ranks  # (cp ranks, too, hold their replica's sum)
        norm = squares.sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for param in params:
            if param.grad is not None:
                _local(param.grad).mul_(coef.to(param.grad.dtype))
        return norm

    def full_named_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        names = set(self._parameter_names)  # the tied weight once, as torch names it
        return {name: value for name, value in self.model_state_dict(model).items() if name in names}

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank: each pipeline rank's stages, gathered over the pipeline (as
        CPU tensors, never pickled: ``_all_gather_tensors``; a model that fits one process's memory, as the full
        checkpoint does anyway)."""
        mine = {}
        with self._full_parameters():
            for module in self.modules:  # (FSDP2's shards gathered over the replicas: every rank calls this)
                mine.update({name: self._natural(name, _full(value)).detach().cpu()
                             for name, value in module.state_dict().items()})
            if self.zero is not None:  # copies: zero3's gathered storage goes at the block's end
                mine = {name: value.clone() for name, value in mine.items()}
        parts = _all_gather_tensors(mine, self.pp_group)
        merged = {name: value for part in parts for name, value in part.items()}
        if self._tied:
            merged["head.weight"] = merged["token_embedding.weight"]  # one weight, stored twice as torch does
        return {name: merged[name].to(self.device) for name in self._full.state_dict()}

    def _full_parameters(self) -> AbstractContextManager:
        """zero3's stages gathered (and, when written, their shards updated); nothing to do for the others."""
        return self.zero.full_parameters() if self.zero is not None else nullcontext()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad(), self._full_parameters():
            for module in self.modules:
                for name, tensor in module.state_dict(keep_vars=True).items():
                    source = state["token_embedding.weight"] if self._tied and name == "head.weight" else state[name]
                    source = self._ranked(name, source.to(self.device))
                    _local(tensor).copy_(_local(_shard_like(source, tensor)))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's form of one optimizer over the whole model: every rank's states by parameter name, gathered
        over the pipeline, indexed as the unsplit model's optimizer numbers them."""
        if self.zero is not None:  # the shards' state gathered over dp, as the unsharded optimizer's
            local, params = self.zero.full_optimizer_state(optimizer)
        else:
            local = optimizer.state_dict()
            params = [p for group in optimizer.param_groups for p in group["params"]]
        names = self._names
        mine = {names[id(params[int(i)])]: {key: self._natural(names[id(params[int(i)])], _full(value))
                                            if _is_moment(value, params[int(i)]) else _full(value)
                                            for key, value in entry.items()}
                for i, entry in local["state"].items() if params[int(i)] is not self._clone}
        parts = _all_gather_tensors(_to_cpu(mine), self.pp_group)
        by_name = {name: entry for part in parts for name, entry in part.items()}
        index = {name: i for i, name in enumerate(n for group in self._groups for n in group)}
        groups = []
        for group, group_names in zip(local["param_groups"], self._groups):
            groups.append({**group, "params": [index[name] for name in group_names]})
        state = {index[name]: entry for name, entry in by_name.items()}
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        flat_names = [n for group in self._groups for n in group]
        full = {flat_names[int(i)]: entry for i, entry in state["state"].items()}
        names = self._names
        local_state, groups, offset = {}, [], 0
        mine = self.zero.param_groups() if self.zero is not None else [g["params"] for g in optimizer.param_groups]
        for group, full_group in zip(mine, state["param_groups"]):
            indices = []
            for param in group:
                name = "token_embedding.weight" if param is self._clone else names[id(param)]
                if name in full:
                    local_state[offset] = {key: _shard_like(self._ranked(name, value.to(self.device)), param)
                                           if isinstance(value, torch.Tensor) and value.shape == param.shape else value
                                           for key, value in full[name].items()}
                indices.append(offset)
                offset += 1
            groups.append({**full_group, "params": indices})
        local = {"state": local_state, "param_groups": groups}
        return self.zero.shard_optimizer_state(optimizer, local) if self.zero is not None else local

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's stages' tensors for a sharded (DCP) checkpoint, named as the whole model's (torch's
        ``get_state_dict`` over ``_view``): each pipeline rank writes its own stages, replicas' copies are written
        once. The last stage's copy of the tied weight keeps its parameter name (``head.weight``, as the unsplit
        model's state has it too) but its optimizer state is filed as the embedding's, the one entry an unsplit
        model's optimizer has: the two are equal."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.zero is not None:
            return self.zero.checkpoint_state(self._view(), optimizer, "head.weight" if self._clone is not None else None)
        model_sd, optim_sd = get_state_dict(self._view(), optimizer)
        if self._clone is not None:
            _rename(optim_sd, "head.weight", "token_embedding.weight")
        state = {"model": model_sd, "optimizer": optim_sd}
        if self.tp > 1:  # the qkv rows in the unsplit model's order (tensor.TensorParallelStrategy.checkpoint_state)
            for name, moments, value, dim in _fused_entries(state, _qkv_dim):
                moments[name] = _recut(value, _to_natural(_full(value), self.tp, dim))
        return state

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                              load: Callable[[dict[str, Any]], None]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self.zero is not None:
            self.zero.load_checkpoint_state(self._view(), optimizer, load, "head.weight" if self._clone is not None
                                            else None, "token_embedding.weight")
            return
        state = self.checkpoint_state(model, optimizer)
        load(state)
        if self.tp > 1:
            for name, moments, value, dim in _fused_entries(state, _qkv_dim):
                moments[name] = _recut(value, _to_ranks(_full(value), self.tp, dim))
        if self._clone is not None:
            _rename(state["optimizer"], "token_embedding.weight", "head.weight")
        set_state_dict(self._view(), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def _natural(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A full tensor of ``name`` in the unsplit model's order (tp > 1: the qkv rows, kept in rank order)."""
        return _to_natural(value, self.tp, _qkv_dim(name)) if self.tp > 1 and _qkv_dim(name) is not None else value

    def _ranked(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return _to_ranks(value, self.tp, _qkv_dim(name)) if self.tp > 1 and _qkv_dim(name) is not None else value

    def _view(self) -> nn.Module:
        """This rank's stages as one module named as the whole model (the blocks of several stages in one
        ``blocks``)."""
        view = nn.Module()
        if self.split is not None:  # user stages: their paths merged (two stages' "model.layers" become one)
            for module in self.modules:
                merge_into(view, module)
            return view
        for module in self.modules:
            for name, child in module.named_children():
                if name == "blocks":
                    if "blocks" not in view._modules:
                        view.add_module("blocks", nn.ModuleDict())
                    view.blocks.update(child)
                else:
                    view.add_module(name, child)
        return view

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        params = self._own_parameters()
        yield from (_local(p) for p in params)
        yield from (_local(p.grad) for p in params if p.grad is not None)
        yield from (_local(t) for t in optimizer_tensors(optimizer))
        if self.zero is not None:  # the flat units (zero1's whole gradient, zero2/3's shards)
            yield from self.zero.state_tensors()

    # --- evaluation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """One batch through the stages in order, without a schedule (evaluation): each stage receives its
        input from the previous one's rank and sends its output on. The logits on the rank of the last stage (the
        first of its tensor-parallel ranks), None on the others. Every rank of the pipeline calls it with the same batch."""
        rows = len(inputs)
        x = inputs = pad_rows(inputs, max(rows, 1))  # a replica with no batch left still runs the stages' gathers
        if self.context is not None:
            self.context.length = inputs.shape[1]
        for stage in range(self.stages):
            holder, before = self._stage_rank(stage), self._stage_rank(stage - 1) if stage else None
            if before is not None and before != holder:  # the activation crosses ranks
                if holder == self.pp_rank:
                    x = _recv_tensor(before, self.pp_group, self.device)
                elif before == self.pp_rank:
                    _send_tensor(x, holder, self.pp_group)
            if holder == self.pp_rank:
                x = self.modules[self.indices.index(stage)](x)
        # Under tensor and context parallelism every rank of the last stage holds the logits (split by vocabulary
        # under loss_parallel: put together, every tp rank joins): the first of them answers.
        last = self._stage_rank(self.stages - 1) == self.pp_rank
        if last and hasattr(x, "full_tensor"):
            x = x.full_tensor()
        answers = (last and (self.tp == 1 or self.mesh.get_local_rank("tp") == 0)
                   and (self.cp == 1 or self.context.rank == 0))
        return x[:rows] if answers else None

    def forward_to_all(self, inputs: torch.Tensor) -> torch.Tensor:
        """``forward``, then its outputs sent from the last stage to every rank of the pipeline, so each rank's
        evaluation code sees them (a pipeline without tensor or context parallelism: the Session's)."""
        if self.tp > 1 or self.cp > 1:
            raise ConfigError("forward_to_all runs a pipeline without tensor or context parallelism")
        outputs, last = self.forward(inputs), self._stage_rank(self.stages - 1)
        if self.pp_rank == last:
            for rank in range(self.pp):
                if rank != last:
                    _send_tensor(outputs, rank, self.pp_group)
            return outputs
        return _recv_tensor(last, self.pp_group, self.device)


def _qkv_dim(name: str) -> int | None:
    """The built-in transformer's fused q | k | v parameters: the dimension they are fused along."""
    return next((dim for suffix, dim in _FUSED.items() if name.endswith(suffix)), None)


def _reduced(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its pending sums done: a DTensor gradient that is Partial over a mesh dimension (sequence
    parallelism's norms: each tp rank holds its tokens' share) holds parts whose squares are not the sum's; it is
    made Replicate there (one all-reduce), so its local value is the whole gradient. Anything else as it is."""
    from torch.distributed.tensor import Partial, Replicate

    placements = getattr(tensor, "placements", ())
    if not any(isinstance(p, Partial) for p in placements):
        return tensor
    return tensor.redistribute(tensor.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in placements])


def _copies(tensor: torch.Tensor) -> int:
    """How many ranks hold the same copy of ``tensor``'s local value: the product of the mesh dimensions a
    DTensor is replicated over (1 for a plain tensor)."""
    from torch.distributed.tensor import Replicate

    if not hasattr(tensor, "device_mesh"):
        return 1
    return math.prod(tensor.device_mesh.size(i) for i, p in enumerate(tensor.placements) if isinstance(p, Replicate))


def _is_moment(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)


def _rename(optim_sd: dict[str, Any], old: str, new: str) -> None:
    """An optimizer state in torch's FQN form (``get_state_dict``'s), one parameter's entry renamed."""
    optim_sd["state"][new] = optim_sd["state"].pop(old)
    for group in optim_sd["param_groups"]:
        group["params"] = [new if name == old else name for name in group["params"]]
