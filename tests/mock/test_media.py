"""``openengine-mock`` with ``--capability multimodal=true``: media items are checked as an engine must before fetching
them (a modality, exactly one well-formed source), aligned with the prompt's ``<image>``/``<video>``/``<audio>``
placeholders when it has any, and reported in ``ServerInfo.extra.mock_stats`` (``media_requests``, ``last_media``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from tokenizers import Tokenizer

from openengine.v1 import generation_pb2, openengine_grpc, server_pb2
from sidecar.testing.mock.lm import MODEL_DIR
from sidecar.testing.mock.structs import struct_to_dict

from ._client import Outcome, call, generate, make_request
from .conftest import MockProcess, _start

IMAGE = generation_pb2.MODALITY_IMAGE
VIDEO = generation_pb2.MODALITY_VIDEO
AUDIO = generation_pb2.MODALITY_AUDIO
PNG = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
WAV = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA="


@pytest.fixture(scope="module")
def mm_mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockProcess]:
    mock = _start(tmp_path_factory.mktemp("mm"), ("--capability", "multimodal=true"))
    yield mock
    mock.kill()


def with_media(
    *items: dict[str, Any], prompt: str = "Describe these.", **kwargs: Any
) -> generation_pb2.GenerateRequest:
    request = make_request(prompt=prompt, max_tokens=2, **kwargs)
    for item in items:
        request.media.add(**item)
    return request


def stats(address: str) -> dict[str, Any]:
    info = call(address, lambda ch: openengine_grpc.ControlStub(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))
    found = struct_to_dict(info.extra)["mock_stats"]
    assert isinstance(found, dict)
    return found


def run(address: str, request: generation_pb2.GenerateRequest) -> Outcome:
    async def go(ch: Channel) -> Outcome:
        return await generate(ch, request)

    return call(address, go)


def test_accepted_media_are_reported_in_order(mm_mock: MockProcess) -> None:
    """Every source kind is accepted, and ``last_media`` lists the items in request order with their uuids."""
    before = stats(mm_mock.address).get("media_requests", 0)
    out = run(
        mm_mock.address,
        with_media(
            {"modality": AUDIO, "data_uri": WAV},
            {"modality": IMAGE, "url": "http://example.invalid/cat.png", "uuid": "cat-1"},
            {"modality": VIDEO, "raw_bytes": b"\x00\x01", "mime_type": "video/mp4"},
            {"modality": IMAGE, "data_uri": PNG},
        ),
    )
    assert out.status == Status.OK, out
    after = stats(mm_mock.address)
    assert after["media_requests"] == before + 1
    assert after["last_media"] == [
        {"modality": "audio", "source": "data_uri", "uuid": ""},
        {"modality": "image", "source": "url", "uuid": "cat-1"},
        {"modality": "video", "source": "raw_bytes", "uuid": ""},
        {"modality": "image", "source": "data_uri", "uuid": ""},
    ]


def test_media_aligned_with_placeholders_are_accepted(mm_mock: MockProcess) -> None:
    """A prompt whose placeholders name the media's modalities in the media's order is served."""
    prompt = "Listen <audio> then look <image>."
    out = run(
        mm_mock.address,
        with_media({"modality": AUDIO, "data_uri": WAV}, {"modality": IMAGE, "url": "u"}, prompt=prompt),
    )
    assert out.status == Status.OK, out


def test_placeholders_are_read_from_token_ids_too(mm_mock: MockProcess) -> None:
    """With token-id input the mock decodes the ids to find the placeholders (an order mismatch is refused)."""
    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode("<image> then <audio>").ids
    request = with_media({"modality": AUDIO, "data_uri": WAV}, {"modality": IMAGE, "url": "u"}, token_ids=ids)
    assert request.WhichOneof("input") == "token_ids"
    out = run(mm_mock.address, request)
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])
    assert out.details == "media[0] is audio but placeholder 0 is <image>"


Items = list[dict[str, Any]]

REFUSED: list[tuple[str, Items, str, str]] = [
    ("no source", [{"modality": IMAGE}], "Describe.", "media[0] needs exactly one source"),
    ("unspecified modality", [{"url": "http://example.invalid/x.png"}], "Describe.", "media[0].modality"),
    ("unknown modality", [{"modality": 9, "url": "u"}], "Describe.", "media[0].modality"),
    ("empty url", [{"modality": IMAGE, "url": ""}], "Describe.", "media[0].url must not be empty"),
    ("empty raw bytes", [{"modality": IMAGE, "raw_bytes": b""}], "Describe.", "media[0].raw_bytes"),
    (
        "data uri without base64",
        [{"modality": IMAGE, "data_uri": "data:image/png,abc"}],
        "Describe.",
        "media[0].data_uri",
    ),
    (
        "data uri without a type",
        [{"modality": IMAGE, "data_uri": "data:;base64,AAAA"}],
        "Describe.",
        "media[0].data_uri",
    ),
    (
        "data uri bad base64",
        [{"modality": IMAGE, "data_uri": "data:image/png;base64,@@@"}],
        "Describe.",
        "valid base64",
    ),
    ("data uri of another modality", [{"modality": IMAGE, "data_uri": WAV}], "Describe.", "holds audio data"),
    (
        "second item broken",
        [{"modality": IMAGE, "url": "u"}, {"modality": AUDIO, "data_uri": "data:audio/wav;base64,%%"}],
        "Describe.",
        "media[1].data_uri",
    ),
    (
        "more placeholders than media",
        [{"modality": IMAGE, "url": "u"}],
        "<image> and <image>",
        "the prompt has 2 media placeholders for 1 media items",
    ),
    (
        "fewer placeholders than media",
        [{"modality": IMAGE, "url": "u"}, {"modality": IMAGE, "url": "v"}],
        "only <image>",
        "the prompt has 1 media placeholders for 2 media items",
    ),
    (
        "placeholders in another order",
        [{"modality": IMAGE, "url": "u"}, {"modality": AUDIO, "url": "a"}],
        "<audio> <image>",
        "media[0] is image but placeholder 0 is <audio>",
    ),
]


@pytest.mark.parametrize(("items", "prompt", "message"), [pytest.param(i, p, m, id=n) for n, i, p, m in REFUSED])
def test_malformed_media_are_refused_before_acceptance(
    mm_mock: MockProcess, items: Items, prompt: str, message: str
) -> None:
    """A malformed item or a media/placeholder mismatch is INVALID_ARGUMENT naming it, with zero stream messages."""
    out = run(mm_mock.address, with_media(*items, prompt=prompt))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, []), out
    assert message in (out.details or ""), out.details


def test_media_without_the_capability_are_unimplemented(addr: str) -> None:
    """Without ``multimodal=true`` the mock answers media like TensorRT-LLM: UNIMPLEMENTED, nothing counted."""
    out = run(addr, with_media({"modality": IMAGE, "url": "http://example.invalid/cat.png"}))
    assert (out.status, out.messages) == (Status.UNIMPLEMENTED, [])
    assert "media_requests" not in stats(addr)
