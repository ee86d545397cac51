"""``[parallel]``: the device mesh's degrees (data replicated, data sharded, tensor, pipeline) and the pipeline's
schedule, with the checks that need no worker. The existing strategies are this mesh's 1-D cases:

    comm.strategy         dp_replicate   dp_shard   tp   pp
    ddp, manual, diloco   world          1          1    1
    zero1/2/3, fsdp       1              world      1    1

``comm.strategy`` chooses how the data-parallel dimension runs; an unset ``dp_replicate`` / ``dp_shard`` is
what the strategy implies (its own dimension -1, the rest; the other 1). A degree that disagrees with the
strategy is refused in one line. tp > 1 (``check_tensor_parallel``) and pp > 1 (``check_pipeline_parallel``) each
run with the layouts they are built for, together too (``check_tensor_parallel_stages``: tensor parallelism
inside the pipeline's stages, with the pipeline's data-parallel replicas or FSDP2 beside them), and refuse the
rest (issue 23) in one line naming the numbers; the
checks of the layout's own numbers run first, so a config that will not fit is told why before "not yet".

    >>> resolve_layout(ParallelConfig(), "fsdp", world_size=4).degrees
    {'dp_replicate': 1, 'dp_shard': 4, 'cp': 1, 'tp': 1, 'pp': 1}

The layout itself (``ringtrain/layout.py``) is the one place degrees are resolved and the mesh is built; what a
strategy runs beside is its spec's (``ringtrain/strategies.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from ringtrain.config.section import Section
from ringtrain.errors import ConfigError
from ringtrain.layout import Layout
from ringtrain.strategies import strategy_spec

if TYPE_CHECKING:
    from ringtrain.config.schema import Config

__all__ = ["DEGREES", "ParallelConfig", "check_parallel", "check_pipeline_parallel", "check_strategy_agrees",
           "check_tensor_parallel", "resolve_layout"]

DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
"""The mesh's dimensions, outermost first (torchtitan's order)."""
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


class ParallelConfig(Section):
    dp_replicate: int | None = None
    """Data-parallel replicas (each holds the whole model, or under comm.strategy = 'fsdp' each is a group of
    dp_shard ranks sharding it: FSDP2's HSDP): -1 takes the ranks the other degrees leave. Unset: what
    comm.strategy implies (ddp, manual, diloco: -1; zero1-3, fsdp: 1)."""

    dp_shard: int | None = None
    """Data-parallel ranks the model's state is sharded over: -1 takes the ranks the other degrees leave.
    Unset: what comm.strategy implies (zero1-3, fsdp: -1; ddp, manual, diloco: 1)."""

    cp: int = 1
    """Context-parallel degree (-1: the rest): the built-in transformer's sequence split over cp ranks, each
    holding two load-balanced chunks of every sequence (activations inside the model: 1/cp), attention by ring
    attention over them (``parallel/context.py``); the cp ranks read the same samples, beside data-parallel ranks
    of any strategy but DiLoCo. Needs model.dropout = 0."""

    tp: int = 1
    """Tensor-parallel degree (-1: the rest): the built-in transformer's attention and MLP split over tp ranks,
    with FSDP2 on the other ranks (comm.strategy = 'fsdp', HSDP with dp_replicate > 1), whole replicas
    (comm.strategy = 'ddp': FSDP2's replicate dimension), ringtrain's own data parallelism on each rank's local
    part ('manual', 'zero1'-'zero3'), or inside pipeline stages (pp > 1)."""

    tp_algorithm: Literal["torch", "shm"] = "torch"
    """How the tensor-parallel ranks all-reduce the split layers' activations and gradients: 'torch' (the
    backend's own, Gloo on CPU) or 'shm' (ringtrain's shared-memory all-reduce, a torch.distributed backend of
    its own on the tp dimension: CPU workers; a ring between hosts)."""

    sequence_parallel: bool = False
    """With tp > 1, the built-in transformer's norms, dropouts and residual stream run on each tp rank's share of
    the sequence (torch's SequenceParallel, Megatron's sequence parallelism): each split layer's all-reduce
    becomes an all-gather before it and a reduce-scatter after it (the same bytes), and the activations outside
    attention and the MLP are divided by tp."""

    loss_parallel: bool = False
    """With tp > 1 and a model whose output layer is its own (a Hugging Face Llama-style model built from a
    config: ``lm_head`` not tied to the embeddings), that layer is split by vocabulary over the tp ranks and the
    cross-entropy is computed on the logits' shards (torch's ``loss_parallel``): the whole logits are never
    gathered. Inside a pipeline (pp > 1, the built-in transformer) the last stage's own copy of the tied output
    layer is the one split (not under pp_schedule 'zbv_zero_bubble' or FSDP2). Needs loss 'cross_entropy'."""

    pp: int = 1
    """Pipeline-parallel degree, the ranks a model's stages are spread over (-1: the rest): the built-in
    transformer's blocks in pp x stages_per_rank stages, its pipelines replicated over the other ranks
    (comm.strategy = 'ddp' or 'manual') or its stages sharded over them ('zero1'-'zero3', 'fsdp')."""

    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"] = "1f1b"
    """Pipeline schedule (torch.distributed.pipelining's): 'gpipe' and '1f1b' run one stage per rank;
    'interleaved_1f1b' and 'interleaved_zero_bubble' two or more (stages_per_rank); 'zbv_zero_bubble' exactly
    two, in a V."""

    pp_microbatches: int | None = Field(default=None, gt=0)
    """Micro-batches a step's batch is cut into for the pipeline (they replace train.local_batch_size's
    accumulation); at least one per stage (pp x stages_per_rank), a multiple of pp for the interleaved
    schedules. Unset: one per stage."""

    stages_per_rank: int = Field(default=1, gt=0)
    """Pipeline stages each pipeline rank holds (more than one: an interleaved schedule)."""

    @model_validator(mode="after")
    def _degrees_and_schedule(self) -> ParallelConfig:
        rest = [name for name in DEGREES if getattr(self, name) == -1]
        for name in DEGREES:
            value = getattr(self, name)
            if value is not None and value != -1 and value < 1:
                raise ValueError(f"{name} = {value}: a degree is a number of ranks (1 or more), or -1 "
                                 "for the ranks the others leave")
        if len(rest) > 1:
            raise ValueError(f"{' and '.join(rest)} are each -1 ('the rest'): at most one degree can take the "
                             "ranks the others leave; give the others numbers")
        schedule, stages = self.pp_schedule, self.stages_per_rank
        if schedule in SINGLE_STAGE_SCHEDULES and stages != 1:
            raise ValueError(f"pp_schedule = '{schedule}' runs one stage per rank, but stages_per_rank = "
                             f"{stages}; use 'interleaved_1f1b' or 'interleaved_zero_bubble', or stages_per_rank = 1")
        if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and stages < 2:
            raise ValueError(f"pp_schedule = '{schedule}' interleaves several stages per rank, but "
                             f"stages_per_rank = {stages}; set stages_per_rank = 2 (or more), or use '1f1b'")
        if schedule == "zbv_zero_bubble" and stages != 2:
            raise ValueError(f"pp_schedule = 'zbv_zero_bubble' places exactly 2 stages per rank (a V), "
                             f"but stages_per_rank = {stages}; set stages_per_rank = 2")
        return self


def check_strategy_agrees(parallel: ParallelConfig, strategy: str) -> None:
    """The data-parallel degrees against comm.strategy (no world size needed): ValueError naming both."""
    shard, replicate = parallel.dp_shard, parallel.dp_replicate
    spec = strategy_spec(strategy)
    if spec.owner == "dp_replicate" and shard not in (None, 1):
        raise ValueError(
            f"[parallel] dp_shard = {shard} shards the model's state, but comm.strategy = '{strategy}' keeps a "
            f"whole copy on every rank; set comm.strategy = 'fsdp' (or 'zero1', 'zero2', 'zero3') to shard, or "
            "dp_shard = 1 (or leave it unset)")
    if spec.owner == "dp_shard" and "hsdp" not in spec.beside and replicate not in (None, 1):
        raise ValueError(
            f"[parallel] dp_replicate = {replicate} with comm.strategy = '{strategy}': replicas of a sharded model "
            "(HSDP) are built on FSDP2 only; set comm.strategy = 'fsdp', dp_replicate = 1 (or leave it unset), or "
            "comm.strategy = 'ddp' to replicate")


def resolve_layout(parallel: ParallelConfig, strategy: str, world_size: int) -> Layout:
    """The layout at ``world_size``: unset data-parallel degrees from the strategy (its own dimension takes the
    rest), -1 as the rest. ConfigError when they cannot multiply to ``world_size``, naming every degree."""
    given = {name: getattr(parallel, name) for name in DEGREES}
    return Layout.resolve(given, owner=strategy_spec(strategy).owner, world_size=world_size)


def check_tensor_parallel(config: Config, degrees: dict[str, int]) -> None:
    """What tensor parallelism (``parallel/tensor.py``) runs with: the built-in transformer (whole heads per
    rank) or a model of your own (its plan checked when it is built), any data-parallel strategy whose spec
    composes with tp (``beside``), --heal by whole replicas (replicated strategies)."""
    tp, model, strategy = degrees["tp"], config.model, config.comm.strategy
    where = f"[parallel] tp = {tp}"
    if model.factory is None and model.name != "transformer":
        raise ConfigError(f"{where}: tensor parallelism splits the built-in transformer (model.name = 'transformer') "
                          f"or a model of your own with a plan (model.factory, fit(tp_plan=...), or a Hugging Face "
                          f"model that declares one), not model.name = '{model.name}'; set tp = 1")
    if model.factory is None and model.n_heads % tp:
        raise ConfigError(f"{where} does not divide model.n_heads ({model.n_heads}): each rank computes whole heads; "
                          f"set n_heads to a multiple of {tp}, or tp to a divisor of {model.n_heads}")
    spec = strategy_spec(strategy)
    if "tp" not in spec.beside:
        raise ConfigError(f"{where} with comm.strategy = '{strategy}' ({spec.summary}): its spec "
                          "(ringtrain/strategies.py) does not run beside tensor parallelism; set comm.strategy = "
                          "'ddp', 'manual', 'zero1'-'zero3', 'fsdp' or 'diloco', or tp = 1")

    refuse_for_split_model(config, where, "a step without collectives until its end, and a tensor-parallel "
                                          "forward all-reduces in every block")


def check_loss_parallel(config: Config, degrees: dict[str, int]) -> None:
    """``loss_parallel``: tensor parallelism, a model of the user's own (its output layer untied: checked when it
    is split) or, inside a pipeline, the built-in transformer (its last stage holds its own copy of the tied output
    layer when the first stage is on another rank), the cross-entropy loss."""
    where = "[parallel] loss_parallel = true"
    if degrees["tp"] == 1:
        raise ConfigError(f"{where} with tp = 1: the output layer is split over the tensor-parallel ranks; set tp to 2 "
                          "or more, or leave loss_parallel unset")
    pp, schedule = degrees["pp"], config.parallel.pp_schedule
    if pp > 1 and schedule == "zbv_zero_bubble":
        raise ConfigError(f"{where} with pp_schedule = 'zbv_zero_bubble': the V puts the first and last stages on one "
                          "rank, where the output layer is the token embedding itself (tied), which a vocabulary split "
                          "would split too; use '1f1b' or 'interleaved_1f1b', or leave loss_parallel unset")
    if pp > 1 and degrees["dp_shard"] > 1:
        raise ConfigError(f"{where} with pp = {pp} and dp_shard = {degrees['dp_shard']}: FSDP2 would shard the first "
                          "stage's embedding and the last stage's vocabulary-split copy of it by different rows, so "
                          "the tie's two gradients cannot be added shard by shard; use comm.strategy = 'ddp', or leave "
                          "loss_parallel unset")
    if pp == 1 and config.model.factory is None:
        raise ConfigError(f"{where}: the built-in '{config.model.name}' model's output layer is its token embedding "
                          "(tied), which a vocabulary split would split too; leave loss_parallel unset (it is built "
                          "for models whose output layer is their own, such as a Hugging Face Llama)")
    if config.task.loss != "cross_entropy":
        raise ConfigError(f"{where} with task.loss = '{config.task.loss}': torch's loss_parallel computes the "
                          "cross-entropy only; set loss = 'cross_entropy', or leave loss_parallel unset")


def check_tensor_parallel_stages(config: Config, degrees: dict[str, int]) -> None:
    """Tensor parallelism inside pipeline stages (the 2-D tp x pp and 3-D dp x tp x pp meshes): the built-in
    transformer, whole heads per rank; the pipeline's own checks follow."""
    tp, pp, model = degrees["tp"], degrees["pp"], config.model
    where = f"[parallel] tp = {tp} with pp = {pp}"
    if model.factory is not None or model.name != "transformer":
        raise ConfigError(f"{where}: tensor parallelism inside pipeline stages is built for the built-in transformer "
                          f"(model.name = 'transformer'), not {'a model of your own' if model.factory else repr(model.name)}; "
                          "set tp = 1 or pp = 1")
    if model.n_heads % tp:
        raise ConfigError(f"{where}: tp does not divide model.n_heads ({model.n_heads}): each rank computes whole heads; "
                          f"set n_heads to a multiple of {tp}, or tp to a divisor of {model.n_heads}")


