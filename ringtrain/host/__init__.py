"""The host's tuning: core pinning and the allocator (apart from the process group's lifetime)."""
