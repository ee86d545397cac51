"""A command started now and left running beside a test's own work, waited for when its result is needed: two
small jobs overlap well on 2 cores (much of each is its processes starting and waiting on each other), as in
conftest.run_clis, but the test goes on meanwhile instead of waiting for both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from tests.conftest import REPO

__all__ = ["Background"]


class Background:
    """``command`` (run in the repository, as ``run_cli`` runs one, ``env`` added to the environment) started
    now; ``result()`` waits for it (once) and returns the finished process; ``stop()`` ends it with its
    processes if nobody waited for it (a test failed first) and frees its files."""

    def __init__(self, command: list[str], env: dict | None = None):
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        # Output to files, not pipes: nobody reads them while the job runs (as in conftest.run_clis).
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, cwd=REPO, env=full_env, text=True, stdout=self.out, stderr=self.err,
                                        process_group=0)
        self._done: subprocess.CompletedProcess | None = None

    @classmethod
    def cli(cls, *args: str, env: dict | None = None) -> Background:
        """``python -m ringtrain ARGS``."""
        return cls([sys.executable, "-m", "ringtrain", *args], env)

    def result(self, timeout: float = 300) -> subprocess.CompletedProcess:
        if self._done is None:
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            self.out.seek(0), self.err.seek(0)
            self._done = subprocess.CompletedProcess(self.process.args, self.process.returncode, self.out.read(),
                                                     self.err.read())
        return self._done

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.out.close(), self.err.close()

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
