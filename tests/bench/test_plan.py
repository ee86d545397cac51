"""The cost model of `ringtrain plan` (bench/plan.py): its formulas, the fit, the step simulation, the CLI."""

from __future__ import annotations

import json

import pytest

from ringtrain.bench.plan import (
    Link, PlanError, Topology, Workload, all_reduce_time, bucket_sizes, extrapolate, fit_link, predict_step,
    ring_time, validate,
)
from tests.conftest import run_cli

GLOO = Link(50e-6, 1e9, "torch")
FAST = Link(1e-6, 100e9, "shm")


@pytest.mark.unit
def test_a_ring_moves_2_n_minus_1_over_n_of_the_message():
    assert ring_time(1e9, 1, GLOO) == 0
    assert ring_time(1e9, 2, Link(0, 1e9)) == pytest.approx(1.0)       # 2(n-1)/n = 1
    assert ring_time(1e9, 4, Link(0, 1e9)) == pytest.approx(1.5)
    assert ring_time(0.0, 4, GLOO) == 0
    assert ring_time(1.0, 4, Link(1e-3, 1e12)) == pytest.approx(6e-3, rel=1e-6)  # 2(n-1) latency terms


@pytest.mark.unit
def test_hierarchical_cuts_cross_host_traffic_by_the_ratio_the_issue_states():
    """2 hosts x 2 workers, a fast inside link: flat carries 2(n-1)/n = 1.5 of the message over the slow
    link, hierarchical 2(h-1)/h = 1: the ratio tends to 1.5 for large messages."""
    topo, slow = Topology(2, 2), Link(0.0, 125e6)
    flat = all_reduce_time(64e6, topo, Link(0, 1e15), slow, "flat")
    hier = all_reduce_time(64e6, topo, Link(0, 1e15), slow, "hierarchical")
    assert flat / hier == pytest.approx(1.5, rel=1e-3)
    with pytest.raises(PlanError, match="flat"):
        all_reduce_time(1e6, topo, FAST, slow, "tree")


@pytest.mark.unit
def test_the_fit_recovers_alpha_and_beta():
    truth = Link(120e-6, 0.8e9)
    points = [(b, ring_time(b, 2, truth)) for b in (256e3, 1e6, 4e6, 16e6)]
    got = fit_link(points, 2, "torch")
    assert got.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6) and got.beta_Bps == pytest.approx(truth.beta_Bps, rel=1e-6)
    with pytest.raises(PlanError, match="quiet"):
        fit_link([(1e6, 2e-3), (16e6, 1e-3)], 2)


@pytest.mark.unit
def test_buckets_overlap_the_backward_and_only_the_tail_is_exposed():
    assert bucket_sizes(60e6, 25e6) == [1 << 20, 25e6, 25e6, 60e6 - (1 << 20) - 50e6]
    work = Workload(60e6, forward_s=0.1, backward_s=0.2, optimizer_s=0.01)
    alone = predict_step(work, Topology(1, 1), FAST, FAST, "flat", 25e6)
    assert alone.exposed_s == 0 and alone.efficiency == 1 and alone.step_s == pytest.approx(0.31)
    fast = predict_step(work, Topology(1, 2), FAST, FAST, "flat", 25e6)
    last = bucket_sizes(60e6, 25e6)[-1]
    # Communication much faster than compute: only the last bucket, ready at the backward's end, shows.
    assert fast.exposed_s == pytest.approx(ring_time(last, 2, FAST), rel=1e-6)
    slow = predict_step(work, Topology(1, 2), GLOO, GLOO, "flat", 25e6)
    assert slow.comm_s == pytest.approx(sum(ring_time(b, 2, GLOO) for b in bucket_sizes(60e6, 25e6)))
    assert slow.exposed_s > fast.exposed_s and slow.efficiency < fast.efficiency < 1
    halved = predict_step(work, Topology(1, 2), GLOO, GLOO, "flat", 25e6, compression=0.5)
    assert halved.exposed_s < slow.exposed_s


@pytest.mark.unit
def test_validate_predicts_each_case_from_its_own_compute():
    rows = [
        {"runner": "bare", "world_size": 2, "median_step_s": 0.3, "breakdown_s": {}},
        {"runner": "ringtrain", "label": "ddp", "algorithm": "torch", "world_size": 2, "median_step_s": 0.4,
         "breakdown_s": {"forward_backward": 0.3, "optimizer": 0.01, "comm_exposed": 0.05}},
    ]
    [case] = validate(rows, 46.8e6, {"torch": GLOO}, 25e6)
    work = Workload(46.8e6, 0.1, 0.2, 0.01)
    want = predict_step(work, Topology(1, 2), GLOO, GLOO, "flat", 25e6)
    assert case["predicted_step_ms"] == pytest.approx(want.step_s * 1e3)
    assert case["step_error"] == pytest.approx(want.step_s / 0.4 - 1)


@pytest.mark.unit
def test_the_extrapolated_table_falls_with_scale_and_rises_with_link_speed():
    rows = extrapolate()
    for model in ("resnet50", "gpt2-small"):
        for link in ("25gbit", "400gbit"):
            flat = [r["flat"] for r in rows if r["model"] == model and r["link"] == link]
            assert flat == sorted(flat, reverse=True), (model, link, flat)
        slow = {r["workers"]: r for r in rows if r["model"] == model and r["link"] == "25gbit"}
        fast = {r["workers"]: r for r in rows if r["model"] == model and r["link"] == "400gbit"}
        assert all(fast[n]["flat"] >= slow[n]["flat"] and slow[n]["hierarchical"] >= slow[n]["flat"] for n in slow)


