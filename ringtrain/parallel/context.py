"""Context parallelism's attention: causal self-attention over a sequence split across ``cp`` ranks.

Each rank of the context-parallel group holds a slice of every sequence; attention needs each query's earlier
keys and values, which live on other ranks. Ring attention (Liu et al., 2023) passes the key/value blocks around
the ring of ranks: in ``cp`` steps every rank sees every block, attends its queries to the block's keys, and
merges the partial outputs with their log-sum-exps (the online softmax of flash attention), so the result is
exact, not an approximation. The next block's transfer overlaps the current block's compute.

Load balance: under a causal mask the last tokens attend to everything and the first to almost nothing, so
cutting the sequence into ``cp`` contiguous slices would give the last rank ``2 cp - 1`` times the first's work.
The sequence is instead cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (an
early one and a late one): every rank does the same causal work, at every ring step.

    from ringtrain.parallel.context import ring_attention, sequence_positions, shard_sequence, unshard_sequence

    # q, k, v: [batch, heads, seq, head_dim] of the whole sequence; each rank keeps its two chunks
    q, k, v = (shard_sequence(t, 2, cp_rank, cp_size) for t in (q_full, k_full, v_full))
    out = ring_attention(q, k, v, cp_group)      # this rank's rows of causal SDPA over the whole sequence
    out.sum().backward()                         # dq, dk, dv of this rank's tokens (dk/dv gathered over the ring)
    sequence_positions(seq_len, cp_rank, cp_size)   # the global positions of this rank's tokens
    unshard_sequence(out, 2, cp_group)           # [batch, heads, seq, head_dim] in sequence order, on every rank

``apply_context_parallel(model, cp_group)`` makes the built-in transformer use it: each rank then feeds its
``shard_sequence`` of the tokens (and of the targets).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.comm.groups import group_rank, group_size, group_timeout_s, resolve_group
from ringtrain.comm.ring import RingPeers

__all__ = [
    "shard_sequence", "unshard_sequence", "sequence_positions", "ring_attention", "ContextCommTimer",
    "apply_context_parallel",
]


# --- load balancing ---------------------------------------------------------------------------------------------


def _check_sequence(seq_len: int, cp_size: int) -> None:
    chunks = 2 * cp_size
    if cp_size < 1:
        raise ValueError(f"cp ({cp_size}) must be at least 1")
    if seq_len % chunks:
        fit = math.ceil(seq_len / chunks) * chunks
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * cp = {chunks} (cp = {cp_size}): pad the sequences "
            f"to a multiple of {chunks} (e.g. {fit}), or choose a cp that divides {seq_len} // 2"
        )


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank ({cp_rank}) must be in [0, cp_size) = [0, {cp_size})")


def _chunks_of(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 cp``) rank ``cp_rank`` holds: an early one and its mirror from the end."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``: chunks ``cp_rank`` and ``2 cp - 1 - cp_rank`` of ``2 cp``, joined.

    ``x.size(dim)`` must be divisible by ``2 cp`` (else one-line ValueError naming the numbers and the fix).
    """
    _check_rank(cp_rank, cp_size)
    _check_sequence(x.size(dim), cp_size)
    chunks = x.chunk(2 * cp_size, dim)
    first, second = _chunks_of(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim)


