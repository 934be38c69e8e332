"""``open_dynamo`` in this process with the in-memory discovery backend: no frontend, no files.

Exercises the discovery-client branch of ``registration_present`` (the one etcd and Kubernetes use) and the
lifecycle calls, and shows that a runtime can be created and shut down more than once per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from sidecar.dynamo import DynamoSettings, Registration, RequestContext, open_dynamo
from sidecar.edge import open_edge
from tests.helpers.handlers import batches_handler

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path


async def handler(request: dict[str, Any], ctx: RequestContext) -> AsyncIterator[list[dict[str, Any]]]:
    yield [{"token_ids": [1], "finish_reason": "length"}]


async def test_lifecycle_with_in_memory_discovery(model_dir: Path) -> None:
    reg = Registration(model_path=str(model_dir), served_model_name="tiny", context_length=2048, kv_block_size=16)
    for round_ in range(2):
        with trio.fail_after(20):
            settings = DynamoSettings(discovery_backend="mem", namespace=f"inproc{round_}")
            async with open_edge() as edge, open_dynamo(edge, settings) as worker, trio.open_nursery() as nursery:
                assert await worker.registration_present()  # nothing published yet: nothing missing
                await worker.serve(nursery, batches_handler(edge, handler))
                await worker.register(reg)
                await worker.register(reg)  # idempotent
                assert worker.registration == reg
                assert await worker.registration_present()
                await worker.withdraw()
                with trio.fail_after(5):
                    while await worker._instance_listed():
                        await trio.sleep(0.01)
                assert await worker.registration_present()  # withdrawn: the instance is not expected
                await worker.restore()
                with trio.fail_after(5):
                    while not await worker._instance_listed():
                        await trio.sleep(0.01)
                worker.set_health(False)
                await worker.shutdown()
