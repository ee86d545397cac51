"""``ringtrain plan layouts``: which split of a transformer over a cluster fits and trains fastest.

Given the model's shape and a cluster (workers, workers per host, memory and achieved FLOP/s per worker, the
links inside and between hosts), every layout ``dp x cp x tp x pp`` (tp inside a host, dividing the heads; cp
with ``2 cp`` dividing the sequence; pp dividing the layers) with each data-parallel strategy (ddp, zero1, zero2,
fsdp) and activation checkpointing off or full, as far as ringtrain composes them (``runs_in_ringtrain``: cp beside
each of them, not beside pp, beside tp without sequence parallelism), is given a memory per
worker and a step time; those that fit are listed fastest first, and the first is recommended.

Memory per worker (bytes), the fullest rank (a pipeline's first stage, which also holds the embeddings):

- model state: the parameters it holds, ``(L / pp) x 12 h^2 / tp`` of blocks plus the embeddings (whole:
  ringtrain splits neither them nor the output layer), at 16 bytes each under ddp (fp32 weight and gradient,
  AdamW's two moments), ``8 + 8 / n`` under zero1, ``4 + 12 / n`` under zero2, ``16 / n`` under fsdp, n the ranks
  the data-parallel strategy runs over, ``dp x cp`` (a cp rank holds a whole replica of its part: cp alone divides
  no state, but zero and fsdp shard it over the cp ranks too);
- activations, the peak of what forward and backward create and hold at once on the fullest stage, counted
  tensor by tensor for a pre-norm GPT block with fused attention (SDPA) and no dropout, for a micro-batch of b
  sequences of s tokens at e bytes a value (t = tp): per layer ``s b h e (4 + 13 / t)``: the two norms',
  the qkv layer's and the MLP's inputs are whole on every tp rank, q, k, v, the attention output, the output
  projection's input and the MLP's 4h-wide GELU and down-projection inputs are split. SDPA keeps each row's
  log-sum-exp, not the s x s scores: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models") count ``5 a s / h`` more per layer for those and the dropout masks of an unfused model.
  1F1B's stage i holds ``min(m, pp - i)`` micro-batches of its L / pp layers (accumulation frees each
  micro-batch's before the next); the last stage adds the final norm's input and output, ``2 s b h e``, and
  the fp32 logits with their log-softmax, ``2 x 4 b s V`` (``4 x 4 b s V`` in a pipeline, whose last stage
  keeps its output, the logits, until the loss's backward has made their two gradients); backward adds the residual stream's and the MLP's
  gradients, ``s b h e (1 + 4 / t)``. Full checkpointing keeps each layer's input, ``s b h e``, and while
  backward recomputes one layer, that layer's whole set beside it. Sequence parallelism divides the norms'
  inputs, the final norm's and each checkpointed layer's input by t (``s b h e (2 / t + 2 + 13 / t)`` a layer);
  the gathered inputs of the split layers, backward's gradients and a recomputed layer stay whole. Measured
  against this in fp32 on one worker, tp 2 (with and without sequence parallelism), pp 2, tp 2 x pp 2 (also with it), each with
  and without full checkpointing, and FSDP2 on 2 ranks alone and beside tp 2 (its gathered parameters and unreduced
  gradients, not counted here, leave it up to 5% under): within 10% (tests/bench/test_activation_memory.py); in bf16, whose norms autocast
  keeps in fp32, not measured. Context parallelism gives each rank s / cp tokens of every sequence inside the
  model: every term above but the logits' is divided by cp (s / cp for s); the fp32 logits and their
  log-softmax, ``2 x 4 b s V``, stay whole (gathered back over the cp ranks before the loss), so cp saves most
  where the blocks outweigh the logits (at text_lm's shape, 16 x 256 tokens, this gives 0.52 of one worker's at
  cp 2 and 0.29 at cp 4; measured there, what autograd saves for backward: 0.54 and 0.31,
  bench/context_parallel_memory.py).
Step time: compute ``tokens x (6 P + 12 L h s) / (cp tp pp) / FLOP/s`` (a third more under full checkpointing:
the forward again; under tp a stated share ``tp_unsplit`` of it is not divided by tp; cp divides all of it: the
load-balanced chunks give every cp rank the same causal attention work); tensor parallelism's 4 all-reduces per
layer and micro-batch (6 with checkpointing) of ``b (s / cp) h`` activations over tp ranks, not overlapped (tp
layouts are listed with sequence parallelism, whose all-gathers and reduce-scatters move the same bytes as those
all-reduces, except beside cp); the pipeline's bubble, ``(pp - 1) / m`` of a rank's compute for m micro-batches,
and its activation sends (one forward, one backward per micro-batch); context parallelism's ring
(``cp_comm_s``), per layer and micro-batch, each hop a point-to-point send ``alpha + bytes / beta``: forward
``cp - 1`` key/value blocks of ``2 b (s / cp) (h / tp) e`` bytes (twice under full checkpointing: the recompute
runs the ring again), backward ``cp - 1`` blocks again and ``cp`` hops of their fp32 dK/dV accumulator,
``2 b (s / cp) (h / tp) 4`` bytes; and per micro-batch the logits' all-gather, ``(cp - 1) alpha + (cp - 1) / cp
x b s V e / beta``; over the link inside a host when tp x cp ranks fit in one (a cp group spans tp x cp
consecutive ranks), else between hosts, each of a host's tp rings getting 1 / tp of its link; not overlapped
(ringtrain posts the next block before computing the current one: where that compute is slower than the send,
this is an upper bound); the data-parallel gradient sync of the worker's parameters as ``plan.predict_step`` has
it (buckets overlapping the backward over the data-parallel ranks, dp x cp of them, hierarchical across hosts;
fsdp moves 1.5x the bytes: parameters gathered twice, gradients reduce-scattered). Not modelled: sequence
parallelism's effect on the share ``tp_unsplit`` (the norms it splits), overlap of tensor-parallel
communication, the loss's softmax over the whole gathered logits on every cp rank, stragglers, the optimizer
step.

    ringtrain plan layouts --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 50304 --global-batch 512 \\
        --workers 64 --per-host 8 --memory-gb 80 --tflops 300
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringtrain.strategies import strategy_spec
from ringtrain.bench.plan import Link, Topology, Workload, PlanError, predict_step, ring_time

__all__ = ["ModelShape", "Cluster", "Layout", "DATA_STRATEGIES", "activation_bytes", "enumerate_layouts", "layout_memory",
           "layout_step", "cp_comm_time", "parse_tp_unsplit", "plan_layouts", "runs_in_ringtrain", "validate_layouts"]

DATA_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
STATE_BYTES = 16.0
"""fp32 weight, fp32 gradient, AdamW's two fp32 moments, per parameter (ringtrain keeps fp32 weights under
bf16 autocast)."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    @property
    def block_params(self) -> float:
        return 12.0 * self.hidden ** 2  # qkv 3h^2, proj h^2, MLP 8h^2 (4h wide)

    @property
    def embed_params(self) -> float:
        return float(self.vocab * self.hidden + self.seq * self.hidden)  # tied output layer, learned positions

    @property
    def params(self) -> float:
        return self.layers * self.block_params + self.embed_params

    @property
    def flops_per_token(self) -> float:
        """Training (forward and backward) FLOPs per token: 6 per parameter plus the attention scores."""
        return 6.0 * self.params + 12.0 * self.layers * self.hidden * self.seq


