"""`monitor.memory.new_tensor_peak`: the most bytes of storages created inside the block alive at once,
counted op by op (views and in-place results of existing tensors are not new; freed ones are subtracted)."""

from __future__ import annotations

import pytest
import torch

from ringtrain.monitor.memory import new_tensor_peak

pytestmark = pytest.mark.unit


def test_the_peak_counts_what_is_alive_at_once_and_not_views_or_in_place_results():
    existing = torch.zeros(1000)  # 4,000 bytes, made before
    with new_tensor_peak() as tracked:
        a = torch.ones(250)  # 1,000 bytes
        b = torch.ones(500)  # 2,000 bytes: 3,000 alive
        view = a.view(25, 10).t()  # a's storage: nothing new
        existing.add_(1.0)  # in place: existing's storage
        del a, view, b  # 0 alive
        c = existing * 2  # 4,000 bytes
        assert tracked.bytes == 4000
        del c
    assert tracked.peak == 4000 and tracked.bytes == 0


def test_a_training_step_peaks_above_what_autograd_saves_and_frees_it_all():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    with new_tensor_peak() as tracked:
        model(x).square().sum().backward()
    # Kept for backward at least: the GELU's input and the second layer's input (32 x 256 fp32 each).
    assert tracked.peak >= 2 * 32 * 256 * 4
    assert tracked.bytes == 0
