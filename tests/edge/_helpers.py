"""Small helpers shared by the edge tests."""

from __future__ import annotations

from typing import Final

# The absolute bound on every test body (rule: a hang fails, it never blocks CI).
TIMEOUT: Final = 20.0


class Boom(Exception):
    """An exception that only the test raises, so identity checks cannot be fooled."""
