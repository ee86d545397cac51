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

import pytest

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


@pytest.mark.job
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


# --- the step breakdown, through the Session and through fit ---------------------------------------------------
SAMPLES, STEPS_PER_EPOCH = 512, 32  # 16 samples a step
BREAKDOWN = {"train": {"global_batch_size": 16, "local_batch_size": 8, "seed": 0},
             "checkpoint": {"every_steps": 16}, "monitor": {"progress": False, "log_every_steps": 4}}


def breakdown_data():
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 32, generator=generator),
                         torch.randint(0, 4, (SAMPLES,), generator=generator))


def breakdown_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _session_attempt(rank: int, world_size: int, port: int, run_dir: str, epochs: int, resume: bool) -> int:
    import torch
    from torch import nn

    import ringtrain
    from tests.fit.test_session_loop import as_launched_worker

    with as_launched_worker(rank, world_size, port):
        session = ringtrain.Session(BREAKDOWN, run_dir=run_dir, resume=resume)
        model = breakdown_model()
        model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                                 data=breakdown_data())
        steps = 0
        for _ in session.epochs(epochs):
            for inputs, targets in loader:
                optimizer.zero_grad()
                session.backward(nn.functional.cross_entropy(model(inputs), targets))
                optimizer.step()
                steps += 1
        session.close()
    return steps


def _fit_attempt(rank: int, world_size: int, port: int, run_dir: str, epochs: int, resume: bool) -> int:
    import ringtrain
    from tests.fit.test_session_loop import as_launched_worker

    with as_launched_worker(rank, world_size, port):
        result = ringtrain.fit(breakdown_model, breakdown_data(), loss="cross_entropy", run_dir=run_dir,
                               resume=resume, config={**BREAKDOWN, "train": {**BREAKDOWN["train"], "epochs": epochs}})
    return result["steps"]


def assert_the_report_breaks_the_step_down(run_dir):
    from ringtrain.monitor.report import PHASES, load_run, write_report

    run = load_run(run_dir)
    assert len(run.attempts) == 2, [a.describe() for a in run.attempts]  # the start and one --resume
    phases, step_s = run.phase_means(), run.mean("step_time_s")
    shares = {phase: round(seconds / step_s, 3) for phase, seconds in phases.items() if seconds}
    print(f"{run_dir.name}: step {step_s * 1e3:.2f} ms; shares {shares}")
    assert phases["forward_backward"] > 0 and phases["data"] > 0 and phases["optimizer"] > 0, shares
    assert abs(sum(phases[p] for p in PHASES) / step_s - 1) <= 0.10, shares
    assert run.mean("time/comm_s") <= step_s, (run.mean("time/comm_s"), step_s)  # per step, not per interval
    # samples/s of the last attempt's records against summary.json's, which times the attempt to its end.
    last = run.attempts[-1]
    recorded = sum(r["samples_per_s"] * r["step_time_s"] for r in last.train) / sum(r["step_time_s"] for r in last.train)
    print(f"{run_dir.name}: the last attempt's records {recorded:.1f} samples/s, summary.json {run.summary['samples_per_s']}")
    assert abs(recorded / run.summary["samples_per_s"] - 1) <= 0.15, (recorded, run.summary["samples_per_s"])
    text = write_report([run], run_dir / "report").read_text()
    assert " 0 samples/s" not in text and run.totals.samples_per_s > 0, text
    assert f"{run.totals.final_step} steps in 2 attempts" in text, text


@pytest.mark.ranks
def test_the_report_of_a_session_run_and_of_a_fit_run_breaks_the_step_down(tmp_path):
    from tests.fit.test_session_loop import in_two

    for name, attempt in (("session", _session_attempt), ("fit", _fit_attempt)):
        run_dir = tmp_path / name
        assert in_two(attempt, str(run_dir), 1, False) == [STEPS_PER_EPOCH] * 2
        assert in_two(attempt, str(run_dir), 3, True) == [3 * STEPS_PER_EPOCH - (STEPS_PER_EPOCH if name == "session" else 0)] * 2
        finished = (run_dir / "summary.json").read_bytes()
        in_two(attempt, str(run_dir), 3, True)  # a resume of the finished run: nothing trained or written
        assert (run_dir / "summary.json").read_bytes() == finished
        assert_the_report_breaks_the_step_down(run_dir)


