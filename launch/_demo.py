"""The client side of the single-machine launchers (``launch/*.sh``): one fitting request through the frontend, the
engines' own view after it, LoRA loading through the worker's control, and tiny media made on the spot.

Run by the launchers as ``python launch/_demo.py COMMAND ...``; each command prints what it saw for a person and
merges the same facts into ``--report FILE`` (JSON) for the launch-matrix test. A failure is one line naming it and
exit status 1. Only the standard library and the project's own OpenEngine client are used.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import struct
import sys
import time
import urllib.error
import urllib.request
import wave
import zlib
from io import BytesIO
from pathlib import Path
from typing import Any

#: The user text of every request; media rows add their placeholders for openengine-mock (see ``--placeholders``).
PROMPT = "Tell me about the river."
#: How long the engines may take to show nothing running after the answer (a request's clean-up is asynchronous).
IDLE_TIMEOUT_S = 20.0


class DemoError(Exception):
    """A failed check: printed as one line, exit status 1."""


# --- media made on the spot -------------------------------------------------------------------------------------
# Big enough for a real vision processor (Qwen3-VL needs at least 28x28 pixels and two frames), small enough for a
# data: URL. The frontend refuses loopback http URLs, so media travel inline.


def _png(width: int, height: int, shade: int) -> bytes:
    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in ((x * 4) % 256, (y * 4) % 256, shade)) for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _avi(width: int, height: int, frames: int) -> bytes:
    """An uncompressed (BI_RGB) AVI: the one video container every decoder reads without a codec."""
    size = width * height * 3  # width is a multiple of 4, so rows need no padding
    data = [
        b"".join(bytes(((x * 4 + f * 60) % 256, (y * 4) % 256, 128)) for y in range(height) for x in range(width))
        for f in range(frames)
    ]

    def chunk(kind: bytes, body: bytes) -> bytes:
        return kind + struct.pack("<I", len(body)) + body + (b"\0" if len(body) % 2 else b"")

    def listed(kind: bytes, body: bytes) -> bytes:
        return chunk(b"LIST", kind + body)

    # MainAVIHeader: 10 fps, AVIF_HASINDEX, one stream; AVISTREAMHEADER; BITMAPINFOHEADER (24-bit, BI_RGB).
    avih = struct.pack("<14I", 100000, size * 10, 0, 0x10, frames, 0, 1, size, width, height, 0, 0, 0, 0)
    rate = (1, 10)  # dwScale, dwRate
    strh = b"vidsDIB " + struct.pack(
        "<IHHIIIIIIIIhhhh", 0, 0, 0, 0, *rate, 0, frames, size, 0xFFFFFFFF, 0, 0, 0, width, height
    )
    strf = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, size, 0, 0, 0, 0)
    hdrl = listed(b"hdrl", chunk(b"avih", avih) + listed(b"strl", chunk(b"strh", strh) + chunk(b"strf", strf)))
    movi = listed(b"movi", b"".join(chunk(b"00db", frame) for frame in data))
    # idx1 offsets count from the "movi" fourcc; every frame is a key frame.
    index = b"".join(b"00db" + struct.pack("<III", 0x10, 4 + i * (8 + size), size) for i in range(frames))
    body = b"AVI " + hdrl + movi + chunk(b"idx1", index)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _wav(seconds: float, hertz: float) -> bytes:
    rate = 16000
    samples = b"".join(
        struct.pack("<h", int(8000 * math.sin(2 * math.pi * hertz * i / rate))) for i in range(int(rate * seconds))
    )
    out = BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples)
    return out.getvalue()


def _data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def media_parts(kind: str) -> list[dict[str, Any]]:
    """The media of a ``kind`` request in message order, each with a uuid naming its place."""
    if kind == "image-video":
        items = [
            ("image_url", "image-1", _data_url("image/png", _png(64, 64, 40))),
            ("video_url", "video-1", _data_url("video/x-msvideo", _avi(64, 64, 4))),
            ("image_url", "image-2", _data_url("image/png", _png(64, 64, 200))),
        ]
    elif kind == "audio":
        # audio_url parts: the frontend drops input_audio parts (and the sidecar then refuses the request).
        items = [
            ("audio_url", "audio-1", _data_url("audio/wav", _wav(0.5, 440.0))),
            ("audio_url", "audio-2", _data_url("audio/wav", _wav(0.5, 660.0))),
        ]
    else:
        items = []
    return [{"type": part, part: {"url": url}, "uuid": uuid} for part, uuid, url in items]


def _placeholder(part: dict[str, Any]) -> str:
    return "<" + str(part["type"]).removesuffix("_url") + ">"


# --- report -----------------------------------------------------------------------------------------------------


def _merge_report(path: Path | None, key: str, name: str, value: Any) -> None:
    if path is None:
        return
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    report.setdefault(key, {})[name] = value
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


# --- ask ----------------------------------------------------------------------------------------------------------


def ask(url: str, model: str, kind: str, placeholders: bool, timeout: float) -> dict[str, Any]:
    """One streamed chat completion with usage; returns what came back (raises :class:`DemoError` if it failed)."""
    media = media_parts(kind)
    if kind == "image-video":
        text = "Compare the image with the video and the second image."
    elif kind == "audio":
        text = "Transcribe both clips."
    else:
        text = PROMPT
    if placeholders and media:
        # openengine-mock aligns media with <image>/<video>/<audio> in the text (the tiny model's chat template
        # writes none); a real model's template inserts its own.
        text += " " + " ".join(_placeholder(part) for part in media)
    content: str | list[dict[str, Any]] = [{"type": "text", "text": text}, *media] if media else text
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    chunks: list[dict[str, Any]] = []
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    # The frontend has already sent 200: a refusal or failure mid-stream arrives as an SSE error.
                    raise DemoError(f"the stream ended with an error (HTTP 200 + SSE error): {chunk['error']}")
                chunks.append(chunk)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip()
        raise DemoError(f"HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise DemoError(f"no answer from {url}: {exc}") from None
    answer = "".join(
        choice.get("delta", {}).get("content") or "" for chunk in chunks for choice in chunk.get("choices", [])
    )
    finish = [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c.get("finish_reason")]
    with_usage = [i for i, chunk in enumerate(chunks) if chunk.get("usage")]
    result = {
        "model": model,
        "kind": kind,
        "text": answer,
        "finish_reason": finish[-1] if finish else None,
        "usage": chunks[-1].get("usage") if chunks else None,
        "usage_on_final_chunk_only": bool(chunks) and with_usage == [len(chunks) - 1],
        "chunks": len(chunks),
        "media": [{"type": part["type"], "uuid": part["uuid"]} for part in media],
    }
    if not answer:
        raise DemoError(f"empty answer ({len(chunks)} chunks)")
    if not result["usage_on_final_chunk_only"]:
        raise DemoError(f"usage not on the final chunk alone (chunks with usage: {with_usage} of {len(chunks)})")
    return result


# --- engines ------------------------------------------------------------------------------------------------------


async def _engine_view(address: str) -> dict[str, Any]:
    # The project's own client, imported here: the other commands need nothing but the standard library.
    import trio

    from sidecar.convert.structjson import bp_struct_to_json
    from sidecar.edge import open_edge
    from sidecar.engine import EngineClientConfig, open_engine_client, parse_endpoint
    from sidecar.errors import EngineRpcError

    config = EngineClientConfig(endpoint=parse_endpoint(address), connections=1)
    async with open_edge() as edge, open_engine_client(edge, config) as client:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            load = await client.get_load()
            idle = not load.running_requests and not load.queued_requests and not load.active_kv_sessions
            if idle or time.monotonic() > deadline:
                break
            await trio.sleep(0.1)
        info = await client.get_server_info()
        try:
            adapters = sorted(a.lora_name for a in (await client.list_loras()).adapters)
        except EngineRpcError:
            adapters = None  # UNIMPLEMENTED: an engine without LoRA (TensorRT-LLM's baseline)
    extra = bp_struct_to_json(info.extra) if info.extra else {}
    stats = extra.get("mock_stats") if isinstance(extra, dict) else None
    return {
        "address": address,
        "engine": info.engine_name,
        "running_requests": load.running_requests,
        "queued_requests": load.queued_requests,
        "active_kv_sessions": load.active_kv_sessions,
        "loras": adapters,
        "mock_stats": stats if isinstance(stats, dict) else None,
    }


def engines(named: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    import trio

    async def main() -> dict[str, dict[str, Any]]:
        return {name: await _engine_view(address) for name, address in named}

    return trio.run(main)


# --- LoRA ---------------------------------------------------------------------------------------------------------


def load_lora(system_url: str, name: str, path: str) -> dict[str, Any]:
    """``POST /engine/load_lora`` on a worker's system port (docs/lora.md)."""
    body = json.dumps({"lora_name": name, "source_path": path}).encode()
    request = urllib.request.Request(
        f"{system_url}/engine/load_lora", data=body, headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=180) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace").strip()
        hint = " (the engine does not advertise supports_lora)" if exc.code == 404 else ""
        raise DemoError(f"load_lora at {system_url}: HTTP {exc.code}{hint}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise DemoError(f"load_lora at {system_url}: {exc}") from None
    if answer.get("status") != "ok":
        raise DemoError(f"load_lora at {system_url} refused: {answer.get('code')}: {answer.get('message')}")
    return answer


def write_adapter(directory: Path) -> None:
    """A tiny PEFT-shaped adapter (only its config): enough for the sidecar's checks and openengine-mock."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config) + "\n")


# --- command line -------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch/_demo.py", description=__doc__)
    parser.add_argument("--report", type=Path, default=None, help="merge the facts into this JSON file")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ask", help="one streamed chat completion; print the answer and the final chunk's usage")
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--kind", choices=("text", "image-video", "audio"), default="text")
    p.add_argument("--label", default="answer", help="the answer's name in the report")
    p.add_argument("--placeholders", action="store_true", help="write <image>/<video>/<audio> into the text")
    p.add_argument("--timeout", type=float, default=120.0)
    p = sub.add_parser("engines", help="each engine's load once idle (bounded), its LoRA adapters and mock stats")
    p.add_argument("engines", nargs="+", metavar="NAME=HOST:PORT")
    p = sub.add_parser("load-lora", help="load an adapter through a worker's /engine/load_lora")
    p.add_argument("system_url")
    p.add_argument("name")
    p.add_argument("path")
    p = sub.add_parser("differs", help="whether two answers in the report differ (an adapter changed the output)")
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--required", action="store_true", help="fail when they do not")
    p = sub.add_parser("adapter", help="write a tiny adapter directory")
    p.add_argument("directory", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "ask":
            result = ask(args.url, args.model, args.kind, args.placeholders, args.timeout)
            _merge_report(args.report, "answers", args.label, result)
            print(f"{args.label} ({args.model}): {result['text']}")
            print(f"  usage on the final chunk: {json.dumps(result['usage'], sort_keys=True)}")
        elif args.command == "engines":
            named = []
            for item in args.engines:
                name, sep, address = item.partition("=")
                if not sep:
                    raise DemoError(f"expected NAME=HOST:PORT, got {item!r}")
                named.append((name, address))
            for name, view in engines(named).items():
                _merge_report(args.report, "engines", name, view)
                sessions = view["active_kv_sessions"]
                line = (
                    f"{name} {view['address']}: running {view['running_requests']}, "
                    f"queued {view['queued_requests'] or 0}, KV sessions {'-' if sessions is None else sessions}"
                )
                if view["loras"]:
                    line += f", adapters {', '.join(view['loras'])}"
                served = {k: v for k, v in (view["mock_stats"] or {}).items() if k != "last_media" and v}
                if served:
                    line += f"; served {json.dumps(served, sort_keys=True)}"
                print(line)
                media = (view["mock_stats"] or {}).get("last_media") or []
                if media:
                    print("  media it received, in order: " + ", ".join(f"{m['modality']} {m['uuid']}" for m in media))
                if view["running_requests"] or view["queued_requests"] or sessions:
                    raise DemoError(f"the {name} engine is not idle {IDLE_TIMEOUT_S:.0f} s after the answer")
        elif args.command == "load-lora":
            answer = load_lora(args.system_url, args.name, args.path)
            _merge_report(args.report, "loras", args.system_url, answer)
            print(f"load_lora {args.name} at {args.system_url}: {json.dumps(answer, sort_keys=True)}")
        elif args.command == "differs":
            answers = json.loads(args.report.read_text())["answers"] if args.report else {}
            first, second = answers[args.first]["text"], answers[args.second]["text"]
            differs = first != second
            _merge_report(args.report, "compared", f"{args.first} vs {args.second}", {"differs": differs})
            print(f"{args.first} and {args.second} answers differ: {'yes' if differs else 'no'}")
            if args.required and not differs:
                raise DemoError(f"the {args.first} answer is the {args.second} answer: the adapter changed nothing")
        elif args.command == "adapter":
            write_adapter(args.directory)
    except DemoError as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
