"""DeepSpeed's CPU shared-memory all-reduce, for ``ringtrain bench collectives --algorithms ...,deepspeed_shm``.

DeepSpeed builds ``deepspeed/ops/csrc/cpu/comm/shm.cpp`` at run time (``ShareMemCommBuilder``, g++ and
ninja, cached under ``~/.cache/torch_extensions``) and initialises it the way ``deepspeed.comm`` does
(``deepspeed/comm/torch.py``): ``initialize(world_size, rank)`` with ``LOCAL_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment (they name its ``/dev/shm`` files), then
``torch.ops.deepspeed.inference_all_reduce_(tensor)`` sums in place. Its files are never unlinked by
DeepSpeed; the bench removes their names once every rank has mapped them, so none is left behind.

    >>> build()                                  # in the parent: one build, a clear error if it cannot
    >>> call = init(rank, world_size, port)      # in every worker, after the process group is up
    >>> call(tensor)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from ringtrain.errors import RingtrainError

__all__ = ["build", "init", "DTYPES", "INSTALL_HINT"]

DTYPES = ("float32", "bfloat16", "float16")
"""What DeepSpeed's op reduces; it leaves other dtypes untouched (its caller falls back to Gloo)."""
INSTALL_HINT = "pip install 'deepspeed==0.19.8' (or: pip install -e '.[bench]')"


def _load():
    # torch.utils.cpp_extension warns at import on a machine without CUDA: noise on the CPU machines this is for.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError:
        raise RingtrainError(f"--algorithms deepspeed_shm needs DeepSpeed, which is not installed: {INSTALL_HINT}") from None
    try:
        return ShareMemCommBuilder().load(verbose=False)
    except Exception as err:  # noqa: BLE001 - a compiler error is long; its last line names the problem
        last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise RingtrainError(f"DeepSpeed's shm op (ShareMemCommBuilder) did not build: {last}") from None


def build() -> None:
    """Build (or find cached) DeepSpeed's shm op; raise RingtrainError with the fix if it cannot."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    module = _load()
    if module.vector_kernel_level() < 1:
        raise RingtrainError("DeepSpeed's shm op needs AVX2 on x86 and this CPU lacks it")


def init(rank: int, world_size: int, port: int) -> Callable[[torch.Tensor], None]:
    """Collective: initialise DeepSpeed's shm workspace on every rank; return the in-place all-reduce."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    module = _load()
    module.initialize(world_size, rank)  # creates this rank's file, opens every peer's (waits for them)
    dist.barrier()  # everyone has mapped everyone's file: the names can go
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}"
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
    op = torch.ops.deepspeed.inference_all_reduce_
    return lambda tensor: op(tensor)
