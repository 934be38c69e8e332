"""Multimodal media and the LoRA adapter name (issue #7): ``multi_modal_data`` → ``GenerateRequest.media`` in the
original message order, ``routing.lora_name`` → ``GenerateRequest.lora_name`` — each only when the engine advertises
it, refused with a 400 naming the field otherwise.

The request dicts follow what ai-dynamo 1.6.1's frontend was seen to send (``docs/request-features.md``).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openengine.v1 import generation_pb2
from sidecar.convert import GenerateCall
from sidecar.convert.request import FIELD_POLICY
from sidecar.errors import RequestRejected

from .factories import BASE_REQUEST, build, caps, merge

IMAGE = generation_pb2.MODALITY_IMAGE
VIDEO = generation_pb2.MODALITY_VIDEO
AUDIO = generation_pb2.MODALITY_AUDIO

MM = caps(supports_multimodal=True)
MM_TEXT = caps(supports_multimodal=True, supports_text_input=True)
LORA = caps(supports_lora=True)

PNG = "data:image/png;base64,iVBORw0KGgo="
PROMPT = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def part(kind: str, url: str = "") -> dict[str, Any]:
    """A message content part as the frontend forwards it (``data:`` URLs blanked)."""
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    return {"type": kind, kind: {"url": url}}


def media_request(data: dict[str, Any], *parts: dict[str, Any], **extra_args: Any) -> dict[str, Any]:
    """A chat request with ``multi_modal_data`` and, when parts are given, ``extra_args.messages``."""
    args: dict[str, Any] = dict(extra_args)
    if parts:
        args["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, *parts]}]
    request = merge(BASE_REQUEST, {"multi_modal_data": data})
    if args:
        request["extra_args"] = args
    return request


def url(name: str) -> str:
    """An http URL for a short name; values that already are URLs stay as they are."""
    return name if ":" in name else f"https://media.test/{name}"


def urls(*names: str) -> list[dict[str, str]]:
    return [{"Url": url(name)} for name in names]


def items(request: generation_pb2.GenerateRequest) -> list[tuple[int, str, str, str]]:
    """(modality, source member, value, uuid) of every media item."""
    out = []
    for item in request.media:
        source = item.WhichOneof("source")
        out.append((item.modality, source, getattr(item, source), item.uuid))
    return out


def rejected(request: dict[str, Any], field: str, **kwargs: Any) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        build(request, **kwargs)
    assert info.value.field == field, info.value
    assert str(info.value).startswith(f"{field}: ")
    return info.value


# ----------------------------------------------------------------------------------------------------------- order


def test_mixed_media_follow_the_message_order() -> None:
    """Media of several modalities are interleaved as the messages list them, not grouped as multi_modal_data is."""
    # The frontend's own shape for: image (data URL), audio, image, video.
    request = media_request(
        {
            "image_url": urls(PNG, "http://example.com/b.png"),
            "audio_url": urls("http://example.com/a.wav"),
            "video_url": urls("http://example.com/c.mp4"),
        },
        part("image_url"),
        part("audio_url", "http://example.com/a.wav"),
        part("image_url", "http://example.com/b.png"),
        part("video_url", "http://example.com/c.mp4"),
        formatted_prompt=PROMPT,
    )
    call = build(request, capabilities=MM)
    assert items(call.request) == [
        (IMAGE, "data_uri", PNG, ""),
        (AUDIO, "url", "http://example.com/a.wav", ""),
        (IMAGE, "url", "http://example.com/b.png", ""),
        (VIDEO, "url", "http://example.com/c.mp4", ""),
    ]
    assert call.request.WhichOneof("input") == "token_ids"


def test_order_spans_messages_and_accepts_responses_api_part_types() -> None:
    """Parts are read across every message; ``input_image``/``input_video`` count as image/video parts."""
    request = merge(
        BASE_REQUEST,
        {
            "multi_modal_data": {"image_url": urls("i"), "video_url": urls("v")},
            "extra_args": {
                "messages": [
                    {"role": "user", "content": [{"type": "input_video", "video_url": "v"}]},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": None},
                    {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "input_image"}]},
                ]
            },
        },
    )
    assert [m for m, *_ in items(build(request, capabilities=MM).request)] == [VIDEO, IMAGE]


def test_one_modality_keeps_unlisted_items_in_data_order() -> None:
    """With one modality the data order is the message order; items the messages do not list are still sent."""
    data = {"image_url": urls("a", "b", "c")}
    listed_one = build(media_request(data, part("image_url", "a")), capabilities=MM)
    no_messages = build(media_request(data), capabilities=MM)
    expected = [(IMAGE, "url", url(name), "") for name in "abc"]
    assert items(listed_one.request) == items(no_messages.request) == expected


def test_mixed_media_without_messages_are_refused() -> None:
    """Without ``extra_args.messages`` the interleaving of several modalities is unknowable: refused."""
    error = rejected(
        media_request({"image_url": urls("i"), "audio_url": urls("a")}), "multi_modal_data", capabilities=MM
    )
    assert "mixed-modality media order is unavailable" in error.reason


def test_mixed_media_partly_listed_are_refused() -> None:
    """With several modalities every item must be placed by the messages."""
    request = media_request(
        {"image_url": urls("i", "j"), "audio_url": urls("a")}, part("image_url", "i"), part("audio_url", "a")
    )
    error = rejected(request, "multi_modal_data", capabilities=MM)
    assert "mixed-modality media order is unavailable (1 image_url not in extra_args.messages)" in error.reason


@pytest.mark.parametrize(
    ("data", "parts"),
    [
        # What the frontend sends for image_url + input_audio: the audio part is listed but dropped from the data.
        ({"image_url": urls("i")}, [part("image_url", "i"), part("input_audio")]),
        ({"audio_url": urls("a")}, [part("input_audio"), part("audio_url", "a")]),
        ({"image_url": urls("i"), "audio_url": urls("a")}, [part("audio_url"), part("image_url"), part("audio_url")]),
    ],
    ids=["dropped modality", "dropped item of the only modality", "mixed"],
)
def test_messages_listing_media_the_data_lacks_are_refused(data: dict[str, Any], parts: list[dict[str, Any]]) -> None:
    """More media parts in the messages than items in ``multi_modal_data``: media were lost on the way, refused."""
    error = rejected(media_request(data, *parts), "extra_args.messages", capabilities=MM)
    assert "audio_url parts but multi_modal_data carries" in error.reason


# --------------------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize(
    ("value", "source"),
    [
        (PNG, "data_uri"),
        ("DATA:image/png;base64,AAAA", "data_uri"),
        ("https://example.com/cat.png", "url"),
        ("HTTP://example.com/cat.png", "url"),
    ],
)
def test_data_urls_become_data_uri_http_urls_url(value: str, source: str) -> None:
    """``data:`` URLs (any case) travel as ``data_uri`` for the engine to decode, ``http(s)`` ones as ``url``."""
    call = build(media_request({"image_url": [{"Url": value}]}), capabilities=MM)
    assert items(call.request) == [(IMAGE, source, value, "")]


@pytest.mark.parametrize("value", ["file:///etc/passwd", "s3://bucket/cat.png", "cat.png", "ftp://x/y.png"])
def test_other_url_schemes_are_refused(value: str) -> None:
    """Only what the wire says an engine fetches (http, https) or decodes (data) is sent; the frontend lets
    ``file://`` through, which would make the engine read its own host's files."""
    error = rejected(media_request({"image_url": [{"Url": value}]}), "multi_modal_data.image_url[0]", capabilities=MM)
    assert "must be an http(s) URL or a data: URI" in error.reason


