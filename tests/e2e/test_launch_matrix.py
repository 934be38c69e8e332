"""The launch matrix: every single-machine launcher, run as a user would, with ``--demo --once``.

Like the smoke matrix Dynamo ran for its own OpenEngine sidecar on GPUs (aggregated and 1P1D text and LoRA, image
and video aggregated and 1P1D, aggregated audio), on ``openengine-mock`` instead. Each row checks what the launcher
reports (``--log-dir``'s ``report.json``, written by ``launch/_demo.py``) and what it leaves behind:

* a nonempty answer, with the usage on the final chunk (and only there);
* every engine at zero running requests and zero KV sessions after the answer;
* exit status 0, every process stopped by SIGTERM with status 0 (the sidecars drained), none left running, the logs
  kept where ``--log-dir`` said;
* disaggregated rows: the handoff happened -- every request went through both legs, the prefill engine created a
  KV session for each and the decode engine claimed each one;
* media rows: each engine received the media in message order (image, video, image -- not grouped by modality);
* LoRA rows: the adapter was loaded on every engine and changed the answer (openengine-mock's adapters change the
  text; the same request to the base model answers differently).

And the demo as the README's user keeps it running (``agg.sh --demo``, what ``launch/demo.sh`` runs): the OpenAI SDK's
structured-output calls (``response_format`` json_schema from a pydantic model, and json_object) answer JSON valid
for the schema -- the demo engine is TensorRT-LLM's profile of openengine-mock, whose guided decoding is xgrammar's.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema

from tests.deploy.sessions import kill_session, session_members
from tests.deploy.sessions import run_launcher as run_in_session
from tests.e2e.test_guided import Forecast
from tests.helpers.processes import free_low_port, free_port

# pytest.mark.timeout: one launcher run (RUN_BOUND_S) plus its stop and checks
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(480)]

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
#: One launcher run, start to clean stop, on a loaded two-core machine.
RUN_BOUND_S = 300


@dataclass(frozen=True)
class Row:
    script: str
    disaggregated: bool
    media: tuple[tuple[str, str], ...] = ()
    lora: bool = False


IMAGE_VIDEO = (("image", "image-1"), ("video", "video-1"), ("image", "image-2"))
AUDIO = (("audio", "audio-1"), ("audio", "audio-2"))
ROWS = [
    Row("agg.sh", disaggregated=False),
    Row("disagg.sh", disaggregated=True),
    Row("agg_multimodal.sh", disaggregated=False, media=IMAGE_VIDEO),
    Row("disagg_multimodal.sh", disaggregated=True, media=IMAGE_VIDEO),
    Row("agg_audio.sh", disaggregated=False, media=AUDIO),
    Row("agg_lora.sh", disaggregated=False, lora=True),
    Row("disagg_lora.sh", disaggregated=True, lora=True),
]


def run_launcher(row: Row, logs: Path) -> tuple[int, str]:
    ports = ["--http-port", str(free_port())]
    if row.disaggregated:
        ports += ["--system-ports", f"{free_low_port()},{free_low_port()}"]
    else:
        ports += ["--system-port", str(free_low_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    argv = ["bash", str(LAUNCH / row.script), "--demo", "--once", "--log-dir", str(logs), *ports]
    status, output, left = run_in_session(argv, RUN_BOUND_S, env)
    assert status is not None, output[-4000:]
    assert not left, f"{row.script} left processes behind: {left}"
    return status, output


@pytest.mark.parametrize("row", ROWS, ids=[row.script.removesuffix(".sh") for row in ROWS])
def test_launcher_demo_once(row: Row, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    status, output = run_launcher(row, logs)
    assert status == 0, output[-6000:]
    assert f"logs kept in {logs}/" in output
    report: dict[str, Any] = json.loads((logs / "report.json").read_text())

    # The answer: nonempty, usage on the final chunk only.
    answer = report["answers"]["adapter" if row.lora else "answer"]
    assert answer["text"].strip(), answer
    assert answer["usage_on_final_chunk_only"] is True, answer
    assert answer["usage"]["completion_tokens"] > 0
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]

    # The engines after it: nothing running, no KV session held.
    engines: dict[str, dict[str, Any]] = report["engines"]
    assert set(engines) == ({"prefill-engine", "decode-engine"} if row.disaggregated else {"engine"})
    for name, engine in engines.items():
        assert engine["running_requests"] == 0, (name, engine)
        assert not engine["queued_requests"], (name, engine)
        assert engine["active_kv_sessions"] == 0, (name, engine)

    # A clean stop: every process exited 0 on SIGTERM, sidecars first.
    stopped = dict(line.split() for line in (logs / "exit-status").read_text().splitlines())
    assert set(stopped.values()) == {"0"}, stopped
    sidecars = [name for name in stopped if name.endswith("sidecar")]
    assert sidecars == (["decode-sidecar", "prefill-sidecar"] if row.disaggregated else ["sidecar"])
    for sidecar in sidecars:
        assert "draining -> stopped" in (logs / f"{sidecar}.log").read_text()

    requests = 2 if row.lora else 1  # LoRA rows also ask the base model
    if row.disaggregated:
        prefill = engines["prefill-engine"]["mock_stats"]
        decode = engines["decode-engine"]["mock_stats"]
        assert prefill.get("prefill_legs") == requests, prefill
        assert prefill.get("kv_sessions_created") == requests, prefill
        assert prefill.get("kv_sessions_claimed") == requests, prefill
        assert decode.get("decode_legs") == requests, decode
        assert not prefill.get("requests"), "a request skipped the handoff"
        assert not decode.get("requests"), "a request skipped the handoff"
    else:
        assert engines["engine"]["mock_stats"].get("requests") == requests

    if row.media:
        expected = [{"modality": modality, "source": "data_uri", "uuid": uuid} for modality, uuid in row.media]
        for name, engine in engines.items():
            assert engine["mock_stats"]["last_media"] == expected, name
            assert engine["mock_stats"]["media_requests"] == 1, name

    if row.lora:
        assert answer["model"] == "tiny-lora"
        assert report["answers"]["base"]["model"] == "tiny-oe"
        assert report["compared"]["adapter vs base"] == {"differs": True}
        for name, engine in engines.items():
            assert engine["loras"] == ["tiny-lora"], name
        loaded = report["loras"]
        assert len(loaded) == (2 if row.disaggregated else 1)
        assert all(entry["status"] == "ok" and entry["lora_name"] == "tiny-lora" for entry in loaded.values())


def test_ctrl_c_in_a_terminal_stops_every_process_in_order(tmp_path: Path) -> None:
    """A user's Ctrl-C: the terminal sends SIGINT to its foreground process group. Only the launcher may get it (its
    children run in groups of their own); it then stops the sidecar first, which drains while its engine still
    answers, then the engine, then the frontend -- all with status 0. (Had the children shared the launcher's group,
    the engine would stop together with the sidecar, and the sidecar could not confirm it idle: exit 1.)"""
    logs = tmp_path / "logs"
    argv = ["bash", str(LAUNCH / "agg.sh"), "--log-dir", str(logs)]
    argv += ["--http-port", str(free_port()), "--system-port", str(free_low_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    master, slave = os.openpty()

    def own_terminal() -> None:  # a session whose controlling terminal is the pty, like a shell's
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    output = b""

    def read_until(done: Callable[[], bool], seconds: float) -> None:
        nonlocal output
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    output += os.read(master, 65536)
                except OSError:  # the terminal's other side closed
                    return

    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=own_terminal)
    os.close(slave)
    try:
        read_until(lambda: b"serving; Ctrl-C" in output or proc.poll() is not None, RUN_BOUND_S)
        assert b"serving; Ctrl-C" in output, output.decode(errors="replace")[-4000:]
        os.write(master, b"\x03")  # what the terminal sends for Ctrl-C
        read_until(lambda: proc.poll() is not None, 120)
        read_until(lambda: False, 1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=90)
        os.close(master)
        left = session_members(proc.pid)
        kill_session(proc.pid)
    text = output.decode(errors="replace")
    assert proc.returncode == 130, text[-4000:]
    assert not left, left
    assert "stopped (exit status): frontend 0, engine 0, sidecar 0" in text, text[-4000:]
    sidecar = (logs / "sidecar.log").read_text()
    assert "SIGINT" not in sidecar, "the terminal's SIGINT reached the sidecar"
    assert "SIGTERM received: draining" in sidecar
    assert "draining -> stopped" in sidecar
    assert "quiescence not confirmed" not in sidecar


def test_the_demo_answers_the_openai_sdks_structured_output(tmp_path: Path) -> None:
    """Issue 27 item 1: the demo engine ran ``--profile full`` (guided decoding off), so every ``response_format``
    got HTTP 400 "the engine does not advertise guided decoding". Both structured-output calls now answer JSON valid
    for their schema, through the real frontend and sidecar, and the demo still stops cleanly."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    http = free_port()
    argv = ["bash", str(LAUNCH / "agg.sh"), "--demo", "--log-dir", str(logs)]
    argv += ["--http-port", str(http), "--system-port", str(free_low_port())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    messages: Any = [{"role": "user", "content": "What is the weather by the river?"}]
    schema = to_strict_json_schema(Forecast)
    try:
        deadline = time.monotonic() + RUN_BOUND_S
        while "serving; Ctrl-C" not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "serving; Ctrl-C" in out.read_text(), out.read_text()[-4000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", timeout=60, max_retries=0)

        # json_schema: the SDK's parse() sends the pydantic model's strict schema and parses the answer into it.
        parsed = client.chat.completions.parse(
            model="tiny-oe", messages=messages, response_format=Forecast, max_tokens=512, temperature=0
        )
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Forecast), choice.message.content
        jsonschema.Draft202012Validator(schema).validate(json.loads(choice.message.content or ""))

        # json_object: any JSON object.
        plain = client.chat.completions.create(
            model="tiny-oe", messages=messages, response_format={"type": "json_object"}, max_tokens=256
        )
        assert isinstance(json.loads(plain.choices[0].message.content or ""), dict), plain
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        left = session_members(proc.pid)
        kill_session(proc.pid)
    output = out.read_text()
    assert proc.returncode == 143, output[-4000:]  # its own SIGTERM status, after every child stopped cleanly
    assert not left, left
    assert "stopped (exit status): frontend 0, engine 0, sidecar 0" in output, output[-4000:]
