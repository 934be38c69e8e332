"""Test-only launcher: ``python -m sidecar`` with the routing signals wired in from the outside.

Until ``sidecar.worker`` starts :func:`sidecar.kv.run_routing_signals` itself (``KV_ROUTING_WIRED``), this wraps
three of its collaborators -- ``discover`` (also discovers the KV event sources), ``registration_for`` (applies the
routing plan) and ``DynamoWorker.serve`` (starts the signals in the request nursery once serving) -- and runs the
real worker. Used by ``tests/e2e/test_kv_routing.py`` when ``OPENENGINE_KV_E2E_WORKER`` names this file; the real
end-to-end run uses ``python -m sidecar``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sidecar.worker as worker_module
from sidecar.cli import main
from sidecar.dynamo import DynamoWorker
from sidecar.kv import RoutingPlan, discover_routing, routing_config, run_routing_signals

if TYPE_CHECKING:
    import trio

    from sidecar.cli import SidecarConfig
    from sidecar.dynamo import Registration
    from sidecar.engine import EngineClient
    from sidecar.startup import Discovery

_state: dict[str, Any] = {}
_module = vars(worker_module)
_discover = _module["discover"]
_registration_for = _module["registration_for"]
_serve = DynamoWorker.serve


async def discover(client: EngineClient, config: SidecarConfig) -> Discovery:
    found: Discovery = await _discover(client, config)
    if "plan" not in _state:
        _state["plan"] = await discover_routing(client, found.caps, routing_config(config))
        _state["client"] = client
        _state["config"] = config
    return found


def registration_for(discovery: Discovery, config: SidecarConfig) -> Registration:
    plan: RoutingPlan | None = _state.get("plan")
    registration: Registration = _registration_for(discovery, config)
    return plan.registration(registration) if plan is not None else registration


async def serve(self: DynamoWorker, nursery: trio.Nursery, *args: Any, **kwargs: Any) -> None:
    await _serve(self, nursery, *args, **kwargs)
    await nursery.start(run_routing_signals, _state["client"], self, _state["plan"], routing_config(_state["config"]))


_module["discover"] = discover
_module["registration_for"] = registration_for
DynamoWorker.serve = serve  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
