"""OpenEngine client for trio: endpoint, channel pool, discovery/compat, ``Generate``, Control RPCs.

grpclib runs on the edge's asyncio thread (``sidecar.edge``); everything here is called from trio. Every RPC failure
is raised as :class:`sidecar.errors.EngineRpcError` (transport loss → UNAVAILABLE, deadline → DEADLINE_EXCEEDED).
The endpoint parser and the schema pin are ``sidecar.contract``'s (pure, importable without trio), re-exported here.
"""

from sidecar.contract import CLIENT_REVISION as CLIENT_REVISION
from sidecar.contract import MIN_SERVER_REVISION as MIN_SERVER_REVISION
from sidecar.contract import PINNED_SCHEMA_RELEASE as PINNED_SCHEMA_RELEASE
from sidecar.contract import Endpoint as Endpoint
from sidecar.contract import EndpointError as EndpointError
from sidecar.contract import SchemaIncompatible as SchemaIncompatible
from sidecar.contract import check_server_compat as check_server_compat
from sidecar.contract import expected_release_problem as expected_release_problem
from sidecar.contract import parse_endpoint as parse_endpoint
from sidecar.contract import release_matches as release_matches

from ._client import BatchIterator as BatchIterator
from ._client import ChannelStats as ChannelStats
from ._client import EngineClient as EngineClient
from ._client import open_engine_client as open_engine_client
from ._config import MIN_KEEPALIVE_INTERVAL_S as MIN_KEEPALIVE_INTERVAL_S
from ._config import EngineClientConfig as EngineClientConfig
from ._metadata import PRIORITY_KEY as PRIORITY_KEY
from ._metadata import ROUTING_KEY as ROUTING_KEY
from ._metadata import TARGET_DP_RANK_KEY as TARGET_DP_RANK_KEY
from ._metadata import TRACEPARENT_KEY as TRACEPARENT_KEY
from ._metadata import TRACESTATE_KEY as TRACESTATE_KEY
from ._metadata import MetadataError as MetadataError
from ._metadata import RequestMetadata as RequestMetadata
from ._metadata import TraceContext as TraceContext
from ._metadata import check_metadata as check_metadata
from ._status import GRPCLIB_STATUS_CODE as GRPCLIB_STATUS_CODE
from ._status import to_engine_rpc_error as to_engine_rpc_error
from ._transport import TlsFiles as TlsFiles
from ._transport import TlsFilesError as TlsFilesError
from ._transport import build_tls_context as build_tls_context
from ._transport import tls_files_from_flags as tls_files_from_flags
from ._transport import unix_path_problem as unix_path_problem

__all__ = [
    "CLIENT_REVISION",
    "GRPCLIB_STATUS_CODE",
    "MIN_KEEPALIVE_INTERVAL_S",
    "MIN_SERVER_REVISION",
    "PINNED_SCHEMA_RELEASE",
    "PRIORITY_KEY",
    "ROUTING_KEY",
    "TARGET_DP_RANK_KEY",
    "TRACEPARENT_KEY",
    "TRACESTATE_KEY",
    "BatchIterator",
    "ChannelStats",
    "Endpoint",
    "EndpointError",
    "EngineClient",
    "EngineClientConfig",
    "MetadataError",
    "RequestMetadata",
    "SchemaIncompatible",
    "TlsFiles",
    "TlsFilesError",
    "TraceContext",
    "build_tls_context",
    "check_metadata",
    "check_server_compat",
    "expected_release_problem",
    "open_engine_client",
    "parse_endpoint",
    "release_matches",
    "tls_files_from_flags",
    "to_engine_rpc_error",
    "unix_path_problem",
]