@dataclass(frozen=True)
class Cluster:
    workers: int
    per_host: int
    memory_gb: float
    tflops: float
    """FLOP/s one worker achieves on the model's work, in TFLOP/s (not its peak)."""
    intra: Link
    inter: Link
    tp_unsplit: float = 0.0
    """The share of a worker's compute that tensor parallelism leaves whole on every rank of a tp group (norms,
    residual adds, embeddings, the output layer and the loss, framework overhead): small on GPUs at large
    hidden sizes, a quarter of the step on this CPU (measured; see ``validate_layouts``)."""


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    data: str = "ddp"
    ac: str = "none"
    microbatches: int = 1
    sp: bool = False
    """Sequence parallelism on the tp ranks (the norms and residual stream split by sequence)."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (ring attention), which read the same samples."""

    @property
    def name(self) -> str:
        # Beside cp the data-parallel strategy runs even at dp 1: over the cp ranks.
        data = f"{self.data} x{self.dp}" if self.dp > 1 else (self.data if self.cp > 1 else "")
        parts = [data, f"cp{self.cp}" if self.cp > 1 else "",
                 (f"tp{self.tp}" + (" (sp)" if self.sp else "")) if self.tp > 1 else "",
                 f"pp{self.pp}" if self.pp > 1 else ""]
        return " + ".join(p for p in parts if p) or "one worker"

    @property
    def data_ranks(self) -> int:
        """The ranks the data-parallel strategy runs over (syncs gradients, shards state): dp x cp."""
        return self.dp * self.cp


