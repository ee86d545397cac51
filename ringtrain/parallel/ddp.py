"""Torch DistributedDataParallel as a ringtrain strategy, its all-reduce chosen by name (a comm hook)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from ringtrain.comm.hooks import comm_hook
from ringtrain.monitor.comm_timer import CommTimer
from ringtrain.parallel.base import ReplicatedStrategy

__all__ = ["from_config", "DDPStrategy"]


class DDPStrategy(ReplicatedStrategy):
    """Wraps the model in DDP; gradients are averaged across workers during backward.

    ``algorithm`` picks DDP's communication hook: 'torch' (DDP's own all-reduce), ringtrain's 'ring',
    'ring_chunked', 'shm', or torch's 'fp16', 'bf16', 'powersgd' (``ringtrain.comm.hooks``). ``group``: the
    ranks gradients are averaged over (default: every rank; DiLoCo's replicas of one host, ``diloco.py``).

        strategy = DDPStrategy(device)
        model = strategy.wrap(module)               # the process group must exist
        with strategy.no_sync(model):               # accumulation: no all-reduce in this backward
            loss_fn(model(x0)).backward()
        loss_fn(model(x1)).backward()               # one all-reduce: gradients averaged over the ranks
        strategy.comm_timer.syncs                   # gradient synchronisations so far
        strategy.unwrap(model).state_dict()         # the bare module's, for checkpoints
    """

    name = "ddp"

    def __init__(
        self,
        device: torch.device,
        bucket_mb: float = 25.0,
        algorithm: str = "torch",
        chunk_kb: int | None = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        comm_timer: CommTimer | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        self.device = device
        self.group = group
        self.bucket_mb = bucket_mb
        self.algorithm = algorithm
        self.chunk_kb = chunk_kb
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.comm_timer = comm_timer or CommTimer()
        self.hook_state: Any = None
        """The comm hook's state (PowerSGD's error feedback and factors), once wrapped."""

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Gradients as views into the communication buckets: no copy between the two after the all-reduce.
        ddp = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=self.bucket_mb, gradient_as_bucket_view=True,
            process_group=self.group,
        )
        if self.algorithm == "powersgd":
            # PowerSGD keys its error feedback and factors by bucket index, and DDP rebuilds its buckets after
            # the first iteration of every process: a resumed run would meet other buckets under the same
            # indices. Rebuilding now, from the parameters' order, fixes one assignment for good (what DDP's
            # join hook does). The price: buckets are reduced once the whole backward is done, not during it.
            # (find_unused_parameters would also stop the rebuild, but its all-reduce of the used-parameter
            # map interleaves with PowerSGD's asynchronous ones and Gloo aborts on the mismatch.)
            ddp.reducer._push_all_rebuilt_params()
        if dist.get_world_size(self.group) == 1:
            # Alone, a worker's gradient already is the average: no round trip, and no lossy compression.
            state, hook = None, noop_hook
        else:
            state, hook = comm_hook(
                self.algorithm,
                group=self.group,
                chunk_kb=self.chunk_kb,
                powersgd_rank=self.powersgd_rank,
                powersgd_start_iter=self.powersgd_start_iter,
            )
        # Timed, to measure the communication (total, and the part backward waits for).
        ddp.register_comm_hook(state, self.comm_timer.wrap(hook))
        self.hook_state = state
        return ddp

    @property
    def has_rank_state(self) -> bool:
        """Whether the comm hook keeps per-rank state a checkpoint must hold (PowerSGD does)."""
        return isinstance(self.hook_state, PowerSGDState)

    def state_dict(self) -> dict[str, Any]:
        """This rank's comm-hook state: PowerSGD's iteration, error feedback (one gradient's size, different
        on every rank), warm-start factors and generator. Empty for the other hooks."""
        if not self.has_rank_state:
            return {}
        state: PowerSGDState = self.hook_state
        kind, keys, pos, has_gauss, cached = state.rng.get_state()
        return {
            "iter": state.iter,
            "error_dict": _to_cpu(state.error_dict),
            "p_memory_dict": _to_cpu(state.p_memory_dict),
            "q_memory_dict": _to_cpu(state.q_memory_dict),
            # numpy's keys as a tensor: the weights-only unpickler refuses numpy arrays.
            "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                    "has_gauss": has_gauss, "cached_gaussian": cached},
            "total_numel_before_compression": state.total_numel_before_compression,
            "total_numel_after_compression": state.total_numel_after_compression,
            "next_stats_report": state.next_stats_report,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if not self.has_rank_state or not saved:
            return
        state: PowerSGDState = self.hook_state
        state.iter = saved["iter"]
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            setattr(state, name, {int(k): v.to(self.device) for k, v in saved[name].items()})
        rng = saved["rng"]
        state.rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                             rng["cached_gaussian"]))
        for name in ("total_numel_before_compression", "total_numel_after_compression", "next_stats_report"):
            setattr(state, name, saved[name])

    def no_sync(self, model: DistributedDataParallel) -> AbstractContextManager:
        """Skip the gradient all-reduce for the backward passes inside (accumulation micro-steps)."""
        return model.no_sync()

    def unwrap(self, model: DistributedDataParallel) -> nn.Module:
        return model.module


def _to_cpu(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {int(k): v.detach().cpu().clone() for k, v in tensors.items()}


def from_config(comm, device: torch.device, *, spec, diloco=None, heal: bool = False, mesh=None) -> DDPStrategy:
    """``comm.strategy = 'ddp'`` (the registry's builder, ``ringtrain/strategies.py``) over the 1-D ``mesh``'s ranks
    (beside tensor and context parallelism: the dp x cp sub-mesh), or every rank."""
    return DDPStrategy(device, bucket_mb=comm.resolved_bucket_mb, algorithm=comm.algorithm, chunk_kb=comm.chunk_kb,
                       powersgd_rank=comm.powersgd_rank, powersgd_start_iter=comm.powersgd_start_iter,
                       group=None if mesh is None else mesh.get_group())
