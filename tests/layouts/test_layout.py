"""The layout object (ringtrain/layout.py): degrees resolved once at a world size, one line for degrees that do
not multiply to it, the mesh's shape for each kind of layout, and no torch import until a mesh is built."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringtrain.errors import ConfigError
from ringtrain.layout import Layout


@pytest.mark.unit
@pytest.mark.parametrize("given, owner, world, expected", [
    ({}, "dp_replicate", 4, dict(dp_replicate=4)),
    ({}, "dp_shard", 4, dict(dp_shard=4)),
    ({"tp": 2}, "dp_shard", 8, dict(dp_shard=4, tp=2)),
    ({"pp": -1, "dp_replicate": 2}, "dp_replicate", 6, dict(dp_replicate=2, pp=3)),
    ({"cp": 2, "tp": 2}, "dp_shard", 8, dict(dp_shard=2, cp=2, tp=2)),
    ({"dp_replicate": 2}, "dp_shard", 4, dict(dp_replicate=2, dp_shard=2)),
])
def test_unset_degrees_follow_the_owner_and_minus_one_takes_the_rest(given, owner, world, expected):
    layout = Layout.resolve(given, owner, world)
    assert layout == Layout(**expected, owner=owner)
    assert layout.world_size == world
    assert layout.dp * layout.model_parallel == world


@pytest.mark.unit
def test_degrees_that_do_not_multiply_to_the_world_are_one_line_naming_them():
    with pytest.raises(ConfigError) as caught:
        Layout.resolve({"tp": 3}, "dp_shard", 4)
    assert "3 does not divide world_size (4)" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        Layout.resolve({"tp": 2, "pp": 2, "dp_shard": 2}, "dp_shard", 4)
    assert str(caught.value).startswith("[parallel] dp_replicate (1) x dp_shard (2) x tp (2) x pp (2) = 8, but "
                                        "world_size is 4")
    with pytest.raises(ConfigError, match="a resolved degree is a number of ranks"):
        Layout(tp=0)


@pytest.mark.unit
@pytest.mark.parametrize("layout, shape, needs_mesh", [
    (Layout(dp_replicate=4), (("dp",), (4,)), False),
    (Layout(dp_shard=4, owner="dp_shard"), (("dp",), (4,)), False),
    (Layout(dp_replicate=2, dp_shard=2, owner="dp_shard"), (("dp_replicate", "dp_shard"), (2, 2)), True),
    (Layout(dp_shard=2, tp=2, owner="dp_shard"), (("dp", "tp"), (2, 2)), True),
    (Layout(dp_replicate=2, tp=2), (("dp_replicate", "dp_shard", "tp"), (2, 1, 2)), True),
    (Layout(dp_replicate=2, pp=2, tp=2), (("dp", "pp", "tp"), (2, 2, 2)), True),
    (Layout(pp=2, cp=2), (("dp", "pp", "cp"), (1, 2, 2)), True),
])
def test_the_mesh_keeps_model_parallel_ranks_innermost(layout, shape, needs_mesh):
    assert layout.mesh_shape() == shape
    assert layout.needs_mesh is needs_mesh


@pytest.mark.unit
def test_describe_names_the_degrees_above_one():
    assert Layout(dp_shard=2, tp=2, owner="dp_shard").describe() == "dp_shard 2 x tp 2"
    assert Layout().describe() == "1 worker"


@pytest.mark.job
def test_resolving_a_layout_imports_no_torch():
    code = ("import sys; from ringtrain.layout import Layout; from ringtrain.strategies import strategy_spec; "
            "Layout.resolve({'tp': 2}, strategy_spec('fsdp').owner, 4); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
