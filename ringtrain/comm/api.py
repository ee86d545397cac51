"""The public collectives: one entry point per operation, the algorithm chosen by name.

    >>> from ringtrain import comm
    >>> comm.all_reduce(t, op="avg", algorithm="shm")       # in place; returns t
    >>> shard = comm.reduce_scatter(t, algorithm="ring")    # this rank's shard of the sum (a view of t)
    >>> comm.all_gather(t, algorithm="ring")                # every rank's shard, in place

``algorithm="torch"`` is ``torch.distributed`` itself, the reference every other algorithm is tested
against. Everything common to the algorithms lives here: input checks with one-line errors, world size 1,
empty tensors, non-contiguous inputs, averaging, timeouts. The algorithm modules see a contiguous 1-D tensor
and sum it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain.comm import flight, ring, ring_chunked, shm
from ringtrain.comm.groups import group_rank, group_size, group_timeout_s, resolve_group
from ringtrain.comm.shards import tensor_shards
from ringtrain.comm.shm_group import fast_path as shm_fast_path
from ringtrain.comm.scratch import scratch

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "ALGORITHMS", "OPS"]

ALGORITHMS = ("torch", "ring", "ring_chunked", "shm")
OPS = ("sum", "avg")
_UNSUPPORTED = (torch.bool, torch.complex32, torch.complex64, torch.complex128)


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "torch",
    group: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
    chunk_kb: int | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over every rank of ``group`` in place and return it.

    ``op="avg"`` divides by the world size before summing, as DDP's default hook does, so float16
    gradients cannot overflow in the sum. Every rank ends with bit-identical values (``torch``: as
    guaranteed by the backend). ``timeout_s`` defaults to the group's timeout; ``chunk_kb`` sets the chunk
    of ``ring_chunked``. Any shape, contiguous or not (reduced through a contiguous copy). An expanded
    tensor (stride 0, from ``.expand``) gets the sums through the memory it has, which needs the elements
    sharing memory to get equal sums: the same expand on every rank does.

    >>> t = torch.full((5,), float(rank))
    >>> all_reduce(t, algorithm="ring")        # every rank: 0 + 1 + ... + (world_size - 1)
    """
    if algorithm == "shm" and chunk_kb is None:
        # The hot path of a training step (DDP buckets, small gradients): one call into shm's native path,
        # which reduces a tensor it takes as it is (and records it for the flight recorder) or leaves it to
        # the general path below, which checks everything and says what is wrong.
        run = shm_fast_path(group)
        if run is not None and (op == "sum" or op == "avg"):
            status = run(tensor, op == "avg", timeout_s or 0.0)  # a subclass of Tensor: not taken
            if status == 0:
                return tensor
            if status == 1:
                raise shm.native_error(group, tensor, op == "avg", timeout_s)
    _check(tensor, op, algorithm, chunk_kb, "all_reduce")
    group = resolve_group(group)
    size = group_size(group)
    if size == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    timeout_s = timeout_s or group_timeout_s(group, tensor.device)
    entry = flight.begin("all_reduce", algorithm, flat)
    if algorithm == "shm":
        # shm folds the division into its first copy (one pass less over the data).
        shm.all_reduce(flat, group, timeout_s, average=op == "avg")
    else:
        if op == "avg":
            # Divide before the sum so that float16 buckets cannot overflow.
            flat.div_(size)
        if algorithm == "torch":
            _wait(dist.all_reduce(flat, group=group, async_op=True), timeout_s)
        elif algorithm == "ring":
            ring.all_reduce(flat, group, timeout_s)
        else:
            ring_chunked.all_reduce(flat, group, timeout_s, **_chunk(chunk_kb))
    flight.end(entry)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        _write_back(tensor, flat.view(tensor.shape))
    return tensor


def _expanded_dims(tensor: torch.Tensor) -> tuple:
    """An index that keeps one element along every stride-0 dimension: the memory the tensor really has."""
    return tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for size, stride in zip(tensor.shape, tensor.stride()))


