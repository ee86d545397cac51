"""What a user's own loop needs from ringtrain.Session, and what fit's result says (issue 41), in-process on the
harness (tests/distributed.py): each rank leaves the harness's group and becomes a worker as torchrun starts it
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the Session and fit make their own group, as under a launcher.

- ``session.rank`` / ``session.is_main``; ``session.unwrap(model)``: the user's own module (keys without DDP's
  ``module.``, loading into the plain model), refused in one line under FSDP, whose ``model_state_dict()`` gives
  the whole weights under the user's keys;
- ``session.register(name, value)`` with plain values: kept in each checkpoint as JSON text, given back on resume,
  so the README's save-best pattern ends, after a crash and a resume, on the uninterrupted run's best model and
  values (the checkpoint of an epoch's last step is taken after the loop's end-of-epoch code);
- a resumed Session run that finished: "already finished", its summary.json left as it is, no step run;
- DiLoCo whose sync_every is beyond the run: one warning line (Session and ``ringtrain train``'s trainer);
- ``FitResult.rank`` / ``.is_main``, and no ``.lock`` left in a finished run directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from tests.distributed import run_distributed

pytestmark = pytest.mark.ranks

SAMPLES, FEATURES, CLASSES = 24, 5, 3
EPOCHS, STEPS_PER_EPOCH = 3, 3  # 8 samples a step
CONFIG = {"train": {"global_batch_size": 8, "local_batch_size": 4, "seed": 0},
          "checkpoint": {"every_steps": STEPS_PER_EPOCH}, "monitor": {"progress": False}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def as_launched_worker(rank: int, world_size: int, port: int):
    """This harness rank as a worker torchrun started: the harness's group left, torchrun's variables set, so
    ``Session`` and ``fit`` make the group themselves; afterwards a lone group again, for the harness to end.
    Yields what the rank printed on stderr."""
    dist.destroy_process_group()
    names = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size,
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    os.environ.update({name: str(value) for name, value in names.items()})
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            yield stderr
    finally:
        for name in names:
            os.environ.pop(name, None)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=generator),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=generator))


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def in_two(fn, *args) -> list:
    return run_distributed(fn, 2, free_port(), *args, timeout_s=240)


# --- where the worker is; the user's module --------------------------------------------------------------
def _unwrap(rank: int, world_size: int, port: int, run_dir: str, strategy: str) -> dict:
    import ringtrain

    with as_launched_worker(rank, world_size, port) as stderr:
        session = ringtrain.Session({**CONFIG, "comm": {"strategy": strategy}}, run_dir=run_dir)
        model = plain_model()
        wrapped, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen = {"rank": session.rank, "is_main": session.is_main, "wrapped": sorted(wrapped.state_dict()),
                "whole": {k: v.clone() for k, v in session.model_state_dict().items()}}
        try:
            own = session.unwrap(wrapped)
            seen["own_is_model"] = own is model
            plain_model().load_state_dict(own.state_dict())  # strict: the user's keys, the user's shapes
            seen["own"] = sorted(own.state_dict())
        except SystemExit as exit_:
            seen["exit"] = exit_.code
        session.close()
    return {**seen, "stderr": stderr.getvalue()}


def test_a_session_says_its_rank_and_unwraps_the_users_module(tmp_path):
    ranks = in_two(_unwrap, str(tmp_path / "ddp"), "ddp")
    assert [(r["rank"], r["is_main"]) for r in ranks] == [(0, True), (1, False)]
    keys = sorted(plain_model().state_dict())
    for seen in ranks:
        assert seen["wrapped"] == [f"module.{k}" for k in keys]  # what setup returns: DDP's keys
        assert seen["own_is_model"] and seen["own"] == keys, seen
        assert sorted(seen["whole"]) == keys
    assert not (tmp_path / "ddp" / ".lock").exists()  # the session released the run directory


def test_unwrap_under_fsdp_is_one_line_and_model_state_dict_gives_the_whole_weights(tmp_path):
    ranks = in_two(_unwrap, str(tmp_path / "fsdp"), "fsdp")
    expected = plain_model().state_dict()  # rank 0's weights, made every rank's by setup
    for seen in ranks:
        assert seen["exit"] == 2, seen
        errors = [line for line in seen["stderr"].splitlines() if "error" in line]
        assert len(errors) == 1 and "session.unwrap(model) under comm.strategy 'fsdp'" in errors[0], seen["stderr"]
        assert "session.model_state_dict()" in errors[0]
        assert seen["whole"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(seen["whole"][name], value), name


# --- plain values across resume: the save-best pattern -----------------------------------------------------
def _save_best(rank: int, world_size: int, port: int, run_dir: str, best_path: str, resume: bool,
               crash_at_step: int | None) -> dict:
    """The README's save-best pattern on a Session; ``crash_at_step``: leave the loop after that step (a crash:
    no finish, no save)."""
    import ringtrain

    with as_launched_worker(rank, world_size, port) as stderr:
        session = ringtrain.Session(CONFIG, run_dir=run_dir, resume=resume)
        model = plain_model()
        val = data()
        model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), data=data())
        session.register("best_accuracy", 0.0)
        session.register("history", [])
        crashed = False
        for _ in session.epochs(EPOCHS):
            for inputs, targets in loader:
                optimizer.zero_grad()
                session.backward(nn.functional.cross_entropy(model(inputs), targets))
                optimizer.step()
                if session.state.step == crash_at_step:
                    crashed = True
                    break
            if crashed:
                break
            with torch.no_grad():
                correct = sum((model(x).argmax(1) == y).sum().item() for x, y in session.eval_loader(val, 8))
            accuracy = session.sum(correct) / len(val)
            session.values["history"].append(accuracy)
            if accuracy > session.values["best_accuracy"]:
                session.values["best_accuracy"] = accuracy
                if session.is_main:
                    torch.save(session.unwrap(model).state_dict(), best_path)
        values = json.loads(json.dumps(session.values))
        session.close()
    return {"values": values, "stderr": stderr.getvalue()}


def test_registered_plain_values_come_back_on_resume_and_the_best_model_is_the_uninterrupted_runs(tmp_path):
    from ringtrain.checkpoint.manager import load_checkpoint_file

    whole = in_two(_save_best, str(tmp_path / "whole"), str(tmp_path / "whole.pt"), False, None)
    # Crashed in epoch 2 (step 5): the newest checkpoint is step 3's, the end of epoch 1, taken after its evaluation.
    in_two(_save_best, str(tmp_path / "cut"), str(tmp_path / "cut.pt"), False, 5)
    saved = load_checkpoint_file(tmp_path / "cut" / "checkpoints" / "step_00000003.pt")
    assert isinstance(saved["history"]["json"], str) and isinstance(saved["best_accuracy"]["json"], str)
    assert len(json.loads(saved["history"]["json"])) == 1, saved["history"]  # epoch 1's accuracy, as data
    resumed = in_two(_save_best, str(tmp_path / "cut"), str(tmp_path / "cut.pt"), True, None)
    assert "resumed from step_00000003.pt" in resumed[0]["stderr"], resumed[0]["stderr"]
    print(f"accuracy by epoch {whole[0]['values']['history']}; best {whole[0]['values']['best_accuracy']}")
    assert len(whole[0]["values"]["history"]) == EPOCHS
    for mine, one in zip(resumed, whole):
        assert mine["values"] == one["values"]
    best, whole_best = torch.load(tmp_path / "cut.pt", weights_only=True), torch.load(tmp_path / "whole.pt",
                                                                                         weights_only=True)
    assert best.keys() == whole_best.keys() and all(torch.equal(best[k], whole_best[k]) for k in best)


def _register_wrong(rank: int, world_size: int, port: int, run_dir: str) -> list[str]:
    import ringtrain

    lines = []
    with as_launched_worker(rank, world_size, port) as stderr:
        session = ringtrain.Session(CONFIG, run_dir=run_dir)
        for name, value in (("best", torch.tensor(0.5)), ("pair", (1, 2)), ("model", 0), ("keys", {1: "a"})):
            try:
                session.register(name, value)
            except SystemExit:
                lines.append(stderr.getvalue().strip().splitlines()[-1])
        session.close()
    return lines


def test_register_refuses_what_is_not_plain_data_in_one_line(tmp_path):
    """At one worker: each refusal is the rank's own line."""
    [lines] = run_distributed(_register_wrong, 1, free_port(), str(tmp_path / "run"), timeout_s=120)
    assert len(lines) == 4, lines
    assert "'best', ...): best is a Tensor" in lines[0] and "pass .item() or .tolist()" in lines[0]
    assert "pair is a tuple" in lines[1] and "pass a list" in lines[1]
    assert "the session's checkpoint holds its own 'model'" in lines[2]
    assert "has the key 1, not a string" in lines[3]


