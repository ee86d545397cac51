"""The packets DiLoCo's compressed pseudo-gradients travel in (ringtrain/comm/codec.py): their sizes, what
rounding loses at most, and the packing of int4 nibbles."""

from __future__ import annotations

import pytest
import torch

from ringtrain.comm import codec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("numel", [1, 2, 255, 256, 257, 1001])
@pytest.mark.parametrize("dtype", codec.DTYPES)
def test_a_packet_is_its_announced_size_and_loses_at_most_half_a_step_of_its_block(numel, dtype):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    packet = codec.encode(x, dtype)
    assert packet.dtype == torch.uint8 and packet.numel() == codec.packet_bytes(numel, dtype)
    y = codec.decode(packet, dtype, numel)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if dtype == "bf16":
        torch.testing.assert_close(y, x.to(torch.bfloat16).to(torch.float32), rtol=0, atol=0)
        return
    levels = {"int8": 127, "int4": 7}[dtype]
    for start in range(0, numel, codec.BLOCK):
        block = slice(start, start + codec.BLOCK)
        step = float(x[block].abs().max()) / levels
        assert float((x[block] - y[block]).abs().max()) <= step / 2 * (1 + 1e-6)


def test_sizes_per_value():
    n = 256 * 1000
    assert codec.packet_bytes(n, "bf16") == 2 * n
    assert codec.packet_bytes(n, "int8") == n + 4 * 1000
    assert codec.packet_bytes(n, "int4") == n // 2 + 4 * 1000
    assert codec.packet_bytes(3, "int4") == 4 + 2  # one scale, two bytes for three nibbles


def test_values_on_the_grid_come_back_exactly_and_a_zero_block_stays_zero():
    levels = torch.arange(-7, 8, dtype=torch.float32) * 0.5  # multiples of 3.5 / 7
    assert torch.equal(codec.decode(codec.encode(levels, "int4"), "int4", levels.numel()), levels)
    zeros = torch.zeros(300)
    for dtype in codec.DTYPES:
        assert torch.equal(codec.decode(codec.encode(zeros, dtype), dtype, 300), zeros)


def test_int4_packs_two_values_a_byte_the_even_index_low():
    x = torch.tensor([7.0, -7.0, 0.0])  # scale 1: q = 7, -7, 0 stored as 15, 1, 8
    body = codec.encode(x, "int4")[4:]
    assert body.tolist() == [15 | (1 << 4), 8 | (8 << 4)]


def test_error_feedback_telescopes_what_is_sent_over_many_rounds_is_what_was_learned():
    """Sending x_t + e_{t-1} and keeping e_t = (x_t + e_{t-1}) - sent_t: the sum of what was sent equals the sum
    of what there was to send, less one round's residue; without feedback the rounding error accumulates."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(512, generator=g) * 0.01 + 0.003 for _ in range(50)]  # a steady drift under noise
    error, sent_fed, sent_blind = torch.zeros(512), torch.zeros(512), torch.zeros(512)
    for x in xs:
        packet = codec.encode(x + error, "int4")
        decoded = codec.decode(packet, "int4", 512)
        error = x + error - decoded
        sent_fed += decoded
        sent_blind += codec.decode(codec.encode(x, "int4"), "int4", 512)
    truth = torch.stack(xs).sum(0)
    torch.testing.assert_close(sent_fed + error, truth, rtol=0, atol=1e-5)
    assert float((sent_fed - truth).abs().max()) < float((sent_blind - truth).abs().max()) / 3


def test_a_wrong_input_is_one_line():
    with pytest.raises(ValueError, match="1-D float32"):
        codec.encode(torch.zeros(2, 2), "int8")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        codec.packet_bytes(4, "fp8")
