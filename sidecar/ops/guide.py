"""The generated parts of ``docs/operator-guide.md``: every flag of ``openengine-sidecar`` and its subcommands, and
every metric family the worker exports.

The flag tables are rendered from the argument parsers themselves (``sidecar.cli.build_parser`` and
``sidecar.ops.cli.build_parser``), the metrics table from the metrics registry (``sidecar.ops.metrics.catalogue``),
each between two marker comments of the hand-written guide, by ``scripts/gen_state_docs.py``; ``--check`` (run by the
test suite) fails when the committed guide differs. Defaults are rendered from a clean environment: the parsers read
their ``DYN_*`` twins as defaults, and the docs must not depend on the machine that generated them.
"""

from __future__ import annotations

import argparse
import os
import re
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["BEGIN", "END", "METRICS_BEGIN", "METRICS_END", "flag_tables", "metrics_table", "update_guide"]

BEGIN: Final = "<!-- BEGIN GENERATED FLAGS (scripts/gen_state_docs.py; edit sidecar/cli.py, not this table) -->"
END: Final = "<!-- END GENERATED FLAGS -->"
METRICS_BEGIN: Final = (
    "<!-- BEGIN GENERATED METRICS (scripts/gen_state_docs.py; edit the metric definitions, not this table) -->"
)
METRICS_END: Final = "<!-- END GENERATED METRICS -->"

#: ``[env NAME]`` or ``[env NAME, OTHER]`` (a flag with two twins) ending a flag's help.
_ENV = re.compile(r"\s*\[env ([A-Z0-9_]+(?:, [A-Z0-9_]+)*)\]\s*$")


@contextmanager
def _clean_environment() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("DYN_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _rows(actions: list[argparse.Action]) -> list[str]:
    rows = []
    for action in actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        help_text = action.help or ""
        env = ""
        match = _ENV.search(help_text)
        if match:
            env = ", ".join(f"`{name}`" for name in match.group(1).split(", "))
            help_text = help_text[: match.start()]
        if action.choices is not None:
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
        if action.nargs == 0:
            default = ("`on`" if action.default else "`off`") if isinstance(action.default, bool) else ""
        elif action.default is None:
            default = "—"
        else:
            default = f"`{action.default}`"
        rows.append(f"| {flags} | {env} | {default} | {_cell(help_text)} |")
    return rows


def flag_tables() -> str:
    """Markdown: one table per flag group of the worker, one per operator subcommand."""
    from sidecar.cli import build_parser
    from sidecar.ops.cli import build_parser as build_ops_parser

    with _clean_environment():
        worker = build_parser()
        ops = build_ops_parser()
    out: list[str] = []
    head = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for group in worker._action_groups:
        rows = _rows(group._group_actions)
        if rows:
            out += [f"#### `openengine-sidecar` — {group.title}", "", *head, *rows, ""]
    subparsers = next(a for a in ops._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subparsers.choices.items():
        out += [f"#### `openengine-sidecar {name}`", "", _cell(parser.description or ""), ""]
        out += [*head, *_rows(parser._actions), ""]
    return "\n".join(out).rstrip() + "\n"


def metrics_table() -> str:
    """Markdown: one row per exported family (every module that registers metrics is imported first)."""
    import sidecar.kv  # noqa: F401 -- registers the routing-signal families
    from sidecar.ops import metrics

    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for doc in metrics.catalogue():
        labels = ", ".join(f"`{label}`" for label in doc.labels)
        rows.append(f"| `{doc.name}` | {doc.type} | {labels} | {_cell(doc.help)} |")
    return "\n".join(rows) + "\n"


def _replace(text: str, begin: str, end: str, body: str) -> str:
    start = text.index(begin) + len(begin)
    stop = text.index(end, start)
    return f"{text[:start]}\n\n{body}\n{text[stop:]}"


def update_guide(text: str) -> str:
    """``text`` with the regions between :data:`BEGIN`/:data:`END` and :data:`METRICS_BEGIN`/:data:`METRICS_END`
    replaced by :func:`flag_tables` and :func:`metrics_table`."""
    return _replace(_replace(text, BEGIN, END, flag_tables()), METRICS_BEGIN, METRICS_END, metrics_table())
