"""Process groups: what a worker reads from its environment, and the group's lifetime."""

from ringtrain.dist.env import DistEnv
from ringtrain.dist.group import DistContext, init_distributed, resolve_backend

__all__ = ["DistEnv", "DistContext", "init_distributed", "resolve_backend"]