def sequence_positions(
    seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions (int64, ``seq_len // cp`` of them, increasing) of the tokens ``shard_sequence`` gives
    rank ``cp_rank`` of a ``seq_len``-token sequence: what its position embeddings must see."""
    _check_rank(cp_rank, cp_size)
    _check_sequence(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first, second = _chunks_of(cp_rank, cp_size)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def unshard_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence from every rank's ``shard_sequence`` part, in sequence order, on every rank.

    One all-gather over ``group``; not differentiable (for outputs, logits and tests, not for training).
    """
    group = resolve_group(group)
    cp_size = group_size(group)
    if cp_size == 1:
        return x
    if x.size(dim) % 2:
        raise ValueError(f"a rank's part holds two equal chunks; its length along dim {dim} ({x.size(dim)}) is odd")
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(cp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks: list[torch.Tensor] = [x] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = _chunks_of(rank, cp_size)
        chunks[first], chunks[second] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


# --- exchange accounting ----------------------------------------------------------------------------------------


class ContextCommTimer:
    """Bytes ``ring_attention`` sent and seconds it waited on the ring, until taken.

    The waits are what the passes lost to communication (a transfer that finished under the block's compute costs
    nothing); the trainer books them as the step phase ``cp_comm``, taken out of ``forward_backward``, as it does
    tensor parallelism's waits::

        timer = ContextCommTimer()
        apply_context_parallel(model, cp_group, timer=timer)
        ...
        clock.move("forward_backward", "cp_comm", timer.take_s())
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        # The clock is a parameter so tests can drive the accounting with a fake one.
        self.clock = clock
        self._lock = threading.Lock()  # activation checkpointing or a pipeline may run passes on other threads
        self._wait_s = {"forward": 0.0, "backward": 0.0}
        self._bytes = 0
        self.bytes_sent = 0
        """Bytes this rank sent since the timer was made (key/value blocks, and the dK/dV accumulators)."""

    def record(self, pass_name: str, wait_s: float, bytes_sent: int) -> None:
        """One ring pass: ``pass_name`` 'forward' or 'backward', the seconds it waited, the bytes it sent."""
        with self._lock:
            self._wait_s[pass_name] += wait_s
            self._bytes += bytes_sent
            self.bytes_sent += bytes_sent

    def take_s(self) -> float:
        """Seconds waited on the ring (forward and backward) since the last take."""
        with self._lock:
            total = self._wait_s["forward"] + self._wait_s["backward"]
            self._wait_s = {"forward": 0.0, "backward": 0.0}
            return total

    def take_split_s(self) -> dict[str, float]:
        """Like ``take_s``, by pass: ``{'forward': s, 'backward': s}``."""
        with self._lock:
            split, self._wait_s = self._wait_s, {"forward": 0.0, "backward": 0.0}
            return split

    def take_bytes(self) -> int:
        """Bytes sent since the last take."""
        with self._lock:
            taken, self._bytes = self._bytes, 0
            return taken


# --- ring attention ---------------------------------------------------------------------------------------------

_SKIP, _FULL, _CAUSAL = "skip", "full", "causal"


def _pair_kind(q_chunk: int, k_chunk: int) -> str:
    """What a query chunk sees of a key chunk, by their global order: every key of an earlier chunk, none of a
    later one, and the causal triangle of its own."""
    if k_chunk > q_chunk:
        return _SKIP
    return _FULL if k_chunk < q_chunk else _CAUSAL


def _diagonal_mask(chunk: int, chunk_len: int, device: torch.device) -> torch.Tensor:
    """Query i may see key j of the same chunk where j's global position is not after i's."""
    positions = chunk * chunk_len + torch.arange(chunk_len, device=device)
    return positions[:, None] >= positions[None, :]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    # q [B, Hkv, G, Sq, D], k [B, Hkv, 1, Sk, D]: the G query heads that share a key head broadcast over it.
    scores = (q @ k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores


def _block_forward(q, k, v, scale, mask, out, lse) -> None:
    """Attend ``q`` to one key/value block and merge into the running ``out`` / ``lse`` (views, updated in place)."""
    scores = _scores(q, k, scale, mask)
    block_lse = torch.logsumexp(scores, dim=-1)
    block_out = torch.exp(scores - block_lse.unsqueeze(-1)) @ v
    # Online softmax: both partial outputs are softmax-weighted means over their keys; reweigh each by its share
    # of the merged normaliser, exp(lse_part - lse_merged). Every query row sees its own diagonal, so the merged
    # lse is finite and a skipped or empty start (-inf, zero output) contributes exactly nothing.
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def _block_backward(q, k, v, scale, mask, dout, lse, delta, dq, dk, dv) -> None:
    """Flash attention 2's backward for one block: the probabilities rebuilt from the final lse; adds into the
    ``dq`` / ``dk`` / ``dv`` views."""
    probs = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))
    dv.add_((probs.transpose(-1, -2) @ dout).sum(2, keepdim=True))  # summed over the query heads sharing v
    dscores = probs * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    dq.add_((dscores @ k).mul_(scale))
    dk.add_((dscores.transpose(-1, -2) @ q).sum(2, keepdim=True).mul_(scale))


def _halves(x: torch.Tensor, dim: int = -2) -> tuple[torch.Tensor, torch.Tensor]:
    """The two chunks of a rank's part (views), along its sequence dim: -2 of a [..., seq, head_dim] tensor, -1 of
    the per-row lse."""
    first, second = x.chunk(2, dim)
    return first, second


class _Ring:
    """One call's ring: neighbours, step sources, the waits and bytes it accounts."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float | None, timer: ContextCommTimer | None,
                 device: torch.device):
        self.size = group_size(group)
        self.rank = group_rank(group)
        self.peers = RingPeers(group, timeout_s or group_timeout_s(group, device), "ring attention")
        self.timer = timer
        self.wait_s = 0.0
        self.bytes_sent = 0

    def source(self, step: int) -> int:
        """Whose key/value block this rank holds at ``step``: it moves one rank to the right per step."""
        return (self.rank - step) % self.size

    def post(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> tuple[list, list]:
        self.bytes_sent += send.numel() * send.element_size()
        return self.peers.post(send, recv, tag=tag)

    def wait(self, works: tuple[list, list], step: int) -> None:
        start = time.perf_counter() if self.timer is None else self.timer.clock()
        sends, recvs = works
        for work in recvs:
            self.peers.wait(work, self.peers.left, step, self.size)
        for work in sends:
            self.peers.wait(work, self.peers.right, step, self.size)
        self.wait_s += (time.perf_counter() if self.timer is None else self.timer.clock()) - start

    def account(self, pass_name: str) -> None:
        if self.timer is not None:
            self.timer.record(pass_name, self.wait_s, self.bytes_sent)
        self.wait_s, self.bytes_sent = 0.0, 0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 / fp16 inputs: scores, softmax and every accumulator in fp32 (sums over many blocks lose bits fast).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pairs(ring: _Ring, step: int) -> list[tuple[int, int, str, int]]:
    """(query half, key half, kind, the query chunk's global index) of this step's blocks that are not skipped."""
    q_chunks = _chunks_of(ring.rank, ring.size)
    k_chunks = _chunks_of(ring.source(step), ring.size)
    pairs = []
    for qi, q_chunk in enumerate(q_chunks):
        for ki, k_chunk in enumerate(k_chunks):
            kind = _pair_kind(q_chunk, k_chunk)
            if kind != _SKIP:
                pairs.append((qi, ki, kind, q_chunk))
    return pairs


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, timer, timeout_s):
        batch, heads, seq, head_dim = q.shape
        kv_heads = k.size(1)
        acc = _compute_dtype(q.dtype)
        ring = _Ring(group, timeout_s, timer, q.device)
        chunk = seq // 2
        # [B, H, S, D] -> [B, Hkv, G, S, D]: query head h reads key head h // G (repeat_interleave's order).
        q5 = q.reshape(batch, kv_heads, heads // kv_heads, seq, head_dim).to(acc)
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        q_halves, out_halves, lse_halves = _halves(q5), _halves(out), _halves(lse, -1)
        kv = torch.stack([k, v]).contiguous()  # one message per step; it travels in the inputs' dtype
        for step in range(ring.size):
            last = step == ring.size - 1
            if not last:  # post the next block's transfer first: it travels while this block is computed
                incoming = torch.empty_like(kv)
                works = ring.post(kv, incoming, tag=step)
            k_halves, v_halves = _halves(kv[0].unsqueeze(2).to(acc)), _halves(kv[1].unsqueeze(2).to(acc))
            for qi, ki, kind, q_chunk in _pairs(ring, step):
                mask = _diagonal_mask(q_chunk, chunk, q.device) if kind == _CAUSAL else None
                _block_forward(q_halves[qi], k_halves[ki], v_halves[ki], scale, mask,
                               out_halves[qi], lse_halves[qi])
            if not last:
                ring.wait(works, step)
                kv = incoming
        ring.account("forward")
        result = out.reshape(batch, heads, seq, head_dim).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring_args = (group, scale, timer, timeout_s)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, timer, timeout_s = ctx.ring_args
        batch, heads, seq, head_dim = q.shape
        kv_heads = k.size(1)
        acc = _compute_dtype(q.dtype)
        ring = _Ring(group, timeout_s, timer, q.device)
        chunk = seq // 2
        shape5 = (batch, kv_heads, heads // kv_heads, seq, head_dim)
        q5 = q.reshape(shape5).to(acc)
        dout5 = dout.reshape(shape5).to(acc)
        delta = (dout5 * out.reshape(shape5).to(acc)).sum(-1)  # rowsum(dO * O): the softmax's Jacobian term
        dq = torch.zeros_like(q5)
        q_halves, dout_halves, dq_halves = _halves(q5), _halves(dout5), _halves(dq)
        lse_halves, delta_halves = _halves(lse, -1), _halves(delta, -1)
        kv = torch.stack([k, v]).contiguous()
        # dK/dV of a block are summed over every rank its queries live on: the accumulator follows the block
        # around the ring (fp32, so the sum of cp parts keeps its bits) and a last hop brings it home.
        dkv_works = None
        for step in range(ring.size):
            last = step == ring.size - 1
            if not last:
                incoming = torch.empty_like(kv)
                kv_works = ring.post(kv, incoming, tag=step)
            dkv = torch.zeros((2, batch, kv_heads, 1, seq, head_dim), dtype=acc, device=q.device)
            k_halves, v_halves = _halves(kv[0].unsqueeze(2).to(acc)), _halves(kv[1].unsqueeze(2).to(acc))
            dk_halves, dv_halves = _halves(dkv[0]), _halves(dkv[1])
            for qi, ki, kind, q_chunk in _pairs(ring, step):
                mask = _diagonal_mask(q_chunk, chunk, q.device) if kind == _CAUSAL else None
                _block_backward(q_halves[qi], k_halves[ki], v_halves[ki], scale, mask, dout_halves[qi],
                                lse_halves[qi], delta_halves[qi], dq_halves[qi],
                                dk_halves[ki], dv_halves[ki])
            if dkv_works is not None:  # the block's accumulator from the ranks that held it before
                ring.wait(dkv_works, step)
                dkv.add_(dkv_incoming)
            if ring.size > 1:
                dkv_incoming = torch.empty_like(dkv)
                # Tags apart from the key/value blocks': both transfers are in flight at once.
                dkv_works = ring.post(dkv, dkv_incoming, tag=ring.size + step)
            if not last:
                ring.wait(kv_works, step)
                kv = incoming
        if ring.size > 1:
            ring.wait(dkv_works, ring.size)  # after cp hops this rank's own block's accumulator is back
            dkv = dkv_incoming
        ring.account("backward")
        dk = dkv[0].reshape(k.shape).to(k.dtype)
        dv = dkv[1].reshape(v.shape).to(v.dtype)
        return dq.reshape(q.shape).to(q.dtype), dk, dv, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    scale: float | None = None,
    timer: ContextCommTimer | None = None,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Causal self-attention of this rank's queries over the whole sequence, split over ``group`` (the cp ranks).

    ``q``: [batch, heads, local_seq, head_dim]; ``k``, ``v``: [batch, kv_heads, local_seq, head_dim], with
    ``heads`` a multiple of ``kv_heads`` (grouped-query attention, as SDPA's ``enable_gqa``). Every rank passes
    its ``shard_sequence`` part (two chunks, ``local_seq`` even). Returns this rank's rows of
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)`` over the whole sequence, in ``q``'s
    dtype (computed in fp32 for bf16 / fp16, fp64 for fp64). Differentiable (once): the backward passes the blocks
    around the ring again with their dK/dV accumulators. ``timer``: where the ring's waits and bytes are counted;
    ``timeout_s``: the wait for a neighbour (default: the group's timeout). No dropout, no other mask.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring_attention takes [batch, heads, local_seq, head_dim] tensors; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, "
                         "local_seq and head_dim (and k, v in heads)")
    if q.size(1) % k.size(1):
        raise ValueError(f"q's heads ({q.size(1)}) must be a multiple of k/v's heads ({k.size(1)}) for grouped-query "
                         "attention")
    if q.size(2) % 2:
        raise ValueError(f"local_seq ({q.size(2)}) is odd: each rank holds two equal chunks of the sequence "
                         "(shard_sequence)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, resolve_group(group), scale, timer, timeout_s)


# --- the built-in transformer ------------------------------------------------------------------------------------


def apply_context_parallel(
    model: nn.Module, cp_group: dist.ProcessGroup | None, *, timer: ContextCommTimer | None = None
) -> nn.Module:
    """Split the built-in ``TransformerLM`` over the ranks of ``cp_group`` along the sequence, in place.

    Each rank then calls ``model(shard_sequence(tokens, 1, cp_rank, cp))`` and gets the logits of its part:
    every attention runs ``ring_attention`` over the group, and the position embeddings see the part's global
    positions (``sequence_positions``, unless the call passes ``positions``). The loss is the caller's: each rank
    sums its part's token losses; the whole batch's mean is the sum over the group divided by the group's token
    count, and the parameters' gradients are summed over the group (with data parallelism: over dp x cp). The
    ring's waits and bytes go to ``timer`` (made if not given), kept as ``model.cp_comm_timer``.
    """
    from ringtrain.models.transformer import CausalSelfAttention, TransformerLM

    if not isinstance(model, TransformerLM):
        raise ValueError(f"apply_context_parallel splits ringtrain's TransformerLM; got {type(model).__name__} "
                         "(call ring_attention from your model's attention instead)")
    if getattr(model, "cp_comm_timer", None) is not None:
        raise ValueError("apply_context_parallel was applied to this model already")
    attentions = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if any(m.dropout for m in attentions):
        raise ValueError(f"ring attention has no attention dropout; the model's is {attentions[0].dropout}: "
                         "build it with dropout = 0")
    group = resolve_group(cp_group)
    cp_rank, cp_size = group_rank(group), group_size(group)
    timer = ContextCommTimer() if timer is None else timer
    for module in attentions:
        module.attention = partial(ring_attention, group=group, timer=timer)
    model.cp_comm_timer = timer

    def global_positions(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if kwargs.get("positions") is None and len(args) < 2:
            tokens = args[0] if args else kwargs["tokens"]
            seq_len = tokens.shape[1] * cp_size  # every rank holds an equal part
            if seq_len > module.seq_len:
                raise ValueError(f"sequence of {seq_len} tokens (cp {cp_size} x {tokens.shape[1]}) is longer than "
                                 f"the model's seq_len ({module.seq_len})")
            kwargs = {**kwargs, "positions": sequence_positions(seq_len, cp_rank, cp_size, device=tokens.device)}
        return args, kwargs

    model.register_forward_pre_hook(global_positions, with_kwargs=True)
    return model
