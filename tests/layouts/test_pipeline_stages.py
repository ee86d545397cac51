"""The pipeline's pure pieces, one process, no collectives (``parallel/pipeline_stages.py``,
``parallel/pipeline_schedule.py``): which stages a rank holds, how a model is cut into stages (the stages'
forwards in order are the whole model's), and the padding that gives a schedule's micro-batches one shape.
The pieces that need ranks (the shape agreement, the loss normaliser) are tests/layouts/test_pipeline_pieces.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain.models.transformer import TransformerLM
from ringtrain.parallel.pipeline_schedule import SCHEDULES, pad_rows
from ringtrain.parallel.pipeline_stages import SequentialStage, TransformerStage, sequential_cut, stage_indices

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("schedule, pp, per_rank", [("1f1b", 4, 1), ("interleaved_1f1b", 2, 2),
                                                    ("interleaved_1f1b", 3, 3), ("zbv_zero_bubble", 3, 2)])
def test_every_stage_is_on_one_pipeline_rank(schedule, pp, per_rank):
    held = [stage_indices(rank, pp, per_rank, schedule) for rank in range(pp)]
    assert sorted(s for stages in held for s in stages) == list(range(pp * per_rank))
    assert all(len(stages) == per_rank for stages in held)
    if schedule == "zbv_zero_bubble":  # a V: rank r holds r and 2pp - 1 - r, so rank 0 holds the first and the last
        assert held[0] == [0, 2 * pp - 1] and held[-1] == [pp - 1, pp]
    else:  # a loop: stage s on rank s mod pp
        assert all(s % pp == rank for rank, stages in enumerate(held) for s in stages)


@pytest.mark.parametrize("children, stages", [(7, 3), (4, 4), (9, 2), (5, 1)])
def test_a_sequential_is_cut_into_near_equal_contiguous_runs(children, stages):
    bounds = sequential_cut(children, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == children
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), bounds  # contiguous
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes  # the first ones take more


def test_a_sequentials_stages_keep_its_names_and_compute_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    stages = [SequentialStage(model, index, 2) for index in range(2)]
    assert [list(dict(s.named_parameters())) for s in stages] == [["0.weight", "0.bias", "2.weight", "2.bias"],
                                                                   ["4.weight", "4.bias"]]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, True)]
    x = torch.randn(5, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("stages", [2, 4])
def test_the_transformers_stages_hold_its_layers_in_order_and_compute_it(stages):
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=32, d_model=16, n_heads=2, n_layers=4, seq_len=8, dropout=0.0).eval()
    parts = [TransformerStage(model, index, stages) for index in range(stages)]
    per = 4 // stages
    for index, part in enumerate(parts):
        assert list(part.blocks) == [str(i) for i in range(index * per, (index + 1) * per)]
        # Every submodule keeps the whole model's name (checkpoints are the unsplit model's).
        names = set(dict(part.named_parameters()))
        assert names <= set(dict(model.named_parameters(remove_duplicate=False))), names
        assert ("token_embedding.weight" in names) == (index == 0)
        assert ("norm.weight" in names) == (index == stages - 1)
    held = [n for part in parts for n in dict(part.named_parameters(remove_duplicate=False)) if n != "head.weight"]
    assert sorted(held) == sorted(n for n in dict(model.named_parameters()))  # every parameter in one stage
    tokens = torch.randint(0, 32, (3, 8))
    x = tokens
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, model(tokens), rtol=0, atol=0)


def test_micro_batches_are_padded_to_one_shape_with_zero_rows():
    x = torch.arange(6.0).reshape(3, 2)
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 2) and torch.equal(padded[:3], x) and not padded[3:].any()
    assert pad_rows(x, 3) is x
    assert pad_rows(torch.ones(0, 4, dtype=torch.int64), 2).tolist() == [[0] * 4] * 2  # an empty micro-batch


def test_every_schedule_name_is_a_torch_schedule():
    import torch.distributed.pipelining as pipelining

    assert all(hasattr(pipelining, cls) for cls in SCHEDULES.values())
