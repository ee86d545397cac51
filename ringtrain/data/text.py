"""Byte-level text for the language model: a corpus of files cut into variable-length sequences.

The corpus is every file under a directory, or every file a glob matches; ``{stdlib}`` in the path stands
for the Python standard library's folder. Unset, it is the standard library's own ``*.py`` sources
without test suites (about 13 MB of real text on any machine with Python, nothing to download).

Files are assigned to train or validation by a hash of their relative path, so the split is fixed
whatever the listing order and no file's text is on both sides. Each file is cut at line boundaries
into sequences of at most ``seq_len + 1`` bytes (a line longer than that is cut hard): every sequence
starts at the beginning of a line and lengths vary, which is what token-budget batching is for. A
sequence of n bytes gives n - 1 (input, next byte) pairs.

Batches pad inputs with 0 and targets with ``IGNORE_INDEX`` to a multiple of ``PAD_MULTIPLE`` tokens;
the loss counts only real targets.
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ringtrain.data.split import DatasetSplit

__all__ = [
    "IGNORE_INDEX",
    "PAD_MULTIPLE",
    "PadCollate",
    "STDLIB",
    "VOCAB_SIZE",
    "TextSequences",
    "corpus_files",
    "load_text_split",
    "pad_collate",
    "padded_length",
    "segment",
    "split_files",
    "unigram_entropy",
]

VOCAB_SIZE = 256
"""Tokens are bytes."""
IGNORE_INDEX = -100
"""Target value of padding (cross_entropy's default ignore_index)."""
PAD_MULTIPLE = 16
"""Padded lengths are multiples of this, so batches come in few shapes: the CPU's bf16 kernels are
compiled and cached per shape (megabytes each), and GPU tensor cores want multiples of 8."""
STDLIB = "{stdlib}"
"""Placeholder for the standard library's folder in ``data.path``."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: str | None) -> list[Path]:
    """The corpus's files, sorted; an empty list when nothing matches."""
    if path is None:
        root = stdlib_dir()
        skip = {"test", "tests", "site-packages", "dist-packages", "__pycache__"}
        return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))
    expanded = os.path.expanduser(path.replace(STDLIB, str(stdlib_dir())))
    if os.path.isdir(expanded):
        root = Path(expanded)
        # Caches and hidden files are not text someone chose to train on.
        return sorted(
            p for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)
        )
    return sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))


def split_files(files: list[Path], test_fraction: float) -> tuple[list[Path], list[Path]]:
    """(train, validation) by a hash of each file's path relative to the corpus's common folder."""
    if not files:
        return [], []
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    train, val = [], []
    for f in sorted(files):
        bucket = zlib.crc32(f.relative_to(root).as_posix().encode()) % 10_000
        (val if bucket < test_fraction * 10_000 else train).append(f)
    return train, val


def segment(text: bytes, max_len: int) -> list[tuple[int, int]]:
    """(start, length) of sequences of at most ``max_len`` bytes, cut after newlines where possible."""
    pieces: list[tuple[int, int]] = []
    start = pos = 0
    size = len(text)
    while pos < size:
        newline = text.find(b"\n", pos)
        line_end = size if newline < 0 else newline + 1
        if line_end - start > max_len:
            if pos > start:  # close the sequence before this line
                pieces.append((start, pos - start))
                start = pos
            while line_end - start > max_len:  # a line longer than a whole sequence
                pieces.append((start, max_len))
                start += max_len
        pos = line_end
    if size > start:
        pieces.append((start, size - start))
    return [(s, n) for s, n in pieces if n >= 2]  # a sequence needs one input and one target


class TextSequences(Dataset):
    """Variable-length byte sequences; item i is (inputs, targets), targets shifted by one byte."""

    def __init__(self, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
        self.data = torch.from_numpy(data)
        self.starts = starts
        self.lengths = lengths

    @classmethod
    def from_files(cls, files: list[Path], max_len: int) -> TextSequences:
        chunks, starts, lengths = [], [], []
        offset = 0
        for path in files:
            text = path.read_bytes()
            for start, length in segment(text, max_len):
                starts.append(offset + start)
                lengths.append(length)
            chunks.append(np.frombuffer(text, dtype=np.uint8))
            offset += len(text)
        data = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
        return cls(data, np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, length = int(self.starts[index]), int(self.lengths[index])
        sequence = self.data[start : start + length].long()
        return sequence[:-1], sequence[1:]

    @property
    def num_tokens(self) -> int:
        """Target tokens of one pass over the set."""
        return int(self.lengths.sum() - len(self.lengths))


def padded_length(longest: int, limit: int) -> int:
    """``longest`` rounded up to a multiple of PAD_MULTIPLE, at most ``limit``."""
    return min(limit, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)


class PadCollate:
    """Right-pad sequences (inputs with 0, targets with IGNORE_INDEX) to the longest, rounded up to a
    multiple of PAD_MULTIPLE but at most ``seq_len``. With causal attention, padding after a sequence
    cannot change its outputs."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def __call__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = padded_length(max((len(s[0]) for s in samples), default=1), self.seq_len)
        inputs = torch.zeros(len(samples), width, dtype=torch.long)
        targets = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
        for row, (x, y) in enumerate(samples):
            inputs[row, : len(x)] = x
            targets[row, : len(y)] = y
        return inputs, targets


pad_collate = PadCollate(seq_len=2**31)
"""Pads without a length limit (for sequences known to fit)."""


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the byte distribution in nats: the loss of the best model that ignores context."""
    counts = torch.bincount(data.long(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def load_text_split(path: str | None, seq_len: int, test_fraction: float) -> DatasetSplit:
    files = corpus_files(path)
    train_files, val_files = split_files(files, test_fraction)
    if not train_files or not val_files:
        raise ValueError(
            f"data.path {path!r} gave {len(train_files)} training and {len(val_files)} validation files; "
            "both need at least one (match more files or change data.test_fraction)"
        )
    train = TextSequences.from_files(train_files, seq_len + 1)
    val = TextSequences.from_files(val_files, seq_len + 1)
    entropy = unigram_entropy(torch.cat([train.data, val.data]))
    return DatasetSplit(
        train=train,
        test=val,
        num_classes=VOCAB_SIZE,
        input_shape=(seq_len,),
        collate_fn=PadCollate(seq_len),
        stats={
            "files": len(files),
            "train_tokens": train.num_tokens,
            "val_tokens": val.num_tokens,
            "unigram_entropy_nats": round(entropy, 4),
            "unigram_perplexity": round(math.exp(entropy), 2),
        },
    )
