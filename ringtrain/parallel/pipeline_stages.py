"""A pipeline's stages (``pipeline.py``'s pieces that cut a model): which stages a pipeline rank holds
(``stage_indices``: a loop, or a V), the built-in transformer's stage (``TransformerStage``: its blocks, the
embeddings before the first, the norm and output layer after the last), a user's ``nn.Sequential`` cut into
near-equal runs of children (``SequentialStage``, ``sequential_cut``) or by a user's split function
(``UserStage``), and context parallelism inside the stages (``SequenceSplit``). Every stage keeps the whole
model's names, so checkpoints are the unsplit model's.

    >>> stage_indices(0, 2, 2, "interleaved_1f1b"), sequential_cut(7, 3)
    ([0, 2], [(0, 3), (3, 5), (5, 7)])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SequenceSplit", "SequentialStage", "TransformerStage", "UserStage", "describe_stages", "merge_into",
           "sequential_cut", "stage_indices"]


def stage_indices(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: a loop (rank r: r, r + pp, ...) or, for the V schedule,
    r and 2pp - 1 - r.

        >>> stage_indices(0, 2, 2, "interleaved_1f1b"), stage_indices(0, 2, 2, "zbv_zero_bubble")
        ([0, 2], [0, 3])
    """
    if schedule == "zbv_zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


class TransformerStage(nn.Module):
    """Stage ``index`` of ``stages`` of a ``models.transformer.TransformerLM``: its blocks (the whole model's
    modules, under their whole-model names), with the embeddings before the first stage's and the final norm
    and ``head`` after the last stage's. The forward is ``TransformerLM.forward`` cut at the stage's edges."""

    def __init__(self, model: nn.Module, index: int, stages: int, head: nn.Module | None = None,
                 context: SequenceSplit | None = None):
        super().__init__()
        per = model.n_layers // stages
        self.index, self.is_first, self.is_last = index, index == 0, index == stages - 1
        object.__setattr__(self, "context", context)  # (not a child: it holds no parameters)
        self.seq_len = model.seq_len
        if self.is_first:
            self.token_embedding, self.position_embedding, self.dropout = (
                model.token_embedding, model.position_embedding, model.dropout)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(index * per, (index + 1) * per)})
        if self.is_last:
            self.norm, self.head = model.norm, head if head is not None else model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = self.context
        if self.is_first:
            if context is None:
                positions = torch.arange(x.shape[1], device=x.device)
            else:  # this cp rank's chunks of the tokens, at their global positions
                x, positions = context.shard(x, self.seq_len)
            x = self.dropout(self.token_embedding(x) + self.position_embedding(positions))
        for block in self.blocks.values():
            x = block(x)
        if not self.is_last:
            return x
        logits = self.head(self.norm(x))
        return logits if context is None else context.gather(logits)


class SequenceSplit:
    """Context parallelism inside the pipeline (``[parallel] cp``): the ranks of ``group`` hold the same stages and
    split every micro-batch's sequence. The first stage keeps this rank's two load-balanced chunks of the tokens
    and their global positions (``context_split.shard_tokens_of``), the blocks' attention is ring attention over
    ``group`` (``context.apply_context_parallel``, applied to the whole model before it is cut), the activations
    passed between stages are the chunks, and the last stage gathers the logits back into the whole sequence
    (``context_split.gather_sequence``: its backward keeps this rank's chunks of the gradient). ``length``: the
    micro-batches' sequence length this step, which every rank of the pipeline is handed (the last stage cuts
    the padding with it)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)
        self.length = 0

    def shard(self, tokens: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        from ringtrain.parallel.context_split import shard_tokens_of

        return shard_tokens_of(tokens, self.rank, self.size, max_positions)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        from ringtrain.parallel.context_split import gather_sequence

        return gather_sequence(logits, self.group, self.rank, self.size, self.length)


class SequentialStage(nn.Module):
    """Stage ``index`` of ``stages`` of a user's ``nn.Sequential``: a contiguous run of its children under their
    own names (``"0"``, ``"1"``, ...), as near-equal in count as the division allows (the first stages take one
    more when it does not divide)."""

    def __init__(self, model: nn.Sequential, index: int, stages: int):
        super().__init__()
        start, stop = sequential_cut(len(model), stages)[index]
        self.index, self.is_first, self.is_last = index, index == 0, index == stages - 1
        for name in list(model._modules)[start:stop]:
            self.add_module(name, model._modules[name])  # the Sequential's own names: "3.weight" stays "3.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self._modules.values():
            x = layer(x)
        return x


class _Shell(nn.Module):
    """A module path's container inside a ``UserStage`` (``model`` of ``model.layers.0``): holds what is under it,
    runs nothing."""


class UserStage(nn.Module):
    """Stage ``index`` of ``stages`` made by a user's split function (``fit(pp_split=...)``): its forward is the
    user's stage module's, and it holds the whole model's submodules that module uses under their whole-model
    paths (``model.layers.3`` stays ``model.layers.3``), so its parameters and state are named as the unsplit
    model's (checkpoints load into any layout). The user's module itself is not a child: its names are its own."""

    def __init__(self, model: nn.Module, module: nn.Module, index: int, stages: int):
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == stages - 1
        object.__setattr__(self, "_stage", module)
        used = {id(m) for m in module.modules()}
        grafted: list[str] = []
        for path, sub in model.named_modules():
            if not path or id(sub) not in used or any(path.startswith(g + ".") for g in grafted):
                continue
            grafted.append(path)
            *parents, name = path.split(".")
            holder: nn.Module = self
            for part in parents:
                if part not in holder._modules:
                    holder.add_module(part, _Shell())
                holder = holder._modules[part]
            holder.add_module(name, sub)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stage(x)


def merge_into(view: nn.Module, module: nn.Module) -> None:
    """``module``'s children into ``view`` under the same paths; shells are copied (a stage's own stay as they are)."""
    for name, child in module.named_children():
        mine = view._modules.get(name)
        if mine is None and isinstance(child, _Shell):
            mine = _Shell()
            view.add_module(name, mine)
        if isinstance(child, _Shell) and isinstance(mine, _Shell):
            merge_into(mine, child)
        elif mine is None:
            view.add_module(name, child)


def sequential_cut(children: int, stages: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each stage's children: near-equal counts, the first stages one more.

        >>> sequential_cut(7, 3)
        [(0, 3), (3, 5), (5, 7)]
    """
    per, extra = divmod(children, stages)
    bounds, start = [], 0
    for index in range(stages):
        stop = start + per + (index < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def describe_stages(made: Any) -> str:
    """What a split function returned, in a few words (for its one-line refusal)."""
    if isinstance(made, (list, tuple)):
        return f"a {type(made).__name__} of {len(made)}: " + ", ".join(type(m).__name__ for m in made[:4])
    return f"a {type(made).__name__}"