def check_pipeline_parallel(config: Config, degrees: dict[str, int]) -> None:
    """What pipeline parallelism (``parallel/pipeline.py``) runs with: the built-in transformer or a user's model
    (an nn.Sequential, checked when it is built), its pipelines replicated over dp (their gradients averaged by
    ``comm.algorithm``'s all-reduce: the backend's, or ringtrain's ring or shm) or sharded by FSDP2, a fixed
    number of equal micro-batches, --heal by whole replicas. (The layout's own numbers, stages against layers and
    micro-batches, are checked by the caller.)"""
    pp, model, strategy, parallel = degrees["pp"], config.model, config.comm.strategy, config.parallel
    where = f"[parallel] pp = {pp}"
    if model.factory is None and model.name != "transformer":
        raise ConfigError(f"{where}: pipeline parallelism cuts the built-in transformer (model.name = 'transformer') "
                          f"or a model of your own that is an nn.Sequential (model.factory, fit) into stages, not "
                          f"model.name = '{model.name}'; set pp = 1")
    spec = strategy_spec(strategy)
    if "pp" not in spec.beside:
        raise ConfigError(f"{where} with comm.strategy = '{strategy}': beside a pipeline the data-parallel ranks either "
                          "replicate it (its gradients averaged by one all-reduce with comm.algorithm, 'ddp' or "
                          "'manual') or shard its stages ('zero1'-'zero3', 'fsdp'), or DiLoCo's replicas are whole "
                          f"pipelines ('diloco'), not {spec.summary}; set comm.strategy = 'ddp' or 'fsdp'")
    if "stage" in spec.options and (degrees["tp"] > 1 or degrees["cp"] > 1):
        split = " and ".join(f"{d} = {degrees[d]}" for d in ("tp", "cp") if degrees[d] > 1)
        raise ConfigError(f"{where} with {split} and comm.strategy = '{strategy}': ringtrain's ZeRO wraps each stage "
                          "over the data-parallel ranks only (its flat buffers of plain tensors, beside tp's DTensors "
                          "and cp's tokens' shares, are not composed); set comm.strategy = 'fsdp' (FSDP2 shards "
                          "DTensors over dp x cp), or tp = 1 and cp = 1")
    if spec.owner == "dp_shard" and parallel.pp_schedule == "zbv_zero_bubble" and model.factory is None:
        raise ConfigError(f"{where} with comm.strategy = '{strategy}' and pp_schedule = 'zbv_zero_bubble': the V puts "
                          "the first and last stages on one rank, where they share the tied embedding, which cannot be "
                          "sharded in two modules; use '1f1b' or 'interleaved_1f1b', or comm.strategy = 'ddp'")
    if parallel.pp_schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        microbatches = parallel.pp_microbatches or pp * parallel.stages_per_rank
        if microbatches % pp:
            raise ConfigError(f"[parallel] pp_schedule = '{parallel.pp_schedule}' runs micro-batches in rounds of pp "
                              f"({pp}), but pp_microbatches = {microbatches}; set it to a multiple of {pp}")
    refuse_for_split_model(config, where, "its own micro-batches: a pipeline's are its schedule's "
                                          "(parallel.pp_microbatches), and a rank that ran out of memory mid-schedule "
                                          "would leave its neighbours waiting")


