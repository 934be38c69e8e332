"""Failures that belong to the bridge itself, as opposed to the ones that merely cross it."""

from __future__ import annotations

__all__ = ["BridgeCancelled", "EdgeClosed", "EdgeError"]


class EdgeError(RuntimeError):
    """Base of the bridge's own failures. Exceptions raised by bridged code cross unchanged and never subclass this."""


class EdgeClosed(EdgeError):
    """The other side is gone: the edge loop is closed or shutting down, trio has finished, or the nursery is closed."""


class BridgeCancelled(EdgeError):
    """The other side's task was cancelled by something other than this caller (an outer trio scope, for example).

    The message carries the original cancellation text, which on trio >= 0.31 includes the scope's reason.
    """
