"""The byte-level corpus: files, split, sequences, padding, token-budget micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringtrain.data.loader import StepBatch, pack_by_tokens
from ringtrain.data.text import (
    IGNORE_INDEX,
    PAD_MULTIPLE,
    PadCollate,
    corpus_files,
    load_text_split,
    segment,
    split_files,
    stdlib_dir,
    unigram_entropy,
)

pytestmark = pytest.mark.unit


@given(st.binary(max_size=600).map(lambda b: b.replace(b"\r", b"\n")), st.integers(2, 40))
@settings(max_examples=200, deadline=None)
def test_segments_tile_the_text_within_the_limit_and_cut_after_newlines(text, max_len):
    pieces = segment(text, max_len)
    assert all(2 <= n <= max_len for _, n in pieces)
    # Consecutive, in order; only pieces of one byte (no target) may be left out.
    position = 0
    for start, length in pieces:
        assert start >= position and start - position <= 1
        position = start + length
    assert len(text) - position <= 1
    for start, length in pieces[:-1]:
        # A piece ends at a newline unless one line alone was longer than max_len (then it is cut hard).
        assert text[start + length - 1 : start + length] == b"\n" or length == max_len


def test_stdlib_corpus_split_is_fixed_disjoint_and_about_ten_percent():
    files = corpus_files(None)
    assert files and all(f.suffix == ".py" and stdlib_dir() in f.parents for f in files)
    assert not any("test" in f.relative_to(stdlib_dir()).parts[:-1] for f in files)
    train, val = split_files(files, 0.1)
    assert not set(train) & set(val) and len(train) + len(val) == len(files)
    assert 0.05 < len(val) / len(files) < 0.15
    assert split_files(list(reversed(files)), 0.1) == (train, val), "the split must not depend on the order"


def test_text_split_counts_targets_and_reports_unigram_entropy():
    data = load_text_split("{stdlib}/asyncio/*.py", seq_len=64, test_fraction=0.1)
    assert data.num_classes == 256 and data.input_shape == (64,)
    lengths = [len(data.train[i][0]) for i in range(len(data.train))]
    assert max(lengths) <= 64 and len(set(lengths)) > 10, "sequences should vary in length"
    assert sum(lengths) == data.stats["train_tokens"]
    inputs, targets = data.train[3]
    assert torch.equal(inputs[1:], targets[:-1])
    assert 2.5 < data.stats["unigram_entropy_nats"] < 3.5


def test_unigram_entropy_of_uniform_bytes_is_log_256():
    assert math.isclose(unigram_entropy(torch.arange(256).repeat(4)), math.log(256))
    assert unigram_entropy(torch.zeros(10, dtype=torch.long)) == 0.0


def test_pad_collate_pads_to_a_multiple_and_ignores_padding():
    samples = [(torch.arange(5), torch.arange(1, 6)), (torch.arange(18), torch.arange(1, 19))]
    inputs, targets = PadCollate(seq_len=64)(samples)
    assert inputs.shape == targets.shape == (2, 32)
    assert (targets[0, 5:] == IGNORE_INDEX).all() and (targets[0, :5] != IGNORE_INDEX).all()
    assert PadCollate(seq_len=20)(samples)[0].shape == (2, 20), "never wider than seq_len"


@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 200), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_pack_by_tokens_respects_the_budget_and_keeps_every_item(lengths, max_tokens, max_items):
    lengths = sorted(lengths, reverse=True)
    groups = pack_by_tokens(lengths, max_tokens, max_items)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for group in groups:
        assert len(group) <= max_items
        assert len(group) == 1 or len(group) * lengths[group[0]] <= max_tokens


def test_token_micro_batches_hold_every_token_once_within_the_budget():
    data = load_text_split("{stdlib}/asyncio/*.py", seq_len=64, test_fraction=0.1)
    ids = list(range(0, 400, 7))
    inputs, targets = PadCollate(64)([data.train[i] for i in ids])
    batch = StepBatch(torch.tensor(ids), inputs, targets)
    micro = batch.token_micro_batches(max_tokens=200, max_sequences=5)
    assert len(micro) > 1
    for x, y in micro:
        assert x.shape == y.shape and x.shape[0] <= 5
        assert x.numel() <= 200 or x.shape[0] == 1
        assert x.shape[1] % PAD_MULTIPLE == 0 or x.shape[1] == 64
    real = sorted(tuple(row[row != IGNORE_INDEX].tolist()) for _, y in micro for row in y)
    assert real == sorted(tuple(row[row != IGNORE_INDEX].tolist()) for row in targets)
