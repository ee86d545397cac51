"""Which modules of a model are gathered together when parameters are sharded (zero3, fsdp): one unit per
block.

The blocks are the children of the model's first ``nn.ModuleList`` (a Transformer's layers), else the
model's direct children that hold parameters (a ResNet's stem, stages and head; an MLP's layers), looking
inside a wrapper that holds a single such child; a block with more than 30% of the parameters is split
into its children. A block that shares a parameter with anything outside it (tied
embeddings: the token embedding is the output layer) is no unit: its parameters stay in the root unit,
which is gathered for the whole forward and backward.

    >>> block_units(transformer_lm)       # [blocks.0, blocks.1, ...]; embeddings, norm, head in the root
"""

from __future__ import annotations

from torch import nn

__all__ = ["block_units"]


SPLIT_FRACTION = 0.3
"""A block holding more than this share of the model's parameters is split into its own children (a ResNet
stage of two big BasicBlocks, then each block): every unit is gathered whole, so the largest one sets the
memory that zero3 holds beyond its shards."""


def block_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard as units, in registration order (the root unit is the rest)."""
    total = sum(p.numel() for p in model.parameters())
    candidates = _split_large(_blocks(model), SPLIT_FRACTION * total)
    units = []
    for block in candidates:
        inside = {id(p) for p in block.parameters()}
        if not inside:
            continue
        members = {id(m) for m in block.modules()}
        outside = {id(p) for m in model.modules() if id(m) not in members for p in m.parameters(recurse=False)}
        if inside & outside:
            continue  # tied to something outside: gathered with the root
        units.append(block)
    return units


def _blocks(model: nn.Module) -> list[nn.Module]:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    node = model
    while True:  # a wrapper holding one container: look inside it
        children = [c for c in node.children() if _has_params(c)]
        if len(children) == 1 and next(node.parameters(recurse=False), None) is None:
            node = children[0]
            continue
        return children


def _split_large(blocks: list[nn.Module], limit: float) -> list[nn.Module]:
    out = []
    for block in blocks:
        children = [c for c in block.children() if _has_params(c)]
        own = next(block.parameters(recurse=False), None) is not None
        if sum(p.numel() for p in block.parameters()) > limit and len(children) >= 2 and not own:
            out.extend(_split_large(children, limit))
        else:
            out.append(block)
    return out


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None
