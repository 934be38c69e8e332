"""The disaggregation handoff: ``KvSessionRef`` (upb) ⇄ the JSON Dynamo carries as ``disaggregated_params``.

Context-first disaggregation (as Dynamo's TensorRT-LLM sidecar on OpenEngine does it): the prefill worker's final
chunk carries the engine's ``PrefillReady.kv_session`` as JSON; the frontend hands that JSON, untouched, to the decode
worker as ``prefill_result.disaggregated_params``; the decode worker replays it as ``GenerateRequest.kv.session``.
Both ends are this module.

The JSON is the ``KvSessionRef`` with its proto field names::

    {"session_id": "12", "transfer_backend": "NIXL", "dp_rank": 0,
     "endpoints": [{"host": "10.0.0.5", "port": 5555, "protocol": "tcp"}],
     "attributes_struct": {...engine data, opaque to us...}}

Rules, both directions:

* **Number fidelity** (wire reference §7.7). ``attributes_struct`` is a ``google.protobuf.Struct``, whose numbers are
  doubles: a whole double comes out as a JSON integer (``3.0`` → ``3``), a fraction unrounded, a string stays a string
  (engines carry large ids such as TensorRT-LLM's ``disagg_request_id`` as decimal strings). Replaying it gives the
  engine the very same doubles and strings back. A JSON integer beyond 2^53 cannot become a Struct number without
  being rounded, so decoding refuses it (naming the field) instead of silently handing the engine another id; NaN and
  infinities are refused as well. Explicit zeros and ``false`` are kept.
* **Unknown fields.** Everything inside ``attributes_struct`` is kept verbatim, known or not. Unknown top-level keys
  and unknown keys inside an endpoint are accepted (rolling upgrades: a newer prefill worker may add fields) but have
  nowhere to go in a ``KvSessionRef``, so they are dropped.
* **Validation** names the offending field: every top-level field is required (``attributes_struct`` may be null; the
  key ``attributes``, TensorRT-LLM's Rust sidecar's spelling, is accepted instead), ``session_id`` is a non-empty
  string, ``dp_rank`` a uint32, each endpoint has a non-empty host, a port in 1…65535 and a non-empty protocol.
  Decoding also checks the session against this engine's KV connector: the transfer backend must be the connector's
  (case-insensitive), and an endpoint protocol must be one the connector lists (when it lists any).

Encoding errors are the engine's (a malformed ``PrefillReady``): :class:`HandoffError`, which the response mapper turns
into a protocol violation. Decoding errors are the request's: :class:`~sidecar.errors.RequestRejected` (HTTP 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from openengine.v1 import kv_pb2
from sidecar.errors import RequestRejected

from .structjson import StructValueError, json_to_pb_struct, pb_struct_to_json

if TYPE_CHECKING:
    from .capabilities import KvConnector
    from .structjson import JsonObject

__all__ = [
    "ATTRIBUTES_ALIAS",
    "HANDOFF_FIELDS",
    "HandoffError",
    "handoff_to_session",
    "session_to_handoff",
]

#: The top-level keys of the handoff JSON, all required.
HANDOFF_FIELDS: Final = ("session_id", "transfer_backend", "endpoints", "dp_rank", "attributes_struct")
#: Accepted in place of ``attributes_struct`` (the key Dynamo's TensorRT-LLM Rust sidecar writes).
ATTRIBUTES_ALIAS: Final = "attributes"

_UINT32_MAX: Final = 2**32 - 1
_PORT_MAX: Final = 65535


class HandoffError(ValueError):
    """The engine's ``KvSessionRef`` cannot be handed off; ``field`` names where (``endpoints[0].port``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"kv_session.{field}: {reason}")
        self.field = field
        self.reason = reason


# ------------------------------------------------------------------------------------------------- encode


def session_to_handoff(session: kv_pb2.KvSessionRef) -> JsonObject:
    """The handoff JSON for one ``PrefillReady.kv_session``; raises :class:`HandoffError` if it is unusable.

    A prefill leg's session must name itself (``session_id``) and carry the engine's transfer data
    (``attributes_struct``, non-empty): without them no decode engine can attach to it.
    """
    session_id: str = session.session_id
    if not session_id:
        raise HandoffError("session_id", "empty: a decode engine cannot claim an unnamed session")
    if not session.HasField("attributes_struct") or not session.attributes_struct.fields:
        raise HandoffError("attributes_struct", "missing or empty: the engine sent no transfer data")
    endpoints: list[Any] = []
    for i, endpoint in enumerate(session.endpoints):
        host: str = endpoint.host.strip()
        port: int = endpoint.port
        protocol: str = endpoint.protocol
        if not host:
            raise HandoffError(f"endpoints[{i}].host", "empty")
        if not 1 <= port <= _PORT_MAX:
            raise HandoffError(f"endpoints[{i}].port", f"{port} is not a TCP port (1…{_PORT_MAX})")
        if not protocol:
            raise HandoffError(f"endpoints[{i}].protocol", "empty")
        endpoints.append({"host": host, "port": port, "protocol": protocol})
    try:
        attributes = pb_struct_to_json(session.attributes_struct, path="attributes_struct")
    except StructValueError as exc:
        raise HandoffError(exc.path, exc.reason) from None
    transfer_backend: str = session.transfer_backend
    dp_rank: int = session.dp_rank
    return {
        "session_id": session_id,
        "transfer_backend": transfer_backend,
        "endpoints": endpoints,
        "dp_rank": dp_rank,
        "attributes_struct": attributes,
    }


