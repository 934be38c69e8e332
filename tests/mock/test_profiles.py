"""One record per engine (``sidecar/testing/mock/profiles.py``): the mock's code reads the record's fields, never a
profile's name; the docs' table is generated from the records, every field has a row; the flags a profile sets
default to its record."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sidecar.testing.mock.config import parse_args
from sidecar.testing.mock.profiles import PROFILES, TABLE, EngineProfile, render_table

ROOT = Path(__file__).resolve().parents[2]
MOCK = ROOT / "sidecar" / "testing" / "mock"
#: The two modules that may name a profile: the records themselves, and the flag that picks one.
_NAMING = {"profiles.py", "config.py"}


def test_every_field_of_the_record_has_a_row_and_every_row_shows_fields() -> None:
    fields = {f.name for f in dataclasses.fields(EngineProfile)} - {"name", "summary"}
    shown = {name for row in TABLE for name in row.fields}
    assert fields - shown == set(), "a field the docs' table does not show"
    assert shown - fields == set(), "a row naming no field of the record"


def test_the_docs_table_is_the_generated_one() -> None:
    doc = (ROOT / "docs" / "mock.md").read_text()
    assert render_table() in doc, "run python scripts/gen_mock_profiles.py"
    header = render_table().splitlines()[0]
    assert [f"`{name}`" for name in PROFILES] == [c.strip() for c in header.strip("|").split("|")][1:]


def test_the_mocks_code_reads_records_not_profile_names() -> None:
    names = "|".join(re.escape(name) for name in PROFILES)
    pattern = re.compile(rf"""["']({names})["']|\.(trt|newer)\b""")
    offenders = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(MOCK.glob("*.py"))
        if path.name not in _NAMING
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize("name", list(PROFILES))
def test_a_profile_sets_the_defaults_of_its_flags_and_flags_still_win(name: str) -> None:
    engine = PROFILES[name]
    config = parse_args(["--profile", name])
    assert config.engine is engine
    assert (config.role, config.engine_name, config.kv_events, config.load_report) == (
        engine.role,
        engine.engine_name,
        engine.kv_events,
        engine.load_report,
    )
    assert (config.max_num_sequences, config.kv_transfer_backend, config.capabilities.guided) == (
        engine.max_num_sequences,
        engine.kv_transfer_backend,
        engine.guided,
    )
    assert config.engine_version.endswith(engine.version_suffix)
    assert (config.max_output_tokens == config.max_context_length) is engine.max_output_tokens_is_window
    flagged = parse_args(["--profile", name, "--role", "decode", "--load-report", "full", "--kv-events", "disabled"])
    assert (flagged.role, flagged.load_report, flagged.kv_events) == ("decode", "full", "disabled")


def test_the_default_profile_is_tensorrt_llms_merged_server() -> None:
    assert parse_args([]).profile == next(iter(PROFILES)) == "trtllm"


def test_a_fourth_engine_is_one_record_and_one_column() -> None:
    fourth = dataclasses.replace(PROFILES["full"], name="other", engine_name="other-engine", streams_eos=False)
    table = render_table({**PROFILES, "other": fourth})
    assert table.splitlines()[0].endswith("| `other` |")
    (eos,) = [line for line in table.splitlines() if line.startswith("| EOS |")]
    assert eos.endswith("| neither streamed nor counted: `finished(STOP)` with `stop_match.eos_token_id` names it |")
