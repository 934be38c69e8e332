"""``python -m sidecar`` is ``openengine-sidecar``."""

from sidecar.cli import main

main()
