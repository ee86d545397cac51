"""The documentation's code is the code's: every ```python block of README.md and docs/*.md parses, every
`ringtrain` name it imports or uses exists (down to the methods of a ringtrain object it makes), and every class
it uses is imported or defined in the snippet; every ```toml block that is a config loads through ringtrain's
config loader; every `ringtrain COMMAND ...` line of a shell or text block names commands and flags the parser
(ringtrain/cli.py) has. The site's generated references cover every command, flag and config field, and its
API page every name of ringtrain.__all__. No job is launched: the checks read, parse and import."""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import importlib
import re
import shlex
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import docs_reference  # noqa: E402  (tools/docs_reference.py: the site's generated pages)

pytestmark = pytest.mark.unit

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,})(\S*)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "text"}


def code_blocks(path: Path) -> list[tuple[str, str, int]]:
    """Every fenced block of a page: (language, code, line number of its first line of code)."""
    text = path.read_text()
    return [(match.group(2).lower(), match.group(3), text.count("\n", 0, match.start(3)) + 1)
            for match in FENCE.finditer(text)]


def blocks_of(language: set[str], holding=lambda code: True) -> list[Any]:
    return [pytest.param(code, id=f"{path.relative_to(REPO)}:{line}")
            for path in PAGES for lang, code, line in code_blocks(path) if lang in language and holding(code)]


PREFIX = re.compile(r"^(?:\$ )?(?:sudo )?(?:[A-Z_]+=\S* )*(?:\S*/)?(?:python -m |python3 -m )?(?=ringtrain )")


