"""Why a collective failed, in one line that names the operation, the peer rank and the step.

    shm all_reduce: rank 1 (pid 1234) died while rank 0 waited at step 3 of 4
    ring all_reduce: rank 1 did not send within 10.0 s (rank 0 waiting at step 1 of 2)
"""

from __future__ import annotations

__all__ = ["CollectiveError", "PeerDiedError", "PeerTimeoutError", "MismatchError", "PeerDataError"]


class CollectiveError(RuntimeError):
    """A collective could not complete; the group is unusable afterwards (as after a Gloo/NCCL error)."""

    def __init__(self, message: str, *, peer: int | None = None):
        super().__init__(message)
        self.peer = peer
        """Rank (in the default group) that caused the failure, when known."""


class PeerDiedError(CollectiveError):
    """A peer process exited or was killed during the collective."""


class PeerTimeoutError(CollectiveError):
    """A peer did not reach the same point within the timeout (stopped, hung, or far behind)."""


class MismatchError(CollectiveError):
    """Ranks called different collectives, or passed different sizes, dtypes or ops."""


class PeerDataError(CollectiveError):
    """A peer sent bytes that are not what the exchange carries (not JSON, not whole int64s): refused
    without decoding them (``comm/objects.py``)."""