def refuse_for_split_model(config: Config, where: str, shrinking_needs: str) -> None:
    """What no split model (tp, cp, pp) runs with, one line each: automatic micro-batch shrinking (which needs
    ``shrinking_needs``), and --heal beside a strategy whose state is spread over the data-parallel ranks
    (a split model heals by whole replicas that keep their own state: heal/replicas.py)."""
    if config.train.auto_micro_batch:
        raise ConfigError(f"{where} with train.auto_micro_batch: shrinking needs {shrinking_needs}; set "
                          "train.auto_micro_batch = false")
    if config.dist.heal:
        spec = strategy_spec(config.comm.strategy)
        if spec.reloads:
            # A split model heals by whole replicas, each survivor moving the part it holds to the regrouped
            # trainer in memory (heal/replicas.py): that needs every part's state on each replica (DiLoCo's
            # outer state is: every replica holds the global model's part and its momentum).
            raise ConfigError(f"{where} with --heal and comm.strategy = '{config.comm.strategy}': a split model heals "
                              "by whole replicas, each keeping the model part it holds, but this strategy's state "
                              "is spread over the data-parallel ranks a heal removes; use comm.strategy = 'ddp', or "
                              "leave out --heal")


def check_context_parallel(config: Config, degrees: dict[str, int]) -> None:
    """What context parallelism (``parallel/context_split.py``) runs with: the built-in transformer without
    dropout, or a model of your own (a Hugging Face causal LM: checked when it is split), beside data-parallel
    ranks of a strategy whose spec composes with cp (beside tp: over the dp x cp ranks), tp (with sequence
    parallelism or without: cp splits the sequence first, sp each cp part over the tp ranks), pp (its stages'
    sequence split, the built-in transformer, its stages split over tp too), --heal by whole replicas."""
    cp, model, strategy = degrees["cp"], config.model, config.comm.strategy
    where = f"[parallel] cp = {cp}"
    if model.factory is None and model.name != "transformer":
        raise ConfigError(f"{where}: context parallelism splits the built-in transformer's sequence (model.name = "
                          f"'transformer') or a Hugging Face causal LM of your own (model.factory, fit), not "
                          f"model.name = '{model.name}'; set cp = 1")
    if model.factory is None and model.dropout:
        raise ConfigError(f"{where} with model.dropout = {model.dropout}: ring attention has no attention dropout; set "
                          "model.dropout = 0, or cp = 1")
    spec = strategy_spec(strategy)
    if degrees["pp"] > 1 and model.factory is not None:
        raise ConfigError(f"{where} with pp = {degrees['pp']}: inside pipeline stages the built-in transformer's "
                          "sequence is split (its first stage shards the tokens, its last gathers the logits), and the "
                          "stages of a model of your own are its own; set cp = 1 or pp = 1")
    if "cp" not in spec.beside:
        raise ConfigError(f"{where} with comm.strategy = '{strategy}': the ranks of a context-parallel group hold one "
                          f"replica's parts and sum their gradients, which {spec.summary} does not (its workers step "
                          "on their own); use 'ddp', 'manual', 'zero1'-'zero3' or 'fsdp', or cp = 1")
    refuse_for_split_model(config, where, "a step without collectives until its end, and ring attention "
                                          "exchanges keys and values in every layer")


