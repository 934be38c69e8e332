"""``openengine-mock`` / ``python -m sidecar.testing.mock``: run the simulated engine (flags: ``docs/mock.md``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from .config import parse_args
from .server import serve

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, serve until SIGTERM/SIGINT, exit 0."""
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level,
        stream=sys.stderr,
        format="%(asctime)s openengine-mock %(levelname)s %(message)s",
    )
    logging.getLogger("grpclib").setLevel(logging.WARNING)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency
        import asyncio

        code = asyncio.run(serve(config))
    else:
        code = uvloop.run(serve(config))
    sys.exit(code)


if __name__ == "__main__":
    main()