def _micro_batch(global_batch: int, layout: Layout) -> float:
    return global_batch / layout.dp / layout.microbatches  # the cp ranks of a group share their sequences


def layout_memory(shape: ModelShape, layout: Layout, global_batch: int, act_bytes: float = 2.0) -> dict[str, float]:
    """Bytes per worker (the fullest rank): model state and activations."""
    params = shape.layers / layout.pp * shape.block_params / layout.tp + shape.embed_params
    # cp ranks hold whole replicas of their (tp, pp) part; zero and fsdp shard it over every rank the data-parallel
    # strategy runs on, the dp x cp ranks (FSDP2 over the flattened dp_cp mesh beside tp, the default group alone).
    n = layout.data_ranks
    per_param = {"ddp": STATE_BYTES, "zero1": 8.0 + 8.0 / n, "zero2": 4.0 + 12.0 / n,
                 "fsdp": STATE_BYTES / n}[layout.data]
    activations = activation_bytes(shape, layout, global_batch, act_bytes)
    return {"params": params, "state_bytes": params * per_param, "activation_bytes": activations,
            "total_bytes": params * per_param + activations}


def activation_bytes(shape: ModelShape, layout: Layout, global_batch: int, act_bytes: float = 2.0) -> float:
    """Peak activation bytes of the fullest pipeline stage (see the module's docstring)."""
    s, b, h, t = shape.seq, _micro_batch(global_batch, layout), shape.hidden, layout.tp
    sbh = s / layout.cp * b * h * act_bytes  # a cp rank holds s / cp tokens of each sequence inside the model
    shard = 1 / t if layout.sp else 1.0  # the residual stream's share on each rank
    whole = sbh * (4 + 13 / t)
    layer = sbh * (2 * shard + 2 + 13 / t)  # sequence parallel: the norms' inputs split, the gathered ones whole
    kept = sbh * shard if layout.ac == "full" else layer
    gradients = sbh * (1 + 4 / t)  # backward's gathered gradients are whole even under sequence parallelism
    edge = sbh * (shard + 1)  # the final norm's input and the output layer's (gathered) input
    # and the fp32 logits with their log-softmax, whole under cp (gathered back over the cp ranks: s, not s / cp);
    # a pipeline's last stage also keeps its output, the logits, until the loss's backward, which makes their two
    # gradients beside them (measured: tp 2 x pp 2 under full AC).
    head = edge + (4 if layout.pp > 1 else 2) * 4.0 * b * s * shape.vocab
    fullest = 0.0
    for stage in range(layout.pp):
        held = min(layout.microbatches, layout.pp - stage) * shape.layers / layout.pp * kept
        last = stage == layout.pp - 1
        if layout.ac == "full":
            transient = max(whole + gradients, head if last else 0.0)  # one layer recomputed, as without sp
        else:
            transient = max(head, edge + gradients) if last else gradients
        fullest = max(fullest, held + transient)
    return fullest


