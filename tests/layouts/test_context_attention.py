"""Ring attention (ringtrain/parallel/context.py) against its oracle: torch's causal SDPA over the whole sequence in
one process. Each rank gets the whole inputs, keeps its load-balanced part (shard_sequence), and returns its part
of the output and of the q, k, v gradients (under a random upstream gradient, not a sum's ones); the parent cuts
the oracle's the same way and compares. cp 1 to 4 (odd sizes catch ring-order bugs), sequences of 2·cp·k tokens
for k = 1 (chunks of one token: the diagonal is a single key), 2, 3, fp64, fp32, bf16 and grouped-query attention.
Then the built-in transformer split by apply_context_parallel against the unsplit one: the same loss and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringtrain.models.transformer import TransformerLM
from ringtrain.parallel.context import (
    ContextCommTimer, apply_context_parallel, ring_attention, sequence_positions, shard_sequence, unshard_sequence,
)
from tests.distributed import run_distributed

BATCH, HEADS, HEAD_DIM = 2, 4, 16
# (chunk tokens k, dtype, k/v heads): seq = 2 * cp * k.
CASES = [(1, torch.float64, HEADS), (3, torch.float64, HEADS), (2, torch.float32, HEADS), (2, torch.bfloat16, HEADS),
         (2, torch.float64, 2), (2, torch.float32, 1)]
BOUNDS = {torch.float64: dict(rtol=1e-7, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5),
          torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _inputs(cp: int, k: int, dtype: torch.dtype, kv_heads: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    seq = 2 * cp * k

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(BATCH, heads, seq, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype)

    return {"q": randn(HEADS), "k": randn(kv_heads), "v": randn(kv_heads), "dout": randn(HEADS)}


def _ring_pass(rank: int, world_size: int, cases: list[dict[str, torch.Tensor]]) -> list[dict]:
    results = []
    for full in cases:
        q, k, v = (shard_sequence(full[name], 2, rank, world_size).requires_grad_() for name in "qkv")
        timer = ContextCommTimer()
        out = ring_attention(q, k, v, dist.group.WORLD, timer=timer)
        out.backward(shard_sequence(full["dout"], 2, rank, world_size))
        results.append({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                        "whole_out": unshard_sequence(out.detach(), 2, dist.group.WORLD),
                        "bytes": timer.take_bytes(), "wait_s": timer.take_split_s(), "bytes_after": timer.take_bytes()})
    return results


def _oracle(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Causal SDPA over the whole sequence in fp64 (bf16 inputs taken exactly as they are)."""
    q, k, v = (full[name].detach().clone().double().requires_grad_() for name in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))
    out.backward(full["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.ranks
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_attention_output_and_gradients_are_causal_sdpas(cp):
    cases = [_inputs(cp, k, dtype, kv_heads, seed=100 * cp + i) for i, (k, dtype, kv_heads) in enumerate(CASES)]
    ranks = run_distributed(_ring_pass, cp, cases, timeout_s=120)
    for (k, dtype, kv_heads), full, *per_rank in zip(CASES, cases, *ranks):
        expected = _oracle(full)
        what = f"cp {cp}, seq {2 * cp * k}, {dtype}, {kv_heads} k/v heads"
        for rank, got in enumerate(per_rank):
            for name in ("out", "dq", "dk", "dv"):
                assert got[name].dtype == dtype, (what, name)
                torch.testing.assert_close(got[name].double(), shard_sequence(expected[name], 2, rank, cp),
                                           **BOUNDS[dtype], msg=lambda m: f"{what}, rank {rank}, {name}: {m}")
            torch.testing.assert_close(got["whole_out"].double(), expected["out"], **BOUNDS[dtype])
            # Accounted: per pass cp - 1 hops of the k/v block (inputs' dtype); backward also cp hops of the
            # fp32/fp64 dK/dV accumulator.
            kv_bytes = 2 * full["k"][:, :, : 2 * k].numel() * full["k"].element_size()
            acc_bytes = 2 * full["k"][:, :, : 2 * k].numel() * (8 if dtype == torch.float64 else 4)
            expected_bytes = 2 * (cp - 1) * kv_bytes + (cp * acc_bytes if cp > 1 else 0)
            assert got["bytes"] == expected_bytes, (what, rank)
            assert got["bytes_after"] == 0
            assert set(got["wait_s"]) == {"forward", "backward"} and min(got["wait_s"].values()) >= 0.0


def _two_rings(rank: int, world_size: int, cases: list[dict[str, torch.Tensor]]) -> dict:
    # Ranks {0, 2} and {1, 3}: group ranks differ from global ones, so a peer named by the wrong one fails.
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = rank % 2
    group, full = groups[mine], cases[mine]
    cp_rank = dist.get_rank(group)
    q, k, v = (shard_sequence(full[name], 2, cp_rank, 2).requires_grad_() for name in "qkv")
    out = ring_attention(q, k, v, group)
    out.backward(shard_sequence(full["dout"], 2, cp_rank, 2))
    return {"case": mine, "cp_rank": cp_rank, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.ranks
def test_ring_attention_on_subgroups_of_the_world():
    cases = [_inputs(2, 2, torch.float64, HEADS, seed=7), _inputs(2, 2, torch.float64, 2, seed=8)]
    for got in run_distributed(_two_rings, 4, cases, timeout_s=120):
        expected = _oracle(cases[got["case"]])
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name], shard_sequence(expected[name], 2, got["cp_rank"], 2),
                                       **BOUNDS[torch.float64])


def _round_trip(rank: int, world_size: int, x: torch.Tensor) -> dict:
    return {dim: unshard_sequence(shard_sequence(x, dim, rank, world_size), dim, dist.group.WORLD) for dim in (0, 1, 2)}


@pytest.mark.ranks
@pytest.mark.parametrize("cp", [3])
def test_shard_unshard_round_trip(cp):
    x = torch.arange(6 * 12 * 18).reshape(6, 12, 18)  # every dim divisible by 2 * 3
    for per_dim in run_distributed(_round_trip, cp, x):
        for dim, whole in per_dim.items():
            assert torch.equal(whole, x), dim


@pytest.mark.unit
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_hold_chunks_r_and_their_mirror_with_their_positions(cp):
    seq = 2 * cp * 3
    tokens = torch.arange(seq)
    parts = [shard_sequence(tokens, 0, rank, cp) for rank in range(cp)]
    for rank, part in enumerate(parts):
        assert torch.equal(part, sequence_positions(seq, rank, cp))
        assert part.tolist() == [*range(3 * rank, 3 * rank + 3), *range(3 * (2 * cp - 1 - rank), 3 * (2 * cp - rank))]
    assert sorted(torch.cat(parts).tolist()) == tokens.tolist()
    # Balanced: every rank's queries see the same number of keys under the causal mask.
    assert len({int((part + 1).sum()) for part in parts}) == 1


@pytest.mark.unit
def test_a_sequence_that_does_not_divide_is_one_line_naming_the_numbers_and_the_fix():
    with pytest.raises(ValueError) as err:
        shard_sequence(torch.zeros(2, 4, 30, 16), 2, 0, 4)
    message = str(err.value)
    assert "\n" not in message
    assert "30" in message and "2 * cp = 8" in message and "multiple of 8 (e.g. 32)" in message
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 6"):
        sequence_positions(10, 1, 3)


@pytest.mark.unit
def test_ring_attention_refuses_heads_that_do_not_group():
    q = torch.zeros(2, 4, 8, 16)
    kv = torch.zeros(2, 3, 8, 16)
    with pytest.raises(ValueError, match=r"q's heads \(4\) must be a multiple of k/v's heads \(3\)"):
        ring_attention(q, kv, kv, None)
    with pytest.raises(ValueError, match=r"local_seq \(7\) is odd"):
        ring_attention(torch.zeros(2, 4, 7, 16), torch.zeros(2, 4, 7, 16), torch.zeros(2, 4, 7, 16), None)


@pytest.mark.unit
def test_the_timer_hands_each_wait_and_byte_over_once():
    timer = ContextCommTimer()
    timer.record("forward", 0.5, 100)
    timer.record("backward", 0.25, 300)
    assert timer.take_bytes() == 400 and timer.take_bytes() == 0 and timer.bytes_sent == 400
    assert timer.take_s() == 0.75 and timer.take_s() == 0.0
    timer.record("backward", 0.125, 0)
    assert timer.take_split_s() == {"forward": 0.0, "backward": 0.125} and timer.take_s() == 0.0


LM = dict(vocab_size=64, seq_len=24, n_layers=2, n_heads=4, d_model=32)
IGNORE = -100


def _context_parallel_step(rank: int, world_size: int, state: dict, tokens: torch.Tensor, targets: torch.Tensor) -> dict:
    model = TransformerLM(**LM).double()
    model.load_state_dict(state)
    group = dist.group.WORLD
    apply_context_parallel(model, group)
    local_targets = shard_sequence(targets, 1, rank, world_size)
    logits = model(shard_sequence(tokens, 1, rank, world_size))
    # The mean over all the batch's target tokens: each rank sums its own tokens' losses, and divides by the
    # group's count (all-reduced: padding falls unevenly on the parts), so the ranks' gradients add up to the
    # mean's; the loss itself is the all-reduced sum over the same count.
    loss_sum = F.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), ignore_index=IGNORE, reduction="sum")
    items = (local_targets != IGNORE).sum()
    dist.all_reduce(items, group=group)
    (loss_sum / items).backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)  # the parameters' gradients: summed over the cp ranks
        grads[name] = param.grad
    loss = loss_sum.detach().clone()
    dist.all_reduce(loss, group=group)
    return {"loss": loss / items, "grads": grads, "bytes": model.cp_comm_timer.take_bytes()}


@pytest.mark.ranks
@pytest.mark.parametrize("cp", [2, 3])
def test_a_two_block_transformer_split_over_cp_has_the_unsplit_loss_and_gradients(cp):
    torch.manual_seed(0)
    model = TransformerLM(**LM).double()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, LM["vocab_size"], (2, LM["seq_len"]), generator=generator)
    targets = torch.randint(0, LM["vocab_size"], (2, LM["seq_len"]), generator=generator)
    targets[1, -5:] = IGNORE  # padding: the last part holds fewer target tokens than the others
    state = {name: value.clone() for name, value in model.state_dict().items()}
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    for got in run_distributed(_context_parallel_step, cp, state, tokens, targets, timeout_s=120):
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-10, atol=1e-12)
        assert set(got["grads"]) == {name for name, _ in model.named_parameters()}
        for name, param in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-8, atol=1e-12, msg=name)
        assert got["bytes"] > 0


@pytest.mark.unit
def test_apply_context_parallel_refuses_attention_dropout_in_one_line():
    with pytest.raises(ValueError, match="ring attention has no attention dropout; the model's is 0.1"):
        apply_context_parallel(TransformerLM(**LM, dropout=0.1), None)
