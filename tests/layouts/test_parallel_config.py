"""``[parallel]`` (ringtrain/config/parallel.py): the degrees resolve against comm.strategy and the world size,
and every config that cannot run is one line naming the numbers, before any worker starts."""

from __future__ import annotations

import pytest

from ringtrain.config import load_config_dict, validate_for_world_sizes
from ringtrain.config.parallel import check_parallel, resolve_layout
from ringtrain.errors import ConfigError
from tests.conftest import run_main

pytestmark = pytest.mark.unit

LM = {"model": {"name": "transformer", "n_layers": 4}, "data": {"dataset": "text"}}


def degrees_of(config, world_size: int) -> dict[str, int]:
    """``check_parallel``'s layout as the degrees these tests name (cp left out while it is 1)."""
    degrees = check_parallel(config, world_size).degrees
    if degrees["cp"] == 1:
        del degrees["cp"]
    return degrees


def config(parallel: dict, strategy: str = "ddp", **sections):
    return load_config_dict({**LM, "comm": {"strategy": strategy}, "parallel": parallel, **sections})


@pytest.mark.parametrize("strategy, world_size, expected", [
    ("ddp", 4, {"dp_replicate": 4, "dp_shard": 1, "tp": 1, "pp": 1}),
    ("manual", 3, {"dp_replicate": 3, "dp_shard": 1, "tp": 1, "pp": 1}),
    ("diloco", 2, {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1}),
    ("zero3", 3, {"dp_replicate": 1, "dp_shard": 3, "tp": 1, "pp": 1}),
    ("fsdp", 2, {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}),
])
def test_the_existing_strategies_are_the_one_dimensional_meshes(strategy, world_size, expected):
    degrees = {**expected, "cp": 1}
    assert check_parallel(config({}, strategy), world_size).degrees == degrees
    # Spelled out, the same mesh; and -1 takes the rest.
    assert check_parallel(config(expected, strategy), world_size).degrees == degrees
    own = "dp_replicate" if expected["dp_replicate"] > 1 else "dp_shard"
    assert check_parallel(config({own: -1}, strategy), world_size).degrees == degrees


def test_the_product_must_be_the_world_size_in_one_line_naming_every_degree():
    with pytest.raises(ConfigError) as caught:
        validate_for_world_sizes(config({"dp_replicate": 4}), 2, 2)
    assert str(caught.value) == (
        "[parallel] dp_replicate (4) x dp_shard (1) x tp (1) x pp (1) = 4, but world_size is 2: the degrees must "
        "multiply to the number of workers; change one, or set one to -1 (the rest)")
    validate_for_world_sizes(config({"dp_replicate": 2}), 2, 2)  # the product that fits passes
    with pytest.raises(ConfigError, match=r"dp_replicate \(-1: the rest\) x dp_shard \(1\) x tp \(3\) x pp \(1\): 3 "
                                          r"does not divide world_size \(2\)"):
        check_parallel(config({"tp": 3}), 2)


def test_an_elastic_job_is_checked_at_every_size_and_says_so():
    validate_for_world_sizes(config({}), 1, 3)  # the strategy's dimension takes the rest at each size
    with pytest.raises(ConfigError, match=r"= 2, but world_size is 1.*runs with 1 to 2 workers; this is at 1"):
        validate_for_world_sizes(config({"dp_replicate": 2}), 1, 2)


def test_pipeline_parallelism_alone_and_with_replicas_passes_the_checks():
    assert degrees_of(config({"pp": 2}), 2) == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2}
    assert degrees_of(config({"dp_replicate": 2, "pp": -1}), 4) == {"dp_replicate": 2, "dp_shard": 1, "tp": 1,
                                                                        "pp": 2}
    assert degrees_of(config({"pp": 2, "stages_per_rank": 2, "pp_schedule": "zbv_zero_bubble"}), 2)["pp"] == 2
    assert degrees_of(config({"pp": 2}, checkpoint={"sharded": True, "async": True}), 2)["pp"] == 2
    assert degrees_of(config({"pp": 2}, "fsdp"), 4) == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2}


def test_tp_algorithm_without_tensor_parallelism_is_one_line():
    assert degrees_of(config({"tp": 2, "tp_algorithm": "shm"}, "fsdp"), 4)["tp"] == 2
    with pytest.raises(ConfigError, match=r"^\[parallel\] tp_algorithm = 'shm' with tp = 1: there are no"):
        check_parallel(config({"tp_algorithm": "shm"}), 2)