def check_parallel(config: Config, world_size: int) -> Layout:
    """The mesh at ``world_size``: the product, the pipeline's layout, then what does not compose; one
    ConfigError line naming the numbers. Returns the resolved layout."""
    parallel = config.parallel
    layout = resolve_layout(parallel, config.comm.strategy, world_size)
    degrees = layout.degrees
    pp, tp = degrees["pp"], degrees["tp"]
    if pp > 1:
        stages = pp * parallel.stages_per_rank
        microbatches = parallel.pp_microbatches or stages
        if microbatches < stages:
            raise ConfigError(f"[parallel] pp_microbatches ({microbatches}) is fewer than the pipeline's stages (pp "
                              f"({pp}) x stages_per_rank ({parallel.stages_per_rank}) = {stages}): a stage would "
                              f"idle every step; set pp_microbatches = {stages} or more")
        layers = config.model.n_layers
        if config.model.factory is None and config.model.name == "transformer" and layers % stages:
            raise ConfigError(f"[parallel] model.n_layers ({layers}) does not divide into pp ({pp}) x "
                              f"stages_per_rank ({parallel.stages_per_rank}) = {stages} stages; set n_layers to a "
                              f"multiple of {stages}, or change pp or stages_per_rank")
    if tp == 1 and parallel.tp_algorithm != "torch":
        raise ConfigError(f"[parallel] tp_algorithm = '{parallel.tp_algorithm}' with tp = 1: there are no "
                          "tensor-parallel all-reduces to run; set tp to 2 or more, or leave tp_algorithm unset")
    if tp == 1 and parallel.sequence_parallel:
        raise ConfigError("[parallel] sequence_parallel = true with tp = 1: the sequence is split over the "
                          "tensor-parallel ranks; set tp to 2 or more, or leave sequence_parallel unset")
    if degrees["cp"] > 1:
        check_context_parallel(config, degrees)
    spec = strategy_spec(config.comm.strategy)
    if spec.replicas_are_model_groups and layout.model_parallel > 1 and config.diloco.inner != "auto":
        raise ConfigError(f"diloco.inner = '{config.diloco.inner}' beside a split model ({layout.describe()}): a "
                          "DiLoCo replica is then its model-parallel group (one model, its ranks the model's parts); "
                          "leave diloco.inner unset ('auto')")
    if parallel.loss_parallel:
        check_loss_parallel(config, degrees)
    if tp > 1 and pp > 1:
        check_tensor_parallel_stages(config, degrees)
    elif tp > 1:
        check_tensor_parallel(config, degrees)
    if pp > 1:
        check_pipeline_parallel(config, degrees)
    return layout