# --- every layout in a Session: tensor parallelism with the user's plan --------------------------------------
TP_PLAN = {"up": "colwise", "down": "rowwise"}


class Block(__import__("torch").nn.Module):
    """The user's own model: a colwise layer and its rowwise partner."""

    def __init__(self):
        import torch
        from torch import nn

        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.down(self.up(x).relu())


def _layout_run(rank: int, world_size: int, port: int, run_dir: str, sections: dict, plan: dict | None) -> dict:
    import torch
    from torch import nn

    import ringtrain
    from tests.fit.test_session_loop import as_launched_worker

    with as_launched_worker(rank, world_size, port) as stderr:
        config = {**BREAKDOWN, "train": {**BREAKDOWN["train"], "max_steps": 6, "grad_clip_norm": 5.0}, **sections}
        session = ringtrain.Session(config, run_dir=run_dir)
        loader = session.loader(breakdown_data())  # before setup: dealt once the layout is known
        model = Block()
        model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.2), tp_plan=plan)
        losses = []
        for _ in session.epochs(1):
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(inputs), targets)
                session.backward(loss)
                optimizer.step()
                losses.append(session.sum(loss.item()) / session.sum(1))
        weights = {k: v.clone() for k, v in session.model_state_dict().items()}
        try:
            unwrapped = sorted(session.unwrap(model).state_dict())
        except SystemExit:  # the one line is the last of stderr
            unwrapped = stderr.getvalue().strip().splitlines()[-1]
        summary = session.finish()
        session.close()
    return {"losses": losses, "weights": weights, "summary": summary, "stderr": stderr.getvalue(),
            "unwrapped": unwrapped}


@pytest.mark.ranks
def test_a_session_with_tensor_parallelism_trains_as_one_worker(tmp_path):
    import torch

    from tests.distributed import run_distributed
    from tests.fit.test_session_loop import free_port, in_two

    one = run_distributed(_layout_run, 1, free_port(), str(tmp_path / "one"), {}, None, timeout_s=240)[0]
    split = in_two(_layout_run, str(tmp_path / "tp"), {"parallel": {"tp": 2}}, TP_PLAN)
    assert len(one["losses"]) == 12  # 6 steps of 2 micro-batches (16 samples, 8 at a time)
    for rank in split:
        assert rank["summary"]["steps"] == 6, rank["stderr"]
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
        assert rank["weights"].keys() == one["weights"].keys()
        for name, whole in one["weights"].items():
            torch.testing.assert_close(rank["weights"][name], whole, rtol=1e-5, atol=1e-6, msg=name)
        # unwrap: the user's module at one worker; under tp its state_dict would hold parts, so one line.
        assert "session.unwrap(model) under parallel.tp > 1" in rank["unwrapped"], rank["unwrapped"]
        assert "session.model_state_dict()" in rank["unwrapped"]
    assert one["unwrapped"] == sorted(one["weights"])


# --- every layout in a Session: pipeline parallelism with the user's split ----------------------------------
def stack():
    """The user's own model: an nn.Sequential of five layers, cut by the user's split (below)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def two_stages(model, stages):
    """The user's split: the first three layers, then the rest."""
    assert stages == 2
    return [model[:3], model[3:]]


