"""Top-level bench/ runs without tests/ (issue 45): what its scripts drive jobs with (test hosts, the chaos
drivers) lives in ringtrain/testing/, which tests/ imports too."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit


def test_no_bench_script_imports_tests():
    offenders = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {name}" for name in names
                          if name == "tests" or name.startswith("tests.")]
    assert not offenders, "bench/ imports tests/ (move what it needs into ringtrain/testing/):\n" + "\n".join(offenders)
