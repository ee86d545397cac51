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

from ringtrain.errors import ConfigError
from ringtrain.parallel.context import (ContextCommTimer, apply_context_parallel, ring_attention, sequence_positions,
                                        shard_sequence, unshard_sequence)

__all__ = ["split_context", "shard_tokens_of", "gather_sequence", "hf_ring_attention"]


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


def shard_tokens_of(tokens: torch.Tensor, rank: int, size: int,
                    max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's part of ``tokens`` ``[batch, seq]`` and its tokens' global positions: the sequence padded
    to a multiple of ``2 size`` (after the last token: the causal mask hides it from every real one), then its
    two load-balanced chunks (``context.shard_sequence``). The padding's positions (past the model's last one
    when the sequence is full) are clamped to ``max_positions - 1``: no real token sees them, and their logits
    are cut off (``gather_sequence``)."""
    length = tokens.shape[1]
    padded = -(-length // (2 * size)) * (2 * size)
    if padded != length:
        tokens = F.pad(tokens, (0, padded - length))
    positions = sequence_positions(padded, rank, size, device=tokens.device).clamp(max=max_positions - 1)
    return shard_sequence(tokens, 1, rank, size), positions


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int, length: int) -> torch.Tensor:
    """Every cp rank's part of ``[batch, seq, ...]`` (``shard_tokens_of``'s order) as the whole sequence's first
    ``length`` positions, on every rank; its backward keeps this rank's part of the gradient (every rank computes
    the same loss from the same whole tensor)."""
    return _GatherSequence.apply(local, group, rank, size)[:, :length]


def split_context(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Split ``model`` over the ranks of ``group`` along the sequence, in place: the built-in ``TransformerLM``, or
    a Hugging Face causal LM whose attention goes through transformers' attention interface (SDPA or eager: it
    becomes ring attention, ``hf_ring_attention``). It still takes whole token sequences and returns whole
    logits (see the module's docstring). State dict keys are unchanged (hooks only), so a checkpoint crosses
    layouts. Any other model: one ConfigError line."""
    from ringtrain.models.transformer import TransformerLM

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(model, TransformerLM):
        apply_context_parallel(model, group)
        positions_kwarg, max_positions = "positions", model.seq_len
    elif _is_hf_causal_lm(model):
        _ring_for_hf(model, group)
        positions_kwarg, max_positions = "position_ids", model.config.max_position_embeddings
    else:
        raise ConfigError(f"[parallel] cp = {size}: context parallelism splits the built-in transformer or a Hugging "
                          "Face causal LM whose attention is 'sdpa' or 'eager' (transformers' attention interface), "
                          f"not {type(model).__name__}; set cp = 1")
    lengths: list[int] = []

    def shard_tokens(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        tokens = args[0] if args else kwargs.pop("tokens", None)
        if tokens is None:
            tokens = kwargs.pop("input_ids")
        if kwargs.get("attention_mask") is not None:
            raise ConfigError(f"[parallel] cp = {size}: ring attention is causal over whole sequences and takes no "
                              "attention_mask; pass the tokens alone (padding at the end is fine), or set cp = 1")
        lengths.append(tokens.shape[1])
        local, positions = shard_tokens_of(tokens, rank, size, max_positions)
        extra = {positions_kwarg: positions}
        if positions_kwarg == "position_ids":  # a Hugging Face model: (batch, seq) positions, no key/value cache
            extra = {"position_ids": positions.expand(tokens.shape[0], -1), "use_cache": False}
        return (local, *args[1:]), {**kwargs, **extra}

    def gather_logits(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        length = lengths.pop()
        if isinstance(output, torch.Tensor):
            return gather_sequence(output, group, rank, size, length)
        output.logits = gather_sequence(output.logits, group, rank, size, length)  # a ModelOutput
        return output

    # First among the pre-hooks: the positions hook (apply_context_parallel's) sees this rank's chunks.
    model.register_forward_pre_hook(shard_tokens, with_kwargs=True, prepend=True)
    model.register_forward_hook(gather_logits, with_kwargs=True)
    return model


# --- Hugging Face causal LMs -------------------------------------------------------------------------------------

_HF_GROUPS: dict[int, tuple[dist.ProcessGroup, ContextCommTimer]] = {}
"""id(model.config) -> its cp group and timer: transformers hands an attention function the attention module,
whose ``config`` is the model's."""
HF_ATTENTION = "ringtrain_ring"


def _is_hf_causal_lm(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) in ("sdpa", "eager", HF_ATTENTION)
            and hasattr(model, "set_attn_implementation"))


def hf_ring_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (``sdpa_attention_forward``'s signature) as ring attention over the
    model's cp group: causal over the whole sequence, ``attention_mask`` (the local causal mask transformers
    builds) unused; returns ``[batch, seq, heads, head_dim]``, as SDPA's does."""
    group, timer = _HF_GROUPS[id(module.config)]
    out = ring_attention(query, key, value, group, scale=scaling, timer=timer)
    return out.transpose(1, 2).contiguous(), None


def _ring_for_hf(model: nn.Module, group: dist.ProcessGroup) -> None:
    from transformers import AttentionInterface

    if getattr(model.config, "attention_dropout", 0.0):
        raise ConfigError(f"ring attention has no attention dropout; the model's config has attention_dropout = "
                          f"{model.config.attention_dropout}: build it with 0, or set cp = 1")
    AttentionInterface.register(HF_ATTENTION, hf_ring_attention)
    timer = ContextCommTimer()
    _HF_GROUPS[id(model.config)] = (group, timer)
    model.set_attn_implementation(HF_ATTENTION)
    model.cp_comm_timer = timer
