"""Sequence parallelism for a model split by a tensor-parallel plan of its own (a Hugging Face model's declared
plan, ringtrain's GPT-2 plan, a user's ``fit(tp_plan=...)``): the residual stream between the split layers is
sharded by sequence over the tp ranks (``Shard(1)``), as Megatron-SP and torchtitan do for the built-in
transformer (``tensor.parallelize_transformer``), derived from the plan instead of written per model.

- Each column split gathers the sequence before it (``ColwiseParallel(input_layouts=Shard(1))``) and each row
  split reduce-scatters into it (``RowwiseParallel(output_layouts=Shard(1))``) in place of its all-reduce.
- Every other module that holds parameters (norms, embeddings, a whole output layer) gets them as replicated
  DTensors and decides by what it is given: a DTensor is the stream, which it computes on this rank's share of
  the tokens (the norms: torch's ``SequenceParallel``; DTensor sums their weights' gradients over the tp ranks); a
  plain tensor (token ids, a layer's local heads) is the same on every rank as far as it is concerned, and its
  output goes back to a plain tensor. An embedding starts the stream (its output a replicated DTensor, cut by the
  first module that takes it). Model code between them (residual sums, activations, reshapes by the input's
  shape, position ids from the sequence length) sees the DTensor's global shape.
- The model's outputs leave as plain tensors, gathered (logits a vocabulary split leaves sharded excepted: torch's
  ``loss_parallel`` reads those).

A plan entry given as a ParallelStyle object sets its own layouts and is refused beside sequence parallelism in one
line (its input and output layouts cannot be derived). The modules must be token-wise on the stream (a norm, a
linear layer), which is what sequence parallelism needs of any model.

    plan = sequence_parallel_plan(plan)     # before apply_plan
    apply_plan(model, plan, mesh)
    shard_stream(model, mesh)               # after it
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from ringtrain.errors import ConfigError

__all__ = ["sequence_parallel_plan", "shard_stream"]


def sequence_parallel_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` (module paths to 'colwise', 'rowwise' or torch's ColwiseParallel / RowwiseParallel, as made by
    ``tensor.gpt2_plan``) with the stream sharded by sequence between the splits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    derived = {}
    for path, style in plan.items():
        kind = style if isinstance(style, str) else "colwise" if isinstance(style, ColwiseParallel) and _default(
            style, Replicate(), Shard(-1)) else "rowwise" if isinstance(style, RowwiseParallel) and _default(
            style, Shard(-1), Replicate()) else None
        if kind is None:
            raise ConfigError(f"[parallel] sequence_parallel = true: tp_plan[{path!r}] is a {type(style).__name__} that "
                              "sets its own input and output layouts, which sequence parallelism cannot derive; give "
                              "'colwise' or 'rowwise', or leave sequence_parallel unset")
        if kind == "colwise":
            cls = ColwiseParallel if isinstance(style, str) else type(style)
            derived[path] = cls(input_layouts=Shard(1))
        else:
            cls = RowwiseParallel if isinstance(style, str) else type(style)
            derived[path] = cls(output_layouts=Shard(1), use_local_output=False)
    return derived


def _default(style: Any, given: Any, made: Any) -> bool:
    """A column or row split with torch's default layouts (the plain 'colwise' / 'rowwise': its input ``given``,
    its output ``made``)."""
    return style.input_layouts == (given,) and style.output_layouts == (made,) and style.use_local_output


def shard_stream(model: nn.Module, mesh: Any) -> None:
    """After ``apply_plan``: every module with plain parameters takes the stream as above (a weight two modules tie
    stays one parameter), and ``model``'s outputs leave as plain tensors."""
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    replicated: dict[int, nn.Parameter] = {}

    def partition(name: str, module: nn.Module, mesh: Any) -> None:
        if name:  # distribute_module calls this for every submodule: each is given its own hooks below
            return
        for key, param in list(module.named_parameters(recurse=False)):
            if hasattr(param, "device_mesh"):
                continue
            if id(param) not in replicated:
                replicated[id(param)] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()]),
                                                     requires_grad=param.requires_grad)
            module.register_parameter(key, replicated[id(param)])

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if not own or all(hasattr(p, "device_mesh") for p in own):
            continue
        starts = isinstance(module, nn.Embedding)
        distribute_module(module, mesh, partition, _stream_input, _starts_stream if starts else _stream_output)
    model.register_forward_hook(_plain_outputs)


def _stream_input(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    """The stream (a DTensor) at this rank's share of the sequence; a plain tensor as the same on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not inputs or not hasattr(inputs[0], "shape"):
        return inputs
    first = inputs[0]
    module._ringtrain_stream = isinstance(first, DTensor)
    if module._ringtrain_stream:
        if first.ndim >= 2 and tuple(first.placements) != (Shard(1),):
            first = first.redistribute(placements=[Shard(1)])
    else:
        first = DTensor.from_local(first, mesh, [Replicate()], run_check=False)
    return (first, *inputs[1:])


def _stream_output(module: nn.Module, output: Any, mesh: Any) -> Any:
    return output if getattr(module, "_ringtrain_stream", False) or not hasattr(output, "to_local") else output.to_local()


def _starts_stream(module: nn.Module, output: Any, mesh: Any) -> Any:
    """An embedding's output: the stream, replicated (the first module that takes it cuts it, no communication)."""
    return output


def _plain_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
    """The model's outputs as plain tensors: a DTensor gathered whole, unless it is sharded on its last dimension
    (a vocabulary split's logits, which torch's loss_parallel reads as they are)."""
    if isinstance(output, tuple):
        return type(output)(_plain(value) for value in output)
    if isinstance(output, dict):  # a Hugging Face ModelOutput (its attributes follow its items)
        for key in list(output.keys()):
            output[key] = _plain(output[key])
        return output
    return _plain(output)


def _plain(value: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return value
    if any(isinstance(p, Shard) and p.dim in (-1, value.ndim - 1) for p in value.placements):
        return value
    return value.full_tensor()
