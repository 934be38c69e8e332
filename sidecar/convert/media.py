"""Dynamo's ``multi_modal_data`` → ``GenerateRequest.media`` in the original message order.

What the frontend (ai-dynamo 1.6.1, its Rust preprocessor) hands a Tokens-input worker registered without a media
decoder, for a chat whose messages carry media parts (``docs/request-features.md``):

* ``multi_modal_data = {"image_url": [{"Url": u}, …], "video_url": […], "audio_url": […]}``: grouped by modality,
  each list in message order. The interleaving *across* modalities is lost there.
* ``extra_args.messages``, the chat messages (``data:`` URLs blanked, the parts' ``type`` kept), and
  ``extra_args.formatted_prompt``, the rendered chat template: both sent only when media are present.
* ``multi_modal_uuids = {"image_url": ["id" | None, …], …}``, aligned with ``multi_modal_data``, when a part carries a
  ``uuid``; an image part with a ``uuid`` and no URL arrives as ``{"UuidOnly": id}``.
* ``{"Decoded": …}`` (RDMA descriptors of media the frontend decoded) only for workers that register a media decoder.

An engine aligns media item *i* with the *i*-th placeholder of the prompt (wire §7.5), so the items must follow the
messages. The rules are those of Dynamo's engine-neutral sidecar (ai-dynamo/dynamo PR #11610, "ordered media"): the
order comes from ``extra_args.messages[*].content[*].type``, the values from ``multi_modal_data``; with more than one
modality every item must be listed there (else the order is unknowable and the request is refused); with one modality
the order within it is already right and unlisted items are kept; messages listing more items of a modality than
``multi_modal_data`` carries are refused (the frontend dropped media: it does not forward ``input_audio`` parts).
Only media the engine can fetch or decode itself travel: ``data:`` URLs as ``data_uri``, ``http(s)`` URLs as ``url``
(other schemes, which the frontend lets through, are refused).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from openengine.v1 import generation_pb2
from sidecar.errors import RequestRejected

__all__ = ["MEDIA_KINDS", "map_media"]

#: ``multi_modal_data`` keys → the wire modality.
MEDIA_KINDS: Final[Mapping[str, int]] = {
    "image_url": generation_pb2.MODALITY_IMAGE,
    "video_url": generation_pb2.MODALITY_VIDEO,
    "audio_url": generation_pb2.MODALITY_AUDIO,
}

#: Message content part types → the ``multi_modal_data`` key their media land under (``input_*``: Responses API).
_PART_KINDS: Final[Mapping[str, str]] = {
    "image_url": "image_url",
    "input_image": "image_url",
    "video_url": "video_url",
    "input_video": "video_url",
    "audio_url": "audio_url",
    "input_audio": "audio_url",
}

#: vLLM's modality names (``extra_args.mm_hashes_by_modality`` keys) per ``multi_modal_data`` key.
_HASH_KINDS: Final[Mapping[str, str]] = {"image_url": "image", "video_url": "video", "audio_url": "audio"}

#: Bound on one uuid or media hash (they are short ids; a cache key is not a payload).
MAX_UUID_CHARS: Final = 1024


def map_media(target: generation_pb2.GenerateRequest, request: Mapping[str, Any], extra_args: Mapping[str, Any]) -> int:
    """Fill ``target.media`` from ``request["multi_modal_data"]``; returns the number of items.

    The caller has checked that the engine takes media. Raises only :class:`~sidecar.errors.RequestRejected`.
    """
    data = _media_lists(request.get("multi_modal_data"))
    uuids = _uuids(request.get("multi_modal_uuids"), data, extra_args)
    order = _order(data, extra_args)
    for kind, index in order:
        source, value = data[kind][index]
        item = target.media.add(modality=MEDIA_KINDS[kind])
        setattr(item, source, value)
        uuid = uuids[kind][index]
        if uuid is not None:
            item.uuid = uuid
    return len(order)


def _media_lists(raw: object) -> dict[str, list[tuple[str, str]]]:
    """``multi_modal_data`` as ``{kind: [(source field, value), …]}`` with empty kinds dropped."""
    if not isinstance(raw, Mapping):
        raise RequestRejected("multi_modal_data", f"must be an object, got {type(raw).__name__}")
    data: dict[str, list[tuple[str, str]]] = {}
    for kind, items in raw.items():
        if items is None or (isinstance(items, list | tuple) and not items):
            continue
        if kind not in MEDIA_KINDS:
            # The key is the client's text: quoted and cut, never made part of a field name.
            expected = ", ".join(MEDIA_KINDS)
            raise RequestRejected("multi_modal_data", f"unknown media kind {str(kind)[:40]!r} (expected {expected})")
        field = f"multi_modal_data.{kind}"
        if not isinstance(items, list | tuple):
            raise RequestRejected(field, f"must be a list, got {type(items).__name__}")
        data[kind] = [_source(item, f"{field}[{i}]") for i, item in enumerate(items)]
    return data


def _source(item: object, field: str) -> tuple[str, str]:
    """One ``multi_modal_data`` entry → (``url`` | ``data_uri``, value)."""
    if isinstance(item, Mapping) and len(item) == 1:
        ((variant, value),) = item.items()
        if variant == "Url":
            item = value
        elif variant == "Decoded":
            reason = (
                "pre-decoded media (the frontend's RDMA descriptors) cannot travel over OpenEngine; the engine must "
                "fetch and decode media itself (register the worker without a media decoder)"
            )
            raise RequestRejected(field, reason)
        elif variant == "UuidOnly":
            reason = "uuid-only media (a processor-cache reference without the media) cannot be sent; give the URL"
            raise RequestRejected(field, reason)
        else:
            raise RequestRejected(field, f"unknown media variant {str(variant)[:40]!r} (expected Url)")
    # A bare string is the pre-enum shape some clients still send; it is as unambiguous as {"Url": …}.
    if not isinstance(item, str) or not item:
        raise RequestRejected(field, 'must be {"Url": "<non-empty URL>"}')
    scheme = item.partition(":")[0].lower()
    if scheme == "data":
        return "data_uri", item
    if scheme in ("http", "https"):
        return "url", item
    # The wire promises only that an engine fetches http(s) URLs. Other schemes are refused rather than passed on: the
    # frontend lets file:// through, and an engine that honoured it would read its own host's files for a client.
    raise RequestRejected(field, f"must be an http(s) URL or a data: URI, got a {scheme[:20]!r} URL")


def _order(data: Mapping[str, Sequence[object]], extra_args: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(kind, index in data[kind])`` in message order."""
    messages = extra_args.get("messages")
    listed = None if messages is None else _listed_kinds(messages)
    counts = {kind: len(items) for kind, items in data.items()}
    if listed is not None:
        for kind in dict.fromkeys(listed):
            named = listed.count(kind)
            have = counts.get(kind, 0)
            if named > have:
                reason = (
                    f"list {named} {kind} parts but multi_modal_data carries {have}: media were dropped on the way "
                    "(Dynamo's frontend forwards image_url, video_url and audio_url parts, not input_audio)"
                )
                raise RequestRejected("extra_args.messages", reason)
    if len(counts) == 1:
        # One modality: multi_modal_data is already in message order; items the messages do not list are kept.
        ((kind, count),) = counts.items()
        return [(kind, i) for i in range(count)]
    if listed is None:
        kinds = ", ".join(sorted(counts))
        raise RequestRejected(
            "multi_modal_data", f"mixed-modality media order is unavailable ({kinds} without extra_args.messages)"
        )
    missing = {kind: count - listed.count(kind) for kind, count in counts.items() if listed.count(kind) < count}
    if missing:
        detail = ", ".join(f"{count} {kind}" for kind, count in sorted(missing.items()))
        raise RequestRejected(
            "multi_modal_data", f"mixed-modality media order is unavailable ({detail} not in extra_args.messages)"
        )
    cursor = dict.fromkeys(counts, 0)
    order: list[tuple[str, int]] = []
    for kind in listed:
        order.append((kind, cursor[kind]))
        cursor[kind] += 1
    return order


