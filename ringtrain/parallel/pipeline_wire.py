"""What pipeline ranks pass outside a schedule (``pipeline.py``'s evaluation forward and full forms): one
tensor of any shape to a peer, its dtype and shape first (``_send_tensor`` / ``_recv_tensor``), and every rank's
dict of CPU tensors gathered without pickle (``_all_gather_tensors``: the structure as JSON, the tensors as raw
bytes, a peer's malformed entry refused as ``PeerDataError``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.errors import PeerDataError
from ringtrain.comm.objects import all_gather_bytes, all_gather_json
from ringtrain.errors import ConfigError

__all__ = ["_all_gather_tensors", "_recv_tensor", "_send_tensor", "_to_cpu"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_HEADER = 10
"""A transfer's header: dtype code, ndim, then up to 8 sizes."""


def _send_tensor(x: torch.Tensor, dst: int, group: Any) -> None:
    """``x`` to pipeline rank ``dst``: its dtype and shape first, then its values (evaluation's transfers, whose
    shapes no schedule inferred)."""
    if x.dtype not in _DTYPES or x.dim() > _HEADER - 2:
        raise ConfigError(f"a pipeline stage's output of dtype {x.dtype} and {x.dim()} dimensions cannot be passed on; "
                          "return a tensor of a float, integer or bool dtype with at most 8 dimensions")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    dist.send(header.to(x.device), group_dst=dst, group=group)
    dist.send(x.contiguous(), group_dst=dst, group=group)


def _recv_tensor(src: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group_src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    x = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, group_src=src, group=group)
    return x


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


_TENSOR = "\u0000tensor"
"""The one key of the JSON object that stands for a tensor in ``_all_gather_tensors``'s structure."""
_GATHER_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _all_gather_tensors(value: dict[str, Any], group: dist.ProcessGroup) -> list[dict[str, Any]]:
    """Every rank's ``value`` (dicts with string keys; leaves CPU tensors or JSON values) in rank order of
    ``group``, without pickle (architecture.md: no object collective): the structure travels as JSON
    (``comm/objects.py``), each tensor as its dtype, shape and place in one buffer of raw bytes, rebuilt on
    arrival; anything else a peer sends is ``PeerDataError``."""
    blob = bytearray()

    def encode(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            flat = item.detach().cpu().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            entry = {_TENSOR: [str(flat.dtype).removeprefix("torch."), list(item.shape), len(blob), len(raw)]}
            blob.extend(raw)
            return entry
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise TypeError(f"pipeline state gather: keys must be strings, got {sorted(map(repr, item))[:4]}")
            return {key: encode(inner) for key, inner in item.items()}
        if isinstance(item, (list, tuple)):
            return [encode(inner) for inner in item]
        return item

    structure = encode(value)
    structures = all_gather_json(structure, group=group)
    blobs = all_gather_bytes(bytes(blob), group=group)
    return [_decode_tensors(tree, data, dist.get_global_rank(group, rank))
            for rank, (tree, data) in enumerate(zip(structures, blobs))]


def _decode_tensors(tree: Any, data: bytes, rank: int) -> Any:
    """``_all_gather_tensors``'s structure from ``rank`` with its tensors rebuilt from ``data``."""
    if isinstance(tree, list):
        return [_decode_tensors(inner, data, rank) for inner in tree]
    if not isinstance(tree, dict):
        return tree
    if _TENSOR not in tree:
        return {key: _decode_tensors(inner, data, rank) for key, inner in tree.items()}
    entry = tree[_TENSOR]
    dtype_name, shape, offset, length = entry if isinstance(entry, list) and len(entry) == 4 else (None,) * 4
    dtype = _GATHER_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    good_shape = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
    if (len(tree) != 1 or dtype is None or not good_shape or type(offset) is not int or type(length) is not int
            or not 0 <= offset <= offset + length <= len(data)
            or length != math.prod(shape) * torch.empty((), dtype=dtype).element_size()):
        shown = repr(entry)
        raise PeerDataError(f"rank {rank} sent a tensor entry {shown[:80]}{'...' * (len(shown) > 80)} that its "
                            f"{len(data)} bytes do not hold; refused", peer=rank)
    if not length:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data[offset:offset + length]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
