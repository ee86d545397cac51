"""Collectives written from first principles: ring, pipelined ring and shared-memory all-reduce.

Depends on ``torch.distributed`` alone, so it works without the trainer::

    >>> import torch.distributed as dist
    >>> from ringtrain import comm
    >>> dist.init_process_group("gloo")
    >>> t = torch.ones(1000)
    >>> comm.all_reduce(t, op="avg", algorithm="shm")

Algorithms: ``torch`` (torch.distributed, the reference), ``ring``, ``ring_chunked``, ``shm``
(same-host CPU ranks; hierarchical across hosts). ``hooks`` turns each into a DDP communication hook.
"""

from ringtrain.comm.api import ALGORITHMS, OPS, all_gather, all_reduce, reduce_scatter
from ringtrain.comm.errors import CollectiveError, MismatchError, PeerDiedError, PeerTimeoutError
from ringtrain.comm.shards import shard_bounds, tensor_shards

__all__ = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "shard_bounds",
    "tensor_shards",
    "ALGORITHMS",
    "OPS",
    "CollectiveError",
    "PeerDiedError",
    "PeerTimeoutError",
    "MismatchError",
]
