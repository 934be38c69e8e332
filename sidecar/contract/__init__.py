"""What the sidecar must know of an OpenEngine engine before it connects, as pure code (standard library only): how
to address it (:func:`parse_endpoint`) and which schema this client speaks (the pin, the revisions, the check of a
discovered server). Importable without trio, asyncio or grpclib: the engine client, the CLI and the conformance kit
share it."""

from .endpoint import Endpoint as Endpoint
from .endpoint import EndpointError as EndpointError
from .endpoint import parse_endpoint as parse_endpoint
from .schema import CLIENT_REVISION as CLIENT_REVISION
from .schema import MIN_SERVER_REVISION as MIN_SERVER_REVISION
from .schema import PINNED_SCHEMA_RELEASE as PINNED_SCHEMA_RELEASE
from .schema import SchemaIncompatible as SchemaIncompatible
from .schema import check_server_compat as check_server_compat
from .schema import expected_release_problem as expected_release_problem
from .schema import release_matches as release_matches

__all__ = [
    "CLIENT_REVISION",
    "MIN_SERVER_REVISION",
    "PINNED_SCHEMA_RELEASE",
    "Endpoint",
    "EndpointError",
    "SchemaIncompatible",
    "check_server_compat",
    "parse_endpoint",
    "release_matches",
]
