"""The collective flight recorder (comm/flight.py) and `ringtrain diagnose` (monitor/diagnose.py), on real
ranks: a rank that is behind, ranks that disagree about a collective, and a dump asked for while a rank is
stuck inside a collective (answered by its heartbeat thread)."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringtrain import comm
from ringtrain.comm import flight
from ringtrain.group.jobstore import JobStore
from ringtrain.group.watch import CollectiveWatch, Heartbeat, flight_dumper
from ringtrain.monitor.diagnose import DiagnoseError, diagnose
from tests.distributed import run_distributed


@pytest.mark.unit
def test_the_ring_buffer_keeps_the_last_n_and_costs_nothing_when_off(tmp_path):
    recorder = flight.FlightRecorder(capacity=0)
    assert recorder.begin("all_reduce", "ring", torch.ones(4)) is None
    recorder.resize(3)
    with recorder.region("DDP gradient sync", step=7):
        for n in range(5):
            entry = recorder.begin("all_reduce", "shm", torch.ones(n + 1, dtype=torch.float16))
            recorder.end(entry)
    recorder.begin("all_gather", "ring", torch.ones(8))  # never ended: in flight
    path = recorder.dump(tmp_path / "flight" / "rank-0.json", "requested", rank=0, world_size=1)
    dumped = json.loads(path.read_text())
    got = [(c["seq"], c["op"], c["bytes"], c["dtype"], c["caller"], c["step"], c["end_ns"] is not None)
           for c in dumped["collectives"]]
    assert got == [(4, "all_reduce", 8, "float16", "DDP gradient sync", 7, True),
                   (5, "all_reduce", 10, "float16", "DDP gradient sync", 7, True),
                   (6, "all_gather", 32, "float32", "", None, False)]
    assert dumped["reason"] == "requested" and dumped["regions"][0]["caller"] == "DDP gradient sync"


@pytest.mark.unit
def test_diagnose_without_dumps_says_how_to_get_them(tmp_path):
    with pytest.raises(DiagnoseError, match="SIGUSR1"):
        diagnose(tmp_path)


def _rank_run(rank: int, world_size: int, run_dir: str, port: int, mode: str) -> str:
    """Three collectives under the trainer's watch, dumped on failure and on request. ``mode``:
    'behind': rank 1 sleeps before the third while rank 0 requests a dump; 'mismatch': rank 1's third is
    another size."""
    os.environ[flight.TORCH_BUFFER_VAR] = "100"
    flight.enable(100)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=4))  # torch's recorder reads the variable here
    store = JobStore("127.0.0.1", port, "ringtrain/test/", is_writer=rank == 0)
    dump = flight_dumper(run_dir, rank, world_size)
    watch = CollectiveWatch(store, rank, world_size, timeout_s=4, interval_s=0.2, on_failure=dump)
    with Heartbeat(store, rank, interval_s=0.2, on_dump_request=dump):
        for step in (1, 2):
            with watch.op("all_reduce (step agreement)", step):
                comm.all_reduce(torch.ones(10), algorithm="torch", group=group)
        dtype = torch.float32
        if mode == "behind":
            if rank == 0:
                threading.Timer(1.5, store.request_dump).start()
            else:
                time.sleep(3.5)  # stuck outside the collective: the others wait in #3
        elif rank == 1:
            # Another branch: the same bytes as another dtype. Nothing fails (a different size would make
            # Gloo abort the process); the sums are garbage, and only the recorder shows why.
            dtype = torch.int32
        with watch.op("all_reduce (DDP gradient sync)", 3):
            # 'ring' runs on point-to-point sends, which torch numbers per pair: only ringtrain's stream
            # sees it as a collective.
            comm.all_reduce(torch.ones(10, dtype=dtype), algorithm="torch" if mode == "behind" else "ring", group=group)
        if mode == "mismatch":
            if rank == 0:
                store.request_dump()
            mine = Path(run_dir) / "flight" / f"rank-{rank}.json"
            deadline = time.monotonic() + 10
            while not mine.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return "done"


@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["behind", "mismatch"])
def test_diagnose_names_the_rank_behind_and_the_disagreement(tmp_path, mode):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    results = run_distributed(_rank_run, 2, str(tmp_path), server.port, mode)
    dumps = sorted(p.name for p in (tmp_path / "flight").glob("rank-*.json"))
    assert dumps == ["rank-0.json", "rank-1.json"], results
    findings = diagnose(tmp_path)
    text = "\n".join(f.text for f in findings)
    print(f"{mode}: {results}\n{text}")
    if mode == "behind":
        assert results == ["done", "done"]
        behind = [f for f in findings if f.kind == "behind"]
        # Both streams see it: ringtrain's numbering and torch's own (the process group's all-reduces).
        assert any(f.text.startswith("ringtrain collectives: rank 1 is behind: rank 1's last is #2 all_reduce "
                                     "(all_reduce (step agreement), step 2), done") for f in behind), text
        assert any("rank 0 waits in #3 all_reduce 40 B float32 (all_reduce (DDP gradient sync), step 3)" in f.text
                   for f in behind), text
        assert any(f.text.startswith("torch collectives") and "rank 1 is behind" in f.text for f in behind), text
    else:
        assert results == ["done", "done"]
        mismatch = [f.text for f in findings if f.kind == "mismatch"]
        assert mismatch == ["ringtrain collectives: ranks disagree at #3: rank 0: #3 all_reduce 40 B float32 "
                            "(all_reduce (DDP gradient sync), step 3); rank 1: #3 all_reduce 40 B int32 "
                            "(all_reduce (DDP gradient sync), step 3)"], text
