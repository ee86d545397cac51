"""Tests of torch's c10d conformance set (``torch_suite.py``) that are not run against ringtrain_shm, each with
why. Keep it short: a test belongs here only when it checks something that is not ringtrain_shm's to provide
(a backend's name, Gloo's own internals), never because ringtrain_shm fails it."""

EXCLUDED: dict[str, str] = {
}
