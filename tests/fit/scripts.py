"""A user's `fit()` script in the harness's ranks, as `ringtrain run SCRIPT` or `python SCRIPT` runs it (issue 45).

``script_in_ranks``: the script's main() in each rank, under the variables `ringtrain run`'s `--set`/`--run-dir`/
`--resume` set, each rank a worker as torchrun starts one; ``script_alone``: one rank as `python SCRIPT`. The
script is imported as its module (tests/user_code.py as ``tests.user_code``), not run as ``__main__``:
what a name of its own is recorded as (``__main__:digits_mlp`` under a launcher) is the one difference.
Used by tests/fit/test_fit.py, test_front_door.py, test_tensor_parallel_fit.py and test_pipeline_split_fit.py.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from ringtrain.group.env import RESUME_VAR, RUN_DIR_VAR, SET_VAR
from tests.conftest import REPO
from tests.distributed import run_distributed
from tests.fit.test_session_loop import as_launched_worker, free_port

SCRIPT = "tests/user_code.py"


@contextlib.contextmanager
def as_lone_process():
    """This harness rank as `python SCRIPT` (no launcher variables, no group: fit makes its own alone); afterwards
    a lone group again, for the harness to end. Yields what it printed on stderr."""
    dist.destroy_process_group()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            yield stderr
    finally:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _script_in_rank(rank: int, world_size: int, port: int | None, argv: list[str], variables: dict[str, str],
                    script: str = SCRIPT) -> dict:
    """The script's main() with ``argv`` in this harness rank, as a worker `ringtrain run` starts it (the launcher's
    variables set, the harness's group left: fit makes its own), or, with no ``port``, as `python SCRIPT` alone.
    Returns its exit code, its stderr (what Python code wrote to sys.stderr, then what reached file descriptor 2
    from below: torch's C++ log lines) and its last ``SUMMARY`` line (written to file descriptor 1)."""
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    saved_argv, saved_fds = sys.argv, {fd: os.dup(fd) for fd in (1, 2)}
    sys.argv = [str(REPO / script), *argv]
    os.environ.update(variables)
    code = 0
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as below:
        os.dup2(stdout.fileno(), 1)
        os.dup2(below.fileno(), 2)
        try:
            with (as_launched_worker(rank, world_size, port) if port else as_lone_process()) as stderr:
                try:
                    module.main()
                except SystemExit as exit_:  # one line and exit 2 (fit's refusal), as the process would end
                    code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            for fd, saved in saved_fds.items():
                os.dup2(saved, fd)
                os.close(saved)
            sys.argv = saved_argv
            for name in variables:
                os.environ.pop(name, None)
        stdout.seek(0)
        below.seek(0)
        summaries = [json.loads(line[8:]) for line in stdout.read().decode().splitlines() if line.startswith("SUMMARY ")]
        written = stderr.getvalue() + below.read().decode(errors="replace")
    return {"code": code, "stderr": written, "summary": summaries[-1] if summaries else None}


def script_in_ranks(run_dir: Path, *overrides: str, case: str = "oracle", resume: bool = False,
                    config: dict | None = None, nproc: int = 2, env: dict[str, str] | None = None,
                    refused: bool = False, script: str = SCRIPT, args: tuple[str, ...] = (),
                    timeout_s: float = 240) -> list[dict]:
    """What `ringtrain run SCRIPT --nproc NPROC --run-dir RUN_DIR [--set O ...] [--resume] -- --case CASE [--config
    CONFIG] [ARGS ...]` runs in its workers, with ``env`` added to their environment (a fault plan's), run in the
    harness's ranks (the flags as the variables ringtrain.cli sets from them), each of which must end well unless
    ``refused``; by rank, what ``_script_in_rank`` returns."""
    variables = {RUN_DIR_VAR: str(Path(run_dir).resolve()), RESUME_VAR: "resume" if resume else "checked",
                 **(env or {})}
    if overrides:
        variables[SET_VAR] = json.dumps(list(overrides))
    argv = ["--case", case, *(["--config", json.dumps(config)] if config else []), *args]
    ranks = run_distributed(_script_in_rank, nproc, free_port(), argv, variables, script, timeout_s=timeout_s)
    for rank, got in enumerate(ranks):
        assert refused or got["code"] == 0, f"rank {rank} exited {got['code']}: {got['stderr']}"
    return ranks


def script_alone(*argv: str, variables: dict[str, str] | None = None) -> dict:
    """`python SCRIPT ARGV` (one process, no launcher) with these environment variables, in a harness rank; what
    ``_script_in_rank`` returns."""
    [got] = run_distributed(_script_in_rank, 1, None, list(argv), variables or {}, timeout_s=240)
    return got
