"""Process groups: what a worker reads from its environment, and the group's lifetime."""

from ringtrain.group.env import DistEnv
from ringtrain.group.init import DistContext, init_distributed, resolve_backend

__all__ = ["DistEnv", "DistContext", "init_distributed", "resolve_backend"]
