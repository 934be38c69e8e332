"""The load poller: ``GetLoad(include_per_rank=true)`` every interval → per-rank KV usage to Dynamo's router.

A snapshot is published only when it passes :func:`~sidecar.kv._convert.check_load` (fresh, every served rank,
``used <= total``). Anything else -- a refused snapshot, a failed or timed-out poll -- publishes *nothing*: Dynamo's
``WorkerMetricsPublisher`` cannot say "unknown" (it refuses a call without figures), and re-sending the last good
figures is exactly the stale load the Rust sidecar is known for. Every such poll is counted by reason
(``openengine_sidecar_load_snapshots_rejected``), ``openengine_sidecar_load_fresh`` drops to 0, and a warning is
logged when the reason first appears (then at most once a minute while it persists).

**Estimated load** (an engine that reports no KV usage, as TensorRT-LLM's baseline ``GetLoad``: ``running_requests``
only): a single-rank worker publishes an estimate instead of nothing, so Dynamo's router still balances: the KV blocks
its in-flight requests occupy, ``ceil((prompt + generated tokens) / block_size)`` summed over the requests this worker
has in flight (prefix-cache sharing is not subtracted: an upper bound). It is logged once at INFO, counted as a
published snapshot and shown as ``openengine_sidecar_engine_kv_blocks{kind="used"}``; a multi-rank worker cannot
tell which rank holds a request and still publishes nothing.

**Engine identity**: every answer is handed to :class:`EngineIdentity`: an ``instance_id`` other than the discovered
one is an engine restart (even one quicker than the health watch notices), and any answer tells a reconnecting worker
that the engine is back.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Final

import trio

from sidecar.errors import EngineRpcError, GrpcCode

from . import _metrics as m
from ._convert import InvalidLoad, check_load

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._config import RoutingConfig
    from ._types import LoadPublisher, RoutingClient

__all__ = ["EngineIdentity", "estimate_blocks", "poll_load"]

log: Final = logging.getLogger("sidecar.kv")

_REPEAT_WARNING_S: Final = 60.0


class EngineIdentity:
    """What the load poller learns about the engine between two health polls: that it answers, and which instance
    it is. The worker :meth:`expect`-s the discovered ``instance_id``; an answer naming another sets :attr:`changed`
    (the engine restarted); every answer sets :attr:`answered` (replace it with a fresh event to wait for the next)."""

    def __init__(self, expected: str = "") -> None:
        self.expected = expected
        #: The instance id that differed from the expected one (valid once :attr:`changed` is set).
        self.seen = ""
        self.changed = trio.Event()
        self.answered = trio.Event()

    def expect(self, instance_id: str) -> None:
        """The instance the worker serves now (after discovery); forgets an earlier change."""
        self.expected = instance_id
        self.seen = ""
        if self.changed.is_set():
            self.changed = trio.Event()

    def observe(self, instance_id: str | None) -> None:
        """A GetLoad answer naming ``instance_id`` (empty or None: the engine does not say)."""
        self.answered.set()
        if instance_id and self.expected and instance_id != self.expected and not self.changed.is_set():
            self.seen = instance_id
            self.changed.set()


def estimate_blocks(tokens_in_flight: Sequence[int], block_size: int) -> int:
    """The KV blocks requests holding ``tokens_in_flight`` tokens each occupy (one partial block per request)."""
    return sum(math.ceil(tokens / block_size) for tokens in tokens_in_flight if tokens > 0)


async def poll_load(
    client: RoutingClient,
    sink: LoadPublisher,
    ranks: Sequence[int],
    config: RoutingConfig,
    *,
    identity: EngineIdentity | None = None,
    in_flight: Callable[[], Sequence[int]] | None = None,
    block_size: int | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Poll and publish until cancelled; the first poll happens at once, ``task_status.started()`` after it.

    ``identity`` receives every answer's ``instance_id``. ``in_flight`` (the token count of each request in flight)
    and ``block_size`` enable the estimate published when the engine reports no KV usage (single rank only).
    """
    estimating = False
    max_age_ns = int(config.load_max_age_s * 1e9)
    max_future_ns = int(config.load_max_future_s * 1e9)
    fresh: bool | None = None
    last_reason = ""
    last_warned = -float("inf")
    started = False
    while True:
        tick = trio.current_time()
        reason = ""
        level = logging.WARNING
        try:
            load = await client.get_load(True, timeout_s=config.load_timeout_s)
            if identity is not None:
                identity.observe(load.instance_id)
            figures = check_load(load, ranks, now_ns=time.time_ns(), max_age_ns=max_age_ns, max_future_ns=max_future_ns)
        except EngineRpcError as exc:
            if exc.code is GrpcCode.UNIMPLEMENTED:
                log.info("the engine does not implement GetLoad: no load is published to Dynamo's router")
                m.LOAD_FRESH.set(0)
                if not started:
                    task_status.started()
                return
            reason, message = "rpc_failed", str(exc)
            if exc.code is GrpcCode.UNAVAILABLE:
                # An engine that is not there is the engine watch's to report (the worker leaves serving for
                # reconnecting, one line); a warning here for every outage would say it twice, above INFO.
                level = logging.INFO
        except InvalidLoad as exc:
            reason, message = exc.reason, str(exc)
            if reason == "no_kv_usage" and in_flight is not None and block_size and len(ranks) == 1:
                used = estimate_blocks(in_flight(), block_size)
                await sink.publish([(ranks[0], used)])
                m.RANK_KV_BLOCKS.labels(rank=str(ranks[0]), kind="used").set(used)
                m.LOAD_PUBLISHED.inc()
                m.LOAD_FRESH.set(1)
                if not estimating:
                    log.info(
                        "the engine reports no KV usage (%s): publishing an estimate to Dynamo's router, the KV blocks "
                        "of the requests in flight here (block size %d)",
                        message,
                        block_size,
                    )
                estimating, fresh, reason = True, True, ""
        else:
            estimating = False
            await sink.publish([(f.rank, f.used_blocks) for f in figures])
            for f in figures:
                m.RANK_KV_BLOCKS.labels(rank=str(f.rank), kind="used").set(f.used_blocks)
                m.RANK_KV_BLOCKS.labels(rank=str(f.rank), kind="total").set(f.total_blocks)
            m.LOAD_PUBLISHED.inc()
            m.LOAD_FRESH.set(1)
            if fresh is False:
                log.info("load is known again: publishing per-rank KV usage to Dynamo's router")
            fresh = True
        if reason:
            m.LOAD_REJECTED.labels(reason=reason).inc()
            m.LOAD_FRESH.set(0)
            now = trio.current_time()
            if reason != last_reason or now - last_warned >= _REPEAT_WARNING_S:
                log.log(level, "not publishing load to Dynamo's router (%s): %s", reason, message)
                last_warned = now
            fresh = False
        last_reason = reason
        if not started:
            started = True
            task_status.started()
        await trio.sleep_until(tick + config.load_poll_interval_s)
