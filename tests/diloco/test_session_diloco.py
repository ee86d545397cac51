"""A Session loop (your own loop) under comm.strategy = 'diloco' ends on one model on every rank (issue 24): at
the planned last step, whose outer step the session asks for as ``ringtrain train`` does, and when the loop
leaves early (``finish`` syncs what the workers learned since their last outer step). Before, both ended in
ReplicasDiverged: 15 steps with H = 4 left the ranks three inner steps apart. Its checkpoints hold the outer state
(before, a Session's held none: its resume started the outer momentum afresh)."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import run_clis

pytestmark = pytest.mark.job

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import torch.distributed
    from torch import nn
    from torch.utils.data import TensorDataset
    import ringtrain

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(240, 6, generator=g), torch.randint(0, 3, (240,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = ringtrain.Session({"train": {"global_batch_size": 16, "local_batch_size": 8},
                                 "comm": {"strategy": "diloco"}, "diloco": {"sync_every": 4},
                                 "checkpoint": {"every_steps": 5, "keep_last": 10}, "run_dir": sys.argv[1]})
    val = session.eval_loader(data, 64)  # before setup(), as the examples do
    model, optimizer, loader = session.setup(model, optimizer, data=data)
    stop_at = int(sys.argv[2])
    for epoch in session.epochs(1):
        for x, y in loader:
            optimizer.zero_grad()
            session.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            if session.state.step == 6:  # two inner steps after the outer step at 4: the workers are apart
                own = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                for _ in val:  # while the batches are handed out the model is the global one
                    scored = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                mine = [own.double().sum().item(), scored.double().sum().item()]
                every = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(every, mine)
                after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                session.print("workers apart:", len({o for o, _ in every}) > 1,
                              "scored one model:", len({s for _, s in every}) == 1,
                              "own weights back:", torch.equal(after, own))
            if session.state.step == stop_at:
                break
        if session.state.step == stop_at:
            break
    session.finish()
''')


def test_a_diloco_session_ends_on_one_model_at_its_planned_end_and_when_its_loop_leaves_early(tmp_path):
    """240 samples, 16 a step: 15 planned steps. H = 4: outer steps after 4, 8, 12 and the last (15); a loop
    that leaves after step 6 has one at 4 and one from finish(). Both jobs run at once."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    cases = {"planned-end": (15, 4), "left-early": (6, 2)}
    done = run_clis(*(["run", str(script), "--nproc", "2", "--", str(tmp_path / name), str(stop_at)]
                      for name, (stop_at, _) in cases.items()), timeout=300)
    for (name, (stop_at, outer_steps)), result in zip(cases.items(), done):
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == stop_at and len(set(summary["param_sha256"])) == 1, (name, summary)
        assert summary["outer_steps"] == outer_steps, (name, summary["outer_steps"])
        # Evaluation between outer steps scores the global model on every rank, then gives back each its own.
        assert "workers apart: True scored one model: True own weights back: True" in result.stdout, result.stdout
    # Its checkpoints hold DiLoCo's outer state, as ringtrain train's do (a resume goes on from the outer momentum).
    from ringtrain.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(tmp_path / "planned-end" / "checkpoints", is_writer=False)
    outer = manager.load(manager.path_for(5))["outer"]
    assert outer["outer_steps"] == 1 and outer["optimizer"]["state"], outer.keys()
