"""The kit's wire layer keeps reading through a graceful GOAWAY (grpc-core's stop with grace; trtllm §3).

A stock grpclib client closes the connection on any GOAWAY, cutting the streams the server promised to finish. The
server here is a stand-in for grpc-core: it sends GOAWAY(last stream id 2^31−1) in the middle of a stream and goes on
sending (h2 would refuse to, so it reopens its own connection state the way grpc-core simply never closes it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpclib.const import Status
from grpclib.server import Server
from h2.connection import ConnectionState

from openengine.v1 import generation_pb2, openengine_grpc
from sidecar.conformance import Observation, Target, generate

TOKENS = 12
GOAWAY_AFTER = 4


class _GracefulStopServer(openengine_grpc.InferenceBase):
    async def Generate(self, stream: Any) -> None:
        request = await stream.recv_message()
        for i in range(TOKENS):
            response = generation_pb2.GenerateResponse(request_id=request.request_id)
            response.token.output_index = 0
            response.token.tokens.add(token_id=i)
            await stream.send_message(response)
            if i == GOAWAY_AFTER:
                h2_stream = stream._stream
                h2_stream._h2_connection.close_connection(last_stream_id=2**31 - 1)
                h2_stream.connection.flush()
                h2_stream._h2_connection.state_machine.state = ConnectionState.SERVER_OPEN
            await asyncio.sleep(0.005)  # not a synchronisation: the fake engine's pace
        final = generation_pb2.GenerateResponse(request_id=request.request_id)
        final.finished.output_index = 0
        final.finished.reason = generation_pb2.FINISH_REASON_LENGTH
        final.usage.completion_tokens = TOKENS
        await stream.send_message(final)


def _run(tolerate: bool) -> tuple[Observation, int]:
    async def main() -> tuple[Observation, int]:
        server = Server([_GracefulStopServer()])
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        channel = Target("stand-in", host="127.0.0.1", port=port).channel(tolerate_goaway=tolerate)
        try:
            request = generation_pb2.GenerateRequest(request_id="r", model="m", prompt="p")
            obs = await generate(channel, request, bound=10)
            return obs, len(channel.goaways)
        finally:
            channel.close()
            server.close()
            await asyncio.wait_for(server.wait_closed(), 5)

    return asyncio.run(main())


def test_a_tolerant_channel_reads_the_stream_to_its_end_after_goaway() -> None:
    obs, goaways = _run(tolerate=True)
    assert goaways == 1
    assert obs.status is Status.OK
    assert len(obs.messages) == TOKENS + 1
    assert obs.messages[-1].WhichOneof("event") == "finished"


def test_a_stock_channel_is_cut_at_goaway() -> None:
    obs, goaways = _run(tolerate=False)
    assert goaways == 1
    assert obs.status is None
    assert "GOAWAY" in (obs.error or "")
    assert len(obs.messages) <= GOAWAY_AFTER + 2
