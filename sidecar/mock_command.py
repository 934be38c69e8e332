"""``openengine-mock`` as openengine-sidecar installs it: runs the test engine when its own distribution is installed,
otherwise says in one line how to get it.

The mock (``sidecar/testing``, distribution ``openengine-mock``) is a tool beside the product: openengine-sidecar's
wheel and image never carry it, and production code never imports it. This command names it only as a string, at run
time, so that the command a launcher or a user types keeps one name whether the mock is there or not.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

__all__ = ["DISTRIBUTION", "NOT_INSTALLED", "main"]

#: The mock's distribution (``sidecar/testing/pyproject.toml``).
DISTRIBUTION = "openengine-mock"
#: The one line printed when it is missing (exit status 1).
NOT_INSTALLED = (
    "openengine-mock: not installed (it is the test engine, not part of openengine-sidecar): "
    "in a source checkout run `bash launch/setup.sh`, or `pip install ./sidecar/testing`"
)


def main() -> None:
    """Run ``openengine-mock`` with this process's arguments, or explain in one line that it is not installed."""
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        print(NOT_INSTALLED, file=sys.stderr)
        sys.exit(1)
    importlib.import_module("sidecar.testing.mock.__main__").main()
