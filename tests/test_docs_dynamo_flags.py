"""``docs/operator-guide.md``, "Dynamo's own sidecar, flag by flag": one row per flag of Dynamo's own TensorRT-LLM
sidecar, as its ``--help`` in the installed wheel states it (flag, values, variable, default), each a flag this worker
accepts. A flag a new Dynamo release adds fails here until the table has its row (issue 36 §1)."""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.cli import build_parser
from tests.helpers.cli import dynamo_sidecar_flags

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operator-guide.md"
SECTION = "## Dynamo's own sidecar, flag by flag"


def table() -> dict[str, list[str]]:
    text = GUIDE.read_text()
    start = text.index(SECTION)
    body = text[start : text.index("\n## ", start + len(SECTION))]
    rows: dict[str, list[str]] = {}
    for line in body.splitlines():
        match = re.match(r"^\| `(--[a-z-]+)`", line)
        if match:
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            assert len(cells) == 6, line
            rows[match.group(1)] = cells
    return rows


def test_the_table_has_one_row_per_flag_of_theirs_with_what_their_help_says() -> None:
    rows = table()
    theirs = dynamo_sidecar_flags()
    assert sorted(rows) == sorted(f.flag for f in theirs)
    ours = {flag for action in build_parser()._actions for flag in action.option_strings}
    for their in theirs:
        flag_cell, variable, default, here, same, _why = rows[their.flag]
        assert their.flag in ours, their.flag
        stated = "—" if their.env is None else f"`{their.env}`"
        assert variable == stated or variable.startswith(f"{stated} ("), their.flag
        if their.choices:
            assert f"({', '.join(their.choices)})" in flag_cell, their.flag
        if their.default is not None:
            assert default.startswith(their.default), (their.flag, default)
        assert here, their.flag
        assert same, their.flag