@pytest.mark.parametrize(
    ("item", "field", "reason"),
    [
        ({"Decoded": {"descriptor": {}, "shape": [1, 1, 3]}}, "multi_modal_data.image_url[1]", "pre-decoded media"),
        ({"UuidOnly": "cached-image"}, "multi_modal_data.image_url[1]", "uuid-only media"),
        ({"Embedding": "x"}, "multi_modal_data.image_url[1]", "unknown media variant"),
        ({"Url": ""}, "multi_modal_data.image_url[1]", "non-empty URL"),
        ({"Url": 7}, "multi_modal_data.image_url[1]", "non-empty URL"),
        ({"Url": "a", "Decoded": {}}, "multi_modal_data.image_url[1]", "non-empty URL"),
        (None, "multi_modal_data.image_url[1]", "non-empty URL"),
    ],
    ids=["decoded", "uuid only", "unknown variant", "empty url", "url not a string", "two variants", "null"],
)
def test_unsendable_media_are_refused_naming_the_item(item: Any, field: str, reason: str) -> None:
    """Media the engine cannot fetch or decode itself (pre-decoded, uuid-only, malformed) are refused by item."""
    error = rejected(media_request({"image_url": [{"Url": url("ok")}, item]}), field, capabilities=MM)
    assert reason in error.reason


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ("http://x/y.png", "multi_modal_data"),
        ({"image_url": "http://x/y.png"}, "multi_modal_data.image_url"),
        ({"embedding_url": urls("x")}, "multi_modal_data"),
    ],
)
def test_malformed_multi_modal_data_is_refused(data: Any, field: str) -> None:
    """A ``multi_modal_data`` that is not ``{kind: [item, …]}`` with a known kind is refused naming the culprit."""
    rejected(merge(BASE_REQUEST, {"multi_modal_data": data}), field, capabilities=MM)