def test_sequence_parallel_needs_tensor_parallelism():
    assert degrees_of(config({"tp": 2, "sequence_parallel": True}, "fsdp"), 4)["tp"] == 2
    assert degrees_of(config({"tp": 2, "pp": 2, "sequence_parallel": True}), 4)["pp"] == 2  # inside the stages
    with pytest.raises(ConfigError, match=r"^\[parallel\] sequence_parallel = true with tp = 1: the sequence is split"):
        check_parallel(config({"sequence_parallel": True}), 2)
    # A model of your own with a plan: its plan's splits derive the stream's (parallel/sequence_split.py).
    own = load_config_dict({"model": {"factory": "tests.layouts.tp_code:Mixer"}, "data": {"dataset": "text"},
                            "comm": {"strategy": "fsdp"}, "parallel": {"tp": 2, "sequence_parallel": True}})
    check_parallel(own, 2)


def test_replicas_of_shard_groups_are_fsdp2s_hsdp_beside_tp_or_alone():
    assert degrees_of(config({"dp_replicate": 2}, "fsdp"), 8) == {"dp_replicate": 2, "dp_shard": 4, "tp": 1, "pp": 1}
    assert degrees_of(config({"dp_replicate": 2, "tp": 2}, "fsdp"), 8) == {"dp_replicate": 2, "dp_shard": 2,
                                                                              "tp": 2, "pp": 1}
    assert degrees_of(config({"tp": 2}, "ddp"), 4) == {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 1}
    assert degrees_of(config({"dp_replicate": 2, "pp": 2}, "fsdp"), 8) == {"dp_replicate": 2, "dp_shard": 2,
                                                                            "tp": 1, "pp": 2}
    # HSDP beside a pipeline whose stages tp splits (tests/layouts/test_composition_pp.py trains it).
    check_parallel(config({"dp_replicate": 2, "pp": 2, "tp": 2}, "fsdp"), 16)
    assert degrees_of(config({"dp_replicate": 2, "pp": 2, "tp": 2}, "fsdp"), 16) == {"dp_replicate": 2, "dp_shard": 2,
                                                                                      "tp": 2, "pp": 2}


def test_loss_parallel_needs_tp_a_users_own_output_layer_and_the_cross_entropy():
    with pytest.raises(ConfigError, match=r"^\[parallel\] loss_parallel = true with tp = 1: the output layer is split"):
        check_parallel(config({"loss_parallel": True}), 2)
    with pytest.raises(ConfigError, match=r"loss_parallel = true: the built-in 'transformer' model's output layer is "
                                          r"its token embedding \(tied\)"):
        check_parallel(config({"tp": 2, "loss_parallel": True}, "fsdp"), 2)
    assert degrees_of(config({"tp": 2, "pp": 2, "loss_parallel": True}), 4)["pp"] == 2  # the last stage's own copy
    with pytest.raises(ConfigError, match=r"loss_parallel = true with pp_schedule = 'zbv_zero_bubble': the V puts the "
                                          r"first and last stages on one rank, where the output layer is the token"):
        check_parallel(config({"tp": 2, "pp": 2, "loss_parallel": True, "pp_schedule": "zbv_zero_bubble",
                               "stages_per_rank": 2}), 4)
    with pytest.raises(ConfigError, match=r"loss_parallel = true with pp = 2 and dp_shard = 2: FSDP2 would shard"):
        check_parallel(config({"tp": 2, "pp": 2, "loss_parallel": True}, "fsdp"), 8)
    own = {"model": {"factory": "tests.layouts.tp_code:llama"}, "data": {"dataset": "text"}, "comm": {"strategy": "fsdp"},
           "parallel": {"tp": 2, "loss_parallel": True}}
    assert degrees_of(load_config_dict(own), 2)["tp"] == 2
    with pytest.raises(ConfigError, match=r"loss_parallel = true with task.loss = 'mse': torch's loss_parallel"):
        check_parallel(load_config_dict({**own, "task": {"loss": "mse"}}), 2)


def test_tensor_parallelism_takes_sharded_checkpoints():
    sharded = {"sharded": True, "async": True}
    assert degrees_of(config({"tp": 2}, "fsdp", checkpoint=sharded), 4) == {"dp_replicate": 1, "dp_shard": 2,
                                                                                 "tp": 2, "pp": 1}