def _pipeline_run(rank: int, world_size: int, port: int, run_dir: str, sections: dict, resume: bool = False,
                  crash_after: int | None = None) -> dict:
    """A Session loop over ``stack()`` with SGD (so a wrong loss scale shows in the weights): under pp through
    ``session.forward_backward`` (one call a step, the loss back on every rank), else the plain loop, whose step
    loss is its micro-batches' mean (each the same size). ``crash_after``: leave the loop after that step (no
    finish, no save: a resume goes on from the last checkpoint)."""
    import torch
    from torch import nn

    import ringtrain
    from tests.fit.test_session_loop import as_launched_worker

    with as_launched_worker(rank, world_size, port) as stderr:
        config = {**BREAKDOWN, "train": {**BREAKDOWN["train"], "max_steps": 6},
                  "checkpoint": {"every_steps": 2}, "data": {"ledger": True}, **sections}
        session = ringtrain.Session(config, run_dir=run_dir, resume=resume)
        pipelined = config.get("parallel", {}).get("pp", 1) > 1
        model = stack()
        model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.2),
                                                 data=breakdown_data(), pp_split=two_stages if pipelined else None)
        losses, micro = [], []
        for _ in session.epochs(1):
            for inputs, targets in loader:
                optimizer.zero_grad()
                if pipelined:
                    loss = session.forward_backward((inputs, targets), nn.functional.cross_entropy)
                    losses.append(session.sum(loss.item()) / session.sum(1))  # the mean over the replicas' shares
                else:
                    loss = nn.functional.cross_entropy(model(inputs), targets)
                    session.backward(loss)
                    micro.append(loss.item())
                    if len(micro) == 2:
                        losses.append(sum(micro) / 2)
                        micro = []
                optimizer.step()
                if session.state.step == crash_after:
                    break
            if session.state.step == crash_after:
                break
        weights = {k: v.clone() for k, v in session.model_state_dict().items()}
        if crash_after is not None:
            session.close()
            return {"losses": losses, "weights": weights, "stderr": stderr.getvalue()}
        # Evaluation: under pp session.forward gives the outputs on every rank of the pipeline; the code after it
        # is the plain loop's.
        loss_sum = correct = count = 0.0
        with torch.no_grad():
            for inputs, targets in session.eval_loader(breakdown_data(), 48):
                outputs = session.forward(inputs) if pipelined else model(inputs)
                loss_sum += nn.functional.cross_entropy(outputs, targets, reduction="sum").item()
                correct += (outputs.argmax(1) == targets).sum().item()
                count += len(targets)
        evaluation = (session.sum(loss_sum) / session.sum(count), session.sum(correct), session.sum(count))
        summary = session.finish()
        session.close()
    return {"losses": losses, "weights": weights, "summary": summary, "stderr": stderr.getvalue(),
            "evaluation": evaluation}


@pytest.mark.ranks
def test_a_session_with_pipeline_parallelism_trains_as_one_worker(tmp_path):
    """pp = 2 (the user's split) at 2 ranks, and pp = 2 x dp = 2 at 4, match one worker: the step losses every
    rank gets back from forward_backward, the weights after 6 SGD steps, and an evaluation through
    session.forward on every rank."""
    import torch

    from tests.distributed import run_distributed
    from tests.fit.test_session_loop import free_port

    one = run_distributed(_pipeline_run, 1, free_port(), str(tmp_path / "one"), {}, timeout_s=240)[0]
    assert len(one["losses"]) == 6, one["stderr"]
    for ranks in (2, 4):
        split = run_distributed(_pipeline_run, ranks, free_port(), str(tmp_path / f"pp{ranks}"),
                                {"parallel": {"pp": 2}}, timeout_s=300)
        for rank in split:
            assert rank["summary"]["steps"] == 6, rank["stderr"]
            torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
            assert rank["weights"].keys() == one["weights"].keys()
            for name, whole in one["weights"].items():
                torch.testing.assert_close(rank["weights"][name], whole, rtol=1e-5, atol=1e-6, msg=name)
            # session.forward: every rank's evaluation, every sample once, equals one worker's.
            (loss, correct, count), (loss_1, correct_1, count_1) = rank["evaluation"], one["evaluation"]
            assert (correct, count) == (correct_1, count_1) == (correct_1, SAMPLES), (rank["evaluation"], one["evaluation"])
            assert abs(loss - loss_1) <= 1e-5 * loss_1, (loss, loss_1)
        if ranks == 2:
            uninterrupted = split
    # A pp run stopped after step 3 (its checkpoint: step 2) and resumed ends on the uninterrupted run's weights,
    # bit for bit; the ledger holds every sample of the 6 steps once; the report breaks its steps down.
    run_dir = tmp_path / "resumed"
    run_distributed(_pipeline_run, 2, free_port(), str(run_dir), {"parallel": {"pp": 2}}, False, 3, timeout_s=300)
    resumed = run_distributed(_pipeline_run, 2, free_port(), str(run_dir), {"parallel": {"pp": 2}}, True,
                              timeout_s=300)
    for rank, whole in zip(resumed, uninterrupted):
        assert "resumed from step_00000002" in resumed[0]["stderr"], resumed[0]["stderr"]
        assert rank["summary"]["steps"] == 6 and len(rank["losses"]) == 4, rank["stderr"]
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(whole["losses"][2:]), rtol=0, atol=0)
        for name, value in whole["weights"].items():
            assert torch.equal(rank["weights"][name], value), name
    from ringtrain.data.ledger import check_ledger
    from ringtrain.monitor.report import PHASES, load_run

    reports = check_ledger(run_dir / "ledger.jsonl")  # a step redone after the resume is recorded once
    assert [(r.used, r.duplicates) for r in reports] == [(6 * 16, 0)], reports
    run = load_run(run_dir)
    phases, step_s = run.phase_means(), run.mean("step_time_s")
    assert phases["forward_backward"] > 0 and phases["pipeline_wait"] >= 0 and phases["optimizer"] > 0, phases
    assert abs(sum(phases[p] for p in PHASES) / step_s - 1) <= 0.10, (phases, step_s)


