"""End to end: multimodal media (issue #7) through the real frontend → sidecar → ``openengine-mock``.

The frontend groups a chat's media by modality (``multi_modal_data``); the sidecar restores the message order from
``extra_args.messages`` so item *i* fills the *i*-th placeholder. The tiny model's chat template renders no media
placeholders, so the user text carries them (``<image>``, ``<audio>``): the mock refuses media that do not line up
with them, which makes a 200 proof of the order, and reports what it received in ``mock_stats.last_media``.
Media travel as ``data:`` URLs only: the frontend refuses loopback ``http`` URLs (its guard against server-side
request forgery) and would try to fetch others itself to size images for the KV router.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from tests.helpers.processes import DynamoEnv, Frontend
from tests.helpers.stack import MODEL, engine_and_worker, mock_stats

pytestmark = pytest.mark.e2e

#: The richer engine (TensorRT-LLM refuses any media).
FULL = ("--profile", "full")

WAV = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA="
PNG = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(url: str, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def audio(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


async def chat(url: str, *parts: dict[str, Any], **body: Any) -> httpx.Response:
    messages = [{"role": "user", "content": list(parts)}]
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, **body}
        )


@pytest.mark.parametrize("text_input", ["true", "false"], ids=["prompt", "token_ids"])
async def test_media_reach_the_engine_in_message_order(
    dynamo_env: DynamoEnv, frontend: Frontend, text_input: str
) -> None:
    """An image, an audio clip and another image arrive as the messages order them (not grouped by modality), with
    the caller's uuid, whether the engine takes the rendered prompt (text input) or the token ids."""
    with trio.fail_after(120):
        async with engine_and_worker(
            dynamo_env, frontend, *FULL, "--capability", "multimodal=true", "--capability", f"text_input={text_input}"
        ) as engine:
            before = await mock_stats(engine)
            answer = await chat(
                frontend.url,
                text("Compare <image> with <audio> and <image>."),
                image(PNG, uuid="first"),
                audio(WAV),
                image(PNG),
            )
            assert answer.status_code == 200, answer.text
            after = await mock_stats(engine)
            assert after["media_requests"] == before.get("media_requests", 0) + 1
            assert after["last_media"] == [
                {"modality": "image", "source": "data_uri", "uuid": "first"},
                {"modality": "audio", "source": "data_uri", "uuid": ""},
                {"modality": "image", "source": "data_uri", "uuid": ""},
            ]
            prompts = after.get("text_prompt_requests", 0) - before.get("text_prompt_requests", 0)
            assert prompts == (1 if text_input == "true" else 0)


async def test_media_that_cannot_be_ordered_or_sent_are_refused(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    """Media the engine would misplace are refused with a 400: placeholders disagreeing with the media (the engine
    refuses), an ``input_audio`` part the frontend dropped (the sidecar refuses: the order would be wrong), and
    per-request media options OpenEngine cannot carry (the sidecar refuses)."""
    with trio.fail_after(120):
        async with engine_and_worker(dynamo_env, frontend, *FULL, "--capability", "multimodal=true") as engine:
            url = frontend.url
            answer = await chat(url, text("<audio> then <image>"), image(PNG), audio(WAV))
            assert answer.status_code == 400, answer.text
            assert "media[0] is image but placeholder 0 is <audio>" in answer.json()["message"]

            before = await mock_stats(engine)
            dropped = {"type": "input_audio", "input_audio": {"data": WAV.split(",", 1)[1], "format": "wav"}}
            answer = await chat(url, text("Hello"), image(PNG), dropped)
            assert answer.status_code == 400, answer.text
            assert answer.json()["message"].startswith("extra_args.messages: list 1 audio_url parts")

            answer = await chat(url, text("Hello"), image(PNG), mm_processor_kwargs={"crops": 4})
            assert answer.status_code == 400, answer.text
            assert answer.json()["message"].startswith("mm_processor_kwargs: ")
            after = await mock_stats(engine)
            assert after.get("requests", 0) == before.get("requests", 0), "nothing reached the engine"


async def test_media_refused_when_the_engine_is_not_multimodal(dynamo_env: DynamoEnv, frontend: Frontend) -> None:
    """Without ``supports_multimodal`` a chat with media is a 400 naming ``multi_modal_data``, before any RPC;
    the same chat without media is served."""
    with trio.fail_after(120):
        async with engine_and_worker(dynamo_env, frontend, *FULL) as engine:
            before = await mock_stats(engine)
            answer = await chat(frontend.url, text("What is this?"), image(PNG))
            assert answer.status_code == 400, answer.text
            message = answer.json()["message"]
            assert message == "multi_modal_data: the engine does not advertise supports_multimodal"
            after = await mock_stats(engine)
            assert after.get("requests", 0) == before.get("requests", 0), "nothing reached the engine"
            assert (await chat(frontend.url, text("What is this?"))).status_code == 200
