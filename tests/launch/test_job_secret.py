"""The job's secret (ringtrain/group/auth.py): a store value, a rendezvous state or a job file that the job did
not write is never read, whoever reached the store or the run directory. Every test plants what a stranger
can write (a TCPStore takes ``set`` from anyone who reaches its port) and feeds it through ringtrain's real
read path; the planted pickles would touch a marker file if they were ever unpickled."""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ringtrain.elastic import JOB_FILE, JobSpec
from ringtrain.errors import LaunchError
from ringtrain.group.auth import (SECRET_FILE_VAR, SECRET_VAR, JobSecret, SecretError, UnsealedValue,
                                  load_job_secret, save_job_secret, saved_job_secret)
from ringtrain.group.auth_store import AuthStore
from ringtrain.group.env import DistEnv
from ringtrain.group.jobstore import JobStore
from ringtrain.launch import LaunchOptions, Program, default_run_id, job_secret_for
from tests.conftest import run_cli
from tests.security.test_hostile_files import Payload, marker  # noqa: F401 (a fixture)


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield store


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


# --- sealed stores -------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_sealed_store_reads_back_what_the_job_wrote_and_refuses_a_strangers_value_in_one_line(server):
    secret = JobSecret.new()
    store = dist.PrefixStore("ringtrain/run/", AuthStore(_client(server), secret, "the job store at here"))
    store.set("heartbeat/0", "3 1.5")
    assert store.get("heartbeat/0") == b"3 1.5"
    stranger = _client(server)  # no secret: what another local user can do
    stranger.set("ringtrain/run//heartbeat/0", b"999 1.5")
    with pytest.raises(UnsealedValue) as err:
        store.get("heartbeat/0")
    message = str(err.value)
    assert "\n" not in message and "the job store at here" in message and "'ringtrain/run//heartbeat/0'" in message


@pytest.mark.unit
def test_a_value_sealed_by_another_secret_or_for_another_key_is_refused(server):
    mine, theirs = JobSecret.new(), JobSecret.new()
    store = AuthStore(_client(server), mine, "the store")
    other = AuthStore(_client(server), theirs, "the store")
    other.set("a", "x")
    with pytest.raises(UnsealedValue):
        store.get("a")
    store.set("b", "y")
    raw = _client(server)
    raw.set("c", raw.get("b"))  # a replay of the job's own sealed value under another key
    with pytest.raises(UnsealedValue):
        store.get("c")


@pytest.mark.unit
def test_compare_set_keeps_torchs_meaning_over_sealed_values(server):
    store = AuthStore(_client(server), JobSecret.new(), "the store")
    assert store.compare_set("k", "", "one") == b"one"
    assert store.compare_set("k", "one", "two") == b"two"
    assert store.compare_set("k", "stale", "three") == b"two"  # not swapped: the current value comes back
    assert store.get("k") == b"two"


@pytest.mark.unit
def test_job_store_and_workers_store_are_sealed_with_the_environments_secret(server):
    secret = JobSecret.new()
    env = DistEnv.from_environ({SECRET_VAR: secret.hex})
    assert env.job_secret is not None and env.job_secret.hex == secret.hex
    job = JobStore("127.0.0.1", server.port, "ringtrain/r/", is_writer=True, secret=env.job_secret)
    job.record_progress(7)
    assert job.begin_attempt().last_step == 7
    _client(server).set("ringtrain/r//progress", b"100 0.0")  # a stranger's claim
    with pytest.raises(UnsealedValue):
        job.begin_attempt()


