"""Run the selected checks in order against one engine and collect the report."""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import Callable

from openengine.v1 import openengine_grpc, server_pb2

from . import _disagg, _discovery, _kv, _lifecycle, _lora, _stop, _stream, _validation
from ._context import Context, KitConfig
from ._model import CheckResult, FailCheck, Outcome, Report, SkipCheck
from ._registry import CHECKS, Check
from ._wire import call

__all__ = ["GROUPS", "Unreachable", "run", "selected_checks"]

# The modules register their checks on import; the names keep the imports from looking unused.
_MODULES = (_discovery, _disagg, _kv, _lifecycle, _lora, _stop, _stream, _validation)

#: Run order: cheap and read-only first, destructive last.
GROUPS = ("discovery", "control", "validation", "stream", "abort", "kv", "lora", "disagg", "stop")


class Unreachable(Exception):
    """No OpenEngine server answers at an endpoint (connection refused, TLS failure, no answer in time)."""


def selected_checks(only: tuple[str, ...] = ()) -> list[Check]:
    """Every check in run order, or those whose id or group matches one of the ``only`` patterns."""
    ordered = sorted(CHECKS, key=lambda c: GROUPS.index(c.group))
    if not only:
        return ordered
    return [c for c in ordered if any(fnmatch.fnmatchcase(c.id, p) or c.group == p for p in only)]


def _server_summary(ctx: Context) -> dict[str, object]:
    info = ctx.server_info.response
    if info is None:
        return {}
    role = server_pb2.EngineRole.Name(ctx.role).removeprefix("ENGINE_ROLE_")
    return {
        "engine_name": info.engine_name,
        "engine_version": info.engine_version,
        "instance_id": info.instance_id,
        "engine_role": role,
        "schema_revision": info.schema_revision,
        "schema_release": info.schema_release,
        "model": ctx.model,
    }


async def _preflight(config: KitConfig, ctx: Context) -> None:
    await ctx.discover()
    if ctx.server_info.status is None:
        raise Unreachable(f"cannot reach an engine at {config.target.text}: {ctx.server_info.error}")
    if config.decode_target is not None:
        channel = config.decode_target.channel()
        try:
            answer = await call(
                openengine_grpc.ControlStub(channel).GetServerInfo,
                server_pb2.GetServerInfoRequest(),
                bound=config.rpc_timeout,
            )
        finally:
            channel.close()
        if answer.status is None:
            raise Unreachable(f"cannot reach the decode engine at {config.decode_target.text}: {answer.error}")


async def _run_one(ctx: Context, check: Check) -> Outcome:
    try:
        return await asyncio.wait_for(check.run(ctx), ctx.config.check_timeout)
    except SkipCheck as exc:
        return Outcome.skipped(str(exc))
    except FailCheck as exc:
        return Outcome.failed(str(exc))
    except TimeoutError:
        return Outcome.failed(f"no answer within {ctx.config.check_timeout:g} s (the check did not finish)")
    except Exception as exc:  # a kit defect must not hide the other checks' results
        return Outcome.failed(f"the kit hit an unexpected error: {exc!r}")


async def run(
    config: KitConfig,
    on_result: Callable[[CheckResult], None] | None = None,
    on_start: Callable[[Report], None] | None = None,
) -> Report:
    """Run the checks of ``config``; raise :class:`Unreachable` if no engine answers at all.

    ``on_start`` sees the report once discovery is done, ``on_result`` each result as it comes (for live output).
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    ctx = Context(config)
    try:
        await _preflight(config, ctx)
        report = Report(engine=config.target.text, server=_server_summary(ctx))
        if on_start is not None:
            on_start(report)
        for check in selected_checks(config.only):
            check_started = loop.time()
            outcome = await _run_one(ctx, check)
            result = CheckResult(
                check.id, check.rule, check.cites, outcome.verdict, outcome.evidence, loop.time() - check_started
            )
            report.results.append(result)
            if on_result is not None:
                on_result(result)
        report.seconds = loop.time() - started
        return report
    finally:
        await ctx.aclose()
