"""End to end: structured output through the real Dynamo frontend → ``openengine-sidecar`` → ``openengine-mock``.

The OpenAI client's structured-output calls (``response_format`` json_schema from a pydantic model, json_schema by
hand, json_object; streaming too) return text that validates, because the mock honours the guide it receives
(``sidecar/testing/mock/guided.py``); a schema the engine cannot honour is refused, never answered with text that
ignores it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema  # type: ignore[import-untyped]
import openai
import pydantic
import pytest
import trio
from openai.lib._pydantic import to_strict_json_schema
from openai.types.chat import ChatCompletionMessageParam

from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import MODEL, engine_and_worker, mock_stats

pytestmark = pytest.mark.e2e

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather by the river?"}]
#: What the mock needs for these requests to reach it: nothing -- its default profile advertises TensorRT-LLM's
#: guided modes (xgrammar), as the demo engine does.
GUIDED_FLAGS: tuple[str, ...] = ()


class Day(pydantic.BaseModel):
    day: int = pydantic.Field(ge=1, le=14)
    sky: Literal["clear", "cloudy", "rain"]


class Forecast(pydantic.BaseModel):
    city: str
    days: list[Day]
    wind_kmh: float
    warning: str | None


def _client(frontend: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", timeout=60, max_retries=0)


async def _in_thread(fn: Any) -> Any:
    return await trio.to_thread.run_sync(fn)


async def test_structured_output_validates(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    client = _client(frontend)
    schema = to_strict_json_schema(Forecast)
    validator = jsonschema.Draft202012Validator(schema)
    with trio.fail_after(180):
        async with engine_and_worker(dynamo_env, frontend, *GUIDED_FLAGS) as engine:
            before = (await mock_stats(engine)).get("guided_requests", 0)

            # The OpenAI client's structured-output call: pydantic model in, parsed model out.
            for temperature in (0.0, 1.0):
                completion = await _in_thread(
                    lambda t=temperature: client.chat.completions.parse(
                        model=MODEL, messages=MESSAGES, response_format=Forecast, max_tokens=512, temperature=t
                    )
                )
                choice = completion.choices[0]
                assert choice.finish_reason == "stop", choice
                assert isinstance(choice.message.parsed, Forecast), choice.message.content
                validator.validate(json.loads(choice.message.content or ""))

            # The same schema by hand, streamed: the concatenated deltas validate.
            response_format: Any = {
                "type": "json_schema",
                "json_schema": {"name": "forecast", "schema": schema, "strict": True},
            }

            def streamed() -> str:
                stream = client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, response_format=response_format, max_tokens=512, stream=True
                )
                return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

            validator.validate(json.loads(await _in_thread(streamed)))

            # json_object.
            plain = await _in_thread(
                lambda: client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=256
                )
            )
            assert isinstance(json.loads(plain.choices[0].message.content or ""), dict)

            after = (await mock_stats(engine)).get("guided_requests", 0)
            assert after == before + 4, "every structured request reached the engine as a guided one"

            # A schema outside what the engine honours is refused, never answered with unguided text.
            unsupported: Any = {
                "type": "json_schema",
                "json_schema": {"name": "bag", "schema": {"type": "array", "uniqueItems": True}},
            }
            with pytest.raises(openai.APIError) as refused:
                await _in_thread(
                    lambda: client.chat.completions.create(
                        model=MODEL, messages=MESSAGES, response_format=unsupported, max_tokens=64
                    )
                )
            assert "uniqueItems" in str(refused.value)