# --- the rendezvous --------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_planted_rendezvous_pickle_is_never_unpickled_and_the_last_good_state_is_written_back(server, marker, capfd):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder, RendezvousSettings
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    from ringtrain.group.rendezvous import SealedRendezvousBackend

    secret = JobSecret.new()
    sealed = AuthStore(_client(server), secret, "the rendezvous store at X")
    backend = SealedRendezvousBackend(sealed, "job")
    settings = RendezvousSettings("job", 1, 2, RendezvousTimeout(), timedelta(seconds=1), 3)
    holder = _BackendRendezvousStateHolder(backend, settings, cache_duration=0)
    holder.state.round = 4
    holder.mark_dirty()
    holder.sync()
    good = _client(server).get("torch.rendezvous.job")
    # The attack: torch's c10d backend keeps the state as base64 pickle under a key anyone can set.
    _client(server).set("torch.rendezvous.job", base64.b64encode(pickle.dumps(Payload(marker))))
    holder.sync()
    assert holder.state.round == 4  # the last good state, not the planted one
    assert _client(server).get("torch.rendezvous.job") == good  # and written back over the planted one
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "the rendezvous store at X" in err and "'torch.rendezvous.job'" in err
    holder.mark_dirty()
    holder.sync()  # and the rendezvous goes on writing from there
    assert holder.state.round == 4


@pytest.mark.unit
def test_the_run_id_is_not_predictable_from_the_endpoint_but_the_same_on_every_node():
    one, other = JobSecret.new(), JobSecret.new()
    assert default_run_id(one, "127.0.0.1", 29500) != default_run_id(other, "127.0.0.1", 29500)
    assert default_run_id(one, "127.0.0.1", 29500) == default_run_id(JobSecret.from_hex(one.hex), "127.0.0.1", 29500)
    assert "29500" not in default_run_id(one, "127.0.0.1", 29500)


# --- the secret's sources ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_launcher_makes_a_secret_once_and_hands_it_on_through_its_environment(monkeypatch):
    monkeypatch.delenv(SECRET_VAR, raising=False)
    monkeypatch.delenv(SECRET_FILE_VAR, raising=False)
    secret = job_secret_for(LaunchOptions(nproc=2))
    assert os.environ[SECRET_VAR] == secret.hex and len(bytes.fromhex(secret.hex)) == 32
    assert job_secret_for(LaunchOptions(nproc=2)).hex == secret.hex  # a second call keeps the job's


@pytest.mark.unit
@pytest.mark.parametrize("options, fix", [
    (LaunchOptions(nproc=1, nnodes="2", rdzv_endpoint="127.0.0.1:29999"), "one secret on every node"),
    (LaunchOptions(nproc=1, join=True, rdzv_endpoint="127.0.0.1:29999", run_id="r"), "joining a job needs its secret"),
])
def test_a_job_of_several_nodes_or_a_joiner_without_the_secret_is_one_line(monkeypatch, options, fix):
    monkeypatch.delenv(SECRET_VAR, raising=False)
    monkeypatch.delenv(SECRET_FILE_VAR, raising=False)
    with pytest.raises(LaunchError, match=fix) as err:
        job_secret_for(options)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_a_secret_file_must_be_the_users_own_and_private(tmp_path):
    path = tmp_path / "secret"
    path.write_text(JobSecret.new().hex + "\n")
    path.chmod(0o600)
    assert load_job_secret({SECRET_FILE_VAR: str(path)}) is not None
    path.chmod(0o644)
    with pytest.raises(SecretError, match="mode 644"):
        load_job_secret({SECRET_FILE_VAR: str(path)})
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(SecretError, match="cannot open"):
        load_job_secret({SECRET_FILE_VAR: str(link)})
    if os.geteuid() == 0:
        os.chown(path, 12345, 12345)
        with pytest.raises(SecretError, match="belongs to uid 12345"):
            load_job_secret({SECRET_FILE_VAR: str(path)})
    with pytest.raises(SecretError, match="at least 128"):
        load_job_secret({SECRET_VAR: "abcd"})


# --- job.json and `ringtrain join` --------------------------------------------------------------------------
def _spec(args: tuple[str, ...]) -> JobSpec:
    return JobSpec("127.0.0.1:1", "ringtrain-test", 1, 2, 0, "", Program(args), "/tmp/logs")


