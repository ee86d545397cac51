"""Test facilities that ship with ringtrain: ``faults`` (named fault points, armed only by a test harness's plan:
product code calls into it), and what both tests/ and the top-level bench/ scripts drive jobs with (issue 45:
bench/ no longer imports tests/): ``hosts`` (test hosts in network namespaces), ``runs`` (a run directory's
records, read one way), ``fault_plans`` (writing a plan and reading what fired), ``jobs`` (a background
``ringtrain`` command and its processes), ``heal_cycles`` and ``random_chaos`` (the chaos tests' kills, joins and
seeded schedules). tests/hosts.py, tests/runs.py, tests/faults.py, tests/jobs.py and
tests/heal/{heal_cycles,random_chaos}.py are these very modules under the tests' names."""