# --- a finished run resumed --------------------------------------------------------------------------------
def _train(rank: int, world_size: int, port: int, run_dir: str, resume: bool, overrides: dict) -> dict:
    import ringtrain

    with as_launched_worker(rank, world_size, port) as stderr:
        session = ringtrain.Session({**CONFIG, **overrides}, run_dir=run_dir, resume=resume)
        model = plain_model()
        model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), data=data())
        steps = 0
        for _ in session.epochs(EPOCHS):
            for inputs, targets in loader:
                optimizer.zero_grad()
                session.backward(nn.functional.cross_entropy(model(inputs), targets))
                optimizer.step()
                steps += 1
        summary = session.finish()
        session.close()
    return {"steps": steps, "summary": summary, "stderr": stderr.getvalue()}


def test_resuming_a_finished_session_run_says_already_finished_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    first = in_two(_train, str(run_dir), False, {})
    assert [r["steps"] for r in first] == [EPOCHS * STEPS_PER_EPOCH] * 2
    written = {p.name: p.read_bytes() for p in (run_dir / "summary.json", run_dir / "metrics.jsonl")}
    again = in_two(_train, str(run_dir), True, {})
    assert [r["steps"] for r in again] == [0, 0]
    lines = again[0]["stderr"].splitlines()
    assert [line for line in lines if "already finished" in line] == [
        f"ringtrain: run directory {run_dir} already finished at step {EPOCHS * STEPS_PER_EPOCH} (summary.json); "
        "nothing to do"], lines
    assert "already finished" not in again[1]["stderr"]  # one line, from rank 0
    assert {p.name: p.read_bytes() for p in (run_dir / "summary.json", run_dir / "metrics.jsonl")} == written
    assert all(r["summary"] == json.loads(written["summary.json"]) for r in again)
    assert not (run_dir / ".lock").exists()