def _listed_kinds(messages: object) -> list[str]:
    """The ``multi_modal_data`` kind of every media part of ``extra_args.messages``, in order."""
    if not isinstance(messages, list | tuple):
        raise RequestRejected("extra_args.messages", f"must be a list, got {type(messages).__name__}")
    kinds: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestRejected(f"extra_args.messages[{i}]", f"must be an object, got {type(message).__name__}")
        content = message.get("content")
        if not isinstance(content, list | tuple):
            continue  # text (or nothing): no media parts
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                field = f"extra_args.messages[{i}].content[{j}]"
                raise RequestRejected(field, f"must be an object, got {type(part).__name__}")
            part_type = part.get("type")
            kind = _PART_KINDS.get(part_type) if isinstance(part_type, str) else None
            if kind is not None:
                kinds.append(kind)
    return kinds


def _uuids(
    raw: object, data: Mapping[str, Sequence[object]], extra_args: Mapping[str, Any]
) -> dict[str, list[str | None]]:
    """Per kind, one optional uuid per item: the caller's ``multi_modal_uuids``, else the frontend's media hashes."""
    uuids: dict[str, list[str | None]] = {kind: [None] * len(items) for kind, items in data.items()}
    hashes = extra_args.get("mm_hashes_by_modality")
    if hashes is not None:
        if not isinstance(hashes, Mapping):
            raise RequestRejected("extra_args.mm_hashes_by_modality", f"must be an object, got {type(hashes).__name__}")
        for kind, name in _HASH_KINDS.items():
            if kind in data and hashes.get(name) is not None:
                _fill(uuids[kind], hashes[name], f"extra_args.mm_hashes_by_modality.{name}", kind)
    flat = extra_args.get("mm_hashes")
    if flat is not None and (not isinstance(flat, list | tuple) or flat):
        # The legacy flat list is images only (the frontend sends it only when every item is an image).
        if "image_url" not in data:
            raise RequestRejected("extra_args.mm_hashes", "media hashes for images, but the request has no images")
        _fill(uuids["image_url"], flat, "extra_args.mm_hashes", "image_url", keep=True)
    if raw is not None:
        if not isinstance(raw, Mapping):
            raise RequestRejected("multi_modal_uuids", f"must be an object, got {type(raw).__name__}")
        for kind, values in raw.items():
            if values is None:
                continue
            if kind not in data:
                reason = f"uuids for {str(kind)[:40]!r} media, which the request does not carry"
                raise RequestRejected("multi_modal_uuids", reason)
            field = f"multi_modal_uuids.{kind}"
            # The caller's own ids win over the frontend's hashes: they are what the caller caches by.
            _fill(uuids[kind], values, field, kind, allow_null=True)
    return uuids


def _fill(
    target: list[str | None],
    values: object,
    field: str,
    kind: str,
    *,
    keep: bool = False,
    allow_null: bool = False,
) -> None:
    """Check ``values`` (one per ``kind`` item) and write them into ``target``.

    ``keep``: never replace an id already there. ``allow_null``: a None entry leaves that item as it is.
    """
    if not isinstance(values, list | tuple):
        raise RequestRejected(field, f"must be a list, got {type(values).__name__}")
    if len(values) != len(target):
        raise RequestRejected(field, f"has {len(values)} entries for {len(target)} {kind} items")
    for i, value in enumerate(values):
        if value is None:
            if allow_null:
                continue
            raise RequestRejected(f"{field}[{i}]", "must be a string, got null")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            value = str(value)  # vLLM-style integer hashes; the wire field is a string
        if not isinstance(value, str):
            raise RequestRejected(f"{field}[{i}]", f"must be a string, got {type(value).__name__}")
        if not value:
            raise RequestRejected(f"{field}[{i}]", "must not be empty")
        if len(value) > MAX_UUID_CHARS:
            raise RequestRejected(f"{field}[{i}]", f"longer than {MAX_UUID_CHARS} characters")
        if keep and target[i] is not None:
            continue
        target[i] = value
