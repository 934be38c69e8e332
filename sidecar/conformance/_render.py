"""The report as text lines, one JSON object, or a Markdown table."""

from __future__ import annotations

import json

from ._model import CheckResult, Report

__all__ = ["header_line", "json_text", "markdown", "result_line"]

_ID_WIDTH = 34


def header_line(report: Report) -> str:
    s = report.server
    if not s:
        return f"engine {report.engine}: no ServerInfo"
    version = f" {s['engine_version']}" if s.get("engine_version") else ""
    return (
        f"engine {report.engine}: {s['engine_name']}{version}, role {s['engine_role']},"
        f" schema revision {s['schema_revision']} release {s['schema_release']!r}, model {s['model']!r}"
    )


def result_line(result: CheckResult) -> str:
    """``PASS     stream.output_index_set             evidence  [cites]``."""
    return f"{result.verdict.value.upper():<8} {result.id:<{_ID_WIDTH}} {result.evidence}  [{result.cites}]"


def json_text(report: Report) -> str:
    return json.dumps(report.as_json(), indent=2, ensure_ascii=False)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(report: Report) -> str:
    lines = [
        f"Result of `openengine-conformance` against {_cell(header_line(report))}",
        "",
        "| check | rule | cites | verdict | evidence |",
        "|---|---|---|---|---|",
    ]
    for r in report.results:
        lines.append(f"| `{r.id}` | {_cell(r.rule)} | {_cell(r.cites)} | {r.verdict.value} | {_cell(r.evidence)} |")
    lines += ["", report.totals_line()]
    return "\n".join(lines)