def command_lines(code: str) -> list[str]:
    """The `ringtrain ...` lines of a shell or text block, continuation lines joined, comments cut; a line of
    output (indented, or `ringtrain: error: ...`) is not a command."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = joined.splitlines()
    if any(line.startswith("$ ") for line in lines):  # a session with prompts: the rest is output
        lines = [line for line in lines if line.startswith("$ ")]
    found = []
    for line in lines:
        match = PREFIX.match(line)
        if match:
            found.append(re.sub(r"\s+#\s.*$", "", line[match.end():]))
    return found


# ---------------------------------------------------------------- python


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the snippet binds: assignments, loop and with targets, defs, classes, arguments, imports."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound


def _attribute(owner: Any, name: str, where: str) -> Any:
    """owner.name for a ringtrain module (a submodule imported if need be) or class, else a failed test."""
    if isinstance(owner, ModuleType):
        if hasattr(owner, name):
            return getattr(owner, name)
        try:
            return importlib.import_module(f"{owner.__name__}.{name}")
        except ModuleNotFoundError:
            pytest.fail(f"{where}: {owner.__name__}.{name} does not exist")
    if hasattr(owner, name):
        return getattr(owner, name)
    # Instance attributes a class declares without a class-level value: dataclass and pydantic fields,
    # annotations.
    declared = set(getattr(owner, "__dataclass_fields__", {})) | set(getattr(owner, "model_fields", {}))
    for base in getattr(owner, "__mro__", ()):
        declared |= set(getattr(base, "__annotations__", {}))
    if name in declared:
        return None
    pytest.fail(f"{where}: {getattr(owner, '__qualname__', owner)} has no attribute {name!r}")


def check_python(code: str, where: str) -> None:
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        pytest.fail(f"{where}: does not parse: {err}")
    # A class comes from an import or is defined in the snippet (lower-case free names are the reader's own
    # values: build_model, train_ds, args).
    free = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    unknown = sorted(name for name in free - _bound_names(tree) - set(dir(builtins))
                     if re.fullmatch(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*", name))
    assert not unknown, f"{where}: {unknown} used but neither imported nor defined in the snippet"

    # What each name holds, where it is ringtrain's: a module, a class, a function, or an object of a class.
    known: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ringtrain":
                    module = importlib.import_module(alias.name)
                    known[alias.asname or "ringtrain"] = module if alias.asname else importlib.import_module("ringtrain")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ringtrain":
            try:
                module = importlib.import_module(node.module)
            except ModuleNotFoundError:
                pytest.fail(f"{where}: module {node.module} does not exist")
            for alias in node.names:
                known[alias.asname or alias.name] = _attribute(module, alias.name, where)
    if "ringtrain" in free - set(known):
        known["ringtrain"] = importlib.import_module("ringtrain")  # a fragment of a script that imported it

    def resolve(expr: ast.AST) -> Any:
        """The ringtrain object an expression names (ringtrain.train.Session, session.loader), else None."""
        if isinstance(expr, ast.Name):
            return known.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = resolve(expr.value)
            if owner is None or not (isinstance(owner, (ModuleType, type)) or _Instance.of(owner)):
                return None
            if isinstance(owner, _Instance):
                _attribute(owner.cls, expr.attr, where)
                return None
            return _attribute(owner, expr.attr, where)
        return None

    # Objects made by calling a ringtrain class: `session = ringtrain.Session(...)`; their attributes are checked.
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            made = resolve(node.value.func)
            if isinstance(made, type):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        known[target.id] = _Instance(made)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            resolve(node)


@dataclasses.dataclass
class _Instance:
    cls: type

    @staticmethod
    def of(value: Any) -> bool:
        return isinstance(value, _Instance)


@pytest.mark.parametrize("code", blocks_of({"python", "py"}))
def test_a_python_snippet_parses_and_names_what_ringtrain_has(code, request):
    check_python(code, request.node.callspec.id)


# ---------------------------------------------------------------- toml


@pytest.mark.parametrize("code", blocks_of({"toml"}))
def test_a_toml_snippet_that_is_a_config_loads(code, request):
    from ringtrain.config import load_config_dict
    from ringtrain.config.schema import Config

    where = request.node.callspec.id
    try:
        raw = tomllib.loads(code)
    except tomllib.TOMLDecodeError as err:
        pytest.fail(f"{where}: not TOML: {err}")
    if not set(raw) & set(Config.model_fields):
        pytest.skip("not a ringtrain config")
    load_config_dict(raw, source=where)  # a one-line ConfigError fails the test, naming the field


# ---------------------------------------------------------------- command lines

def check_command(line: str, parser: argparse.ArgumentParser, where: str) -> None:
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    words = words[1:]  # 'ringtrain'
    path = ["ringtrain"]
    while True:
        choices = next((action.choices for action in parser._actions
                        if isinstance(action, argparse._SubParsersAction)), None)
        if choices is None or not words:
            break
        word = words[0]
        if word in choices:
            parser = choices[word]
            path.append(word)
            words = words[1:]
            continue
        # A placeholder where a command goes (`ringtrain ...`, `ringtrain COMMAND`) says nothing to check.
        assert word == "..." or word.isupper() or word.startswith(("[", "-")), \
            f"{where}: `{' '.join(path)} {word}`: no such command (the parser has {sorted(choices)})"
        break
    flags = docs_reference.option_strings(parser)
    for word in words:
        word = word.strip("[]()|,")
        if word == "--":
            break  # the script's own arguments follow
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in flags, f"{where}: `{' '.join(path)}` has no flag {flag} (it has {sorted(flags)})"


@pytest.mark.parametrize("code", blocks_of(SHELL_LANGUAGES, holding=lambda code: bool(command_lines(code))))
def test_a_command_line_names_commands_and_flags_that_exist(code, request):
    from ringtrain.cli import build_parser

    for line in command_lines(code):
        check_command(line, build_parser(), request.node.callspec.id)


def test_the_snippet_checks_catch_what_they_are_for():
    """Each check fails on a wrong name (the tests above pass only if these would fail)."""
    from ringtrain.cli import build_parser

    good = "import ringtrain\nsession = ringtrain.Session({})\nsession.backward(loss)\nringtrain.fit(model=m)\n"
    check_python(good, "good")
    for bad in (good.replace("ringtrain.fit", "ringtrain.fitt"),           # a function that is not there
                good.replace("session.backward", "session.backwards"),     # a method the Session lacks
                "from ringtrain.comm import all_reducee\n",                  # an import of a missing name
                "import ringtrain\nringtrain.fit(pp_split=lambda m, n: [LlamaStage(m)])\n"):  # a class from nowhere
        with pytest.raises(BaseException) as failed:
            check_python(bad, "bad")
        assert failed.type in (AssertionError, pytest.fail.Exception), failed.type
    check_command("ringtrain train configs/digits_mlp.toml --nproc 2 --set train.lr=0.1", build_parser(), "good")
    for bad in ("ringtrain trian configs/x.toml", "ringtrain train configs/x.toml --nprocs 2",
                "ringtrain plan layouts --layer 24"):
        with pytest.raises(AssertionError):
            check_command(bad, build_parser(), "bad")
    assert command_lines("$ ringtrain ledger runs/x   # check\nringtrain: error: no\nringtrain collectives: rank 1\n") \
        == ["ringtrain ledger runs/x"]
    assert command_lines("ringtrain ledger runs/x\n  ringtrain summary\n") == ["ringtrain ledger runs/x"]


# ---------------------------------------------------------------- the generated references and the API page


def test_the_cli_reference_has_every_command_and_flag():
    from ringtrain.cli import build_parser

    page = (REPO / "docs" / "cli.md").read_text()
    assert "<!-- generated: cli-reference -->" in page
    reference = docs_reference.cli_reference()
    for path, parser, _ in docs_reference.subcommands(build_parser()):
        assert f"### `ringtrain {' '.join(path)}`" in reference, path
        shown = {flag for action in parser._actions if action.help != argparse.SUPPRESS
                 for flag in action.option_strings}
        for flag in shown - {"-h", "--help"}:
            assert f"`{flag}`" in reference, (path, flag)


def test_the_config_reference_has_every_field_with_its_docstring():
    page = (REPO / "docs" / "config.md").read_text()
    assert "<!-- generated: config-reference -->" in page
    reference = docs_reference.config_reference()
    count = 0
    for prefix, _, fields in docs_reference.config_sections():
        for name, field in fields:
            count += 1
            row = next(line for line in reference.splitlines() if line.startswith(f"| `{prefix}{name}` |"))
            first_words = " ".join((field.description or "").split()[:4])
            assert first_words and first_words.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;") in row, \
                (prefix + name, "has no docstring in the reference")
    assert count > 80 and "| `parallel.tp` |" in reference and "| `checkpoint.async` |" in reference


def test_the_api_page_documents_every_exported_name():
    import ringtrain

    documented = {}
    for path in re.findall(r"^::: ([\w.]+)$", (REPO / "docs" / "api.md").read_text(), flags=re.MULTILINE):
        module, _, name = path.rpartition(".")
        documented[name] = getattr(importlib.import_module(module), name)
    missing = [name for name in ringtrain.__all__ if name != "__version__"
               and documented.get(name) is not getattr(ringtrain, name)]
    assert not missing, f"docs/api.md lacks (or points elsewhere for): {missing}"