def _pipeline_misuse(rank: int, world_size: int, port: int, run_dir: str, sections: dict, launched_as: int) -> dict:
    """What a loop does wrong around a pipeline, each one line and exit 2: pp with tp in a Session (refused before
    any group starts), ``session.unwrap`` and ``session.backward`` under pp, ``forward_backward`` and ``forward``
    under pp = 1."""
    import torch

    import ringtrain
    from tests.fit.test_session_loop import as_launched_worker

    exits = []
    with as_launched_worker(rank, launched_as, port) as stderr:
        try:
            session = ringtrain.Session({**BREAKDOWN, **sections}, run_dir=run_dir)
        except SystemExit as exit_:
            return {"exits": [exit_.code], "stderr": stderr.getvalue()}
        pipelined = sections.get("parallel", {}).get("pp", 1) > 1
        model = stack()
        model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.2),
                                                 data=breakdown_data())  # an nn.Sequential: cut by its children
        if pipelined:
            try:
                session.unwrap(model)
            except SystemExit as exit_:
                exits.append(exit_.code)
        for inputs, targets in loader:
            try:
                if pipelined:
                    session.backward(torch.zeros((), requires_grad=True))
                else:
                    session.forward_backward((inputs, targets), torch.nn.functional.cross_entropy)
            except SystemExit as exit_:
                exits.append(exit_.code)
            break
        if not pipelined:
            try:
                session.forward(torch.zeros(2, 32))
            except SystemExit as exit_:
                exits.append(exit_.code)
        session.close()
    return {"exits": exits, "stderr": stderr.getvalue()}


@pytest.mark.ranks
def test_a_pipeline_used_wrong_in_a_session_is_one_line_each(tmp_path):
    from tests.distributed import run_distributed
    from tests.fit.test_session_loop import free_port, in_two

    def lines(result):
        return [line for line in result["stderr"].splitlines() if line.startswith("ringtrain: error:")]

    refused = run_distributed(_pipeline_misuse, 1, free_port(), str(tmp_path / "pptp"), {"parallel": {"pp": 2, "tp": 2}},
                              4, timeout_s=120)[0]
    assert refused["exits"] == [2] and len(lines(refused)) == 1, refused["stderr"]
    assert "tp = 2 with pp = 2" in lines(refused)[0] and "set tp = 1 or pp = 1" in lines(refused)[0]
    for rank in in_two(_pipeline_misuse, str(tmp_path / "pp"), {"parallel": {"pp": 2}}, 2):
        assert rank["exits"] == [2, 2] and len(lines(rank)) == 2, rank["stderr"]
        assert "session.unwrap(model) under parallel.pp > 1" in lines(rank)[0]
        assert "session.model_state_dict()" in lines(rank)[0]
        assert "session.backward(loss) under parallel.pp > 1" in lines(rank)[1]
        assert "session.forward_backward((inputs, targets), loss_fn)" in lines(rank)[1]
    plain = run_distributed(_pipeline_misuse, 1, free_port(), str(tmp_path / "plain"), {}, 1, timeout_s=120)[0]
    assert plain["exits"] == [2, 2] and len(lines(plain)) == 2, plain["stderr"]
    assert "runs a pipeline's schedule (parallel.pp > 1), and pp is 1 here" in lines(plain)[0]
    assert "session.forward(inputs) runs a pipeline's stages for evaluation" in lines(plain)[1]
    assert "outputs = model(inputs)" in lines(plain)[1]
