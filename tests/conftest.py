"""Shared fixtures. Each test process and each worker it starts uses one compute thread."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests that press Ctrl-C (send SIGINT to a job's processes) need those processes to take it. A shell starts a
# background job (`make test &`, a CI step run as one) with SIGINT ignored, and an ignored signal stays ignored
# across exec in every process started from it: the joiner of
# test_joiners_that_left_before_admission_are_never_admitted_and_the_job_finishes then never exited (seen in a
# full run started in the background). A caught signal goes back to its default across exec instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parent.parent

# A job of several nodes needs one secret on every node (ringtrain/group/auth.py), which its user exports on each;
# the tests' multi-node jobs (test hosts, SLURM's variables, --nnodes on loopback) get this one the same way. A
# one-node launcher then takes it instead of making its own; tests/security/test_shared_host.py runs one without
# it, and `ringtrain join` commands (tests/jobs.py) drop it to find the secret the job's launcher kept.
os.environ.setdefault("RINGTRAIN_JOB_SECRET", __import__("secrets").token_hex(32))


def run_cli(*args: str, timeout: float = 240, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ringtrain ARGS`` as a user runs it; returns the finished process (never raises on exit code)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_clis(*commands: list[str], timeout: float = 240, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Several independent ``python -m ringtrain ARGS`` at once, as ``run_cli`` runs one (``env`` added to every
    one's environment); the finished processes, in the order given. On 2 cores two small jobs overlap well:
    much of each is its processes starting and waiting on each other (10.9 s for two `ringtrain run` jobs at
    once, 8.3 s for one alone)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    # Output to files, not pipes: a job must not block on a full pipe while another one is waited for.
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    started = [subprocess.Popen([sys.executable, "-m", "ringtrain", *args], cwd=REPO, env=full_env, text=True,
                                stdout=out, stderr=err, process_group=0)
               for args, (out, err) in zip(commands, outputs)]
    deadline = time.monotonic() + timeout
    finished = []
    try:
        for process, (out, err) in zip(started, outputs):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
            out.seek(0), err.seek(0)
            finished.append(subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read()))
    finally:
        for process, files in zip(started, outputs):
            if process.poll() is None:  # timed out (or the test was interrupted): the job goes with its workers
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            for file in files:
                file.close()
    return finished


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``ringtrain ARGS`` in this process (``ringtrain.cli.main``, what ``python -m ringtrain`` calls), with its
    exit code and its stdout and stderr, as ``run_cli`` returns them: for the quick commands that only read
    a run directory (ledger, diagnose, report, export), which as a new process spend ~2 s importing torch."""
    from ringtrain.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # a new process's filters; its warnings go to stderr, as they would
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code if isinstance(exit_.code, int) else 1
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess(["ringtrain", *args], code, out.getvalue(), shown + err.getvalue())


@pytest.fixture
def cli():
    return run_cli


# --- DeepSpeed's shm op, built in the background while other tests run ------------------------------------
# tests/comm/test_bench_deepspeed.py runs DeepSpeed's CPU shm all-reduce, which DeepSpeed compiles at
# first use (~40 s of g++ in a fresh venv: its cache is keyed by the venv's path). When that test is collected,
# the build starts at the session's start, niced so it only takes CPU the other tests leave idle (most of them
# wait on processes, heartbeats and timeouts); the test awaits it through the ``deepspeed_build`` fixture and
# then loads the cached op. Once the test waits for it, the build is put back to normal priority (on busy cores
# SCHED_IDLE never runs: the test timed out waiting for a build that had not started). A failed background
# build costs nothing: the test builds again itself (and skips only if DeepSpeed's builder cannot build here).
DEEPSPEED_TEST = "test_bench_deepspeed.py::test_deepspeed_shm_runs_beside_ringtrain_shm"
_deepspeed_build: subprocess.Popen | None = None


def pytest_collection_finish(session):
    global _deepspeed_build
    # Under pytest-xdist every worker collects every test: one worker (gw0) builds, and a test on another worker
    # waits for that build inside DeepSpeed's own build lock.
    first_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if first_worker and any(DEEPSPEED_TEST in item.nodeid for item in session.items) and _deepspeed_build is None:
        # SCHED_IDLE and nice 19 (g++ inherits both): it runs on a core only when no test wants it. Its own
        # process group, to be killed whole, but pytest's session: with the kernel's autogroups a new session
        # would get an equal share of the CPU whatever its niceness.
        code = "from ringtrain.bench import deepspeed_shm; deepspeed_shm.build()"
        _deepspeed_build = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        # Demoted from here, not by itself: the fixture may hurry it at once (a run of that test alone), and a
        # build that demoted itself a moment later would then starve anyway.
        os.sched_setscheduler(_deepspeed_build.pid, os.SCHED_IDLE, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, _deepspeed_build.pid, 19)
        paths = _lock_paths(session.config)
        if paths is not None:  # for the test, on whichever worker it runs: which process to hurry
            import psutil

            started = psutil.Process(_deepspeed_build.pid).create_time()
            _build_pid_path(paths).write_text(f"{_deepspeed_build.pid} {started}")


