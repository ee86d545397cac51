"""Build and load the C++ hot path of the shm all-reduce (``csrc/shm_native.cpp``), or say why not.

``make install`` builds it (``python -m ringtrain.comm.shm_native``) with ``torch.utils.cpp_extension``
into a cache folder keyed by the source, the compiler flags, torch's and Python's versions and the CPU's
features (it is compiled for this CPU); later processes import the built module directly, in
milliseconds. Where it cannot be built (no compiler, a read-only cache) or is switched off
(``RINGTRAIN_SHM_NATIVE=0``), shm keeps working on its Python path, after one warning line::

    >>> module = shm_native.load()        # None: use the Python path
    >>> module.dtypes()                   # what the native path reduces; other dtypes take the Python path
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["load", "build", "cache_dir", "ENV_SWITCH", "NAME"]

ENV_SWITCH = "RINGTRAIN_SHM_NATIVE"
"""``0`` turns the native path off (the Python path is used); anything else, or unset, leaves it on."""
NAME = "ringtrain_shm_native"
_SOURCE = Path(__file__).parent / "csrc" / "shm_native.cpp"
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno"]  # no -ffast-math: sums must keep their order

_loaded: dict[str, ModuleType | None] = {}


def cache_dir() -> Path:
    """Where this machine's build lives: ``$RINGTRAIN_CACHE_DIR`` or ``~/.cache/ringtrain``, one folder per key."""
    root = os.environ.get("RINGTRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ringtrain")
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    key.update(" ".join(_CFLAGS).encode())
    key.update(f"{torch.__version__} {sys.version} {platform.machine()} {_cpu_flags()}".encode())
    return Path(root) / f"shm_native-{key.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(verbose: bool = False) -> ModuleType:
    """Compile (or find) the module; raise with the compiler's reason when it cannot be built."""
    folder = cache_dir()
    built = folder / f"{NAME}.so"
    if built.exists():
        return _import(built)
    folder.mkdir(parents=True, exist_ok=True)
    # torch.utils.cpp_extension warns at import on a machine without CUDA, which is what shm is for.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    # A file lock in ``folder`` lets one process build while the others of the job wait for it.
    return cpp_extension.load(name=NAME, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                              build_directory=str(folder), verbose=verbose)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The native module, or None (the Python path) after one warning line saying why. Cached per process."""
    if ENV_SWITCH in _loaded:
        return _loaded[ENV_SWITCH]
    module = None
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        pass  # switched off on purpose: no warning
    elif platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"ringtrain: warning: the native shm all-reduce is built for x86-64 only, not {platform.machine()}; "
              "using the Python path", file=sys.stderr)
    else:
        try:
            module = build()
        except Exception as err:  # noqa: BLE001 - any build failure means: fall back, and say why in one line
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            reason = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else type(err).__name__)
            print(f"ringtrain: warning: the native shm all-reduce could not be built ({reason[:200]}); using the Python "
                  f"path (`python -m ringtrain.comm.shm_native --verbose` shows the compiler; {ENV_SWITCH}=0 silences this)",
                  file=sys.stderr)
    _loaded[ENV_SWITCH] = module
    return module


if __name__ == "__main__":  # `make install`: build now, so that no job waits for the compiler
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        print(f"ringtrain: {ENV_SWITCH}=0, not building the native shm all-reduce")
    elif "--verbose" in sys.argv[1:]:
        build(verbose=True)  # the compiler's own output, and its error if any
        print(f"ringtrain: native shm all-reduce ready in {cache_dir()}")
    else:
        loaded = load()
        print(f"ringtrain: native shm all-reduce {'ready in ' + str(cache_dir()) if loaded else 'unavailable (Python path)'}")