@pytest.mark.unit
def test_job_json_is_sealed_and_a_tampered_one_is_refused(tmp_path, monkeypatch):
    secret = JobSecret.new()
    monkeypatch.setenv(SECRET_VAR, secret.hex)
    (tmp_path / JOB_FILE).write_text(_spec(("-m", "ringtrain.worker")).to_json(secret))
    assert JobSpec.read(tmp_path).program.args == ("-m", "ringtrain.worker")
    values = json.loads((tmp_path / JOB_FILE).read_text())
    values["program"]["args"] = ["-c", "print('planted')"]
    (tmp_path / JOB_FILE).write_text(json.dumps(values))
    with pytest.raises(LaunchError, match="wrong seal") as err:
        JobSpec.read(tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_join_finds_the_secret_its_account_kept_for_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(SECRET_VAR, raising=False)
    secret = JobSecret.new()
    save_job_secret(secret, "ringtrain-test")
    kept = tmp_path / "home" / ".ringtrain" / "jobs" / "ringtrain-test.secret"
    assert oct(kept.stat().st_mode & 0o777) == "0o600" and oct(kept.parent.stat().st_mode & 0o777) == "0o700"
    assert saved_job_secret("ringtrain-test").hex == secret.hex
    (tmp_path / JOB_FILE).write_text(_spec(("-m", "ringtrain.worker")).to_json(secret))
    assert JobSpec.read(tmp_path).run_id == "ringtrain-test"
    values = json.loads((tmp_path / JOB_FILE).read_text())
    values["run_id"] = "../../../etc/passwd"  # a path, not a run id: no file outside the folder is read
    (tmp_path / JOB_FILE).write_text(json.dumps(values))
    monkeypatch.delenv(SECRET_VAR)  # read() hands the secret it found to the agent it starts, through os.environ
    with pytest.raises(LaunchError, match="no secret for this job"):
        JobSpec.read(tmp_path)


@pytest.mark.job
def test_ringtrain_join_of_a_planted_job_file_runs_nothing(tmp_path, marker, server):
    """The issue's row 6: a planted job.json (heal, a store anyone can start: ``server`` here, a command in args).
    Before job files were sealed, join found the store answering and started the command."""
    planted = {"rdzv_endpoint": f"127.0.0.1:{server.port}", "run_id": "ringtrain-planted", "min_workers": 1, "max_workers": 2,
               "max_restarts": 0, "rdzv_conf": "", "log_dir": str(tmp_path), "nproc": 1, "heal": True,
               "program": {"args": ["-c", f"import os; os.system('touch {marker}')"], "env": {}, "cwd": None}}
    (tmp_path / JOB_FILE).write_text(json.dumps(planted))
    for secret in (None, JobSecret.new()):  # without any secret; with a secret that is not the job's
        env = {"HOME": str(tmp_path / "home"), SECRET_VAR: secret.hex if secret else ""}
        result = run_cli("join", str(tmp_path), env=env, timeout=60)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and JOB_FILE in lines[0], result.stderr
        assert ("no secret for this job" if secret is None else "no seal") in lines[0]


@pytest.mark.unit
def test_the_workers_store_and_the_job_store_a_worker_connects_to_are_sealed(server):
    """What a worker builds from its environment (group/init.py, group/jobstore.py): Gloo's address exchange and
    ringtrain's job keys both go through an AuthStore when the launcher handed the worker a secret."""
    from ringtrain.group.init import _new_store
    from ringtrain.group.jobstore import connect_job_store

    secret = JobSecret.new()
    port = _free_port()
    env = DistEnv(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, bind_addr="127.0.0.1",
                  job_secret=secret, job_store=f"127.0.0.1:{server.port}", run_id="r")
    workers = _new_store(env, timedelta(seconds=10))
    workers.set("rank_1", b"198.18.0.9:1234")
    assert _client_at(port).get("rank_1") != b"198.18.0.9:1234"  # sealed on the wire
    _client_at(port).set("rank_1", b"198.18.0.9:4321")  # a stranger hands rank 0 an address
    with pytest.raises(UnsealedValue, match=f"the workers' store at 127.0.0.1:{port}"):
        workers.get("rank_1")
    job = connect_job_store(env, is_writer=True)
    job.set_host(1, "here")
    _client(server).set("ringtrain/r//host/1", b"there")
    with pytest.raises(UnsealedValue, match="the job store"):
        job.hosts_of([1])


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _client_at(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
