"""MkDocs hook: renders the option reference into docs/options.md at build time.

The page holds the marker below; `on_page_markdown` replaces it with one table per config section,
built from the argparse parser that `cloudtrain.config.add_config_arguments` makes (the same parser
behind `cloudtrain --help`), so a new option or a changed choice shows up without editing the page.
Each row: the flag, its value (the metavar `--help` shows: a type, `true|false`, or the choices), the
default (the value a fresh `Config()` holds) and the help text of `--help`. Only public pieces are read
(add_config_arguments, Config and its dataclass fields), since the config package's internals change.
"""

import argparse
import dataclasses
import html
import re
import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- cloudtrain-options -->"
SRC = Path(__file__).resolve().parents[2] / "src"
GENERAL = "general"  # the parser's own group: --help and --config


def _config_module() -> Any:
    """cloudtrain.config of this checkout (src/ first on sys.path), not of whatever is installed."""
    if SRC.is_dir() and str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    from cloudtrain import config

    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloudtrain")
    _config_module().add_config_arguments(parser)
    return parser


def config_fields() -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """{option name: (section name, field, default value)} from the Config dataclass."""
    cfg = _config_module().Config()
    fields = {}
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            fields[f.name] = (section.name, f, getattr(values, f.name))
    return fields


def sections(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """[(section name, actions)] in --help order; actions that are no config field go to `general`."""
    fields = config_fields()
    out: dict[str, list[argparse.Action]] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.option_strings:
                name = fields[action.dest][0] if action.dest in fields else GENERAL
                out.setdefault(name, []).append(action)
    general = out.pop(GENERAL, [])
    return ([(GENERAL, general)] if general else []) + list(out.items())


def _value(action: argparse.Action) -> str:
    metavar = action.metavar
    if isinstance(metavar, str) and metavar.startswith("{") and metavar.endswith("}"):
        return "one of " + ", ".join(f"<code>{html.escape(c)}</code>" for c in metavar[1:-1].split(","))
    if metavar:
        return f"<code>{html.escape(str(metavar))}</code>"
    return "(no value)" if action.nargs == 0 else f"<code>{html.escape(action.dest.upper())}</code>"


def _meta(field: dataclasses.Field, key: str, default: Any = None) -> Any:
    value = field.metadata.get(key, default)
    return value() if callable(value) else value


def _default(field: dataclasses.Field, value: Any) -> str:
    if _meta(field, "secret"):
        return "(not shown)"
    if value is None or value == []:
        return "&mdash;"
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif isinstance(value, list):
        value = _meta(field, "separator", ",").join(map(str, value))
    return f"<code>{html.escape(str(value))}</code>"


def _plain_help(action: argparse.Action, value: Any) -> str:
    """The --help text without what the value and default columns already show (when it is said exactly so)."""
    text = (action.help or "").replace("%%", "%")
    metavar = action.metavar
    if isinstance(metavar, str) and metavar.startswith("{") and metavar.endswith("}"):
        text = text.replace(f" Choices: {', '.join(metavar[1:-1].split(','))}.", "")
    if value not in (None, []):
        shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        text = text.removesuffix(f" (default: {shown})")
    return text


def _help(text: str, known: set[str]) -> str:
    """Escaped help text, every mention of another option linked to its row."""

    def link(match: re.Match) -> str:
        name = match.group(1)
        if name not in known:
            return match.group(0)
        return f'<a href="#opt-{name}"><code>--{name}</code></a>'

    return re.sub(r"--([a-z][a-z0-9_]*)", link, html.escape(text, quote=False))


def render(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or build_parser()
    fields = config_fields()
    groups = sections(parser)
    known = {a.dest for _, actions in groups for a in actions}
    parts = []
    for name, actions in groups:
        if name == GENERAL:
            parts.append(f"## {GENERAL}\n\nOptions of the command line itself.\n")
        else:
            section_class = type(getattr(_config_module().Config(), name)).__name__
            parts.append(
                f"## {name}\n\nThe `{section_class}` section: `{name}:` in a config file that groups its options.\n"
            )
        rows = []
        for action in actions:
            flags = ", ".join(f"<code>{html.escape(s)}</code>" for s in action.option_strings)
            if action.dest in fields:
                _, field, value = fields[action.dest]
                default, text = _default(field, value), _plain_help(action, value)
            else:
                default, text = "&mdash;", _plain_help(action, None)
            rows.append(
                f'<tr id="opt-{action.dest}"><td>{flags}</td><td>{_value(action)}</td>'
                f"<td>{default}</td><td>{_help(text, known)}</td></tr>"
            )
        parts.append(
            '<table class="cloudtrain-options">\n'
            "<thead><tr><th>flag</th><th>value</th><th>default</th><th>what it does</th></tr></thead>\n"
            "<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>\n"
        )
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "options.md":
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/options.md lost its marker {MARKER}: the option tables have nowhere to go")
    return markdown.replace(MARKER, render())
