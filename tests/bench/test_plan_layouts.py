"""`ringtrain plan layouts` (ringtrain/bench/plan_layouts.py): memory and step time per layout, computed by hand
here for small shapes, the layouts enumerated as ringtrain composes them, and the command's one-line errors."""

from __future__ import annotations

import pytest

from ringtrain.bench.plan import Link, ring_time
from ringtrain.bench.plan import PlanError
from ringtrain.bench.plan_layouts import (DATA_STRATEGIES, Cluster, Layout, ModelShape, activation_bytes,
                                          enumerate_layouts, layout_memory, layout_step, layouts_markdown,
                                          parse_tp_unsplit, plan_layouts, runs_in_ringtrain)
from tests.conftest import run_main

pytestmark = pytest.mark.unit

SHAPE = ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=100)
FAST = Link(1e-6, 1e10, "fast")
SLOW = Link(1e-4, 1e8, "slow")


def test_the_shape_counts_parameters_and_flops_as_stated():
    assert SHAPE.block_params == 12 * 64 ** 2
    assert SHAPE.embed_params == 100 * 64 + 32 * 64
    assert SHAPE.params == 4 * 12 * 64 ** 2 + 100 * 64 + 32 * 64
    assert SHAPE.flops_per_token == 6 * SHAPE.params + 12 * 4 * 64 * 32


def test_memory_of_a_tp2_layout_by_hand():
    layout = Layout(dp=1, tp=2, pp=1, microbatches=2)  # 8 sequences -> micro-batches of 4
    got = layout_memory(SHAPE, layout, global_batch=8, act_bytes=2.0)
    params = 4 * 12 * 64 ** 2 / 2 + (100 * 64 + 32 * 64)
    assert got["params"] == params and got["state_bytes"] == 16 * params
    s, b, h, t, e = 32, 4, 64, 2, 2.0
    sbh = s * b * h * e
    layer = sbh * (4 + 13 / t)  # whole: two norm inputs, qkv and MLP inputs; split: q k v, attention out, proj in, 2 x 4h
    head = 2 * sbh + 2 * 4 * b * s * 100  # the final norm's input and output, fp32 logits and log-softmax
    assert got["activation_bytes"] == pytest.approx(4 * layer + head)


def test_checkpointing_keeps_layer_inputs_and_sharding_divides_the_state():
    plain = layout_memory(SHAPE, Layout(dp=4, tp=1, pp=1, data="ddp", microbatches=1), global_batch=8)
    full = layout_memory(SHAPE, Layout(dp=4, tp=1, pp=1, data="ddp", ac="full", microbatches=1), global_batch=8)
    s, b, h = 32, 2, 64
    sbh = s * b * h * 2.0
    whole, gradients, head = 17 * sbh, 5 * sbh, 2 * sbh + 2 * 4 * b * s * 100
    # Full: each layer's input, and one layer recomputed beside its gradients (here more than the logits).
    assert full["activation_bytes"] == pytest.approx(4 * sbh + max(whole + gradients, head))
    assert plain["activation_bytes"] == pytest.approx(4 * whole + max(head, 2 * sbh + gradients))
    fsdp = layout_memory(SHAPE, Layout(dp=4, tp=1, pp=1, data="fsdp", microbatches=1), global_batch=8)
    zero1 = layout_memory(SHAPE, Layout(dp=4, tp=1, pp=1, data="zero1", microbatches=1), global_batch=8)
    assert fsdp["state_bytes"] == SHAPE.params * 16 / 4 and zero1["state_bytes"] == SHAPE.params * (8 + 8 / 4)


def test_step_time_of_tp_and_pp_layouts_by_hand():
    cluster = Cluster(workers=2, per_host=2, memory_gb=1.0, tflops=1.0, intra=FAST, inter=SLOW)
    tokens = 8 * 32
    compute_whole = tokens * SHAPE.flops_per_token / 1e12
    tp = layout_step(SHAPE, cluster, Layout(dp=1, tp=2, pp=1, microbatches=2), global_batch=8, act_bytes=4.0)
    assert tp["compute_s"] == pytest.approx(compute_whole / 2)
    # 4 layers x 2 micro-batches x 4 all-reduces of 4 x 32 x 64 fp32 values over 2 ranks, inside the host.
    assert tp["tp_comm_s"] == pytest.approx(4 * 2 * 4 * ring_time(4 * 32 * 64 * 4.0, 2, FAST))
    assert tp["step_s"] == pytest.approx(tp["compute_s"] + tp["tp_comm_s"])
    # A quarter of the compute left whole on each tp rank: 1/4 + 3/4 / 2 of the one worker's.
    unsplit = Cluster(workers=2, per_host=2, memory_gb=1.0, tflops=1.0, intra=FAST, inter=SLOW, tp_unsplit=0.25)
    part = layout_step(SHAPE, unsplit, Layout(dp=1, tp=2, pp=1, microbatches=2), global_batch=8, act_bytes=4.0)
    assert part["compute_s"] == pytest.approx(compute_whole * (0.25 + 0.75 / 2))
    pp = layout_step(SHAPE, cluster, Layout(dp=1, tp=1, pp=2, microbatches=4), global_batch=8, act_bytes=4.0)
    assert pp["bubble_s"] == pytest.approx(compute_whole / 2 * 1 / 4)  # (pp - 1) / m of a rank's compute
    assert pp["p2p_s"] == pytest.approx(2 * 4 * (FAST.alpha_s + 2 * 32 * 64 * 4.0 / FAST.beta_Bps))
    assert pp["step_s"] == pytest.approx(compute_whole / 2 + pp["bubble_s"] + pp["p2p_s"])


