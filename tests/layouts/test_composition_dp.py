"""The composition table (tests/layouts/composition.py says what it proves), its data- and context-parallel part:
each strategy over 2 data-parallel ranks (hsdp: 4), alone and beside cp 2, and cp 2 alone; and the check that the
table is every layout the config accepts. Tensor parallelism without a pipeline: test_composition_tp.py; pipelines:
test_composition_pp.py (the table is split so that pytest-xdist spreads it over its processes)."""

from __future__ import annotations

import pytest

from tests.layouts.composition import CELLS, PARTS, REFUSED, Cell, assert_trains_as_one_worker, candidates, cells, \
    refusal, runs_folder

composition_runs_folder = runs_folder()


@pytest.mark.ranks
@pytest.mark.parametrize("cell", cells("dp"), ids=lambda cell: cell.id)
def test_a_layout_trains_as_one_worker(cell: Cell):
    assert_trains_as_one_worker(cell)


@pytest.mark.unit
def test_the_table_is_every_layout_the_config_accepts():
    """The table follows the config: a refused layout that gets built (or an accepted one that gets refused) fails
    here, naming the cell to add to the table (or to the refused list)."""
    problems = []
    for cell in candidates():
        refused = refusal(cell)
        if cell.id in REFUSED and refused is None:
            problems.append(f"{cell.id} is accepted now: add it to the table (take it out of REFUSED)")
        elif cell.id not in REFUSED and refused is not None:
            problems.append(f"{cell.id} is refused: {refused}")
        elif refused is not None and REFUSED[cell.id] not in refused:
            problems.append(f"{cell.id} is refused for another reason than {REFUSED[cell.id]!r}: {refused}")
    assert not problems, "\n".join(problems)
    assert len(CELLS) == 67 and len(REFUSED) == 0
    # Every cell is trained by one of the table's files, once.
    assert sorted(cell.id for part in PARTS for cell in cells(part)) == sorted(cell.id for cell in CELLS)