def test_a_bare_string_item_is_a_url() -> None:
    """The pre-enum shape (a plain URL string) is unambiguous and accepted."""
    call = build(media_request({"video_url": ["http://x/v.mp4"]}), capabilities=MM)
    assert items(call.request) == [(VIDEO, "url", "http://x/v.mp4", "")]


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ("hello", "extra_args.messages"),
        (["hello"], "extra_args.messages[0]"),
        ([{"role": "user", "content": ["hello"]}], "extra_args.messages[0].content[0]"),
    ],
)
def test_malformed_messages_are_refused_when_they_order_media(messages: Any, field: str) -> None:
    """Messages are read (and checked) only to order media; malformed ones are refused naming the place."""
    request = merge(BASE_REQUEST, {"multi_modal_data": {"image_url": urls("i")}, "extra_args": {"messages": messages}})
    rejected(request, field, capabilities=MM)


def test_part_types_that_are_not_strings_are_not_media() -> None:
    """A part whose ``type`` is not a string (even an unhashable one) is simply not a media part."""
    messages = [{"role": "user", "content": [{"type": ["image_url"]}, {"type": None}, part("image_url", "i")]}]
    request = merge(BASE_REQUEST, {"multi_modal_data": {"image_url": urls("i")}, "extra_args": {"messages": messages}})
    assert len(build(request, capabilities=MM).request.media) == 1


# ----------------------------------------------------------------------------------------------------------- uuids


def test_multi_modal_uuids_set_the_items_uuid() -> None:
    """``multi_modal_uuids`` is aligned with ``multi_modal_data`` per kind; a null entry leaves that item without."""
    request = media_request(
        {"image_url": urls("i", "j"), "audio_url": urls("a")},
        part("audio_url"),
        part("image_url"),
        part("image_url"),
    )
    request["multi_modal_uuids"] = {"image_url": ["img-1", None], "audio_url": ["aud-1"]}
    assert [(m, uuid) for m, _, _, uuid in items(build(request, capabilities=MM).request)] == [
        (AUDIO, "aud-1"),
        (IMAGE, "img-1"),
        (IMAGE, ""),
    ]


