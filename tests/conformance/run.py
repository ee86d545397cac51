"""``make conformance``: torch's c10d tests (``torch_suite.py``) against ringtrain_shm at every world size asked.

    python -m tests.conformance.run                         # the whole set at 2, 3 and 4 ranks
    python -m tests.conformance.run --world-sizes 2 -k "all_reduce or broadcast"   # a subset while developing

Each world size is one pytest run of ``torch_suite.py`` (the suite reads ``WORLD_SIZE`` when it is imported);
the counts (passed, failed, skipped, errors) and the names of the tests that failed go to
``conformance-results.json`` (``--out``), and one line per world size is printed. Exit status 1 if any test
failed at any world size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SUITE = "tests/conformance/torch_suite.py"


def run_suite(world_size: int, pytest_args: list[str], timeout_s: float | None = None, echo=None,
              tests: list[str] | None = None) -> dict:
    """One pytest run of the suite at ``world_size`` ranks; its counts and the tests that failed, by outcome.
    ``tests``: names of ``TestRingtrainShm``'s tests to run, only those (default: the whole suite). ``echo``, if
    given, gets pytest's lines as they come (one per test: a long run shows its progress)."""
    # Node ids alone: pytest runs every test of a file named beside them, so naming the file too ran all 286.
    targets = [f"{SUITE}::TestRingtrainShm::{name}" for name in tests] if tests else [SUITE]
    with tempfile.TemporaryDirectory(prefix="ringtrain-conformance-") as scratch:
        report = Path(scratch) / "junit.xml"
        env = {**os.environ, "WORLD_SIZE": str(world_size), "TEMP_DIR": scratch, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-o", "addopts=",
                   "--timeout", "600", f"--junitxml={report}", *targets, *pytest_args]
        start = time.monotonic()
        output: list[str] = []
        with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as pytest:
            try:
                for line in pytest.stdout:
                    output.append(line)
                    if echo is not None and "::" in line:
                        echo(f"  [{world_size} ranks] {line.rstrip()}")
                    if timeout_s is not None and time.monotonic() - start > timeout_s:
                        raise TimeoutError(f"conformance at {world_size} ranks ran past {timeout_s:.0f} s")
            finally:
                if pytest.poll() is None:
                    pytest.kill()
            returncode = pytest.wait()
        elapsed = time.monotonic() - start
        tail = "".join(output)[-4000:]
        if not report.exists():  # pytest itself failed (a bad -k, an import error): its own words
            raise SystemExit(f"conformance at {world_size} ranks: pytest wrote no report (exit {returncode}):\n"
                             f"{tail.strip()[-3000:]}")
        return {**_outcomes(report), "world_size": world_size, "seconds": round(elapsed, 1),
                "pytest_exit": returncode, "output_tail": tail}


def _outcomes(report: Path) -> dict:
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": [], "errors": []}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        if case.find("failure") is not None:
            outcomes["failed"].append(name)
        elif case.find("error") is not None:
            outcomes["errors"].append(name)
        elif case.find("skipped") is not None:
            outcomes["skipped"].append(name)
        else:
            outcomes["passed"].append(name)
    return {"counts": {outcome: len(names) for outcome, names in outcomes.items()}, "tests": outcomes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4", help="comma-separated rank counts (default 2,3,4)")
    parser.add_argument("--out", default="conformance-results.json", help="results file (default conformance-results.json)")
    parser.add_argument("-k", dest="select", help="pytest -k expression: a subset of torch's tests")
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(part) for part in args.world_sizes.split(",")]
    except ValueError:
        parser.exit(2, f"--world-sizes {args.world_sizes!r}: write rank counts separated by commas, e.g. 2,3,4\n")
    if not world_sizes or not all(2 <= n <= 8 for n in world_sizes):
        parser.exit(2, f"--world-sizes {args.world_sizes!r}: each must be from 2 to 8\n")
    pytest_args = ["-k", args.select] if args.select else []
    results = []
    for world_size in world_sizes:
        result = run_suite(world_size, pytest_args, echo=lambda line: print(line, flush=True))
        results.append(result)
        counts = result["counts"]
        print(f"conformance ringtrain_shm, {world_size} ranks: {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['skipped']} skipped, {counts['errors']} errors ({result['seconds']:.0f} s)", flush=True)
        for name in result["tests"]["failed"] + result["tests"]["errors"]:
            print(f"  FAILED {name}", flush=True)
    command = "python -m tests.conformance.run " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command.strip(), "select": args.select, "results": results},
                                         indent=1) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(r["counts"]["failed"] or r["counts"]["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
