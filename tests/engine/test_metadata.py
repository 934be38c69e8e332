"""RequestMetadata / TraceContext / check_metadata: exact keys and validation (wire contract §7.6)."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.engine import MetadataError, RequestMetadata, TraceContext, check_metadata

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_empty() -> None:
    assert RequestMetadata().pairs() == []


def test_exact_keys_and_order() -> None:
    md = RequestMetadata(
        routing_key="tenant-a",
        target_dp_rank=3,
        priority=-5,
        traceparent=TP,
        tracestate="congo=t61rcWkgMzE",
        extra=(("x-app", "1"),),
    )
    assert md.pairs() == [
        ("openengine-routing-key", "tenant-a"),
        ("openengine-target-dp-rank", "3"),
        ("openengine-priority", "-5"),
        ("traceparent", TP),
        ("tracestate", "congo=t61rcWkgMzE"),
        ("x-app", "1"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"routing_key": ""}, "routing-key"),
        ({"routing_key": "naïve"}, "routing-key"),
        ({"routing_key": "a\nb"}, "routing-key"),
        ({"target_dp_rank": -1}, "target-dp-rank"),
        ({"target_dp_rank": 2**32}, "target-dp-rank"),
        ({"target_dp_rank": True}, "target-dp-rank"),
        ({"target_dp_rank": "1"}, "target-dp-rank"),
        ({"priority": 2**31}, "priority"),
        ({"priority": -(2**31) - 1}, "priority"),
        ({"priority": 1.0}, "priority"),
        ({"traceparent": "nope"}, "traceparent"),
        ({"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, "traceparent"),
        ({"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}, "traceparent"),
        ({"tracestate": "a=b"}, "tracestate without traceparent"),
        ({"extra": (("openengine-priority", "1"),)}, "field"),
        ({"extra": (("traceparent", TP),)}, "field"),
        ({"extra": (("openengine-future", "1"),)}, "not an OpenEngine v0.1.0 metadata key"),
        ({"extra": (("Bad-Key", "1"),)}, "invalid metadata key"),
        ({"extra": (("grpc-timeout", "1S"),)}, "invalid metadata key"),
        ({"extra": (("te", "trailers"),)}, "invalid metadata key"),
        ({"extra": (("x-bin", "AA"),)}, "binary"),
        ({"extra": (("x", ""),)}, "non-empty"),
    ],
)
def test_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(MetadataError, match=match):
        RequestMetadata(**kwargs)


def test_bounds_accepted() -> None:
    RequestMetadata(target_dp_rank=0)
    RequestMetadata(target_dp_rank=2**32 - 1)
    RequestMetadata(priority=-(2**31))
    RequestMetadata(priority=2**31 - 1)
    RequestMetadata(extra=(("x", "1"), ("x", "2")))  # non-reserved keys may repeat


def test_check_metadata_rejects_repeated_reserved_keys() -> None:
    check_metadata([("openengine-routing-key", "a"), ("x", "1")])
    with pytest.raises(MetadataError, match="repeated"):
        check_metadata([("openengine-routing-key", "a"), ("openengine-routing-key", "b")])
    with pytest.raises(MetadataError, match="repeated"):
        check_metadata([("traceparent", TP), *TraceContext(TP).pairs()])


def test_trace_context() -> None:
    assert TraceContext(TP).pairs() == [("traceparent", TP)]
    assert TraceContext(TP, "a=b").pairs() == [("traceparent", TP), ("tracestate", "a=b")]
    with pytest.raises(MetadataError):
        TraceContext("00-xyz")
    with pytest.raises(MetadataError):
        TraceContext(TP, "a=\x00")
    assert issubclass(MetadataError, ValueError)