def test_media_hashes_become_uuids_and_the_callers_ids_win() -> None:
    """The frontend's ``mm_hashes`` (images) and ``mm_hashes_by_modality`` fill uuids; a caller's uuid wins."""
    flat = media_request({"image_url": urls("i", "j")}, mm_hashes=["h1", 2])
    assert [uuid for *_, uuid in items(build(flat, capabilities=MM).request)] == ["h1", "2"]

    by_kind = media_request(
        {"image_url": urls("i"), "audio_url": urls("a")},
        part("image_url"),
        part("audio_url"),
        mm_hashes_by_modality={"image": ["hi"], "audio": ["ha"]},
    )
    by_kind["multi_modal_uuids"] = {"audio_url": ["mine"]}
    assert [uuid for *_, uuid in items(build(by_kind, capabilities=MM).request)] == ["hi", "mine"]


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"multi_modal_uuids": {"image_url": ["u1"]}}, "multi_modal_uuids.image_url"),
        ({"multi_modal_uuids": {"audio_url": ["u1"]}}, "multi_modal_uuids"),
        ({"multi_modal_uuids": {"image_url": ["u1", ""]}}, "multi_modal_uuids.image_url[1]"),
        ({"multi_modal_uuids": {"image_url": ["u1", 3.5]}}, "multi_modal_uuids.image_url[1]"),
        ({"multi_modal_uuids": ["u1", "u2"]}, "multi_modal_uuids"),
        ({"multi_modal_uuids": {"image_url": ["u1", "x" * 1025]}}, "multi_modal_uuids.image_url[1]"),
        ({"extra_args": {"mm_hashes": ["h1"]}}, "extra_args.mm_hashes"),
        ({"extra_args": {"mm_hashes": ["h1", None]}}, "extra_args.mm_hashes[1]"),
        ({"extra_args": {"mm_hashes": "h1"}}, "extra_args.mm_hashes"),
        ({"extra_args": {"mm_hashes_by_modality": {"image": ["h"]}}}, "extra_args.mm_hashes_by_modality.image"),
        ({"extra_args": {"mm_hashes_by_modality": ["h"]}}, "extra_args.mm_hashes_by_modality"),
    ],
)
def test_malformed_uuids_are_refused(patch: dict[str, Any], field: str) -> None:
    """Uuids and hashes must be one non-empty string per item of their kind."""
    rejected(merge(media_request({"image_url": urls("i", "j")}), patch), field, capabilities=MM)


def test_image_hashes_without_images_are_refused() -> None:
    """``mm_hashes`` names images; a request without images cannot carry them."""
    request = media_request({"audio_url": urls("a")}, mm_hashes=["h"])
    rejected(request, "extra_args.mm_hashes", capabilities=MM)


# ------------------------------------------------------------------------------------------ capability and friends


@pytest.mark.parametrize("supported", [None, False], ids=["unreported", "false"])
def test_media_refused_when_the_engine_does_not_advertise_multimodal(supported: bool | None) -> None:
    """Media for an engine without ``supports_multimodal`` are a 400 naming ``multi_modal_data``, even malformed."""
    data: dict[str, Any]
    for data in ({"image_url": urls("http://x/y.png")}, {"image_url": [{"Decoded": {}}]}):
        error = rejected(
            merge(BASE_REQUEST, {"multi_modal_data": data}),
            "multi_modal_data",
            capabilities=caps(supports_multimodal=supported, supports_text_input=True),
        )
        assert error.reason == "the engine does not advertise supports_multimodal"


@pytest.mark.parametrize("key", ["multi_modal_uuids", "mm_routing_info"])
def test_media_descriptions_without_media_are_refused(key: str) -> None:
    """Uuids or media routing info for a request that carries no media point at lost media: refused."""
    rejected(merge(BASE_REQUEST, {key: {"image_url": ["u"]}}), key, capabilities=MM)


def test_media_routing_info_is_the_routers_business() -> None:
    """``mm_routing_info`` next to the media it describes changes nothing on the wire."""
    plain = media_request({"image_url": urls("i")})
    routed = merge(plain, {"mm_routing_info": {"routing_token_ids": [1, 2], "block_mm_infos": [None]}})
    assert build(routed, capabilities=MM).request == build(plain, capabilities=MM).request


