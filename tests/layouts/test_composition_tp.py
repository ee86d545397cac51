"""The composition table (tests/layouts/composition.py says what it proves), its tensor-parallel part without a
pipeline: tp 2 and tp 2 with sequence parallelism, alone, beside cp 2 and beside each strategy over 2 data-parallel
ranks; and a DiLoCo checkpoint beside tp refusing to resume."""

from __future__ import annotations

import shutil

import pytest

from tests.distributed import DistributedTestError
from tests.layouts.composition import SGD, Cell, assert_trains_as_one_worker, cell_run, cells, root, runs_folder, \
    train

pytestmark = pytest.mark.ranks

composition_runs_folder = runs_folder()


@pytest.mark.parametrize("cell", cells("tp"), ids=lambda cell: cell.id)
def test_a_layout_trains_as_one_worker(cell: Cell):
    assert_trains_as_one_worker(cell)


def test_a_full_diloco_checkpoint_beside_a_split_model_refuses_to_resume_in_one_line():
    """Its outer state is every rank's parts, which a full checkpoint (rank 0's replica) does not hold: a resume
    refuses rather than step from a wrong anchor, and names the sharded checkpoints that hold them
    (parallel/diloco_state.SplitOuterState; tests/diloco/test_diloco_sharded.py resumes those)."""
    cell = Cell("diloco", 2, tp=2)
    run_dir = root() / "diloco-dp2-tp2-resumed"
    shutil.copytree(cell_run(cell).run_dir / "checkpoints", run_dir / "checkpoints")
    refusal = "full checkpoint of DiLoCo beside tensor or pipeline parallelism: a full checkpoint holds rank 0.s replica only"
    with pytest.raises(DistributedTestError, match=f"{refusal}.*checkpoint.sharded = true"):
        train("", 4, [*SGD, *cell.overrides(), "train.max_steps=7"], resume=True, run_dir=run_dir)
