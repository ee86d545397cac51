"""Which modules of a model are gathered together when parameters are sharded (zero3, fsdp): one unit per
block.

The blocks are the children of the model's first ``nn.ModuleList`` (a Transformer's layers), else of its
first ``nn.Sequential`` with at least two children that hold parameters (a ResNet's stages, an MLP), else the
model's direct children with parameters. A block that shares a parameter with anything outside it (tied
embeddings: the token embedding is the output layer) is no unit: its parameters stay in the root unit,
which is gathered for the whole forward and backward.

    >>> block_units(transformer_lm)       # [blocks.0, blocks.1, ...]; embeddings, norm, head in the root
"""

from __future__ import annotations

from torch import nn

__all__ = ["block_units"]


def block_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard as units, in registration order (the root unit is the rest)."""
    candidates = _blocks(model)
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
    for module in model.modules():
        if isinstance(module, nn.Sequential) and sum(1 for c in module if _has_params(c)) >= 2:
            return [c for c in module if _has_params(c)]
    return [c for c in model.children() if _has_params(c)]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None