def test_layouts_are_those_ringtrain_composes_and_a_tight_memory_rules_some_out():
    cluster = Cluster(workers=8, per_host=4, memory_gb=1.0, tflops=1.0, intra=FAST, inter=SLOW)
    found = enumerate_layouts(SHAPE, cluster, global_batch=16, microbatches=4)
    shapes = {(l.dp, l.tp, l.pp, l.data) for l in found}
    assert (8, 1, 1, "zero2") in shapes and (2, 4, 1, "fsdp") in shapes and (4, 1, 2, "ddp") in shapes
    # tp inside pipeline stages, with the pipelines replicated or sharded (the 3-D mesh); tp with sequence parallelism.
    assert {(2, 2, 2, "ddp"), (2, 2, 2, "fsdp"), (1, 4, 2, "ddp")} <= shapes
    assert all(l.sp for l in found if l.tp > 1 and l.cp == 1)  # (cp layouts are listed without sp)
    # zero1/2 beside a pipeline wrap each stage over dp (parallel/pipeline_zero.py), not beside tp or cp.
    assert (4, 1, 2, "zero2") in shapes
    assert not any(l.pp > 1 and l.data not in ("ddp", "fsdp") and (l.tp > 1 or l.cp > 1) for l in found)
    # tp beside data-parallel ranks of every strategy (zero1/2 on the tp ranks' local parts, parallel/tensor_data.py).
    assert {(2, 4, 1, data) for data in ("ddp", "zero1", "zero2", "fsdp")} <= shapes
    assert (2, 4, 1, "ddp") in shapes
    assert not any(l.tp > 4 for l in found)  # a tp group stays inside a host
    assert all(16 // l.dp % l.microbatches == 0 for l in found)
    rows = plan_layouts(SHAPE, cluster, global_batch=16)
    assert rows[0]["fits"] and rows[0]["step_s"] == min(r["step_s"] for r in rows if r["fits"])
    small = plan_layouts(SHAPE, Cluster(8, 4, 0.0006, 1.0, FAST, SLOW), global_batch=16)
    assert any(r["fits"] for r in small) and not all(r["fits"] for r in small)
    assert all(r["memory_gb"] <= 0.0006 for r in small if r["fits"])
    assert small[0]["ac"] == "full"  # only checkpointed layouts fit in 600 KB


def test_the_command_prints_a_recommendation_and_refuses_a_bad_shape_in_one_line(tmp_path):
    result = run_main("plan", "layouts", "--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "2048",
                      "--global-batch", "512", "--workers", "64,1024", "--out", str(tmp_path))
    assert result.returncode == 0 and "recommended:" in result.stdout and "1,024 workers" in result.stdout
    assert (tmp_path / "plan_layouts.md").exists() and (tmp_path / "plan_layouts.json").exists()
    result = run_main("plan", "layouts", "--layers", "24", "--hidden", "2050", "--heads", "16", "--seq", "2048",
                      "--global-batch", "512")
    assert result.returncode == 2 and "--hidden 2050 does not divide into --heads 16" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_unsplit_share_is_one_value_or_one_per_precision():
    assert parse_tp_unsplit("0.25") == {"fp32": 0.25, "bf16": 0.25}
    assert parse_tp_unsplit("fp32=0.237,bf16=0.595") == {"fp32": 0.237, "bf16": 0.595}
    assert parse_tp_unsplit("bf16=0.5") == {"fp32": 0.0, "bf16": 0.5}
    for bad in ("1.5", "fp16=0.2", "bf16=half"):
        with pytest.raises(PlanError, match=r"--tp-unsplit .*: a share of the compute between 0 and 1"):
            parse_tp_unsplit(bad)
    result = run_main("plan", "layouts", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32",
                      "--global-batch", "8", "--workers", "2", "--tp-unsplit", "fp32=2")
    assert result.returncode == 2 and "--tp-unsplit fp32=2: a share of the compute" in result.stderr


# --- context parallelism (issue 40) ------------------------------------------------------------------------------
def test_cp_layouts_are_enumerated_where_ringtrain_composes_them():
    cluster = Cluster(workers=8, per_host=4, memory_gb=1.0, tflops=1.0, intra=FAST, inter=SLOW)
    found = enumerate_layouts(SHAPE, cluster, global_batch=16, microbatches=4)
    shapes = {(l.dp, l.cp, l.tp, l.pp, l.data) for l in found}
    # Beside every data-parallel strategy the planner lists, even at dp 1 (the strategy runs over the cp ranks).
    assert {(4, 2, 1, 1, data) for data in ("ddp", "zero1", "zero2", "fsdp")} <= shapes
    assert {(1, 8, 1, 1, "ddp"), (1, 8, 1, 1, "fsdp")} <= shapes
    # Beside tp: every strategy over the dp x cp ranks, without sequence parallelism; beside pp: its strategies
    # (ddp, fsdp), with tp inside the stages too.
    assert {(2, 2, 2, 1, data) for data in ("ddp", "zero1", "zero2", "fsdp")} <= shapes
    assert (1, 4, 2, 1, "fsdp") in shapes and (1, 4, 2, 1, "ddp") in shapes
    assert not any(l.sp for l in found if l.cp > 1 and l.tp > 1)
    assert {(2, 2, 1, 2, "ddp"), (2, 2, 1, 2, "fsdp"), (1, 2, 1, 4, "ddp"), (1, 2, 2, 2, "ddp")} <= shapes
    assert all(l.data in ("ddp", "fsdp") and not l.sp for l in found if l.cp > 1 and l.pp > 1)
    assert all(32 % (2 * l.cp) == 0 for l in found) and not any(l.cp == 16 for l in found)  # 2 cp divides 32
    assert Layout(dp=2, tp=2, pp=1, data="fsdp", cp=2).name == "fsdp x2 + cp2 + tp2"
    assert Layout(dp=1, tp=1, pp=1, data="zero2", cp=4).name == "zero2 + cp4"
    # A sequence of 12 tokens: cp 2 (4 chunks of 3), not cp 4 (8 chunks).
    twelve = ModelShape(layers=4, hidden=64, heads=4, seq=12, vocab=100)
    cps = {l.cp for l in enumerate_layouts(twelve, cluster, global_batch=16, microbatches=4)}
    assert cps == {1, 2}


@pytest.mark.parametrize("data", ["ddp", "manual", "zero1", "zero2", "zero3", "fsdp", "diloco"])
def test_the_planners_cp_rule_is_the_configs(data):
    """runs_in_ringtrain against ringtrain/config/parallel.py's check_parallel itself, for every cp layout of 8
    workers, and every other one the planner could list (its strategies; at dp x cp = 1 it lists ddp only)."""
    from ringtrain.config import load_config_dict
    from ringtrain.config.parallel import check_parallel
    from ringtrain.errors import ConfigError

    checked = 0
    for tp in (1, 2, 4):
        for cp in (1, 2, 4):
            for pp in (1, 2, 4):
                if tp * cp * pp > 8:
                    continue
                dp = 8 // (tp * cp * pp)
                if cp == 1 and (data not in DATA_STRATEGIES or (dp == 1 and data != "ddp")):
                    continue
                config = load_config_dict({"model": {"name": "transformer", "n_layers": 4, "n_heads": 4,
                                                     "dropout": 0.0},
                                           "data": {"dataset": "text"}, "comm": {"strategy": data},
                                           "parallel": {"cp": cp, "tp": tp, "pp": pp}})
                try:
                    check_parallel(config, 8)
                    runs = True
                except ConfigError:
                    runs = False
                assert runs_in_ringtrain(tp, pp, dp, data, cp) == runs, (data, dp, cp, tp, pp)
                checked += cp > 1
    assert checked >= 6


def test_cp_divides_the_blocks_activations_not_the_logits():
    # Small logits against the blocks: cp 2 keeps well under 0.6 of one rank's activations (measured 0.54 of
    # what autograd saves on text_lm, bench/context_parallel_memory.py).
    blocks = ModelShape(layers=8, hidden=256, heads=4, seq=256, vocab=64)
    one = Layout(dp=1, tp=1, pp=1, microbatches=1)
    two = Layout(dp=1, tp=1, pp=1, microbatches=1, cp=2)
    assert activation_bytes(blocks, two, 4) < 0.6 * activation_bytes(blocks, one, 4)
    # By hand: every per-layer term at s / 2 tokens; the fp32 logits and log-softmax of all s tokens.
    s, b, h, e, v = 256, 4, 256, 2.0, 64
    sbh = s / 2 * b * h * e
    head = 2 * sbh + 2 * 4 * b * s * v
    assert activation_bytes(blocks, two, 4) == pytest.approx(8 * 17 * sbh + max(head, 2 * sbh + 5 * sbh))
    # Logits that outweigh the blocks: they stay whole on every cp rank.
    logits = ModelShape(layers=1, hidden=64, heads=4, seq=256, vocab=50000)
    whole = 2 * 4 * b * s * 50000
    for cp in (2, 4):
        split = activation_bytes(logits, Layout(dp=1, tp=1, pp=1, microbatches=1, cp=cp), 4)
        assert whole < split and split > 0.95 * activation_bytes(logits, one, 4)
    # The state: cp ranks hold whole replicas (ddp), and zero / fsdp shard over the dp x cp ranks.
    ddp = layout_memory(SHAPE, Layout(dp=2, tp=1, pp=1, data="ddp", cp=2), global_batch=8)
    fsdp = layout_memory(SHAPE, Layout(dp=2, tp=1, pp=1, data="fsdp", cp=2), global_batch=8)
    zero2 = layout_memory(SHAPE, Layout(dp=2, tp=1, pp=1, data="zero2", cp=2), global_batch=8)
    assert ddp["state_bytes"] == SHAPE.params * 16
    assert fsdp["state_bytes"] == SHAPE.params * 16 / 4 and zero2["state_bytes"] == SHAPE.params * (4 + 12 / 4)


def test_step_time_of_cp_layouts_by_hand():
    cluster = Cluster(workers=4, per_host=4, memory_gb=1.0, tflops=1.0, intra=FAST, inter=SLOW)
    tokens = 8 * 32
    compute_whole = tokens * SHAPE.flops_per_token / 1e12
    cp2 = Layout(dp=1, tp=1, pp=1, data="fsdp", microbatches=2, cp=2)  # micro-batches of 4 sequences
    got = layout_step(SHAPE, cluster, cp2, global_batch=8, act_bytes=2.0)
    assert got["compute_s"] == pytest.approx(compute_whole / 2)
    local = 4 * 16 * 64  # b x s / cp x h
    kv = FAST.alpha_s + 2 * local * 2.0 / FAST.beta_Bps
    dkv = FAST.alpha_s + 2 * local * 4.0 / FAST.beta_Bps
    gather = FAST.alpha_s + 1 / 2 * 4 * 32 * 100 * 2.0 / FAST.beta_Bps
    # Per micro-batch: 4 layers of one block forward, one block and two dK/dV hops backward; the logits gathered.
    assert got["cp_comm_s"] == pytest.approx(2 * (4 * (kv + kv + 2 * dkv) + gather))
    # The gradients are averaged over the cp ranks even at dp 1.
    assert got["dp_exposed_s"] > 0
    assert got["step_s"] == pytest.approx(got["compute_s"] + got["cp_comm_s"] + got["dp_exposed_s"])
    full = layout_step(SHAPE, cluster, Layout(dp=1, tp=1, pp=1, data="fsdp", ac="full", microbatches=2, cp=2),
                       global_batch=8, act_bytes=2.0)
    assert full["cp_comm_s"] == pytest.approx(got["cp_comm_s"] + 2 * 4 * kv)  # the recompute's ring forward
    # A ring of 4 over hosts of 2: between hosts.
    split = Cluster(workers=4, per_host=2, memory_gb=1.0, tflops=1.0, intra=FAST, inter=SLOW)
    cp4 = layout_step(SHAPE, split, Layout(dp=1, tp=1, pp=1, data="fsdp", microbatches=1, cp=4), global_batch=8)
    local = 8 * 8 * 64
    kv = SLOW.alpha_s + 2 * local * 2.0 / SLOW.beta_Bps
    dkv = SLOW.alpha_s + 2 * local * 4.0 / SLOW.beta_Bps
    gather = 3 * SLOW.alpha_s + 3 / 4 * 8 * 32 * 100 * 2.0 / SLOW.beta_Bps
    assert cp4["cp_comm_s"] == pytest.approx(4 * (3 * kv + 3 * kv + 4 * dkv) + gather)


def test_a_long_sequence_fits_only_split_over_cp_ranks_and_cp_is_recommended():
    long = ModelShape(layers=8, hidden=256, heads=2, seq=8192, vocab=64)
    rows = plan_layouts(long, Cluster(8, 8, 0.08, 1.0, FAST, SLOW), global_batch=8)
    fits = [r for r in rows if r["fits"]]
    assert fits and all(r["cp"] > 1 for r in fits) and any(r["cp"] == 1 for r in rows)
    assert rows[0]["fits"] and rows[0]["cp"] > 1 and "cp" in rows[0]["layout"]
    assert all("cp_comm_s" in r for r in rows) and rows[0]["cp_comm_s"] > 0
    assert "| cp comm |" in layouts_markdown(rows)
