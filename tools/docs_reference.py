"""The site's generated pages, so they cannot drift from the code: the CLI reference from ringtrain/cli.py's
argparse parser, the config reference from ringtrain/config/schema.py's fields (type, default, docstring).

A page asks for one with a marker line, replaced as the site builds (an MkDocs hook, `hooks:` in mkdocs.yml):

    <!-- generated: cli-reference -->
    <!-- generated: config-reference -->

`python tools/docs_reference.py cli|config` prints either, to read without building the site.
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKERS = {
    "<!-- generated: cli-reference -->": lambda: cli_reference(),
    "<!-- generated: config-reference -->": lambda: config_reference(),
    "<!-- generated: readme -->": lambda: repository_page("README.md"),
    "<!-- generated: changelog -->": lambda: repository_page("CHANGELOG.md"),
}


def repository_page(name: str) -> str:
    """A Markdown file of the repository's root as a site page: links into docs/ made the site's own, links to
    the repository's other files named in code (the site holds only docs/)."""
    text = (ROOT / name).read_text()

    def link(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if target.startswith(("#", "http://", "https://")):
            return match.group(0)
        if target.startswith("docs/"):
            return f"[{label}]({target[len('docs/'):]})"
        return label if label.strip("`") == target else f"{label} (`{target}`)"

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", link, text)


# ---------------------------------------------------------------- the command line


def subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
                ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command the parser takes, parents before children: (('bench', 'train'), its parser, its help)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield (*prefix, name), child, helps.get(name) or ""
                yield from subcommands(child, (*prefix, name))


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """The flags a (sub)parser takes, e.g. {'--nproc', '--set', '-h', '--help'}."""
    return {flag for action in parser._actions for flag in action.option_strings}


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _argument_row(action: argparse.Action) -> str:
    if action.option_strings:
        name = ", ".join(f"`{flag}`" for flag in action.option_strings)
        if action.nargs != 0:
            name += f" `{action.metavar or action.dest.upper()}`"
    else:
        name = f"`{action.metavar or action.dest}`"
    help_text = (action.help or "") % {"default": action.default, "prog": ""} if action.help else ""
    extra = []
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        extra.append("choices: " + ", ".join(f"`{choice}`" for choice in action.choices))
    if action.option_strings and action.nargs != 0 and action.default not in (None, [], "", argparse.SUPPRESS) \
            and "default" not in help_text:
        extra.append(f"default: `{action.default}`")
    if isinstance(action, argparse._AppendAction) and "repeatable" not in help_text:
        extra.append("repeatable")
    # A default computed where the parser is built (this machine's Python) is named, not quoted.
    cell = " ".join(help_text.replace(sys.executable, "the Python that runs ringtrain").split())
    if extra:
        cell = f"{cell} ({'; '.join(extra)})" if cell else "; ".join(extra)
    return f"| {_escape(name)} | {_escape(cell)} |"


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """Markdown: a section per command with its usage line and a table of its arguments and flags."""
    if parser is None:
        from ringtrain.cli import build_parser

        parser = build_parser()
    parts = []
    for path, child, help_text in subcommands(parser):
        if any(isinstance(action, argparse._SubParsersAction) for action in child._actions):
            names = next(a for a in child._actions if isinstance(a, argparse._SubParsersAction)).choices
            parts.append(f"### `ringtrain {' '.join(path)}`\n\n{_escape(help_text)}. Its commands: "
                         + ", ".join(f"`{name}`" for name in names) + ".\n")
            continue
        usage = " ".join(child.format_usage().split())
        usage = usage[len("usage: "):] if usage.startswith("usage: ") else usage
        section = [f"### `ringtrain {' '.join(path)}`", ""]
        description = " ".join((child.description or help_text).split())
        if description:
            section += [_escape(description), ""]
        section += ["```text", usage, "```", ""]
        groups = [(group.title, group._group_actions) for group in child._action_groups if group._group_actions]
        for title, actions in groups:
            rows = [_argument_row(action) for action in actions if action.help != argparse.SUPPRESS
                    and "--help" not in action.option_strings]
            if not rows:
                continue
            section += [f"**{title}**", "", "| argument | meaning |", "| --- | --- |", *rows, ""]
        if child.epilog:
            section += [_escape(" ".join(child.epilog.split())), ""]
        parts.append("\n".join(section))
    return "\n".join(parts)


# ---------------------------------------------------------------- the config


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(_toml(arg) for arg in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if origin is None else None
    return text or str(annotation).replace("typing.", "")


def _toml(value: Any) -> str:
    """A value as a config writes it: true, "gloo", [128, 64], {}."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + "}"
    return repr(value)


def _default(field) -> str:
    value = field.get_default(call_default_factory=True)
    return "unset" if value is None else "`" + _toml(value).replace("|", "\\|") + "`"


def config_sections(model=None, prefix: str = "") -> Iterator[tuple[str, Any, list[tuple[str, Any]]]]:
    """(section name, its class, [(field name, pydantic field)]) for the config and each nested section."""
    from pydantic import BaseModel

    if model is None:
        from ringtrain.config.schema import Config

        model = Config
    plain, nested = [], []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((field.alias or name, annotation))
        else:
            plain.append((field.alias or name, field))
    yield prefix, model, plain
    for name, section in nested:
        yield from config_sections(section, f"{prefix}{name}.")


def config_reference() -> str:
    """Markdown: a table per section (field, type, default, its docstring), top-level fields first."""
    parts = []
    for prefix, model, fields in config_sections():
        title = f"`[{prefix.rstrip('.')}]`" if prefix else "Top level"
        rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for name, field in fields:
            doc = " ".join((field.description or "").split())
            rows.append(f"| `{prefix}{name}` | {_escape(_type_name(field.annotation))} | {_default(field)} | "
                        f"{_escape(doc)} |")
        intro = " ".join((model.__doc__ or "").split()) if prefix and model.__doc__ and \
            "Usage docs" not in model.__doc__ else ""
        parts.append("\n".join([f"### {title}", "", *([intro, ""] if intro else []), *rows, ""]))
    return "\n".join(parts)


# ---------------------------------------------------------------- the MkDocs hook


def on_page_markdown(markdown: str, page=None, config=None, files=None, **kwargs) -> str:
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown


if __name__ == "__main__":
    print(cli_reference() if sys.argv[1:] == ["cli"] else config_reference())
