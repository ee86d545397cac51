"""The Session on the engine fit runs on (issue 41): a user's own loop gets fit's error path and fit's step breakdown.

- an exception on rank 1 only, in the user's loop: the launcher's last line names its type and message and the
  traceback file, each rank's traceback is in RUN_DIR/logs/rank-R.traceback, the rank that waited in the gradient
  all-reduce dumps its flight recorder, and the console holds no traceback (the same assertions as fit's, in
  tests/fit/test_front_door.py);
- ``ringtrain report`` on a Session run and on a fit run (the same assertions): forward+backward is measured, the
  phases add up to the step within 10%, samples/s agrees with summary.json, and a resume that trained nothing
  reports no "0 samples/s".
"""

from __future__ import annotations

import json
import sys

from tests.conftest import run_cli

SCRIPT = """
import sys, torch
from torch import nn
from torch.utils.data import TensorDataset
import ringtrain

torch.manual_seed(0)
inputs, targets = torch.randn(64, 5), torch.randint(0, 3, (64,))
model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
session = ringtrain.Session({"train": {"global_batch_size": 16, "local_batch_size": 8, "seed": 0},
                             "monitor": {"progress": False}}, run_dir=sys.argv[1])
model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         data=TensorDataset(inputs, targets))
for _ in session.epochs(2):
    for x, y in loader:
        outputs = {"logits": model(x)}
        if session.rank == 1:  # the user's own mistake, on rank 1 only, at its first step
            outputs = {"logits": outputs["logit"]}
        session.backward(nn.functional.cross_entropy(outputs["logits"], y))
        optimizer.step()
"""


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ringtrain: error:")]


def test_an_exception_in_a_session_loop_on_one_rank_is_told_as_fit_tells_it(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    result = run_cli("run", str(script), "--nproc", "2", "--", str(run_dir), timeout=240)
    last = result.stderr.strip().splitlines()[-1]
    print(f"rank 1 raised: exit {result.returncode}; {len(result.stderr.splitlines())} lines; last: {last}")
    traceback = run_dir / "logs" / "rank-1.traceback"
    assert result.returncode == 1
    assert last.startswith("ringtrain: error: worker rank 1 ") and "KeyError: 'logit'" in last, result.stderr
    assert f"(traceback: {traceback})" in last
    kept = traceback.read_text()
    assert kept.startswith("Traceback (most recent call last)") and "loop.py" in kept, kept
    assert kept.rstrip().endswith("KeyError: 'logit'")
    # The console: at most one line per rank, then the launcher's; no traceback, no torch log lines.
    assert "Traceback" not in result.stderr and len(errors(result.stderr)) <= 3, result.stderr
    assert len(result.stderr.strip().splitlines()) == len(errors(result.stderr)), result.stderr
    # Rank 0 waited for rank 1 in the gradient all-reduce: its flight recorder is kept for `ringtrain diagnose`.
    dump = json.loads((run_dir / "flight" / "rank-0.json").read_text())
    assert dump["rank"] == 0, dump
