"""The load poller: ``GetLoad(include_per_rank=true)`` every interval → per-rank KV usage to Dynamo's router.

A snapshot is published only when it passes :func:`~sidecar.kv._convert.check_load` (fresh, every served rank,
``used <= total``). Anything else -- a refused snapshot, a failed or timed-out poll -- publishes *nothing*: Dynamo's
``WorkerMetricsPublisher`` cannot say "unknown" (it refuses a call without figures), and re-sending the last good
figures is exactly the stale load the Rust sidecar is known for. Every such poll is counted by reason
(``openengine_sidecar_load_snapshots_rejected``), ``openengine_sidecar_load_fresh`` drops to 0, and a warning is
logged when the reason first appears (then at most once a minute while it persists).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final

import trio

from sidecar.errors import EngineRpcError, GrpcCode

from . import _metrics as m
from ._convert import InvalidLoad, check_load

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._config import RoutingConfig
    from ._types import LoadPublisher, RoutingClient

__all__ = ["poll_load"]

log: Final = logging.getLogger("sidecar.kv")

_REPEAT_WARNING_S: Final = 60.0


async def poll_load(
    client: RoutingClient,
    sink: LoadPublisher,
    ranks: Sequence[int],
    config: RoutingConfig,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Poll and publish until cancelled; the first poll happens at once, ``task_status.started()`` after it."""
    max_age_ns = int(config.load_max_age_s * 1e9)
    max_future_ns = int(config.load_max_future_s * 1e9)
    fresh: bool | None = None
    last_reason = ""
    last_warned = -float("inf")
    started = False
    while True:
        tick = trio.current_time()
        reason = ""
        try:
            load = await client.get_load(True, timeout_s=config.load_timeout_s)
            figures = check_load(load, ranks, now_ns=time.time_ns(), max_age_ns=max_age_ns, max_future_ns=max_future_ns)
        except EngineRpcError as exc:
            if exc.code is GrpcCode.UNIMPLEMENTED:
                log.info("the engine does not implement GetLoad: no load is published to Dynamo's router")
                m.LOAD_FRESH.set(0)
                if not started:
                    task_status.started()
                return
            reason, message = "rpc_failed", str(exc)
        except InvalidLoad as exc:
            reason, message = exc.reason, str(exc)
        else:
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
                log.warning("not publishing load to Dynamo's router (%s): %s", reason, message)
                last_warned = now
            fresh = False
        last_reason = reason
        if not started:
            started = True
            task_status.started()
        await trio.sleep_until(tick + config.load_poll_interval_s)
