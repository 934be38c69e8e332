"""Prometheus metrics of the sidecar (prometheus-client's default registry).

Label values come from fixed sets (outcomes, violation names, RPC names), so cardinality stays bounded; request ids
never become labels.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

REQUESTS_RECEIVED: Final = Counter(
    "openengine_sidecar_requests_received", "Generation requests handed to the worker by Dynamo"
)
REQUESTS_ENDED: Final = Counter(
    "openengine_sidecar_requests_ended",
    "Generation requests by terminal outcome (finished, rejected, cancelled, failed)",
    ["outcome"],
)
PROTOCOL_VIOLATIONS: Final = Counter(
    "openengine_sidecar_protocol_violations",
    "Engine responses that broke the OpenEngine stream contract",
    ["violation"],
)
ABORTS: Final = Counter(
    "openengine_sidecar_aborts", "Control.Abort calls sent for requests that ended early", ["result"]
)
ABORT_LATENCY: Final = Histogram(
    "openengine_sidecar_abort_latency_seconds",
    "Time to complete Control.Abort",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
WORKER_STATE: Final = Gauge(
    "openengine_sidecar_worker_state", "1 for the worker's current lifecycle state, 0 for the others", ["state"]
)