# --- DiLoCo with no outer step in the run ------------------------------------------------------------------
def test_a_diloco_session_whose_sync_every_is_beyond_the_run_warns_in_one_line(tmp_path):
    diloco = {"comm": {"strategy": "diloco"}, "diloco": {"sync_every": 1000}}
    ranks = in_two(_train, str(tmp_path / "run"), False, diloco)
    warnings = [line for line in ranks[0]["stderr"].splitlines() if "warning" in line]
    assert warnings == [f"ringtrain: warning: diloco.sync_every (1000) is more than this run's "
                        f"{EPOCHS * STEPS_PER_EPOCH} steps: no outer step runs until the last step (which ends the run "
                        f"on one model), so evaluations before it score the initial model; set diloco.sync_every to "
                        f"{EPOCHS * STEPS_PER_EPOCH} or fewer"], ranks[0]["stderr"]
    assert ranks[0]["summary"]["outer_steps"] == 1, ranks[0]["summary"]  # the last step's, as the line says


def _build_diloco_trainer(rank: int, world_size: int, run_dir: str, sync_every: int) -> str:
    from tests.trainers import build_test_trainer

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        trainer = build_test_trainer(rank, world_size, "configs/debug_lm.toml",
                                     ["comm.strategy='diloco'", f"diloco.sync_every={sync_every}",
                                      "train.max_steps=20"], run_dir)
        trainer.end_threads()
    return stderr.getvalue()