def pytest_sessionfinish(session, exitstatus):
    paths = _lock_paths(session.config)
    if paths is not None:  # this worker is done with them; the other, if still running, opens them afresh
        for path in paths:
            path.unlink(missing_ok=True)
        if _deepspeed_build is not None:
            _build_pid_path(paths).unlink(missing_ok=True)
    if _deepspeed_build is not None and _deepspeed_build.poll() is None:
        # The test was never reached (stopped on the way, or the run interrupted): the build goes, with its g++.
        _kill_build(_deepspeed_build)


def _kill_build(build: subprocess.Popen) -> None:
    """The build and every process under it. ninja starts each compiler in a process group of its own, which a
    killpg of the build's group misses: they were left compiling, reparented to init. The group is stopped
    first, so ninja cannot start another compiler between the listing and the kill."""
    import psutil

    os.killpg(build.pid, signal.SIGSTOP)
    try:
        descendants = psutil.Process(build.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    os.killpg(build.pid, signal.SIGKILL)
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    build.wait()


def _build_pid_path(paths: tuple[Path, Path]) -> Path:
    return paths[0].with_suffix(".deepspeed-build")


def _hurry_build(pid: int) -> bool:
    """Normal priority (SCHED_OTHER, nice 0) for the build ``pid`` and every thread and process under it; False
    where this user may not raise it. Its group is stopped meanwhile, so ninja starts no compiler in between."""
    import psutil

    os.killpg(pid, signal.SIGSTOP)
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                for thread in process.threads():
                    os.sched_setscheduler(thread.id, os.SCHED_OTHER, os.sched_param(0))
                    os.setpriority(os.PRIO_PROCESS, thread.id, 0)
    except PermissionError:
        return False
    except psutil.NoSuchProcess:  # it ended meanwhile
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)
    return True


@pytest.fixture
def deepspeed_build(request):
    """Hurry the background build of DeepSpeed's shm op (if one was started) and, on the worker that started it,
    wait for it to end, however it ended (on another worker the test waits inside DeepSpeed's build lock)."""
    import psutil

    if _deepspeed_build is not None:
        if _deepspeed_build.poll() is None and not _hurry_build(_deepspeed_build.pid):
            _kill_build(_deepspeed_build)  # it would starve: the test builds at its own priority instead
        try:
            _deepspeed_build.wait(timeout=200)  # leaves the test's 300 s the time to build again and run
        except subprocess.TimeoutExpired:
            _kill_build(_deepspeed_build)
        return
    paths = _lock_paths(request.config)
    if paths is None or not _build_pid_path(paths).exists():
        return
    pid, started = _build_pid_path(paths).read_text().split()
    with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
        if psutil.Process(int(pid)).create_time() == float(started):  # that build, not a reused pid
            _hurry_build(int(pid))


# --- Tests side by side (pytest-xdist), and the ones that must run alone ----------------------------------------
# `make test` runs the suite in three processes (`pytest -n 3 --dist loadscope`): most of a test's time is its workers
# starting and waiting on each other, timeouts and heartbeats, so tests share the 2 cores well (one host: 18 min with
# three, 20.5 with two; another: 14.4 min with two against 21 in one process). A test that times something against a
# bound, or checks that /dev/shm holds nothing new, must not share the machine: it is marked ``@pytest.mark.exclusive``
# (or wraps the timed part in ``alone()``), and then runs with no other test beside it. Every other test holds a shared
# lock for its run; ``alone`` takes it exclusively. A turnstile stops new tests from starting while one waits to be
# alone, so it is not starved. Without xdist there is one process and nothing to lock.
_lock_file = None  # this worker's open lock file, shared-locked while a test runs
_lock_depth = 0


def _lock_paths(config) -> tuple[Path, Path] | None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    base = Path(tempfile.gettempdir()) / f"ringtrain-tests-{workerinput['testrunuid']}"
    return base.with_suffix(".lock"), base.with_suffix(".turnstile")


_config = None


def pytest_configure(config):
    global _config
    _config = config
    config.addinivalue_line("markers", "exclusive: runs with no other test beside it (under pytest-xdist)")
    for name, what in COSTS.items():
        config.addinivalue_line("markers", f"{name}: cost: {what}")


