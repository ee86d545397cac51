"""Issue 41's Ctrl-C row, the C++ half: a store a peer closed first made c10d log a warning with a ~25-line C++
stack (`[W... TCPStore.cpp] [c10d] recvVector failed ... Exception raised from recvBytes`). The `ringtrain`
command sets TORCH_CPP_LOG_LEVEL=ERROR before torch loads (its workers inherit it); a user's own level is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.job

CHILD = """
import datetime, socket, sys, threading
if sys.argv[1] == "ringtrain":
    import ringtrain.cli  # noqa: F401  (what the `ringtrain` command loads first)
import torch.distributed as dist

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()

def hang_up():  # a store that closes every connection: what a stopped peer's store looks like to a client
    while True:
        connection, _ = server.accept()
        connection.close()

threading.Thread(target=hang_up, daemon=True).start()
try:
    dist.TCPStore("127.0.0.1", server.getsockname()[1], is_master=False, timeout=datetime.timedelta(seconds=3))
except Exception:
    pass
"""


def _stderr(case: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", CHILD, case], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})
    return done.stderr


@pytest.mark.parametrize("case, level, shown", [("torch", None, True), ("ringtrain", None, False),
                                                ("ringtrain", "WARNING", True)])
def test_c10d_warnings_with_their_stacks_are_off_under_the_ringtrain_command(case, level, shown):
    stderr = _stderr(case, **({"TORCH_CPP_LOG_LEVEL": level} if level else {}))
    warnings = [line for line in stderr.splitlines() if line.startswith("[W") and "TCPStore.cpp" in line]
    assert bool(warnings) is shown, stderr  # the retries' warnings (the give-up is an error: shown either way)
