"""Where a ``Generate`` stream's messages go when they are consumed on the edge loop itself (no trio in between)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["GenerateSink"]


class GenerateSink(Protocol):
    """The consumer of one stream's messages, called on the edge loop thread only (``sidecar.datapath.DataPath``).

    The producer (``EngineClient.start_generate``: grpclib's receive path or ``_direct``) calls :meth:`push` with
    the messages of each read, in order, then :meth:`end` (status OK) or :meth:`fail` (the error, as
    :class:`~sidecar.errors.EngineRpcError` where it is a status or a transport failure), and sets :attr:`on_cancel`
    to what resets its stream (RST_STREAM) while it is open. ``push`` returns whether the sink takes more; a producer
    told no holds back the engine's flow control and calls :meth:`hold` with the callback that resumes it.
    """

    on_cancel: Callable[[], object] | None

    @property
    def has_room(self) -> bool: ...

    def push(self, items: list[Any]) -> bool: ...

    def hold(self, on_room: Callable[[], None]) -> None: ...

    def end(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def fail_cancelled(self) -> None: ...

    def after_round(self, callback: Callable[[], None]) -> None: ...
