"""``open_dynamo`` in this process with the in-memory discovery backend: no frontend, no files.

Exercises the discovery-client branch of ``registration_present`` (the one etcd and Kubernetes use) and the
lifecycle calls, and shows that a runtime can be created and shut down more than once per process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from sidecar.dynamo import (
    DynamoSettings,
    DynamoWorker,
    Registration,
    RegistrationRefused,
    RequestContext,
    file_discovery_keys,
    lora_card_key,
    open_dynamo,
)
from sidecar.edge import open_edge
from tests.helpers.handlers import batches_handler
from tests.helpers.waits import wait_until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


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
                await wait_until(lambda: _unlisted(worker), timeout=5)
                assert await worker.registration_present()  # withdrawn: the instance is not expected
                await worker.restore()
                await wait_until(worker._instance_listed, timeout=5)
                worker.set_health(False)
                await worker.shutdown()


async def _unlisted(worker: DynamoWorker) -> bool:
    return not await worker._instance_listed()


async def test_a_changed_card_replaces_the_published_one_whole(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27 item 2: Dynamo 1.6.1 refuses to rewrite a published model card ("model update can only change
    runtime_config.taints"), so an engine restarted with other limits kept its old card. Failed before: the second
    ``register`` raised and the card on file still said context 2048. Now the card (and the LoRA card built on it)
    is replaced: removed, then published again with the new limits."""
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "kv"))
    old = Registration(model_path=str(model_dir), served_model_name="tiny", context_length=2048, max_num_seqs=256)
    new = dataclasses.replace(old, context_length=1024, max_num_seqs=64)
    settings = DynamoSettings(discovery_backend="file", namespace="cards")
    with trio.fail_after(20):
        async with open_edge() as edge, open_dynamo(edge, settings) as worker, trio.open_nursery() as nursery:
            await worker.serve(nursery, batches_handler(edge, handler))
            await worker.register(old)
            await worker.register_lora("tiny-lora")
            _, card = file_discovery_keys(settings, worker.instance_id)
            lora_card = lora_card_key(card, "tiny-lora")
            assert runtime_config(card)["context_length"] == 2048
            await worker.register(new)
            assert worker.registration == new
            for path in (card, lora_card):
                assert runtime_config(path)["context_length"] == 1024, path.name
                assert runtime_config(path)["max_num_seqs"] == 64, path.name
            await worker.shutdown()


def runtime_config(card: Path) -> dict[str, Any]:
    config = json.loads(card.read_text())["card_json"]["runtime_config"]
    assert isinstance(config, dict)
    return config


async def test_another_model_on_the_same_endpoint_is_refused_naming_the_flags(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27 item 9: a second worker on the same namespace and component, serving another name (the engine's own
    model name becomes its alias), is refused by Dynamo with a plain exception; it is one line naming the flags."""
    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "kv"))
    settings = DynamoSettings(discovery_backend="file", namespace="conflict")
    with trio.fail_after(20):
        async with open_edge() as edge, open_dynamo(edge, settings) as first, trio.open_nursery() as nursery:
            await first.serve(nursery, batches_handler(edge, handler))
            await first.register(Registration(model_path=str(model_dir), served_model_name="tiny-oe"))
            async with open_dynamo(edge, settings) as second:
                await second.serve(nursery, batches_handler(edge, handler))
                other = Registration(model_path=str(model_dir), served_model_name="y", aliases=("tiny-oe",))
                with pytest.raises(RegistrationRefused) as refused:
                    await second.register(other)
                await second.shutdown()
            await first.shutdown()
    line = str(refused.value)
    assert "\n" not in line
    assert "Cannot register model 'y' on endpoint 'conflict/backend/generate'" in line
    for flag in ("--namespace (DYN_NAMESPACE)", "--component (DYN_COMPONENT)", "--served-model-name"):
        assert flag in line, line
