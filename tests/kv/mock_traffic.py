"""Traffic for a real ``openengine-mock`` in the KV tests: deterministic block-aligned prompts, short generations."""

from __future__ import annotations

from openengine.v1 import generation_pb2
from sidecar.engine import EngineClient

#: The mock's KV block size in these tests (its default).
BS = 16


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """``blocks`` full KV blocks of token ids, the same for the same ``seed``; different seeds share no block."""
    return [(seed * 31 + j) % 300 + 5 for j in range(blocks * BS)]


async def generate(client: EngineClient, request_id: str, token_ids: list[int]) -> None:
    """Run one greedy two-token request to its end (its prompt's blocks are then stored in the engine's cache)."""
    request = generation_pb2.GenerateRequest(request_id=request_id, model="tiny-oe")
    request.token_ids.ids.extend(token_ids)
    request.stopping.max_tokens = 2
    request.sampling.temperature = 0.0
    async with client.generate(request) as stream:
        async for _ in stream:
            pass
