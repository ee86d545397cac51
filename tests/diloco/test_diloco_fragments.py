"""How streaming DiLoCo cuts a model into fragments (ringtrain/parallel/diloco.py split_fragments): contiguous,
in model order, each cut at the tensor nearest an equal share, never empty; too many fragments is one line."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.parallel.diloco import split_fragments

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("numels,fragments,starts", [
    ([10, 10, 10, 10], 2, [0, 2]),
    ([10, 10, 10, 10], 4, [0, 1, 2, 3]),
    ([48, 8, 24, 3], 2, [0, 1]),          # 48 | 35: the cut nearest 41.5
    ([1, 1, 100, 1, 1], 2, [0, 2]),       # 2 | 102 and 102 | 2 tie: the earlier cut
    ([100, 1, 1, 1], 3, [0, 1, 2]),       # no fragment left empty while tensors remain
    ([5], 1, [0]),
])
def test_fragments_are_contiguous_and_near_equal(numels, fragments, starts):
    assert split_fragments(numels, fragments) == starts


def test_more_fragments_than_tensors_is_one_line_naming_the_most_there_can_be():
    with pytest.raises(ConfigError, match=r"diloco.fragments = 7 but the model has 6 trainable tensors; set "
                                          r"diloco.fragments to at most 6"):
        split_fragments([1] * 6, 7)