def _link(ranks_per_host_needed: int, cluster: Cluster) -> Link:
    return cluster.intra if ranks_per_host_needed <= cluster.per_host else cluster.inter


def _p2p_time(nbytes: float, link: Link) -> float:
    """One send to a neighbour (every rank sending to its own at once)."""
    return link.alpha_s + nbytes / link.beta_Bps


def cp_comm_time(shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int,
                 act_bytes: float = 2.0) -> float:
    """Seconds a step waits on the context-parallel ring (see the module's docstring), not overlapped."""
    cp, t = layout.cp, layout.tp
    if cp == 1:
        return 0.0
    b = _micro_batch(global_batch, layout)
    local = b * shape.seq / cp * shape.hidden / t  # one rank's keys (or values): its tokens, its tp share of heads
    if t * cp <= cluster.per_host:  # a cp group is tp x cp consecutive ranks (cp outside tp)
        link = cluster.intra
    else:  # a ring leaving the host: the tp rings of a host cross at once, each its share of the host's link
        link = Link(cluster.inter.alpha_s, cluster.inter.beta_Bps / t, cluster.inter.name)
    kv = _p2p_time(2 * local * act_bytes, link)  # K and V in one message, in the activations' dtype
    dkv = _p2p_time(2 * local * 4.0, link)  # the dK / dV accumulator travels in fp32
    forwards = 2 if layout.ac == "full" else 1  # checkpointing runs each attention's forward again
    per_layer = forwards * (cp - 1) * kv + (cp - 1) * kv + cp * dkv  # backward: cp - 1 blocks, cp accumulator hops
    # The logits gathered back whole: an all-gather of each rank's b x s / cp x V (ring: cp - 1 steps).
    logits = b * shape.seq * shape.vocab * act_bytes
    gather = (cp - 1) * link.alpha_s + (cp - 1) / cp * logits / link.beta_Bps
    return layout.microbatches * (shape.layers / layout.pp * per_layer + gather)