def _overlaps(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` share memory. Sorted by stride, each dimension stepping past all
    smaller ones proves there is no overlap; only layouts that fail that (as_strided) get the exact count."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            offsets = torch.arange(reach + (size - 1) * stride + 1).as_strided(tensor.shape, tensor.stride())
            return offsets.unique().numel() < tensor.numel()
        reach += (size - 1) * stride
    return False


def _write_back(tensor: torch.Tensor, result: torch.Tensor) -> None:
    """Copy the reduced ``result`` into ``tensor``; an expanded tensor only through its own memory."""
    index = _expanded_dims(tensor)
    if all(part == slice(None) for part in index):
        tensor.copy_(result)
        return
    unique = result[index]
    # Positions that share memory must agree, or no value can be stored for them (NaN agrees with NaN).
    agree = (result == unique) | (result.isnan() & unique.isnan()) if result.is_floating_point() else result == unique
    if not bool(agree.all()):
        raise ValueError(
            "ringtrain.comm.all_reduce: elements of this expanded (stride 0) tensor share memory but their sums "
            "differ, because other ranks passed different values there; pass tensor.clone() to get every sum"
        )
    tensor[index].copy_(unique)


def reduce_scatter(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "torch",
    group: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
    chunk_kb: int | None = None,
) -> torch.Tensor:
    """Reduce the contiguous ``tensor`` so that this rank's shard holds the result; return that shard.

    The shard is a 1-D view of ``tensor``: rank ``r`` gets ``tensor_shards(tensor.view(-1), world_size)[r]``
    (cache-line aligned; trailing shards can be short or empty). Other shards are left with unspecified values.
    ``all_gather`` on the same tensor completes an all-reduce.
    """
    _check(tensor, op, algorithm, chunk_kb, "reduce_scatter", contiguous=True)
    group = resolve_group(group)
    size = group_size(group)
    flat = tensor.view(-1)
    lo, hi = tensor_shards(flat, size)[group_rank(group)]
    if size == 1 or tensor.numel() == 0:
        return flat[lo:hi]
    timeout_s = timeout_s or group_timeout_s(group, tensor.device)
    entry = flight.begin("reduce_scatter", algorithm, flat)
    if algorithm == "shm":
        shard = shm.reduce_scatter(flat, group, timeout_s, average=op == "avg")
    else:
        if op == "avg":
            flat.div_(size)  # before the sum, as in all_reduce
        if algorithm == "torch":
            shard = _torch_reduce_scatter(flat, group, timeout_s)
        elif algorithm == "ring":
            shard = ring.reduce_scatter(flat, group, timeout_s)
        else:
            shard = ring_chunked.reduce_scatter(flat, group, timeout_s, **_chunk(chunk_kb))
    flight.end(entry)
    return shard


def all_gather(
    tensor: torch.Tensor,
    algorithm: str = "torch",
    group: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
    chunk_kb: int | None = None,
) -> torch.Tensor:
    """Fill every rank's shard of the contiguous ``tensor`` from the rank that owns it; return ``tensor``.

    Rank ``r`` contributes ``tensor_shards(tensor.view(-1), world_size)[r]`` of its ``tensor`` (what ``reduce_scatter``
    left there); afterwards every rank holds all shards.
    """
    _check(tensor, "sum", algorithm, chunk_kb, "all_gather", contiguous=True)
    group = resolve_group(group)
    if group_size(group) == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1)
    timeout_s = timeout_s or group_timeout_s(group, tensor.device)
    entry = flight.begin("all_gather", algorithm, flat)
    if algorithm == "shm":
        shm.all_gather(flat, group, timeout_s)
    elif algorithm == "torch":
        _torch_all_gather(flat, group, timeout_s)
    elif algorithm == "ring":
        ring.all_gather(flat, group, timeout_s)
    else:
        ring_chunked.all_gather(flat, group, timeout_s, **_chunk(chunk_kb))
    flight.end(entry)
    return tensor


def _check(tensor, op: str, algorithm: str, chunk_kb, what: str, contiguous: bool = False) -> None:
    """One line per mistake, naming the fix."""
    where = f"ringtrain.comm.{what}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where} needs a torch.Tensor, got {type(tensor).__name__}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{where}: algorithm={algorithm!r} is unknown; choose one of {', '.join(ALGORITHMS)}")
    if op not in OPS:
        raise ValueError(f"{where}: op={op!r} is not supported; use 'sum' or 'avg'")
    if tensor.dtype in _UNSUPPORTED:
        raise TypeError(f"{where}: dtype {tensor.dtype} is not supported; use a floating-point or integer tensor")
    if tensor.layout != torch.strided:
        raise TypeError(f"{where}: {tensor.layout} tensors are not supported; pass a dense tensor (.to_dense())")
    if op == "avg" and not tensor.is_floating_point():
        raise TypeError(f"{where}: op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide")
    if algorithm == "shm" and tensor.device.type != "cpu":
        raise ValueError(
            f"{where}: algorithm='shm' needs CPU tensors of ranks on one host, got a {tensor.device} tensor; "
            "use algorithm='ring' or 'torch' for GPU tensors"
        )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{where} works on the flat layout and needs a contiguous tensor; call .contiguous() first")
    if not tensor.is_contiguous() and _overlaps(tensor[_expanded_dims(tensor)]):  # contiguous ones cannot
        raise ValueError(f"{where}: elements of this tensor overlap in memory (as_strided?); pass tensor.clone()")
    if chunk_kb is not None:
        if algorithm != "ring_chunked":
            raise ValueError(f"{where}: chunk_kb applies to algorithm='ring_chunked' only (got {algorithm!r})")
        if chunk_kb <= 0:
            raise ValueError(f"{where}: chunk_kb must be positive, got {chunk_kb}")


def _chunk(chunk_kb: int | None) -> dict:
    return {} if chunk_kb is None else {"chunk_bytes": int(chunk_kb) * 1024}


def _wait(work: dist.Work, timeout_s: float) -> None:
    from datetime import timedelta

    work.wait(timeout=timedelta(seconds=timeout_s))


def _torch_reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float) -> torch.Tensor:
    # torch wants equal shards: pad the tail with zeros when the aligned cut leaves it short.
    size, rank = group_size(group), group_rank(group)
    bounds = tensor_shards(flat, size)
    per_shard = bounds[0][1] - bounds[0][0]
    padded = flat
    if per_shard * size != flat.numel():
        padded = scratch(per_shard * size, flat.dtype, flat.device, slot=0)
        padded[: flat.numel()].copy_(flat)
        padded[flat.numel():].zero_()
    out = scratch(per_shard, flat.dtype, flat.device, slot=1)
    _wait(dist.reduce_scatter_single(out, padded, group=group, async_op=True), timeout_s)
    lo, hi = bounds[rank]
    flat[lo:hi].copy_(out[: hi - lo])
    return flat[lo:hi]


def _torch_all_gather(flat: torch.Tensor, group: dist.ProcessGroup, timeout_s: float) -> None:
    size, rank = group_size(group), group_rank(group)
    bounds = tensor_shards(flat, size)
    per_shard = bounds[0][1] - bounds[0][0]
    lo, hi = bounds[rank]
    mine = scratch(per_shard, flat.dtype, flat.device, slot=0)
    mine[: hi - lo].copy_(flat[lo:hi])
    gathered = scratch(per_shard * size, flat.dtype, flat.device, slot=1)
    _wait(dist.all_gather_single(gathered, mine, group=group, async_op=True), timeout_s)
    flat.copy_(gathered[: flat.numel()])
