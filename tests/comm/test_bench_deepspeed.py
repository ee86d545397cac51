"""`ringtrain bench collectives --algorithms ...,deepspeed_shm`: DeepSpeed's CPU shm all-reduce beside ringtrain's.

The short CI form of the side-by-side comparison (docs/benchmarks.md has the long one): the rows, the ratio
to DeepSpeed, DeepSpeed's files gone from /dev/shm afterwards, and one line when DeepSpeed is missing. It skips
only when DeepSpeed is not installed or its own builder cannot build the op here (no compiler, no AVX2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ringtrain.bench.options import BenchOptions
from ringtrain.errors import ConfigError
from tests.conftest import REPO, run_cli


# What DeepSpeed's own builder raises when the op cannot be built here (torch's cpp_extension, or the builder's
# checks): the reasons to skip. Any other exception, and anything ringtrain's bench code raises, fails the test.
_BUILD_FAILURES = ("Error building extension 'deepspeed_shm_comm'", "Unable to JIT load the deepspeed_shm_comm op")


def _missing_prerequisite(monkeypatch) -> str | None:
    """None if DeepSpeed is installed and its own builder builds (or finds cached) its shm op for this CPU, else
    what is missing. Asked of DeepSpeed directly, not through ringtrain's bench code, which the test runs."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # before DeepSpeed's import picks its accelerator
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError as err:
        return f"DeepSpeed is not installed: {err}"
    try:
        module = ShareMemCommBuilder().load(verbose=False)
    except RuntimeError as err:
        if not str(err).startswith(_BUILD_FAILURES):
            raise
        return f"DeepSpeed's shm op cannot be built here: {str(err).splitlines()[0]}"
    if module.vector_kernel_level() < 1:
        return "DeepSpeed's shm op needs AVX2 on x86 and this CPU lacks it"
    return None


def _deepspeed_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("deepspeed_allreduce_buffer")}


@pytest.mark.job
def test_deepspeed_shm_runs_beside_ringtrain_shm(tmp_path, deepspeed_build, monkeypatch):
    # deepspeed_build: the op was compiled in the background (tests/conftest.py); this loads it from the cache.
    reason = _missing_prerequisite(monkeypatch)
    if reason:
        pytest.skip(reason)
    before = _deepspeed_files()
    out = tmp_path / "bench"
    result = run_cli("bench", "collectives", "--nproc", "2", "--sizes", "4K,1M", "--algorithms", "shm,deepspeed_shm",
                     "--out", str(out), timeout=240)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    assert "vs deepspeed" in result.stdout
    rows = json.loads((out / "collectives.json").read_text())
    assert {(r["algorithm"], r["bytes"]) for r in rows} == {(a, b) for a in ("shm", "deepspeed_shm") for b in (4096, 1 << 20)}
    for row in rows:
        if row["algorithm"] == "deepspeed_shm":
            assert row["vs_deepspeed"] is None and row["p50_s"] > 0  # the reference itself
            continue
        reference = next(r for r in rows if r["algorithm"] == "deepspeed_shm" and r["bytes"] == row["bytes"])
        assert row["vs_deepspeed"] == pytest.approx(reference["p50_s"] / row["p50_s"], rel=2e-2)
    assert _deepspeed_files() <= before  # its workspace files were unlinked once mapped


@pytest.mark.job
def test_a_missing_deepspeed_is_one_line_with_the_install_command(tmp_path):
    # DeepSpeed made unimportable (a None entry in sys.modules is how Python spells "not installed").
    code = ("import sys; sys.modules['deepspeed'] = None; from ringtrain.cli import main; "
            f"sys.exit(main(['bench', 'collectives', '--algorithms', 'shm,deepspeed_shm', '--out', {str(tmp_path)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip() and "cpp_extension" not in line]
    assert lines == ["ringtrain: error: --algorithms deepspeed_shm needs DeepSpeed, which is not installed: "
                     "pip install 'deepspeed==0.19.8' (or: pip install -e '.[bench]')"], result.stderr


@pytest.mark.unit
def test_deepspeed_shm_refuses_dtypes_its_op_leaves_untouched():
    with pytest.raises(ConfigError, match="deepspeed_shm reduces float32, bfloat16 and float16 only, not --dtype int64"):
        BenchOptions(algorithms=("shm", "deepspeed_shm"), dtype="int64").validate()