@pytest.mark.parametrize("sync_every, warned", [(50, True), (20, False)])
def test_the_trainer_warns_once_when_no_outer_step_comes_before_the_last(tmp_path, sync_every, warned):
    """``ringtrain train`` and ``fit`` build this trainer: the run's 20 steps are known once its data is."""
    out = run_distributed(_build_diloco_trainer, 2, str(tmp_path / "run"), sync_every, timeout_s=120)
    lines = [line for line in out[0].splitlines() if "no outer step runs" in line]
    assert len(lines) == (1 if warned else 0), out[0]
    if warned:
        assert lines[0].startswith("ringtrain: warning: diloco.sync_every (50) is more than this run's 20 steps")
    assert "no outer step runs" not in out[1]


# --- fit's result --------------------------------------------------------------------------------------------
def _fit(rank: int, world_size: int, port: int, run_dir: str) -> dict:
    import ringtrain

    with as_launched_worker(rank, world_size, port):
        result = ringtrain.fit(plain_model, data(), loss="cross_entropy", run_dir=run_dir,
                               config={**CONFIG, "train": {**CONFIG["train"], "epochs": 1}})
    return {"rank": result.rank, "is_main": result.is_main, "steps": result["steps"]}


def test_fit_result_says_the_rank_and_a_finished_run_directory_holds_no_lock(tmp_path):
    ranks = in_two(_fit, str(tmp_path / "run"))
    assert ranks == [{"rank": 0, "is_main": True, "steps": STEPS_PER_EPOCH},
                     {"rank": 1, "is_main": False, "steps": STEPS_PER_EPOCH}]
    assert (tmp_path / "run" / "summary.json").is_file() and not (tmp_path / "run" / ".lock").exists()


# --- a non-finite step: the guarantee fit's trainer gives (tests/checkpoint/test_fault_tolerance.py), here ----------
def _nan_at(rank: int, world_size: int, port: int, run_dir: str, steps: int, nan_rank: int, nan_step: int | None):
    """A Session loop of ``steps`` steps whose loss is NaN on ``nan_rank`` at ``nan_step`` (None: never)."""
    import ringtrain

    with as_launched_worker(rank, world_size, port):
        session = ringtrain.Session({**CONFIG, "checkpoint": {"every_steps": 100}}, run_dir=run_dir)
        model = plain_model()
        model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), data=data())
        for _ in session.epochs(EPOCHS):
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(inputs), targets)
                if rank == nan_rank and session.state.step + 1 == nan_step:
                    loss = loss * float("nan")
                session.backward(loss)
                optimizer.step()
                if session.state.step == steps:
                    break
            if session.state.step == steps:
                break
        seen = {"step": session.state.step, "skipped": session.state.skipped_steps,
                "params": {k: v.detach().clone() for k, v in session.unwrap(model).state_dict().items()}}
        session.close()
    return seen


def test_a_nan_loss_on_one_rank_of_a_session_loop_is_skipped_by_every_rank(tmp_path):
    """As fit's trainer does (Chaos 9): a NaN loss on rank 1 at step 2: both ranks skip step 2, the parameters stay
    identical on every rank and equal those after step 1, and metrics.jsonl records the skip naming the rank."""
    skipped = in_two(_nan_at, str(tmp_path / "nan"), 2, 1, 2)
    clean = in_two(_nan_at, str(tmp_path / "clean"), 1, 1, None)
    for seen in skipped:
        assert (seen["step"], seen["skipped"]) == (2, 1), seen
        for name, value in clean[0]["params"].items():
            assert torch.equal(seen["params"][name], value), f"{name}: the skipped step changed the parameters"
    assert any(not torch.equal(clean[0]["params"][k], v) for k, v in plain_model().state_dict().items())
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r["type"] == "skip"] == [{"type": "skip", "step": 2,
                                                             "reason": "non-finite loss on rank 1"}]
