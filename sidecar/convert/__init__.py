"""Pure conversions between Dynamo's dicts and OpenEngine v0.1.0 messages.

No I/O here, and no trio, asyncio, grpclib or dynamo imports: everything is a function (or a small
stateful mapper) tested by tables.

* :mod:`.structjson` — ``google.protobuf.Struct`` ⇄ JSON with number fidelity (upb and betterproto2).
* :mod:`.enums` — lenient enum reads (unknown → UNSPECIFIED) and ``optional`` presence helpers.
* :mod:`.capabilities` — :class:`Capabilities` from ``ServerInfo`` + ``ModelInfo``.
* :mod:`.request` — :func:`build_generate_request`: ``PreprocessedRequest`` → ``GenerateRequest``.
* :mod:`.media` — ``multi_modal_data`` → ``GenerateRequest.media`` in the original message order.
* :mod:`.response` — :class:`ResponseMapper`: ``GenerateResponse`` batches → ``LLMEngineOutput`` chunks.
* :mod:`.handoff` — the disaggregation handoff: ``KvSessionRef`` ⇄ ``disaggregated_params`` JSON.
"""

from .capabilities import Capabilities as Capabilities
from .request import HEALTH_CANARY_PAYLOAD as HEALTH_CANARY_PAYLOAD
from .request import GenerateCall as GenerateCall
from .request import build_generate_request as build_generate_request
from .response import ResponseMapper as ResponseMapper
from .structjson import StructValueError as StructValueError
