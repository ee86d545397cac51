"""A user's tensor-parallel plan read as pairs: every "colwise" layer needs a "rowwise" partner.

"colwise" splits an ``nn.Linear`` by output features and leaves its output split (each rank holds
``out_features / tp`` of them); only a "rowwise" layer takes such an output (it is split by input features and
all-reduces its own). A colwise layer whose output reaches an unsplit layer, or the loss, fails in forward with
torch's ``mat1 and mat2 shapes cannot be multiplied (512x64 and 128x64)``, three lines naming no entry. Which
layer takes a layer's output is the model's code, not its structure; the check reads the plan the way plans are
written (Megatron's pairs: q/k/v with o, up/gate with down, ``net.0`` with ``net.2``): a colwise layer's partner is a
rowwise one under the same parent module, and a colwise entry with none is refused in one line naming it. A
colwise layer that is not paired so on purpose takes a torch ``ColwiseParallel()`` (its layouts are then yours).

    check_colwise_partners(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), {"0": "colwise"})
    # ConfigError: tp_plan['0'] = 'colwise' splits 0's 16 output features ... (e.g. '2': 'rowwise') ...
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from ringtrain.errors import ConfigError

__all__ = ["check_colwise_partners", "plan_matches"]


def plan_matches(names: list[str], path: str) -> list[str]:
    """The module names a plan path names (torch's wildcard: ``*`` stands for one name, never a dot)."""
    return [n for n in names if fnmatch.fnmatchcase(n, path) and n.count(".") == path.count(".")]


def check_colwise_partners(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Refuse (one ConfigError line naming the entry) a "colwise" entry of ``plan`` whose layers have no
    "rowwise" layer (the word, or a torch ``RowwiseParallel``) under the same parent module."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    modules = dict(model.named_modules())
    names = list(modules)
    rowwise = {n for path, style in plan.items() if style == "rowwise" or isinstance(style, RowwiseParallel)
               for n in plan_matches(names, path)}
    row_parents = {_parent(n) for n in rowwise}
    for path, style in plan.items():
        if style != "colwise":
            continue
        for name in plan_matches(names, path):
            layer = modules[name]
            if _parent(name) in row_parents or not isinstance(layer, nn.Linear):  # (not a Linear: apply_plan's line)
                continue
            width = layer.out_features
            candidates = [n for n, m in modules.items() if _parent(n) == _parent(name) and n != name
                          and isinstance(m, nn.Linear) and m.in_features == width and n not in rowwise]
            partner = f"e.g. {candidates[0]!r}: 'rowwise'" if candidates else "its consumer as 'rowwise'"
            raise ConfigError(
                f"tp_plan[{path!r}] = 'colwise' splits {name}'s {width} output features over the tensor-parallel "
                f"ranks, but no 'rowwise' layer beside it takes them split (an unsplit next layer gets a part of "
                f"its input); add the layer that reads {name}'s output to the plan ({partner}), or drop the entry")


def _parent(name: str) -> str:
    return name.rpartition(".")[0]
