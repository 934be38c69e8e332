"""The repository stands on its own: no tracked file cites the project's private reference notes.

Those notes (a directory of reference notes beside the repository, one file per subject) were where the facts
this code relies on were first written down; a user of the repository has none of them. Docs, code comments and tests
state the facts themselves, or cite what a user can read (the ``.proto`` files, upstream pull requests, our own docs).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: The notes' file names, and the path that reached them. Spelled in pieces so that this file does not cite them.
_NOTES: tuple[str, ...] = ("dynamo-runtime", "dynamo-sidecar", "grpc-stack", "openengine-wire-v0.1.0")
_NOTES += ("style-anchors", "tensorrt-llm-openengine")
CITATION = re.compile(
    "|".join(
        [re.escape("../" + "shared/"), re.escape("shared/" + "reference"), *(re.escape(n + ".md") for n in _NOTES)]
    )
)


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in listed.decode().split("\0") if name]


def citations(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if CITATION.search(line)]


def test_no_tracked_file_cites_the_reference_notes() -> None:
    found: dict[str, list[str]] = {}
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files; a file deleted but not yet committed
        if lines := citations(text):
            found[str(path.relative_to(REPO))] = lines
    assert not found, "state the fact in the repository instead:\n" + "\n".join(
        f"{name}: {line[:140]}" for name, lines in sorted(found.items()) for line in lines
    )


@pytest.mark.parametrize(
    "line",
    [
        "see `../" + "shared/" + "reference/x.md`",
        "(``dynamo-runtime" + ".md`` §3.7)",
        "as tensorrt-llm-openengine" + ".md describes",
        "/work/" + "shared/" + "reference/openengine-wire-v0.1.0" + ".md",
    ],
)
def test_a_citation_is_found(line: str) -> None:
    assert citations(f"text\n{line}\nmore") == [line]


def test_plain_words_are_not_citations() -> None:
    assert citations("a shared reference; dynamo-runtime 1.6.1; the grpc stack; docs/conformance.md") == []