@pytest.mark.parametrize("parallel, strategy, sections, world_size, words", [
    ({"pp": 2, "pp_schedule": "zbv_zero_bubble", "stages_per_rank": 2}, "fsdp", {}, 4,
     r"pp = 2 with comm.strategy = 'fsdp' and pp_schedule = 'zbv_zero_bubble': the V puts the first and last stages"),
    ({"pp": 2, "tp": 2}, "ddp", {"model": {"name": "mlp"}, "data": {"dataset": "digits"}}, 4,
     r"tp = 2 with pp = 2: tensor parallelism inside pipeline stages is built for the built-in transformer .* not 'mlp'"),
    ({"pp": 2, "tp": 3}, "ddp", {}, 6, r"tp = 3 with pp = 2: tp does not divide model.n_heads \(4\)"),
    ({"pp": 2, "tp": 2}, "zero1", {}, 8, r"pp = 2 with tp = 2 and comm.strategy = 'zero1': ringtrain's ZeRO wraps "
                                         r"each stage over the data-parallel ranks only"),
    ({"tp": 2}, "zero2", {"dist": {"heal": True}, "checkpoint": {"sharded": True}}, 4,
     r"tp = 2 with --heal and comm.strategy = 'zero2': a split model heals by whole replicas, each keeping the model part"),
    ({"pp": 2, "cp": 2}, "zero2", {}, 8, r"pp = 2 with cp = 2 and comm.strategy = 'zero2': ringtrain's ZeRO wraps"),
    ({"pp": 2}, "ddp", {"model": {"name": "mlp"}, "data": {"dataset": "digits"}}, 2,
     r"cuts the built-in transformer \(model.name = 'transformer'\) or a model of your own that is an nn.Sequential "
     r"\(model.factory, fit\) into stages, not model.name = 'mlp'"),
    ({"pp": 2}, "ddp", {"train": {"auto_micro_batch": True}}, 2, r"pp = 2 with train.auto_micro_batch"),
    ({"pp": 2}, "zero2", {"dist": {"heal": True}, "checkpoint": {"sharded": True}}, 4,
     r"pp = 2 with --heal and comm.strategy = 'zero2': a split model heals by whole replicas"),
    ({"pp": 2, "stages_per_rank": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 5}, "ddp", {}, 2,
     r"'interleaved_1f1b' runs micro-batches in rounds of pp \(2\), but pp_microbatches = 5; set it to a multiple"),
])
def test_what_pipeline_parallelism_cannot_run_with_is_one_line(parallel, strategy, sections, world_size, words):
    with pytest.raises(ConfigError, match=words):
        check_parallel(config(parallel, strategy, **sections), world_size)


def test_tensor_parallelism_alone_and_beside_fsdp_passes_the_checks():
    assert degrees_of(config({"tp": -1}), 2) == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1}
    assert degrees_of(config({"tp": 2}, "fsdp"), 4) == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}


@pytest.mark.parametrize("strategy, expected", [
    ("manual", {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 1}),
    ("zero1", {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}),
    ("zero3", {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}),
])
def test_tensor_parallelism_beside_ringtrains_own_data_parallelism_passes_the_checks(strategy, expected):
    assert degrees_of(config({"tp": 2}, strategy), 4) == expected
    assert degrees_of(config({"tp": 2, "cp": 2}, strategy), 8) == {**expected, "cp": 2}
    assert degrees_of(config({"tp": 2}, strategy, checkpoint={"sharded": True}), 4) == expected


@pytest.mark.parametrize("parallel, strategy, sections, world_size, words", [
    ({"tp": 2}, "diloco", {"diloco": {"inner": "host"}}, 4, r"diloco.inner = 'host' beside a split model"),
    ({"tp": 3}, "fsdp", {}, 3, r"tp = 3 does not divide model.n_heads \(4\): each rank computes whole heads"),
    ({"tp": 2}, "fsdp", {"model": {"name": "mlp"}, "data": {"dataset": "digits"}}, 2,
     r"tensor parallelism splits the built-in transformer \(model.name = 'transformer'\) or a model of your own with a plan.*not model.name = 'mlp'"),
    ({"tp": -1}, "ddp", {"train": {"auto_micro_batch": True}}, 2, r"tp = 2 with train.auto_micro_batch"),
])
def test_what_tensor_parallelism_cannot_run_with_is_one_line(parallel, strategy, sections, world_size, words):
    with pytest.raises(ConfigError, match=words):
        check_parallel(config(parallel, strategy, **sections), world_size)


def test_the_pipeline_layout_is_checked_first():
    with pytest.raises(ConfigError, match=r"pp_microbatches \(3\) is fewer than the pipeline's stages \(pp \(2\) x "
                                          r"stages_per_rank \(2\) = 4\).*set pp_microbatches = 4 or more"):
        check_parallel(config({"pp": 2, "stages_per_rank": 2, "pp_schedule": "interleaved_1f1b",
                               "pp_microbatches": 3}), 2)
    with pytest.raises(ConfigError, match=r"model.n_layers \(4\) does not divide into pp \(3\) x stages_per_rank "
                                          r"\(1\) = 3 stages"):
        check_parallel(config({"pp": 3}), 3)


