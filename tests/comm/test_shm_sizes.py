"""Sizes that reach shm's native code are checked (issue 21): ``init_shm(piece_kb=0)`` once set up a
workspace with empty staging buffers, into which the C++ all-reduce then wrote past its end (a segfault).

Every check runs in the harness's worker processes, so a crash fails the test ("died without reporting")
instead of taking pytest down: bad sizes at the Python boundary are one ValueError line naming the argument,
the value and the range, the smallest good ones reduce as torch does; the C++ ``Workspace`` itself refuses
a layout or a call that would write outside its buffers with a RuntimeError, on its own (one local rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringtrain import comm
from ringtrain.comm import shm, shm_native
from ringtrain.comm.shm_board import header_bytes
from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

BAD = [("small_kb", 0), ("piece_kb", 0), ("piece_kb", -4), ("piece_kb", (1 << 20) + 1), ("small_kb", 2.5),
       ("piece_kb", True)]


def refused_then_reduced(rank: int, world_size: int):
    errors = []
    for name, value in BAD:
        try:
            shm.init_shm(**{name: value})
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    try:
        shm.shared_empty(-1)
        errors.append(None)
    except ValueError as err:
        errors.append(str(err))
    # Nothing was set up by the refused calls: the smallest good buffers (1 KB) now, and a message staged
    # through them in many pieces, equal to torch's (two addends: the same bits in any order).
    sg = shm.init_shm(small_kb=1, piece_kb=1)
    x = torch.arange(300_001, dtype=torch.float32) * (rank + 1)
    ours, reference = x.clone(), x.clone()
    comm.all_reduce(ours, algorithm="shm")
    dist.all_reduce(reference)
    return errors, torch.equal(ours, reference), sg.piece_bytes, sg.native is not None


def test_bad_sizes_are_refused_in_one_line_and_the_smallest_good_ones_work():
    for errors, equal, piece_bytes, _ in run_distributed(refused_then_reduced, 2):
        for (name, value), error in zip([*BAD, ("numel", -1)], errors):
            assert error is not None, f"{name}={value!r} was accepted"
            assert "\n" not in error and f"{name} must be a whole number in [" in error, error
            assert error.endswith(f"got {value!r}"), error
        assert errors[1] == "init_shm: piece_kb must be a whole number in [1, 1048576], got 0"
        assert equal and piece_bytes == 1024


# --- the native Workspace on its own (one local rank: its barriers have nobody to wait for) -------------
SMALL, PIECE = 1024, 4096
REGION = 2 * SMALL + 2 * PIECE


def _workspace(module, memory: torch.Tensor, **changed):
    args = dict(base=memory.data_ptr(), header_bytes=header_bytes(1), region_bytes=REGION, small_bytes=SMALL,
                piece_bytes=PIECE, local_rank=0, local_size=1, spin=False, check_liveness=False)
    args.update(changed)
    workspace = module.Workspace(*args.values())
    for dtype in (torch.float32, torch.int32):
        workspace.set_code(dtype, 1, 2)
    return workspace


def _refusal(call) -> str | None:
    try:
        call()
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


def native_refusals(rank: int, world_size: int) -> dict:
    module = shm_native.load()
    memory = torch.zeros(header_bytes(1) + REGION, dtype=torch.uint8)
    out = {
        "piece_bytes=0": _refusal(lambda: _workspace(module, memory, piece_bytes=0)),
        "region too small": _refusal(lambda: _workspace(module, memory, region_bytes=REGION - 1)),
        "local_size=65": _refusal(lambda: _workspace(module, memory, local_size=65)),
        "local_rank=1 of 1": _refusal(lambda: _workspace(module, memory, local_rank=1)),
    }
    workspace = _workspace(module, memory)
    big = torch.ones(3 * PIECE)  # staged: bigger than the small buffer
    arena = torch.zeros(256, dtype=torch.uint8)
    out["arena offset past its region"] = _refusal(
        lambda: workspace.all_reduce(torch.ones(16), False, 1, 5.0, arena.data_ptr(), 128, 100))
    out["non-contiguous"] = _refusal(lambda: workspace.all_reduce(big[::2], False, 1, 5.0, 0, 0, 0))
    out["divide_by=0"] = _refusal(lambda: workspace.all_reduce(torch.ones(8, dtype=torch.int32), True, 0, 5.0, 0, 0, 0))
    workspace.small_turn = 3
    out["small_turn=3"] = _refusal(lambda: workspace.all_reduce(torch.ones(4), False, 1, 5.0, 0, 0, 0))
    workspace.small_turn = 0
    # Still usable after the refusals: a good call of each kind (one rank: the sum is the tensor itself).
    good = [workspace.all_reduce(t, False, 1, 5.0, 0, 0, 0) for t in (torch.ones(4), big)]
    in_place = torch.ones(16)
    good.append(workspace.all_reduce(in_place, False, 1, 5.0, arena.data_ptr(), 128, 64))
    out["good calls failed"] = [bool(g) for g in good]
    return out


@pytest.mark.skipif("shm_native.load() is None", reason="the native shm all-reduce could not be built here")
def test_the_native_workspace_refuses_what_would_write_outside_its_buffers():
    [out] = run_distributed(native_refusals, 1)
    assert out.pop("good calls failed") == [False, False, False]
    for case, error in out.items():
        assert error is not None and error.startswith("shm_native: "), (case, error)
    assert "piece_bytes must be >= 8" in out["piece_bytes=0"] and "got 0" in out["piece_bytes=0"]
    assert "do not fit a rank's arena region of 128 bytes" in out["arena offset past its region"]
