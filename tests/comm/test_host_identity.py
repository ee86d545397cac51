"""Host identity follows ``/dev/shm`` (comm/groups.py ``host_id``, issue 21): processes that share the network
namespace but not ``/dev/shm`` (containers of one pod) are two hosts to shm, which then reduces across them
hierarchically instead of failing to open the other's segment; one ``/dev/shm`` seen from another mount
namespace is still one host. Needs root (a mount namespace with a tmpfs of its own); everything made lives in
namespaces that end with the processes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ringtrain import comm
from ringtrain.comm.groups import host_id
from ringtrain.comm.shm_group import get_shm_group
from tests.conftest import REPO
from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and util-linux `unshare` to give a process a /dev/shm of its own",
)

_PRINT_ID = "from ringtrain.comm.groups import host_id; print(host_id())"


def _child_id(*prefix: str, shell: str | None = None) -> str:
    command = [sys.executable, "-c", _PRINT_ID]
    if shell is not None:  # run inside `sh -c`, after shell's set-up
        command = ["sh", "-c", f"{shell} && exec \"$0\" -c '{_PRINT_ID}'", sys.executable]
    out = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.job
def test_a_process_with_a_dev_shm_of_its_own_is_another_host():
    mine = host_id()
    assert _child_id() == mine  # a plain child: same machine, network and /dev/shm
    private = ["unshare", "--mount", "--propagation", "private"]
    # Another mount namespace, the same /dev/shm mount in it: the same files, so the same host.
    assert _child_id(*private) == mine
    # Same network namespace, a fresh tmpfs on /dev/shm: what one makes there the other cannot open.
    other = _child_id(*private, shell="mount -t tmpfs -o size=4m tmpfs /dev/shm")
    assert other != mine
    assert other.rsplit("/shm:", 1)[0] == mine.rsplit("/shm:", 1)[0]  # only the /dev/shm part differs


_CLONE_NEWNS, _MS_REC, _MS_PRIVATE = 0x00020000, 0x4000, 1 << 18


def _own_dev_shm() -> None:
    """Give this process's main thread (and what it starts) a mount namespace with a fresh tmpfs on /dev/shm,
    its mounts private so nothing reaches the machine's; it ends with the process, tmpfs and all."""
    libc = ctypes.CDLL(None, use_errno=True)
    for call in (lambda: libc.unshare(_CLONE_NEWNS),
                 lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None),
                 lambda: libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"size=64m")):
        if call() != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def shm_across_two_dev_shm(rank: int, world_size: int):
    if rank == 1:
        _own_dev_shm()  # before host_id is first read (cached per process)
    x = torch.arange(300_001, dtype=torch.float32) * (rank + 1)
    ours, reference = x.clone(), x.clone()
    comm.all_reduce(ours, algorithm="shm")
    dist.all_reduce(reference)
    sg = get_shm_group(dist.group.WORLD)
    return host_id(), sg.hierarchical, sg.leaders, sg.local, torch.equal(ours, reference)


@pytest.mark.ranks
def test_two_workers_with_their_own_dev_shm_reduce_as_two_hosts():
    (id0, *first), (id1, *second) = run_distributed(shm_across_two_dev_shm, 2)
    assert id0 != id1
    # Two hosts of one rank each: shm inside each (alone), the ring between the two leaders; torch's sum.
    assert first == [True, [0, 1], [0], True] and second == [True, [0, 1], [1], True]