# ------------------------------------------------------------------------------------------------- decode


def _string(params: Mapping[str, Any], key: str, where: str, *, non_empty: bool) -> str:
    value = params[key]
    if not isinstance(value, str):
        raise RequestRejected(f"{where}.{key}", f"must be a string, got {type(value).__name__}")
    if non_empty and not value.strip():
        raise RequestRejected(f"{where}.{key}", "must not be empty")
    return value


def _uint(value: object, field: str, hi: int, lo: int = 0) -> int:
    # bool is an int subclass; JSON true is not a number. A whole float (3.0) is a number that went through a
    # double somewhere on the way: accept it as the integer it is.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(field, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise RequestRejected(field, f"{value} is out of range ({lo}…{hi})")
    return value


def _endpoint(raw: object, where: str, connector: KvConnector | None) -> kv_pb2.KvEndpoint:
    if not isinstance(raw, Mapping):
        raise RequestRejected(where, f"must be an object, got {type(raw).__name__}")
    for key in ("host", "port", "protocol"):
        if key not in raw:
            raise RequestRejected(f"{where}.{key}", "missing")
    host = _string(raw, "host", where, non_empty=True).strip()
    port = _uint(raw["port"], f"{where}.port", _PORT_MAX, lo=1)
    protocol = _string(raw, "protocol", where, non_empty=True)
    if connector is not None and connector.supported_protocols:
        supported = {p.casefold() for p in connector.supported_protocols}
        if protocol.casefold() not in supported:
            listed = ", ".join(connector.supported_protocols)
            raise RequestRejected(f"{where}.protocol", f"{protocol!r} is not supported by this engine ({listed})")
    return kv_pb2.KvEndpoint(host=host, port=port, protocol=protocol)


def handoff_to_session(
    params: object, *, connector: KvConnector | None, where: str = "prefill_result.disaggregated_params"
) -> kv_pb2.KvSessionRef:
    """Decode ``prefill_result.disaggregated_params`` into the ``KvSessionRef`` the decode engine needs.

    ``connector`` is this engine's KV connector as discovered (None: not reported, nothing to check against).
    Raises :class:`~sidecar.errors.RequestRejected` naming the missing or bad field (``where.endpoints[0].port``).
    """
    if not isinstance(params, Mapping):
        raise RequestRejected(where, f"must be an object, got {type(params).__name__}")
    attributes_key = "attributes_struct"
    if attributes_key not in params and ATTRIBUTES_ALIAS in params:
        attributes_key = ATTRIBUTES_ALIAS
    elif attributes_key in params and ATTRIBUTES_ALIAS in params:
        raise RequestRejected(f"{where}.{ATTRIBUTES_ALIAS}", f"given together with {attributes_key}; send one")
    for key in HANDOFF_FIELDS:
        if (attributes_key if key == "attributes_struct" else key) not in params:
            raise RequestRejected(
                f"{where}.{key}", "missing (a handoff needs all of: " + ", ".join(HANDOFF_FIELDS) + ")"
            )

    session = kv_pb2.KvSessionRef(
        session_id=_string(params, "session_id", where, non_empty=True),
        transfer_backend=_string(params, "transfer_backend", where, non_empty=False),
        dp_rank=_uint(params["dp_rank"], f"{where}.dp_rank", _UINT32_MAX),
    )
    if connector is not None and connector.transfer_backend:
        ours = connector.transfer_backend
        if session.transfer_backend.casefold() != ours.casefold():
            raise RequestRejected(
                f"{where}.transfer_backend",
                f"{session.transfer_backend!r} does not match this engine's KV connector ({ours!r}): the prefill and "
                "decode engines must use the same transfer backend",
            )

    endpoints = params["endpoints"]
    if not isinstance(endpoints, list | tuple):
        raise RequestRejected(f"{where}.endpoints", f"must be a list, got {type(endpoints).__name__}")
    for i, raw in enumerate(endpoints):
        session.endpoints.append(_endpoint(raw, f"{where}.endpoints[{i}]", connector))

    attributes = params[attributes_key]
    if attributes is not None:
        if not isinstance(attributes, Mapping):
            raise RequestRejected(f"{where}.{attributes_key}", f"must be an object, got {type(attributes).__name__}")
        try:
            session.attributes_struct.CopyFrom(json_to_pb_struct(attributes, path=f"{where}.{attributes_key}"))
        except StructValueError as exc:
            raise RequestRejected(exc.path, exc.reason) from None
    return session
