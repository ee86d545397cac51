"""Tests of torch's c10d conformance set (``torch_suite.py``) that are not run against ringtrain_shm, each with
why. Keep it short: a test belongs here only when it checks something that is not ringtrain_shm's to provide
(a backend's name, Gloo's own internals) or what torch's API for backends written in Python cannot express,
never because ringtrain_shm fails what it could do."""

_ANY_SOURCE = ("a recv from any source must report its sender through Work._source_rank(), which torch's trampoline "
               "for work objects written in Python does not forward (only wait and get_future): ringtrain_shm refuses "
               "it in one line where its sends go to shm (tests/comm/test_shm_p2p.py, "
               "test_a_recv_from_any_source_runs_on_gloo_until_sends_go_to_shm_then_is_refused_in_one_line)")

EXCLUDED: dict[str, str] = {
    "test_send_recv_any_source": _ANY_SOURCE,
    "test_send_recv_any_source_autograd_profiler": _ANY_SOURCE,
    "test_send_recv_any_source_torch_profiler": _ANY_SOURCE,
}

AS_GLOO: dict[str, str] = {
    name: "it picks its model's set-up by the backend's name while it runs (`if BACKEND == \"gloo\"`), with no "
          "branch for another CPU backend: it runs with that name read as gloo, its process groups ringtrain_shm's"
    for name in ("test_accumulate_gradients_no_sync", "test_accumulate_gradients_no_sync_grad_is_view",
                 "test_accumulate_gradients_no_sync_allreduce_hook",
                 "test_accumulate_gradients_no_sync_allreduce_with_then_hook")
}
"""Tests that run, with ``distributed_test.BACKEND`` read as "gloo" inside them (torch_suite.py checks that the
default group is still ringtrain_shm's first)."""
