"""`ringtrain bench collectives --algorithms ...,openmpi`: Open MPI's all-reduce measured in the same run as
ringtrain's, taking turns with it (bench/openmpi.py).

The short CI form of the side-by-side comparison (docs/benchmarks.md has the long one): the rows and their
ratio to Open MPI, the turns really interleaved (Open MPI's ranks asleep while ringtrain is timed), nothing
left running or in /dev/shm, one line when Open MPI or mpi4py is missing, one line when mpirun fails. The
run itself skips only where Open MPI and mpi4py are not installed (``make install`` adds them where it can).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from ringtrain.bench import openmpi
from ringtrain.bench.options import BenchOptions
from ringtrain.errors import ConfigError, RingtrainError
from tests.conftest import REPO, run_cli


def _missing() -> str | None:
    try:
        openmpi.check()
    except RingtrainError as err:
        return str(err)
    return None


def _leftovers() -> set[str]:
    """Open MPI's shared-memory segments (btl/vader) in /dev/shm."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("vader_segment")}


@pytest.mark.job
def test_openmpi_takes_turns_with_ringtrain_shm(tmp_path):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    before = _leftovers()
    out = tmp_path / "bench"
    result = run_cli("bench", "collectives", "--nproc", "2", "--sizes", "4K,1M", "--algorithms", "shm,openmpi",
                     "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    assert "vs openmpi" in result.stdout
    rows = json.loads((out / "collectives.json").read_text())
    assert [(r["algorithm"], r["bytes"]) for r in rows] == [("openmpi", 4096), ("shm", 4096), ("openmpi", 1 << 20),
                                                           ("shm", 1 << 20)]
    for row in rows:
        assert row["p50_s"] > 0 and row["iters"] >= 20
        if row["algorithm"] == "openmpi":
            assert row["vs_openmpi"] is None  # the reference itself
        else:
            reference = next(r for r in rows if r["algorithm"] == "openmpi" and r["bytes"] == row["bytes"])
            assert row["vs_openmpi"] == pytest.approx(reference["p50_s"] / row["p50_s"], rel=2e-2)
    # Measured in the same rounds: as many blocks of each.
    assert rows[0]["iters"] == rows[1]["iters"] and rows[2]["iters"] == rows[3]["iters"]
    assert _leftovers() <= before  # Open MPI's ranks finalized and removed their segments
    assert not subprocess.run(["pgrep", "-f", "ringtrain.bench.openmpi"], capture_output=True).stdout


@pytest.mark.job
def test_a_missing_openmpi_is_one_line_with_the_install_command(tmp_path):
    # mpi4py made unimportable (a None entry in sys.modules is how Python spells "not installed").
    code = ("import sys; sys.modules['mpi4py'] = None; from ringtrain.cli import main; "
            f"sys.exit(main(['bench', 'collectives', '--algorithms', 'shm,openmpi', '--out', {str(tmp_path)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: --algorithms openmpi needs Open MPI and mpi4py ("), lines
    assert lines[0].endswith(openmpi.INSTALL_HINT), lines


@pytest.mark.job
def test_an_mpirun_that_fails_is_one_line_naming_it(tmp_path):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    # An mpirun first on PATH that fails as a broken installation would: the bench says so, nothing hangs.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun: could not find orted on this host' >&2\nexit 213\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = run_cli("bench", "collectives", "--nproc", "2", "--sizes", "4K", "--algorithms", "shm,openmpi",
                     "--out", str(tmp_path / "bench"), timeout=240, env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1] == ("ringtrain: error: Open MPI's side of the bench failed: mpirun exited with code 213: "
                         "mpirun: could not find orted on this host"), result.stderr


@pytest.mark.unit
def test_openmpi_refuses_what_it_cannot_measure():
    with pytest.raises(ConfigError, match=r"openmpi reduces float32, float64, int32 and int64 \(MPI has no bfloat16\)"):
        BenchOptions(algorithms=("shm", "openmpi"), dtype="bfloat16").validate()
    with pytest.raises(ConfigError, match="--algorithms openmpi measures one host"):
        BenchOptions(algorithms=("shm", "openmpi"), nnodes=2, nprocs=(2,), rdzv_endpoint="198.18.0.1:29500").validate()


@pytest.mark.job
def test_mpirun_is_pinned_as_the_bench_pins_its_workers():
    cores = len(os.sched_getaffinity(0))
    command = openmpi.mpirun_command(cores, 1234)
    assert command[:7] == ["mpirun", "-np", str(cores), "--map-by", "core", "--bind-to", "core"]
    assert "--oversubscribe" not in command
    over = openmpi.mpirun_command(2 * cores, 1234)
    assert over[6] == "core:overload-allowed" and "--oversubscribe" in over
    assert over[-5:] == [sys.executable, "-m", "ringtrain.bench.openmpi", "127.0.0.1", "1234"]