@pytest.mark.parametrize("key", ["mm_processor_kwargs", "media_io_kwargs"])
def test_per_request_media_options_are_refused(key: str) -> None:
    """Processor and loader options have no portable OpenEngine field: refused even by a multimodal engine."""
    request = merge(media_request({"image_url": urls("i")}), {key: {"num_crops": 4}})
    error = rejected(request, key, capabilities=MM)
    assert "OpenEngine v0.1.0" in error.reason
    assert FIELD_POLICY[key][0] == "refused"


def test_disaggregated_legs_keep_their_media() -> None:
    """Both legs send the media: the prefill engine computes the prompt's KV from them, and the decode engine needs
    them too (TensorRT-LLM recomputes multimodal positions, mRoPE, on the decode leg)."""
    from tests.disagg.test_legs import NIXL, decode_request

    prefill = build(media_request({"image_url": urls("i")}), capabilities=MM, role="prefill")
    assert (items(prefill.request), prefill.max_tokens) == ([(IMAGE, "url", url("i"), "")], 1)
    decode = build(
        merge(decode_request(), {"multi_modal_data": {"image_url": urls("i")}}),
        capabilities=caps(supports_multimodal=True, kv_connector=NIXL),
        role="decode",
    )
    assert decode.leg == "decode"
    assert decode.request.HasField("kv")
    assert items(decode.request) == [(IMAGE, "url", url("i"), "")]


# ----------------------------------------------------------------------------------------------- text prompt path


def test_an_engine_taking_text_gets_the_rendered_prompt_with_media() -> None:
    """With media and ``supports_text_input``, ``extra_args.formatted_prompt`` replaces the token ids as input."""
    call = build(media_request({"image_url": urls("i")}, formatted_prompt=PROMPT), capabilities=MM_TEXT)
    assert call.request.WhichOneof("input") == "prompt"
    assert call.request.prompt == PROMPT
    assert call.prompt_tokens == len(BASE_REQUEST["token_ids"])
    assert len(call.request.media) == 1


@pytest.mark.parametrize(
    ("request_", "capabilities"),
    [
        (media_request({"image_url": urls("i")}, formatted_prompt=PROMPT), MM),
        (
            media_request({"image_url": urls("i")}, formatted_prompt=PROMPT),
            caps(supports_multimodal=True, supports_text_input=False),
        ),
        (media_request({"image_url": urls("i")}, formatted_prompt=""), MM_TEXT),
        (media_request({"image_url": urls("i")}), MM_TEXT),
        (merge(BASE_REQUEST, {"extra_args": {"formatted_prompt": PROMPT}}), MM_TEXT),
    ],
    ids=["text input unreported", "text input false", "empty prompt", "no prompt", "no media"],
)
def test_token_ids_otherwise(request_: dict[str, Any], capabilities: Any) -> None:
    """Without media, a text-capable engine or a rendered prompt, the token ids are the input."""
    call = build(request_, capabilities=capabilities)
    assert call.request.WhichOneof("input") == "token_ids"
    assert list(call.request.token_ids.ids) == BASE_REQUEST["token_ids"]


def test_a_rendered_prompt_that_is_not_text_is_refused() -> None:
    request = media_request({"image_url": urls("i")}, formatted_prompt=["not", "text"])
    rejected(request, "extra_args.formatted_prompt", capabilities=MM_TEXT)


# ------------------------------------------------------------------------------------------------------------ LoRA


def test_lora_name_mapped_when_advertised() -> None:
    """``routing.lora_name`` selects the adapter when the engine advertises ``supports_lora``."""
    call = build(merge(BASE_REQUEST, {"routing": {"lora_name": "poet"}}), capabilities=LORA)
    assert call.request.lora_name == "poet"
    assert FIELD_POLICY["routing.lora_name"][0] == "mapped"


