"""scikit-learn's bundled handwritten digits: 1,797 real 8x8 images, no download.

A fixed stratified split keeps train and test apart and every class in proportion. The split is computed
with scikit-learn once per (scikit-learn version, test fraction, seed) and kept as tensors in
``$RINGTRAIN_CACHE_DIR`` (default ``~/.cache/ringtrain``): importing scikit-learn costs most of a second in
every worker process, reading the kept split a few milliseconds. Where the cache cannot be written the split
is computed each time, with the same result.
"""

from __future__ import annotations

import os
import tempfile
from importlib import metadata
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from ringtrain.data.split import DatasetSplit

__all__ = ["load_digits_split"]

_PIXEL_MAX = 16.0  # the digits pixels are counts 0..16


_FORMAT = 1  # bump when the split or its scaling changes: older kept splits are then ignored


def load_digits_split(test_fraction: float, split_seed: int) -> DatasetSplit:
    """Flattened 64-pixel images scaled to [0, 1], and labels 0..9."""
    kept = _cache_path(test_fraction, split_seed)
    tensors = _read(kept) if kept is not None else None
    if tensors is None:
        tensors = _split(test_fraction, split_seed)
        if kept is not None:
            _write(kept, tensors)
    train_x, train_y, test_x, test_y = tensors
    return DatasetSplit(
        train=TensorDataset(train_x, train_y),
        test=TensorDataset(test_x, test_y),
        num_classes=10,
        input_shape=(train_x.shape[1],),
    )


def _split(test_fraction: float, split_seed: int) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, random_state=split_seed, stratify=labels
    )
    pixels = lambda x: torch.as_tensor(x / _PIXEL_MAX, dtype=torch.float32)  # noqa: E731
    classes = lambda y: torch.as_tensor(y, dtype=torch.long)  # noqa: E731
    return pixels(train_x), classes(train_y), pixels(test_x), classes(test_y)


def _cache_path(test_fraction: float, split_seed: int) -> Path | None:
    try:
        version = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        return None
    folder = Path(os.environ.get("RINGTRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ringtrain"))
    return folder / f"digits-v{_FORMAT}-sklearn{version}-test{test_fraction!r}-seed{split_seed}.pt"


def _read(path: Path) -> tuple[torch.Tensor, ...] | None:
    try:
        tensors = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - missing, partial or foreign: compute the split instead
        return None
    ok = isinstance(tensors, tuple) and len(tensors) == 4 and all(isinstance(t, torch.Tensor) for t in tensors)
    return tensors if ok else None


def _write(path: Path, tensors: tuple[torch.Tensor, ...]) -> None:
    """Atomically (a temporary file renamed into place): workers starting together may all write it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(tensors, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full cache: the split is computed again next time
