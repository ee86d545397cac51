"""Activation checkpointing per block (``[train] activation_checkpointing``), with PyTorch's own tools.

A checkpointed block keeps only its input for backward and runs its forward again when backward reaches
it: memory for compute. ``"full"`` recomputes the whole block; ``"selective"`` is torchtitan's op-level
policy (``torchtitan/distributed/activation_checkpoint.py``): inside a block, the outputs of attention and
of every other matmul are kept and everything else (norms, GELU, adds, views, the other matmuls) is
recomputed, through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``. Op-level rather than
"every other block", because it keeps what is expensive to recompute in every block alike: the step costs
little more than none while memory lies between none and full, and it needs no choice of blocks.

The checkpoint is the composable ``torch.distributed._composable.checkpoint``: forward hooks on the block,
so parameter names (state dicts, checkpoints, shard units) do not change, and it is applied before a
strategy wraps the model (DDP, manual, zero1-3, FSDP2's ``fully_shard`` on the same blocks). Recompute on
CPU is deterministic, and dropout masks are replayed (the RNG state is kept): results are bit-identical.

    >>> apply_ac(model, "full")          # -> the blocks it checkpointed
    >>> loss_fn(model(x)).backward()     # each block's forward runs again inside backward

The blocks (``ac_blocks``): the entries of the model's first non-empty ``nn.ModuleList`` (a Transformer's
layers, most user LMs'), else its direct children that are ``nn.Sequential`` (a ResNet's four stages; the
built-in MLP's whole body, its one Sequential).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import torch
from torch import nn

from ringtrain.errors import ConfigError

__all__ = ["AC_MODES", "ac_blocks", "apply_ac", "selective_policy"]

AC_MODES = ("none", "full", "selective")

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
# Kept by the selective policy: attention (each backend's kernel) and matmuls (every other one: see below).
_SAVE = {
    *_MATMULS,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def ac_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules checkpointed one by one: the first non-empty ``nn.ModuleList``'s entries, else the
    model's direct ``nn.Sequential`` children; ``[]`` when it has neither."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    return [child for child in model.children() if isinstance(child, nn.Sequential)]


def selective_policy():
    """A ``context_fn`` for one block's forward (fresh counts per call): torchtitan's op-level rule."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        # Count forward and recompute apart, so the recompute makes the same choice as the forward did.
        key = "recompute" if ctx.is_recompute else "forward"
        if func in _MATMULS:
            counts[key] += 1
            # Every other matmul is recomputed: half the matmul outputs for one extra matmul in two.
            save = counts[key] % 2 == 1
        else:
            save = func in _SAVE
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    # What the policy keeps goes through the caller's saved_tensors_hooks like any saved tensor (torch's
    # announced default; today it bypasses them): save_on_cpu moves it, and saved_bytes counts it. The
    # checkpoint resets this flag on its own mode (the composable API cannot pass it), so it gets a wrapper.
    forward.respect_saved_tensors_hooks = True
    return _Entered(forward), recompute


class _Entered:
    """Enters ``context`` and nothing else (hides its type from the checkpoint's reset of the flag above)."""

    def __init__(self, context):
        self.context = context

    def __enter__(self):
        return self.context.__enter__()

    def __exit__(self, *exc):
        return self.context.__exit__(*exc)


def apply_ac(model: nn.Module, mode: Literal["none", "full", "selective"]) -> list[nn.Module]:
    """Checkpoint each of ``model``'s blocks in place (before any strategy wraps it); return the blocks.
    ``"none"`` does nothing. A model without blocks is a ConfigError naming the fix."""
    if mode == "none":
        return []
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, got {mode!r}")
    blocks = ac_blocks(model)
    if not blocks:
        raise ConfigError(
            f"train.activation_checkpointing = '{mode}' checkpoints a model's blocks, but {type(model).__name__} "
            "has no nn.ModuleList (nor nn.Sequential child) to take them from; hold the repeated layers in an "
            "nn.ModuleList, or set train.activation_checkpointing = 'none'"
        )
    from torch.distributed._composable import checkpoint

    for block in blocks:
        # Before the checkpoint's own hook, so that its recompute gets the same arguments.
        block.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True, prepend=True)
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=selective_policy)
    return blocks


def _no_cache_in_training(module: nn.Module, args: tuple, kwargs: dict):
    """A Hugging Face decoder layer appends its keys and values to ``past_key_values`` (the generation cache,
    which the model makes whenever ``config.use_cache``; ``cache=`` since transformers 5.x): run again in backward, it appends them a second time,
    and its attention then sees twice the keys (SAC: 'aten.slice.Tensor ... not found in storage'; eager
    attention: a size mismatch). In training nothing reads that cache, so a checkpointed block runs without it,
    as Hugging Face's own ``gradient_checkpointing_enable`` sets ``use_cache=False`` while training."""
    cached = [name for name in _CACHE_KWARGS if kwargs.get(name) is not None]
    if module.training and cached:
        return args, {**kwargs, **dict.fromkeys(cached)}
    return None


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
"""A Hugging Face layer's generation cache, by the names transformers has given it (5.x: ``cache``)."""