@pytest.mark.parametrize("name", [None, ""])
def test_no_lora_name_is_the_base_model(name: str | None) -> None:
    """An absent or empty adapter name is the base model, whatever the engine advertises."""
    for capabilities in (LORA, caps(supports_lora=False)):
        call = build(merge(BASE_REQUEST, {"routing": {"lora_name": name}}), capabilities=capabilities)
        assert call.request.lora_name == ""


@pytest.mark.parametrize("supported", [None, False], ids=["unreported", "false"])
def test_lora_name_refused_when_not_advertised(supported: bool | None) -> None:
    """An adapter for an engine without ``supports_lora`` is refused before any RPC, naming the field."""
    error = rejected(
        merge(BASE_REQUEST, {"routing": {"lora_name": "poet"}}),
        "routing.lora_name",
        capabilities=caps(supports_lora=supported),
    )
    assert error.reason == "the engine does not advertise supports_lora"


def test_lora_name_must_be_a_string() -> None:
    rejected(merge(BASE_REQUEST, {"routing": {"lora_name": 3}}), "routing.lora_name", capabilities=LORA)


# ------------------------------------------------------------------------------------------------------------ fuzz

_scalar = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6)
_json = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_kind = st.sampled_from(["image_url", "video_url", "audio_url"])


def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually (9 in 10) a plausible value, sometimes anything at all."""
    return st.integers(min_value=0, max_value=9).flatmap(lambda k: valid if k else _json)


_item = _mostly(
    st.builds(lambda u: {"Url": u}, st.sampled_from(["http://x/a", PNG, "https://x/b"]))
    | st.sampled_from([{"UuidOnly": "u"}, {"Decoded": {}}, {"Url": ""}, {"Url": "file:///x"}, "http://x/b"])
)
_part = _mostly(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image_url", "input_image", "video_url", "audio_url", "input_audio", "text"])}
    )
)
_media_requests = st.fixed_dictionaries(
    {
        "token_ids": st.just([11, 12, 13]),
        "multi_modal_data": _mostly(st.dictionaries(_kind, st.lists(_item, min_size=1, max_size=3), max_size=3)),
    },
    optional={
        "multi_modal_uuids": _mostly(st.dictionaries(_kind, st.lists(st.none() | st.text(min_size=1, max_size=3)))),
        "mm_routing_info": _mostly(st.just({"routing_token_ids": [1]})),
        "extra_args": st.fixed_dictionaries(
            {},
            optional={
                "messages": _mostly(
                    st.lists(
                        _mostly(st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(_part)})),
                        max_size=3,
                    )
                ),
                "formatted_prompt": _mostly(st.sampled_from([PROMPT, ""])),
                "mm_hashes": _mostly(st.lists(st.text(min_size=1, max_size=3) | st.integers(0, 9), max_size=3)),
                "mm_hashes_by_modality": _mostly(
                    st.dictionaries(st.sampled_from(["image", "audio"]), st.lists(st.text(min_size=1, max_size=3)))
                ),
            },
        ),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_media_requests, capabilities=st.sampled_from([MM, MM_TEXT, caps()]))
def test_media_fuzz_only_maps_or_refuses(request: dict[str, Any], capabilities: Any) -> None:
    """Whatever shape the media fields take, the mapping either succeeds with one well-formed item per media part
    or refuses with RequestRejected — never another exception."""
    outcome: GenerateCall | RequestRejected
    try:
        outcome = build(request, capabilities=capabilities)
    except RequestRejected as rejected:  # the only exception allowed out
        outcome = rejected
    if isinstance(outcome, RequestRejected):
        assert outcome.field
        assert outcome.reason
        return
    wire = generation_pb2.GenerateRequest.FromString(outcome.request.SerializeToString())
    assert wire == outcome.request
    for item in outcome.request.media:
        assert item.modality in (IMAGE, VIDEO, AUDIO)
        source = item.WhichOneof("source")
        assert source in ("url", "data_uri")
        assert getattr(item, source)
        assert getattr(item, source).lower().startswith("data:" if source == "data_uri" else "http")