@pytest.mark.job
def test_plan_commands(tmp_path):
    done = run_cli("plan", "table", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "| gpt2-small | 400gbit | 1,024 | 128 |" in (tmp_path / "plan_table.md").read_text()
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"links": {"torch": {"alpha_s": 5e-5, "beta_Bps": 1e9, "name": "torch"}}}))
    bench = tmp_path / "train_bench.json"
    bench.write_text(json.dumps([{"runner": "ringtrain", "label": "ddp", "algorithm": "torch", "world_size": 2,
                                  "median_step_s": 0.4, "breakdown_s": {"forward_backward": 0.3}}]))
    done = run_cli("plan", "validate", str(bench), "--params", "11.69M", "--links", str(links))
    assert done.returncode == 0 and "| ddp | 2 | torch | 400.0 ms |" in done.stdout, done.stdout + done.stderr
    bad = run_cli("plan", "validate", str(bench), "--params", "eleven", "--links", str(links))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("ringtrain: error: --params 'eleven'")


@pytest.mark.unit
def test_validate_collectives_maps_algorithms_to_flat_and_hierarchical():
    from ringtrain.bench.plan import validate_collectives

    topo, shm, link = Topology(2, 2), Link(5e-6, 2.5e9), Link(1e-4, 118e6)
    rows = [{"algorithm": "torch", "world_size": 4, "bytes": 64 << 20, "p50_s": 0.85},
            {"algorithm": "hierarchical", "world_size": 4, "bytes": 64 << 20, "p50_s": 0.61},
            {"algorithm": "torch", "world_size": 2, "bytes": 64 << 20, "p50_s": 0.5}]  # another world size: left out
    flat, hier = validate_collectives(rows, topo, shm, link)
    assert flat["model"] == "flat" and hier["model"] == "hierarchical"
    assert flat["predicted_ms"] == pytest.approx(ring_time(64 << 20, 4, link) * 1e3)
    assert hier["predicted_ms"] == pytest.approx((ring_time(64 << 20, 2, shm) + ring_time(64 << 20, 2, link)) * 1e3)
    assert hier["error"] == pytest.approx(hier["predicted_ms"] / 610 - 1)


# --- DiLoCo ------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_diloco_exposes_f_over_h_of_each_exchange_and_a_delay_hides_compute_behind_it():
    from ringtrain.bench.plan import VALUE_BYTES, gather_time, predict_diloco_step

    slow = Link(100e-6, 12.5e6, "100 Mbit/s")
    work = Workload(4e6, 0.01, 0.02)  # 1M parameters, 30 ms of compute
    topo = Topology(2, 1)
    exchange = 2 * 100e-6 + 4e6 / 12.5e6  # ring(4 MB, 2 ranks): 2 alpha + B / beta = 0.3202 s
    h50 = predict_diloco_step(work, topo, FAST, slow, "hierarchical", sync_every=50)
    assert h50.step_s == pytest.approx(0.03 + exchange / 50)
    assert h50.efficiency == pytest.approx(0.03 / h50.step_s)
    # A delay of 2 steps hides 60 ms of the exchange; 10 fragments cut it ten times (plus an alpha each).
    late = predict_diloco_step(work, topo, FAST, slow, "hierarchical", sync_every=50, fragments=10, delay=2)
    piece = 2 * 100e-6 + 0.4e6 / 12.5e6
    assert late.step_s == pytest.approx(0.03 + 10 / 50 * max(0.0, piece - 2 * 0.03))
    assert late.exposed_s == 0.0  # 32 ms of exchange under 60 ms of compute
    # int4 packets are all-gathered: (n - 1) alpha + (n - 1) packet / beta.
    int4 = predict_diloco_step(work, topo, FAST, slow, "hierarchical", sync_every=10, dtype="int4")
    packet = 1e6 * VALUE_BYTES["int4"]
    assert int4.step_s == pytest.approx(0.03 + gather_time(packet, 2, slow) / 10)
    assert gather_time(packet, 2, slow) == pytest.approx(100e-6 + packet / 12.5e6)
    with pytest.raises(PlanError, match="divisible"):
        predict_diloco_step(work, topo, FAST, slow, "hierarchical", sync_every=10, fragments=3)


@pytest.mark.job
def test_plan_diloco_prints_ddp_then_each_case_and_refuses_bad_input_in_one_line():
    done = run_cli("plan", "diloco", "--params", "1M", "--compute-ms", "30", "--hosts", "2", "--inter-mbps", "12.5",
                   "--sync-every", "1,50", "--fragments", "1,5", "--dtype", "fp32,int8")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ddp") or line.startswith("| diloco")]
    # ddp, then H=1 (F=1 only: 1 is not divisible by 5) x 2 dtypes, then H=50 x F in (1, 5) x 2 dtypes.
    assert len(rows) == 1 + 2 + 4 and rows[0].endswith("| 1.00x |")
    h1 = next(r for r in rows if r.startswith("| diloco H=1 F=1 delay=0 fp32"))
    h50 = next(r for r in rows if r.startswith("| diloco H=50 F=1 delay=0 fp32"))
    speed = [float(r.rsplit("|", 2)[-2].strip().rstrip("x")) for r in (h1, h50)]
    assert speed[0] < 1.0 < speed[1]  # H = 1 exchanges after the step, DDP during the backward
    for args, words in ((["--sync-every", "ten"], "--sync-every 'ten'"), (["--dtype", "fp8"], "--dtype 'fp8'"),
                        (["--sync-every", "3", "--fragments", "2"], "no DiLoCo case fits")):
        bad = run_cli("plan", "diloco", "--params", "1M", "--compute-ms", "30", "--inter-mbps", "12.5", *args)
        last = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(last) == 1 and words in last[0], bad.stderr
