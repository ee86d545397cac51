"""Issue 24's [diloco] section: its defaults, and every refusal as one line before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.cli import main
from ringtrain.config import Config, DiLoCoConfig, load_config, load_config_dict

pytestmark = pytest.mark.unit

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "debug_mlp.toml"
DILOCO = ["comm.strategy='diloco'"]

# (--set overrides, words the one-line error must contain)
REFUSED = [
    ([*DILOCO, "diloco.sync_every=0"], ["diloco.sync_every", "greater than 0"]),
    ([*DILOCO, "diloco.sync_every=10", "diloco.fragments=3"],
     ["diloco.sync_every (10) must be divisible by diloco.fragments (3)"]),
    ([*DILOCO, "diloco.sync_every=10", "diloco.fragments=2", "diloco.delay=5"],
     ["diloco.delay (5) must be below diloco.sync_every / fragments (10 / 2 = 5)"]),
    ([*DILOCO, "diloco.dtype='fp8'"], ["diloco.dtype", "'fp8'", "'int4'"]),
    ([*DILOCO, "diloco.delay=50"], ["diloco.delay (50) must be below diloco.sync_every / fragments (50 / 1 = 50)"]),
    ([*DILOCO, "diloco.outer_momentum=1.0"], ["diloco.outer_momentum", "less than 1"]),
    ([*DILOCO, "diloco.outer_lr=0"], ["diloco.outer_lr", "greater than 0"]),
    (["diloco.sync_every=5"], ["[diloco] is set but comm.strategy = 'ddp'", "comm.strategy = 'diloco'"]),
    ([*DILOCO, "diloco.inner='hosts'"], ["diloco.inner", "'auto'", "'worker'", "'host'"]),
    # Sharded checkpoints run (issue 40); under --heal every strategy that heals without a reload writes full ones.
    ([*DILOCO, "dist.heal=true", "checkpoint.sharded=true"],
     ["dist.heal = true writes full checkpoints", "checkpoint.sharded = false"]),
    ([*DILOCO, "comm.algorithm='powersgd'"], ["algorithm 'powersgd'", "strategy 'diloco'"]),
]


@pytest.mark.parametrize("overrides,expected", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_a_diloco_config_that_does_not_fit_is_one_line_exit_2_before_any_worker(tmp_path, capsys, overrides, expected):
    run_dir = tmp_path / "run"
    argv = ["train", str(DEFAULT), "--nproc", "2", "--run-dir", str(run_dir)]
    for override in overrides:
        argv += ["--set", override]
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ringtrain: error: "), lines
    for words in expected:
        assert words in lines[0], f"{words!r} missing from: {lines[0]}"
    assert not run_dir.exists(), "the launcher must not have started (it creates the run directory)"


@pytest.mark.parametrize("flag", ["checkpoint.sharded=true", "checkpoint.async=true"])
def test_diloco_takes_sharded_and_background_checkpoints(flag):
    config = load_config(DEFAULT, [*DILOCO, flag])
    assert config.comm.strategy == "diloco" and (config.checkpoint.sharded or config.checkpoint.async_)


def test_the_defaults_are_the_papers_outer_optimizer_with_h_50():
    d = DiLoCoConfig()
    assert (d.sync_every, d.outer_lr, d.outer_momentum, d.nesterov, d.fragments, d.delay, d.dtype, d.inner) == (
        50, 0.7, 0.9, True, 1, 0, "fp32", "auto")


def test_the_limits_of_streaming_hold_at_their_edges():
    """H divisible by F and tau < H/F (torchft's constraints), and nothing stricter: the edges themselves pass."""
    with pytest.raises(ValueError, match="divisible"):
        DiLoCoConfig(sync_every=9, fragments=2)
    with pytest.raises(ValueError, match=r"must be below .* = 3\)"):
        DiLoCoConfig(sync_every=9, fragments=3, delay=3)
    edge = DiLoCoConfig(sync_every=9, fragments=3, delay=2, dtype="int4")
    assert (edge.fragments, edge.delay, edge.dtype) == (3, 2, "int4")
    assert DiLoCoConfig(sync_every=4, fragments=4).fragments == 4  # a fragment syncing after every step


def test_diloco_is_recorded_only_by_a_diloco_run_and_leaves_other_digests_alone():
    plain = Config()
    diloco = load_config_dict({"comm": {"strategy": "diloco"}, "diloco": {"sync_every": 5}})
    assert "[diloco]" not in plain.to_toml()
    assert "[diloco]" in diloco.to_toml() and "sync_every = 5" in diloco.to_toml()
    assert load_config_dict({"comm": {"strategy": "diloco"}}).digest() != diloco.digest()
    # A ddp config's digest does not depend on the (unused) diloco defaults: checkpoints of older runs still match.
    import hashlib
    import json
    values = plain.model_dump()
    values.pop("diloco")
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":")).encode()
    assert plain.digest() == hashlib.sha256(canonical).hexdigest()
