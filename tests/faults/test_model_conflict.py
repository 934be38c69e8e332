"""A second worker serving another model name on the same namespace and component (issue 27 item 9)."""

from __future__ import annotations

import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import dump_logs, start_engine, start_sidecar, wait_routable

from ._client import stream_completion

pytestmark = pytest.mark.e2e


async def test_another_model_name_on_the_same_endpoint_is_refused_in_one_line_naming_the_flags(
    dynamo_env: DynamoEnv, frontend: Frontend
) -> None:
    """Failed before: the second worker ended with a traceback (Dynamo's plain ``Exception`` out of
    ``register_model``). Now: exit 1, one "refusing to start" line naming the flags, the first worker unaffected."""
    with trio.fail_after(120):
        async with (
            start_engine(dynamo_env, "--speedup", "0", name="engine-a") as engine_a,
            start_sidecar(dynamo_env, engine_a.address, name="sidecar-a"),
        ):
            await wait_routable(frontend.url, workers=1)
            # The same engine model under another served name: the engine's own name becomes the card's alias.
            async with (
                start_engine(dynamo_env, "--speedup", "0", name="engine-b") as engine_b,
                start_sidecar(dynamo_env, engine_b.address, name="sidecar-b", model="y", ready=None) as second,
            ):
                try:
                    assert await second.process.wait(60) == 1
                except BaseException:
                    dump_logs(dynamo_env)
                    raise
                log = second.process.log()
            outcome = await stream_completion(frontend.url, "The river", max_tokens=4)
            assert outcome.succeeded, outcome
    refusals = [line for line in log.splitlines() if "refusing to start" in line]
    assert len(refusals) == 1, log
    (line,) = refusals
    assert "a different model 'tiny-oe' is already registered there" in line
    for flag in ("--namespace (DYN_NAMESPACE)", "--component (DYN_COMPONENT)", "--served-model-name"):
        assert flag in line, line
    assert "Traceback" not in log