@pytest.mark.parametrize("parallel, strategy, words", [
    ({"dp_shard": 2}, "ddp", r"dp_shard = 2 shards the model's state, but comm.strategy = 'ddp' keeps a whole copy"),
    ({"dp_shard": -1}, "manual", r"dp_shard = -1 shards"),
    ({"dp_replicate": 2}, "zero3", r"dp_replicate = 2 with comm.strategy = 'zero3': .*\(HSDP\) are built on FSDP2 "
                                   r"only; set comm.strategy = 'fsdp'"),
    ({"tp": -1, "pp": -1}, "ddp", r"tp and pp are each -1"),
    ({"dp_shard": 0}, "fsdp", r"dp_shard = 0: a degree is a number of ranks"),
    ({"pp_schedule": "zbv_zero_bubble"}, "ddp", r"exactly 2 stages per rank.*stages_per_rank = 1"),
    ({"pp_schedule": "interleaved_zero_bubble"}, "ddp", r"interleaves several stages per rank"),
    ({"pp_schedule": "gpipe", "stages_per_rank": 2}, "ddp", r"'gpipe' runs one stage per rank"),
])
def test_configs_that_cannot_mean_anything_fail_at_load(parallel, strategy, words):
    with pytest.raises(ConfigError, match=words):
        config(parallel, strategy)


def test_the_launcher_refuses_before_any_worker_with_exit_2_and_one_line(tmp_path):
    result = run_main("train", "configs/debug_lm.toml", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                      "--set", "parallel.dp_replicate=3")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "dp_replicate (3) x dp_shard (1) x tp (1) x pp (1) = 3, but world_size is 2" in lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_every_strategy_is_registered_with_its_data_parallel_dimension():
    from typing import get_args

    from ringtrain.config import CommConfig
    from ringtrain.strategies import strategy_specs

    strategies = set(get_args(CommConfig.model_fields["strategy"].annotation))
    specs = {spec.name: spec for spec in strategy_specs()}
    assert strategies == set(specs)
    assert {name for name, spec in specs.items() if spec.owner == "dp_replicate"} == {"ddp", "manual", "diloco"}
    assert {name for name, spec in specs.items() if spec.owner == "dp_shard"} == {"zero1", "zero2", "zero3", "fsdp"}


def test_resolve_layout_on_its_own():
    layout = resolve_layout(config({"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": -1}).parallel, "ddp", 6)
    assert layout.degrees == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 3}
    assert (layout.world_size, layout.dp, layout.model_parallel) == (6, 2, 3)


@pytest.mark.parametrize("parallel, strategy, sections, world, says", [
    ({"cp": 2}, "diloco", {"diloco": {"inner": "worker"}}, 4, "a DiLoCo replica is then its model-parallel group"),
    ({"cp": 2}, "diloco", {"diloco": {"inner": "host"}}, 4, "leave diloco.inner unset ('auto')"),
    ({"cp": 2}, "ddp", {"model": {"name": "transformer", "n_layers": 4, "dropout": 0.1}}, 2, "set model.dropout = 0"),
    ({"cp": 2}, "ddp", {"model": {"name": "mlp"}, "data": {"dataset": "digits"}}, 2, "not model.name = 'mlp'"),
])
def test_context_parallelism_refuses_what_it_does_not_run_with_in_one_line(parallel, strategy, sections, world, says):
    with pytest.raises(ConfigError) as caught:
        check_parallel(config(parallel, strategy, **sections), world)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_context_parallel_ranks_are_a_model_dimension_of_the_layout():
    layout = check_parallel(config({"cp": 2}, "zero2"), 4)
    assert layout.degrees == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1, "pp": 1}
    assert (layout.dp, layout.model_parallel, layout.mesh_shape()) == (2, 2, (("dp", "cp"), (2, 2)))
    layout = check_parallel(config({"cp": 2, "tp": 2}, "fsdp"), 8)
    assert layout.mesh_shape() == (("dp", "cp", "tp"), (2, 2, 2))
    layout = check_parallel(config({"cp": 2, "dp_replicate": 2}, "fsdp"), 8)
    assert layout.mesh_shape() == (("dp_replicate", "dp_shard", "cp"), (2, 2, 2))
    layout = check_parallel(config({"cp": 2, "pp": 2, "tp": 2}, "ddp"), 8)  # cp and tp inside pipeline stages
    assert layout.mesh_shape() == (("dp", "pp", "cp", "tp"), (1, 2, 2, 2))
    layout = check_parallel(config({"cp": 2, "dp_replicate": 2, "tp": 2}, "fsdp"), 8)  # HSDP beside tp and cp
    assert layout.mesh_shape() == (("dp_replicate", "dp_shard", "cp", "tp"), (2, 1, 2, 2))
