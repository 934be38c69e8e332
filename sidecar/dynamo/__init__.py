"""The Dynamo adapter: the only package that imports ``dynamo``.

Trio code uses :func:`open_dynamo` and :class:`DynamoWorker`; every Dynamo call runs on the edge loop thread
(``sidecar.edge``). Requests arrive on that thread and are handed to a trio :data:`RequestHandler` through the bridge,
with the :class:`ChunkSink` their chunks go to; a :class:`sidecar.errors.SidecarError` it fails the sink with becomes
the ``dynamo.llm.exceptions`` class its ``kind`` names.
"""

from ._bindings import ControlPlaneError as ControlPlaneError
from ._bindings import ControlPlaneLost as ControlPlaneLost
from ._bindings import ControlPlaneUnreachable as ControlPlaneUnreachable
from ._bindings import RegistrationRefused as RegistrationRefused
from ._handler import CANCELLED_CHUNK as CANCELLED_CHUNK
from ._publishers import KvEventSink as KvEventSink
from ._publishers import LoadSink as LoadSink
from ._publishers import open_kv_event_sink as open_kv_event_sink
from ._publishers import open_load_sink as open_load_sink
from ._types import ChunkSink as ChunkSink
from ._types import DynamoSettings as DynamoSettings
from ._types import Registration as Registration
from ._types import RequestContext as RequestContext
from ._types import RequestHandler as RequestHandler
from ._worker import DynamoWorker as DynamoWorker
from ._worker import RestoreReport as RestoreReport
from ._worker import file_discovery_keys as file_discovery_keys
from ._worker import lora_card_key as lora_card_key
from ._worker import lora_slug as lora_slug
from ._worker import open_dynamo as open_dynamo

__all__ = [
    "CANCELLED_CHUNK",
    "ChunkSink",
    "ControlPlaneError",
    "ControlPlaneLost",
    "ControlPlaneUnreachable",
    "DynamoSettings",
    "DynamoWorker",
    "KvEventSink",
    "LoadSink",
    "Registration",
    "RegistrationRefused",
    "RequestContext",
    "RequestHandler",
    "RestoreReport",
    "file_discovery_keys",
    "lora_card_key",
    "lora_slug",
    "open_dynamo",
    "open_kv_event_sink",
    "open_load_sink",
]
