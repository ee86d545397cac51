"""Context parallelism as a transform of the model (``[parallel] cp``): the built-in transformer's sequence split
over the ranks of the layout's ``cp`` dimension, with everything outside the model left as it is.

    split_context(model, ctx.mesh["cp"].get_group())   # before the data-parallel strategy wraps it
    logits = model(tokens)      # tokens [batch, seq] on every cp rank: logits [batch, seq, vocab], the same

Every rank of a context-parallel group is fed the same whole sequences (they share a data-parallel coordinate:
the sampler, the ledger and the loss see them as one rank). A pre-hook pads the sequence to a multiple of
``2 cp`` (padding after the last token: under the causal mask no real token sees it) and keeps this rank's two
chunks (``context.shard_sequence``: load-balanced) and their global positions for the position embeddings;
every attention runs ``context.ring_attention`` over the group (``context.apply_context_parallel``); a
forward hook gathers the logits back into the whole sequence. The gather's backward keeps this rank's chunks of
the (identical) gradient, so each rank's parameter gradients are its tokens' share of the whole batch's: the
data-parallel strategy averages them over the dp x cp ranks, and the step scales the loss by the cp degree
(``DistContext.gradient_ranks``), so the sum over the cp ranks is what one rank holding the whole sequence
computes. Activations inside the model are 1/cp of the sequence; the logits, the model's last output, are whole.

Why not torch's ``context_parallel``: on CPU its ring covers none of the SDPA kernels (``context.py``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtrain.parallel.context import apply_context_parallel, sequence_positions, shard_sequence, unshard_sequence

__all__ = ["split_context"]


class _GatherSequence(torch.autograd.Function):
    """This rank's chunks of ``[batch, seq, ...]`` -> the whole sequence on every rank; backward: this rank's
    chunks of the gradient (every rank computes the same loss from the same whole tensor)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        return unshard_sequence(local, 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return shard_sequence(grad, 1, ctx.rank, ctx.size).contiguous(), None, None, None


def split_context(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Split ``model`` (the built-in ``TransformerLM``) over the ranks of ``group`` along the sequence, in place:
    it still takes whole token sequences and returns whole logits (see the module's docstring). State dict keys
    are unchanged (hooks only), so a checkpoint crosses layouts."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    apply_context_parallel(model, group)
    lengths: list[int] = []

    def shard_tokens(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        tokens = args[0] if args else kwargs.pop("tokens")
        length = tokens.shape[1]
        padded = -(-length // (2 * size)) * (2 * size)
        if padded != length:  # after the last token: the causal mask hides it from every real one
            tokens = F.pad(tokens, (0, padded - length))
        lengths.append(length)
        # The global positions of this rank's chunks; the padding's (past the model's last position when the
        # sequence is full) clamped: no real token sees it, and its logits are cut off.
        positions = sequence_positions(padded, rank, size, device=tokens.device).clamp(max=module.seq_len - 1)
        return (shard_sequence(tokens, 1, rank, size), *args[1:]), {**kwargs, "positions": positions}

    def gather_logits(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(output, group, rank, size)[:, :lengths.pop()]

    # First among the pre-hooks: the positions hook (apply_context_parallel's) sees this rank's chunks.
    model.register_forward_pre_hook(shard_tokens, with_kwargs=True, prepend=True)
    model.register_forward_hook(gather_logits, with_kwargs=True)
    return model