def _data_topology(layout: Layout, cluster: Cluster) -> Topology:
    """The data-parallel ranks of one (tp, pp) coordinate, dp x cp of them (ranks ordered dp, pp, cp, tp from the
    outermost): spread over the hosts, several on one host when the model-parallel ranks leave room."""
    n, group = layout.data_ranks, layout.tp * layout.pp
    if group * layout.cp <= cluster.per_host:  # whole dp slices per host
        per_host = max(1, min(n, cluster.per_host // group))
        return Topology(max(1, cluster.workers // cluster.per_host), per_host)
    per_host = max(1, min(layout.cp, cluster.per_host // layout.tp))  # a slice's cp ranks over its hosts
    return Topology(max(1, n // per_host), per_host)


def layout_step(shape: ModelShape, cluster: Cluster, layout: Layout, global_batch: int, act_bytes: float = 2.0,
                bucket_mb: float = 25.0) -> dict[str, float]:
    """Seconds per step and its parts (see the module's docstring)."""
    tokens = global_batch / layout.dp * shape.seq  # each data-parallel rank's share (a cp group's)
    recompute = 4 / 3 if layout.ac == "full" else 1.0
    # A cp rank computes 1/cp of its group's tokens; the causal attention's work is balanced over the cp ranks.
    whole = tokens / layout.cp * shape.flops_per_token / layout.pp / (cluster.tflops * 1e12) * recompute
    compute = whole * ((1 - cluster.tp_unsplit) / layout.tp + cluster.tp_unsplit) if layout.tp > 1 else whole
    m, b = layout.microbatches, _micro_batch(global_batch, layout)
    activation = b * shape.seq / layout.cp * shape.hidden * act_bytes
    layers = shape.layers / layout.pp
    tp_calls = layers * m * (6 if layout.ac == "full" else 4)
    tp_s = tp_calls * ring_time(activation, layout.tp, _link(layout.tp, cluster))
    cp_s = cp_comm_time(shape, cluster, layout, global_batch, act_bytes)
    bubble = compute * (layout.pp - 1) / m
    p2p_link = _link(layout.tp * layout.pp, cluster)
    p2p = 2 * m * (p2p_link.alpha_s + activation / p2p_link.beta_Bps) if layout.pp > 1 else 0.0
    params = layers * shape.block_params / layout.tp + shape.embed_params
    volume = strategy_spec(layout.data).comm_volume
    work = Workload(params * 4.0 * volume, compute / 3, compute * 2 / 3)
    dp = (predict_step(work, _data_topology(layout, cluster), cluster.intra, cluster.inter, "hierarchical",
                       bucket_mb * 1e6) if layout.data_ranks > 1 else None)
    dp_exposed = dp.exposed_s if dp else 0.0
    step = compute + tp_s + cp_s + bubble + p2p + dp_exposed
    return {"compute_s": compute, "tp_comm_s": tp_s, "cp_comm_s": cp_s, "bubble_s": bubble, "p2p_s": p2p,
            "dp_exposed_s": dp_exposed, "step_s": step,
            "tokens_per_s_per_worker": tokens * layout.dp / step / cluster.workers}


def enumerate_layouts(shape: ModelShape, cluster: Cluster, global_batch: int, microbatches: int = 8,
                      strategies: tuple[str, ...] = DATA_STRATEGIES, ac: tuple[str, ...] = ("none", "full")) -> list[Layout]:
    """Every layout of ``cluster.workers``: tp dividing the heads and fitting in a host, cp with ``2 cp`` dividing
    the sequence (each rank two equal chunks), pp dividing the layers, dp dividing the global batch. Each
    data-parallel rank's share is cut into ``microbatches`` (at least pp; with pp = 1 the accumulation's, the
    largest count up to it that divides the share)."""
    found = []
    for tp in _divisors(cluster.workers):
        if shape.heads % tp or tp > cluster.per_host:
            continue
        for cp in _divisors(cluster.workers // tp):
            if shape.seq % (2 * cp):
                continue
            for pp in _divisors(cluster.workers // (tp * cp)):
                dp = cluster.workers // (tp * cp * pp)
                if shape.layers % pp or global_batch % dp:
                    continue
                share = global_batch // dp
                if pp > 1:
                    m = max(microbatches, pp)
                    if share % m:
                        continue
                else:
                    m = max(d for d in _divisors(share) if d <= microbatches)
                for data in strategies if dp * cp > 1 else ("ddp",):
                    if runs_in_ringtrain(tp, pp, dp, data, cp):
                        # Under tp, sequence parallelism (the same bytes moved, less memory held); cp layouts are
                        # listed without it (ringtrain runs the two sequence splits together, but the planner's
                        # activation figures for them are not checked against a measurement).
                        found.extend(Layout(dp, tp, pp, data, checkpointing, m, sp=tp > 1 and cp == 1, cp=cp)
                                     for checkpointing in ac)
    return found


def runs_in_ringtrain(tp: int, pp: int, dp: int, data: str, cp: int = 1) -> bool:
    """The compositions ringtrain builds: a split model (tp, pp, cp) beside data-parallel ranks runs where the data
    strategy's spec (``ringtrain/strategies.py``) says it composes with that dimension. Beside cp the strategy
    runs over the dp x cp ranks, so its spec matters even at dp 1."""
    spec = strategy_spec(data)
    if cp > 1:
        # The rest of the rule is ringtrain/config/parallel.py's check_context_parallel (mirrored here): beside pp
        # the pipeline's own rule (below) holds, beside tp the strategy averages over the dp x cp ranks (its spec's
        # "tp", below). Its other refusals (HSDP beside tp, dropout, heal, auto micro-batches) are not layouts the
        # planner enumerates: cp layouts are listed without sp, and with one dp dimension.
        if "cp" not in spec.beside:
            return False
    # ringtrain's ZeRO wraps a pipeline's stages over the dp ranks only: not beside tp's DTensors or cp's shares.
    if "stage" in spec.options and pp > 1 and (tp > 1 or cp > 1):
        return False
    if dp * cp == 1:
        return True
    # tp inside pipeline stages runs beside what the pipeline runs beside (its own gradient average).
    return (tp == 1 or pp > 1 or "tp" in spec.beside) and (pp == 1 or "pp" in spec.beside)


def plan_layouts(shape: ModelShape, cluster: Cluster, global_batch: int, act_bytes: float = 2.0,
                 microbatches: int = 8) -> list[dict]:
    """Every layout with its memory and step time, those that fit first (fastest first), then the rest."""
    if global_batch < 1:
        raise PlanError(f"--global-batch {global_batch}: a step needs at least one sequence")
    rows = []
    for layout in enumerate_layouts(shape, cluster, global_batch, microbatches):
        memory = layout_memory(shape, layout, global_batch, act_bytes)
        step = layout_step(shape, cluster, layout, global_batch, act_bytes)
        rows.append({"layout": layout.name, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp, "pp": layout.pp,
                     "data": layout.data,
                     "ac": layout.ac, "microbatches": layout.microbatches,
                     "memory_gb": memory["total_bytes"] / 1e9, "state_gb": memory["state_bytes"] / 1e9,
                     "activations_gb": memory["activation_bytes"] / 1e9,
                     "fits": memory["total_bytes"] <= cluster.memory_gb * 1e9, **step})
    rows.sort(key=lambda r: (not r["fits"], r["step_s"], r["memory_gb"]))
    if not rows:
        raise PlanError(f"no layout of {cluster.workers} workers divides this model (heads {shape.heads}, layers "
                        f"{shape.layers}) and a global batch of {global_batch}; change the workers or the batch")
    return rows


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts_markdown(rows: list[dict], limit: int = 12) -> str:
    lines = ["| layout | AC | micro-batches | memory GB (state + activations) | step ms | compute | tp comm | cp comm "
             "| bubble | p2p | dp exposed | fits |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for i, r in enumerate(rows[:limit]):
        mark = " **(recommended)**" if i == 0 and r["fits"] else ""
        lines.append(f"| {r['layout']}{mark} | {r['ac']} | {r['microbatches']} | {r['memory_gb']:.1f} "
                     f"({r['state_gb']:.1f} + {r['activations_gb']:.1f}) | {r['step_s'] * 1e3:,.1f} "
                     f"| {r['compute_s'] * 1e3:,.1f} | {r['tp_comm_s'] * 1e3:,.1f} | {r['cp_comm_s'] * 1e3:,.1f} "
                     f"| {r['bubble_s'] * 1e3:,.1f} "
                     f"| {r['p2p_s'] * 1e3:,.1f} | {r['dp_exposed_s'] * 1e3:,.1f} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines) + "\n"


def check_shape(shape: ModelShape) -> None:
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        if getattr(shape, name) < 1:
            raise PlanError(f"--{name} {getattr(shape, name)}: must be 1 or more")
    if shape.hidden % shape.heads:
        raise PlanError(f"--hidden {shape.hidden} does not divide into --heads {shape.heads}")
    if math.isnan(shape.params):
        raise PlanError("the model's shape gives no parameter count")


# --- validation: predict what `ringtrain bench train` measured for tp and pp --------------------------------
def parse_tp_unsplit(text: str) -> dict[str, float]:
    """``--tp-unsplit``: '0.25' (the same share in every precision) or 'fp32=0.237,bf16=0.595' (per precision:
    the share left whole grows when the matrix multiplies get faster)."""
    shares: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        precision, _, value = item.rpartition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if precision not in ("", "fp32", "bf16") or not 0.0 <= share <= 1.0:
            raise PlanError(f"--tp-unsplit {text}: a share of the compute between 0 and 1, for every precision "
                            "(0.25) or per precision (fp32=0.237,bf16=0.595)")
        for name in (precision,) if precision else ("fp32", "bf16"):
            shares[name] = share
    return {"fp32": 0.0, "bf16": 0.0, **shares}


def validate_layouts(rows: list[dict], runs_dir: str, links: dict[str, Link],
                     tp_unsplit: float | dict[str, float] = 0.0) -> list[dict]:
    """For each tensor- or pipeline-parallel case of a ``bench train`` result at 2+ workers (``--strategies
    tp,tp:shm,pp``): its step time predicted from the same case's one-worker step (which sets the FLOP/s) and
    this machine's calibrated links (Gloo's for ``torch``, shm's for ``tp:shm``), against the measured median.
    The model's shape and batch come from each run's ``config.toml`` under ``runs_dir``; ``tp_unsplit`` one
    share, or one per precision."""
    shares = tp_unsplit if isinstance(tp_unsplit, dict) else {"fp32": tp_unsplit, "bf16": tp_unsplit}
    import tomllib
    from pathlib import Path

    by_name = {row["name"]: row for row in rows if row.get("runner") == "ringtrain"}
    cases = []
    for name, row in sorted(by_name.items()):
        if row["world_size"] < 2 or row["strategy"] not in ("tp", "pp"):
            continue
        single = by_name.get(name.replace(f"-n{row['world_size']}-", "-n1-"))
        if single is None:
            continue
        config = tomllib.loads((Path(runs_dir) / name / "config.toml").read_text())
        model, train, parallel = config["model"], config["train"], config.get("parallel", {})
        shape = ModelShape(model["n_layers"], model["d_model"], model["n_heads"], config["data"]["seq_len"], 256)
        act_bytes = 4.0 if train.get("precision") == "fp32" else 2.0
        batch = train["global_batch_size"]
        tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
        m = parallel.get("pp_microbatches") or pp if pp > 1 else max(1, batch // train["local_batch_size"])
        # The one worker's step is all compute: the FLOP/s it achieved.
        tflops = batch * shape.seq * shape.flops_per_token / single["median_step_s"] / 1e12
        link = links["shm"] if row["algorithm"] == "shm" else links["torch"]
        precision = train.get("precision", "bf16")
        cluster = Cluster(row["world_size"], row["world_size"], 1e9, tflops, link, link, shares[precision])
        layout = Layout(row["world_size"] // (tp * pp), tp, pp, "ddp", "none", m)
        predicted = layout_step(shape, cluster, layout, batch, act_bytes)
        measured = row["median_step_s"]
        cases.append({"case": name, "precision": precision, "one_worker_ms": single["median_step_s"] * 1e3,
                      "measured_ms": measured * 1e3, "predicted_ms": predicted["step_s"] * 1e3,
                      "error": predicted["step_s"] / measured - 1,
                      "parts_ms": {k: v * 1e3 for k, v in predicted.items() if k.endswith("_s") and k != "step_s"}})
    return cases


# --- the commands ----------------------------------------------------------------------------------------
def add_layouts_parsers(actions) -> None:
    lay = actions.add_parser("layouts", help="feasible dp x cp x tp x pp layouts of a transformer, memory and step time; "
                                             "recommends one")
    lay.add_argument("--layers", type=int, required=True)
    lay.add_argument("--hidden", type=int, required=True)
    lay.add_argument("--heads", type=int, required=True)
    lay.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    lay.add_argument("--vocab", type=int, default=50304)
    lay.add_argument("--global-batch", type=int, required=True, help="sequences per step, over all workers")
    lay.add_argument("--workers", default="64", help="worker counts, comma-separated (e.g. 8,64,1024)")
    lay.add_argument("--per-host", type=int, default=8)
    lay.add_argument("--memory-gb", type=float, default=80.0, help="memory per worker")
    lay.add_argument("--tflops", type=float, default=300.0, help="TFLOP/s one worker achieves (not its peak)")
    lay.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="activations' and messages' dtype")
    lay.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (at least pp)")
    lay.add_argument("--intra-gbps", type=float, default=200.0, help="inside a host, GB/s of bus bandwidth")
    lay.add_argument("--intra-alpha-us", type=float, default=5.0)
    lay.add_argument("--inter-gbit", type=float, default=400.0, help="between hosts, Gbit/s per host")
    lay.add_argument("--inter-alpha-us", type=float, default=10.0)
    lay.add_argument("--tp-unsplit", default="0",
                     help="share of the compute tensor parallelism leaves whole on each rank (0 to 1; default 0), "
                          "or one per precision: fp32=0.237,bf16=0.595")
    lay.add_argument("--top", type=int, default=8, help="rows shown per worker count")
    lay.add_argument("--out", help="folder for plan_layouts.md / .json")
    lay.set_defaults(handler=_layouts)
    val = actions.add_parser("validate-layouts", help="predict a `bench train` result's tp and pp step times")
    val.add_argument("bench_json", help="train_bench.json from `ringtrain bench train --strategies tp,tp:shm,pp`")
    val.add_argument("--links", default="bench-out/plan/links.json")
    val.add_argument("--tp-unsplit", default="0",
                     help="share of the compute tensor parallelism leaves whole (fit it on one run, check the "
                          "others): one value, or one per precision: fp32=0.237,bf16=0.595")
    val.set_defaults(handler=_validate_layouts)


def _layouts(args) -> int:
    import json
    from pathlib import Path

    from ringtrain.bench.plan import _ints

    shape = ModelShape(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    check_shape(shape)
    act_bytes = 2.0 if args.precision == "bf16" else 4.0
    tp_unsplit = parse_tp_unsplit(args.tp_unsplit)[args.precision]
    intra = Link(args.intra_alpha_us * 1e-6, args.intra_gbps * 1e9, f"{args.intra_gbps:g} GB/s")
    inter = Link(args.inter_alpha_us * 1e-6, args.inter_gbit * 1e9 / 8, f"{args.inter_gbit:g} Gbit/s")
    sections, table = [], {}
    for workers in _ints(args.workers, "--workers"):
        cluster = Cluster(workers, min(args.per_host, workers), args.memory_gb, args.tflops, intra, inter,
                          tp_unsplit)
        rows = plan_layouts(shape, cluster, args.global_batch, act_bytes, args.microbatches)
        fits = [r for r in rows if r["fits"]]
        head = (f"{workers:,} workers ({args.per_host} per host): {len(fits)} of {len(rows)} layouts fit in "
                f"{args.memory_gb:g} GB" + (f"; recommended: {fits[0]['layout']}, AC {fits[0]['ac']}" if fits else
                                            "; none fits: more workers, a smaller batch or checkpointing"))
        sections.append(f"{head}\n\n{layouts_markdown(rows, args.top)}")
        table[workers] = rows
    text = (f"Model: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, {shape.seq} tokens, vocab "
            f"{shape.vocab} ({shape.params / 1e6:,.0f}M parameters); {args.global_batch} sequences a step; "
            f"{args.tflops:g} TFLOP/s a worker; {intra.name} inside a host, {inter.name} between\n\n" + "\n".join(sections))
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan_layouts.md").write_text(text)
        (out / "plan_layouts.json").write_text(json.dumps({str(k): v for k, v in table.items()}, indent=1) + "\n")
        print(f"written: {out / 'plan_layouts.md'}")
    return 0


def _validate_layouts(args) -> int:
    from pathlib import Path

    from ringtrain.bench.plan import _read_rows, read_links

    rows = _read_rows(args.bench_json, "ringtrain bench train")
    cases = validate_layouts(rows, str(Path(args.bench_json).parent / "runs"), read_links(args.links),
                             parse_tp_unsplit(args.tp_unsplit))
    if not cases:
        raise PlanError(f"{args.bench_json}: no tp or pp case at 2+ workers beside its one-worker run "
                        "(ringtrain bench train --nproc 1,2 --strategies tp,pp)")
    print("| case | precision | one worker | measured | predicted | error | predicted parts (ms) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for c in cases:
        parts = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in c["parts_ms"].items() if v)
        print(f"| {c['case']} | {c['precision']} | {c['one_worker_ms']:.1f} ms | {c['measured_ms']:.1f} ms "
              f"| {c['predicted_ms']:.1f} ms | {c['error']:+.1%} | {parts} |")
    return 0
