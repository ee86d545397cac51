"""`ringtrain bench collectives` as a user runs it: the table, the files, one-line errors."""

from __future__ import annotations

import csv
import json
import re

import pytest

from ringtrain import comm
from ringtrain.bench.options import BENCH_ALGORITHMS, BENCH_OPS, BenchOptions, parse_ops, parse_sizes, parse_world_sizes
from ringtrain.errors import ConfigError
from tests.conftest import run_cli


@pytest.mark.job
def test_bench_collectives_prints_the_table_and_writes_json_csv_and_png(tmp_path):
    out = tmp_path / "bench"
    result = run_cli("bench", "collectives", "--nproc", "2", "--sizes", "4K,256K", "--algorithms", "torch,ring,shm",
                     "--out", str(out), timeout=240)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    assert "busbw(GB/s)" in result.stdout and "vs torch" in result.stdout
    rows = json.loads((out / "collectives.json").read_text())
    assert {(r["algorithm"], r["bytes"]) for r in rows} == {(a, b) for a in ("torch", "ring", "shm") for b in (4096, 262144)}
    for row in rows:
        assert {"algorithm", "world_size", "bytes", "p50_s", "algbw_gbps", "busbw_gbps"} <= set(row)
        assert row["world_size"] == 2 and row["iters"] >= 20 and row["p50_s"] > 0
        # busbw = algbw * 2 (n - 1) / n, which is algbw itself at two ranks
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"], rel=1e-3)
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["p50_s"] / 1e9, rel=1e-2, abs=1e-4)
    assert len(list(csv.DictReader((out / "collectives.csv").open()))) == len(rows)
    assert (out / "collectives.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.job
def test_a_bad_flag_is_one_line_before_any_worker_starts(tmp_path):
    result = run_cli("bench", "collectives", "--sizes", "4K:4X", "--out", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == "ringtrain: error: --sizes: '4X' is not a size like 4K, 1M or 4096"


@pytest.mark.unit
@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"algorithms": ("torch", "nccl")}, "--algorithms: unknown 'nccl'; choose from torch,ring,ring_chunked,shm,shm_inplace,deepspeed_shm"),
        ({"nprocs": (0,)}, "--nproc needs world sizes of at least 1"),
        ({"iters": 5}, "--iters must be at least 20"),
        ({"dtype": "complex64"}, "--dtype 'complex64' is not one of"),
    ],
)
def test_bench_option_mistakes_name_the_fix(options, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        BenchOptions(**options).validate()
    with pytest.raises(ConfigError, match="write world sizes separated by commas"):
        parse_world_sizes("2,x")


@pytest.mark.unit
def test_bench_knows_every_comm_algorithm():
    assert set(comm.ALGORITHMS) < set(BENCH_ALGORITHMS)


@pytest.mark.unit
def test_size_ranges_are_powers_of_the_factor():
    assert parse_sizes("4K:64K") == (4096, 8192, 16384, 32768, 65536)
    assert parse_sizes("4K:64M:4")[-1] == 64 << 20 and len(parse_sizes("4K:64M:4")) == 8
    assert parse_sizes("1M, 512") == (1 << 20, 512)
    with pytest.raises(ConfigError):
        parse_sizes("64M:4K")


@pytest.mark.job
def test_bench_ops_time_every_collective_for_gloo_and_ringtrain_shm(tmp_path):
    out = tmp_path / "bench"
    result = run_cli("bench", "collectives", "--nproc", "2", "--sizes", "4K", "--algorithms", "torch,ring,shm",
                     "--ops", "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,sendrecv", "--out", str(out),
                     timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "collectives.json").read_text())
    # ring is an all-reduce only; every other op has a row for Gloo (torch) and the ringtrain_shm backend (shm).
    expected = {("all_reduce", a) for a in ("torch", "ring", "shm")} | {
        (op, a) for op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv") for a in ("torch", "shm")}
    assert {(r["op"], r["algorithm"]) for r in rows} == expected
    factors = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0,
               "sendrecv": 1.0}  # busbw / algbw at two ranks
    for row in rows:
        assert row["bytes"] == 4096 and row["p50_s"] > 0 and row["iters"] >= 20
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factors[row["op"]], rel=1e-2, abs=1e-4)
    assert len(list(csv.DictReader((out / "collectives.csv").open()))) == len(rows)
    for name in ("collectives", "collectives_all_gather", "collectives_sendrecv"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert re.search(r"^  sendrecv +4 KiB  shm ", result.stdout, re.M), result.stdout


@pytest.mark.job
def test_a_bad_op_is_one_line_and_exit_2(tmp_path):
    result = run_cli("bench", "collectives", "--ops", "all_reduce,allgather", "--out", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == ("ringtrain: error: --ops 'all_reduce,allgather': unknown 'allgather'; choose "
                                     "from all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,sendrecv (or all)")


@pytest.mark.unit
def test_ops_flag_parsing():
    assert parse_ops("all") == BENCH_OPS
    assert parse_ops(" all_gather, sendrecv,all_gather") == ("all_gather", "sendrecv")
    with pytest.raises(ConfigError, match=re.escape("--ops ',': unknown 'empty'")):
        parse_ops(",")
    with pytest.raises(ConfigError, match=re.escape("--ops broadcast is timed for --algorithms torch,shm,openmpi")):
        BenchOptions(algorithms=("ring", "deepspeed_shm"), ops=("all_reduce", "broadcast")).validate()
    with pytest.raises(ConfigError, match=re.escape("--ops sendrecv is measured on one host")):
        BenchOptions(ops=("sendrecv",), nnodes=2, nprocs=(2,), rdzv_endpoint="198.18.0.1:29500").validate()
    with pytest.raises(ConfigError, match=re.escape("--ops: unknown 'gather'")):
        BenchOptions(ops=("gather",)).validate()
    BenchOptions(algorithms=("torch", "ring"), ops=BENCH_OPS).validate()
