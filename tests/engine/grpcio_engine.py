"""A grpcio (grpc-core) OpenEngine double, for what only grpc-core does: TensorRT-LLM's way of stopping.

TensorRT-LLM's server is a ``grpc.aio`` server stopped with ``server.stop(grace=5)``: grpc-core sends a GOAWAY with
last-stream-id 2^31-1, then the real one after a PING, lets open streams run until the grace ends, then cuts them
(grpc-core's graceful stop). A grpcio server in this process does exactly that, from its own threads:

* ``Generate`` streams ``stopping.max_tokens`` tokens (default 40), one every ``token_s``, then a ``finished`` event;
  it stops early when grpc-core cancels the call (grace over);
* ``GetServerInfo`` and ``Health`` answer (enough for ``wait_connected`` and health checks).

``GrpcioEngine.tokens_sent`` counts per request id what was sent; ``stop(grace)`` is grpc-core's graceful stop.
``max_connection_age_s`` makes grpc-core rotate connections with the same two-phase GOAWAY while it keeps listening.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import grpc

from openengine.v1 import generation_pb2, lifecycle_pb2, server_pb2
from sidecar.engine import PINNED_SCHEMA_RELEASE

if TYPE_CHECKING:
    from collections.abc import Iterator


class GrpcioEngine:
    """A running grpcio server; see the module docstring."""

    def __init__(self, token_s: float, address: str, options: list[tuple[str, Any]]) -> None:
        self.token_s = token_s
        self.tokens_sent: Counter[str] = Counter()
        self.finished: set[str] = set()
        self.started = threading.Semaphore(0)
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=32), options=options)
        self.server.add_generic_rpc_handlers([_Handlers(self)])
        port = self.server.add_insecure_port(address)
        self.target = address if address.startswith("unix:") else f"127.0.0.1:{port}"
        self.server.start()

    def generate(self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        rid = request.request_id
        self.started.release()
        for _ in range(request.stopping.max_tokens or 40):
            if not context.is_active():
                return
            token = generation_pb2.GenerateResponse(request_id=rid)
            token.token.output_index = 0
            token.token.text = " hi"
            token.token.tokens.add(token_id=7, token=" hi")
            yield token
            with self._lock:
                self.tokens_sent[rid] += 1
            # Not a synchronisation: the engine's time per token.
            time.sleep(self.token_s)
        done = generation_pb2.GenerateResponse(request_id=rid)
        done.finished.output_index = 0
        done.finished.reason = generation_pb2.FINISH_REASON_LENGTH
        done.usage.prompt_tokens = 1
        yield done
        with self._lock:
            self.finished.add(rid)

    def stop(self, grace_s: float) -> threading.Event:
        """grpc-core's graceful stop (what TensorRT-LLM does on SIGTERM); returns at once."""
        stopped: threading.Event = self.server.stop(grace_s)
        return stopped


class _Handlers(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpcio ships no type hints
    def __init__(self, engine: GrpcioEngine) -> None:
        self._methods = {
            "/openengine.v1.Inference/Generate": grpc.unary_stream_rpc_method_handler(
                engine.generate,
                request_deserializer=generation_pb2.GenerateRequest.FromString,
                response_serializer=generation_pb2.GenerateResponse.SerializeToString,
            ),
            "/openengine.v1.Control/GetServerInfo": grpc.unary_unary_rpc_method_handler(
                lambda request, context: server_pb2.ServerInfo(
                    engine_name="grpcio-double",
                    schema_revision=1,
                    minimum_client_revision=1,
                    schema_release=PINNED_SCHEMA_RELEASE,
                ),
                request_deserializer=server_pb2.GetServerInfoRequest.FromString,
                response_serializer=server_pb2.ServerInfo.SerializeToString,
            ),
            "/openengine.v1.Control/Health": grpc.unary_unary_rpc_method_handler(
                lambda request, context: lifecycle_pb2.HealthResponse(state=lifecycle_pb2.HEALTH_STATE_READY),
                request_deserializer=lifecycle_pb2.HealthRequest.FromString,
                response_serializer=lifecycle_pb2.HealthResponse.SerializeToString,
            ),
        }

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._methods.get(handler_call_details.method)


@contextmanager
def grpcio_engine(
    *,
    token_s: float = 0.02,
    address: str = "127.0.0.1:0",
    max_connection_age_s: float | None = None,
    max_concurrent_streams: int | None = None,
) -> Iterator[GrpcioEngine]:
    """Serve the double (loopback, OS-picked port, or ``unix:PATH``); stop it without grace on exit."""
    options: list[tuple[str, Any]] = []
    if max_concurrent_streams is not None:
        options.append(("grpc.max_concurrent_streams", max_concurrent_streams))
    if max_connection_age_s is not None:
        options += [
            ("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", 60_000),
        ]
    engine = GrpcioEngine(token_s, address, options)
    try:
        yield engine
    finally:
        engine.stop(0).wait(10)
