"""ringtrain installed as a package (docs/getting-started.md, "Use ringtrain in your own project"), not run from the clone:
a wheel built from the source, installed into a folder of its own, trains a user's script from another folder,
with the shm all-reduce's C++ path (its source ships in the package), and prints its evaluations on rank 0's
console."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.job

SCRIPT = """
import torch
from torch.utils.data import TensorDataset

import ringtrain

x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
y = (x.sum(1) > 0).long()
summary = ringtrain.fit(
    model=lambda: torch.nn.Linear(8, 2), train_data=TensorDataset(x[:192], y[:192]),
    eval_data=TensorDataset(x[192:], y[192:]), loss="cross_entropy",
    config={"train": {"epochs": 2, "global_batch_size": 32, "local_batch_size": 16, "lr": 0.1},
            "comm": {"algorithm": "shm"}, "monitor": {"progress": False}},
)
print("installed", ringtrain.__file__, summary["steps"])
"""


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=240, **kwargs)


def test_a_pip_installed_ringtrain_trains_a_project_outside_the_clone(tmp_path):
    # A copy of what pip reads, so that its build folders are not left in the repository.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "ringtrain", source / "ringtrain", ignore=shutil.ignore_patterns("__pycache__"))
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                str(tmp_path / "wheels"), str(source))
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp_path / "wheels").glob("ringtrain-*.whl")
    site = tmp_path / "site"
    installed = run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    str(wheel))
    assert installed.returncode == 0, installed.stderr
    assert (site / "ringtrain" / "comm" / "csrc" / "shm_native.cpp").is_file(), "the shm source is not in the package"

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}  # the installed copy, not the clone
    result = run(str(site / "bin" / "ringtrain"), "run", "train.py", "--nproc", "2", "--run-dir",
                 str(tmp_path / "run"), cwd=project, env=env)
    assert result.returncode == 0, result.stderr
    assert f"installed {site / 'ringtrain' / '__init__.py'} 12" in result.stdout, result.stdout
    assert "native shm all-reduce could not be built" not in result.stderr, result.stderr
    # Rank 0's console: a line per evaluation (each epoch's end), through the launch as a user sees it; two
    # classes, so no top-5 accuracy.
    evals = [line for line in result.stderr.splitlines() if line.startswith("eval at step")]
    assert [line.split(":")[0] for line in evals] == ["eval at step 6 (epoch 1)", "eval at step 12 (epoch 2)"], evals
    assert all(re.fullmatch(r"eval at step \d+ \(epoch \d\): accuracy \d\.\d{4}, loss \d\.\d{3,4}", line)
               for line in evals), evals
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


def test_python_m_build_makes_a_wheel_and_an_sdist_that_install_and_train(tmp_path):
    """`python -m build` (issue 45): a wheel and an sdist from one version (ringtrain/__init__.py's), each installed
    into a fresh virtual environment (no pip of its own, no index: the main environment's packages reach it by a
    .pth line, so nothing is downloaded), where `ringtrain --version` says that version and `ringtrain train` runs
    the config shipped in the package."""
    import ringtrain

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "ringtrain", source / "ringtrain", ignore=shutil.ignore_patterns("__pycache__"))
    built = run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(source))
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    version = ringtrain.__version__
    [wheel] = (tmp_path / "dist").glob("ringtrain-*.whl")
    [sdist] = (tmp_path / "dist").glob("ringtrain-*.tar.gz")
    assert wheel.name.startswith(f"ringtrain-{version}-") and sdist.name == f"ringtrain-{version}.tar.gz"
    main_site = next(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))
    for package in (wheel, sdist):
        venv = tmp_path / f"venv-{package.suffix.lstrip('.')}"
        made = run(sys.executable, "-m", "venv", "--without-pip", str(venv))
        assert made.returncode == 0, made.stderr
        [site] = venv.glob("lib/python*/site-packages")
        # torch and the rest from the main environment, after the venv's own site-packages (a plain path line:
        # the main environment's editable ringtrain is not installed by it).
        (site / "main_environment.pth").write_text(main_site + "\n")
        installed = run(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                        "--no-index", "--no-build-isolation", "-q", str(package))
        assert installed.returncode == 0, installed.stderr[-3000:]
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"
        shown = run(str(venv / "bin" / "ringtrain"), "--version", cwd=tmp_path, env=env)
        assert shown.returncode == 0 and shown.stdout.strip() == f"ringtrain {version}", shown.stdout + shown.stderr
        config = site / "ringtrain" / "configs" / "quickstart.toml"
        assert config.is_file(), f"{package.name} does not ship the quickstart config"
        run_dir = tmp_path / f"run-{package.suffix.lstrip('.')}"
        trained = run(str(venv / "bin" / "ringtrain"), "train", str(config), "--nproc", "1", "--run-dir",
                      str(run_dir), cwd=tmp_path, env=env)
        assert trained.returncode == 0, trained.stderr[-3000:]
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 23
        # The installed copy ran, not the clone.
        where = run(str(venv / "bin" / "python"), "-c", "import ringtrain; print(ringtrain.__file__)", cwd=tmp_path,
                    env=env)
        assert where.stdout.strip() == str(site / "ringtrain" / "__init__.py"), where.stdout + where.stderr