# --- Each test's cost, a marker (issue 45) ----------------------------------------------------------------------
# The folders sort tests by the component they prove; what a test costs is its marker, one of four, on the test or
# on its module (``pytestmark = pytest.mark.job``). ``pytest -m unit`` runs the tests that start nothing,
# ``make test-fast`` the unit and ranks ones. A test of the suite without one (or with two) fails to collect, so
# a new test cannot slip out of every selection.
COSTS = {
    "unit": "the test's own process only",
    "ranks": "ranks forked from the test process: the in-process multi-rank harness (tests/distributed.py), "
             "or another forked child",
    "job": "starts processes as subprocesses: a launcher, the ringtrain CLI, torchrun, a script, a pytest",
    "hosts": "test hosts in network namespaces (tests/hosts.py; needs root, skips without it)",
}
_SUITE = Path(__file__).resolve().parent


def _cost_problem(item) -> str | None:
    costs = sorted({mark.name for mark in item.iter_markers()} & COSTS.keys())
    if len(costs) == 1 or not item.path.is_relative_to(_SUITE):  # outside: a test file of a test's own (tmp_path)
        return None
    says = f"two cost markers ({', '.join(costs)})" if costs else "no cost marker"
    return (f"{item.nodeid}: {says}; mark the test or its module (pytestmark) with exactly one of "
            f"{', '.join(COSTS)} (tests/conftest.py COSTS)")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module (or class) with a test that has no cost marker fails to collect, naming the test: before any test
    runs and before ``-m`` deselects (a test with no cost matches no selection), and as a collection error, which
    pytest-xdist's workers report as such."""
    report = yield
    if report.passed:
        wrong = [problem for node in report.result if isinstance(node, pytest.Item)
                 for problem in [_cost_problem(node)] if problem]
        if wrong:
            report.outcome, report.longrepr, report.result = "failed", "\n".join(wrong), []
    return report


@contextlib.contextmanager
def alone():
    """No other test runs while the block runs (under pytest-xdist; otherwise none runs anyway)."""
    global _lock_depth
    paths = _lock_paths(_config) if _config is not None else None
    if paths is None or _lock_file is None or _lock_depth:
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
        return
    lock_path, turnstile_path = paths
    # Drop this test's shared lock first: two tests waiting to be alone must not each hold one the other waits on.
    fcntl.flock(_lock_file, fcntl.LOCK_UN)
    with open(turnstile_path, "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(_lock_file, fcntl.LOCK_EX)
    _lock_depth += 1
    try:
        yield
    finally:
        _lock_depth -= 1
        fcntl.flock(_lock_file, fcntl.LOCK_SH)  # back to sharing, until the test ends


def _record_time(item, started: float, ran: float) -> None:
    """With RINGTRAIN_TEST_TIMES=FILE, one JSON line per test: where its time went (waiting for the lock or
    running), to find what makes the suite long (tests that run alone hold the other test processes)."""
    path = os.environ.get("RINGTRAIN_TEST_TIMES")
    if path:
        worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
        line = {"test": item.nodeid, "worker": worker, "exclusive": item.get_closest_marker("exclusive") is not None,
                "start": started, "wait_s": round(ran - started, 2), "run_s": round(time.time() - ran, 2),
                # CPU of this test process and of the processes it started and waited for (their children too).
                "cpu_s": round(_cpu_s() - _cpu_at.pop(item.nodeid, _cpu_s()), 2)}
        with open(path, "a") as file:
            file.write(json.dumps(line) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.time()
    try:
        return (yield from _run_protocol(item, started))
    finally:
        _record_time(item, started, _ran_at.pop(item.nodeid, started))


_ran_at: dict[str, float] = {}
_cpu_at: dict[str, float] = {}


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _run_protocol(item, started: float):
    global _lock_file
    paths = _lock_paths(item.config)
    if paths is None:
        _ran_at[item.nodeid], _cpu_at[item.nodeid] = time.time(), _cpu_s()
        return (yield)
    lock_path, turnstile_path = paths
    _lock_file = open(lock_path, "a")
    try:
        with open(turnstile_path, "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(_lock_file, fcntl.LOCK_SH)
        if item.get_closest_marker("exclusive") is not None:
            with alone():
                _ran_at[item.nodeid], _cpu_at[item.nodeid] = time.time(), _cpu_s()
                return (yield)
        _ran_at[item.nodeid], _cpu_at[item.nodeid] = time.time(), _cpu_s()
        return (yield)
    finally:
        _lock_file.close()  # releases the lock
        _lock_file = None
