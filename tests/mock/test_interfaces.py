"""The mock's knobs other tests and benchmarks drive: split last token / finished, detokenization and its cost, the
abort log, a Unix socket listener, TLS flag checks and engine-wide protocol violations (the conformance kit's)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import trustme
from grpclib.client import Channel
from grpclib.const import Status
from hyperframe.frame import HeadersFrame

from openengine.v1 import generation_pb2, openengine_grpc, server_pb2
from sidecar.testing.mock.config import parse_args
from sidecar.testing.mock.lm import TinyLM
from sidecar.testing.mock.structs import struct_to_dict

from ._client import Outcome, abort, call, generate, make_request, wait_for_load
from ._h2 import RawH2
from .conftest import StartMock


def stats(addr: str) -> Mapping[str, object]:
    info = call(addr, lambda ch: openengine_grpc.ControlStub(ch).GetServerInfo(server_pb2.GetServerInfoRequest()))
    value = struct_to_dict(info.extra).get("mock_stats") or {}
    assert isinstance(value, dict)
    return value


def count(values: Mapping[str, object], key: str) -> int:
    value = values.get(key, 0.0)
    assert isinstance(value, float)
    return int(value)


def run(addr: str, req: generation_pb2.GenerateRequest) -> Outcome:
    return call(addr, lambda ch: generate(ch, req))


# -- split last token / finished --------------------------------------------------------------------------------------


def _wire(address: str, request: generation_pb2.GenerateRequest) -> RawH2:
    raw = RawH2(address)
    raw.generate(1, request)
    raw.read_until(HeadersFrame, stream_id=1)  # the response headers
    while not any(m.WhichOneof("event") == "finished" for _, m in raw.messages(1)):
        raw.read()
    return raw


def _last_token_and_finished(raw: RawH2) -> tuple[float, float, int, int]:
    """Arrival times and DATA frame indexes of the last token message and the finished message."""
    frames = raw.data_frames(1)
    messages = raw.messages(1)
    token_at = max(at for at, m in messages if m.WhichOneof("event") == "token")
    finished_at = next(at for at, m in messages if m.WhichOneof("event") == "finished")
    frame_of = {r.at: i for i, r in enumerate(frames)}
    return token_at, finished_at, frame_of[token_at], frame_of[finished_at]


def test_split_finish_per_request_writes_the_finished_later_in_its_own_frame(trt_addr: str) -> None:
    raw = _wire(trt_addr, make_request(max_tokens=3, ignore_eos=True, mock={"split_finish_ms": 400}))
    try:
        token_at, finished_at, token_frame, finished_frame = _last_token_and_finished(raw)
    finally:
        raw.close()
    assert finished_frame > token_frame, "separate DATA frames"
    assert finished_at - token_at >= 0.35


def test_split_finish_flag_applies_to_every_request(start_mock: StartMock) -> None:
    mock = start_mock("--split-finish-ms", "400")
    raw = _wire(mock.address, make_request(max_tokens=2, ignore_eos=True))
    try:
        token_at, finished_at, _, _ = _last_token_and_finished(raw)
    finally:
        raw.close()
    assert finished_at - token_at >= 0.35
    out = run(mock.address, make_request(n=2, max_tokens=2, ignore_eos=True, temperature=1.0))
    assert [m.WhichOneof("event") for m in out.messages].count("finished") == 2


@pytest.mark.parametrize("value", [-1.0, "soon", True])
def test_split_finish_ms_must_be_milliseconds(trt_addr: str, value: object) -> None:
    out = run(trt_addr, make_request(max_tokens=2, mock={"split_finish_ms": value}))
    assert (out.status, out.messages) == (Status.INVALID_ARGUMENT, [])


# -- detokenization ---------------------------------------------------------------------------------------------------


def test_detokenize_false_sends_no_text_and_does_no_detokenization(start_mock: StartMock) -> None:
    mock = start_mock()
    before = count(stats(mock.address), "detokenized_tokens")
    silent = run(mock.address, make_request(max_tokens=6, ignore_eos=True, extra={"detokenize": False}))
    assert silent.tokens()
    assert all(not m.token.text for m in silent.messages if m.WhichOneof("event") == "token")
    assert count(stats(mock.address), "detokenized_tokens") == before, "no detokenization work"
    spoken = run(mock.address, make_request(max_tokens=6, ignore_eos=True))
    assert spoken.text()
    assert count(stats(mock.address), "detokenized_tokens") == before + 6


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the mock's CPU time from /proc")
def test_detokenize_cost_is_spent_per_detokenized_token_only(start_mock: StartMock) -> None:
    # 40 tokens x 20 ms of CPU = 0.8 s when detokenized; CPU time, not wall time, so load does not blur it.
    mock = start_mock("--detokenize-cost-us", "20000")
    pid = mock.proc.pid
    start = _cpu_seconds(pid)
    run(mock.address, make_request(max_tokens=40, ignore_eos=True, extra={"detokenize": False}))
    silent = _cpu_seconds(pid) - start
    start = _cpu_seconds(pid)
    run(mock.address, make_request(max_tokens=40, ignore_eos=True))
    spoken = _cpu_seconds(pid) - start
    assert spoken >= 0.7, spoken
    assert silent < spoken - 0.5, (silent, spoken)


# -- abort log --------------------------------------------------------------------------------------------------------


def test_abort_log_counts_calls_by_target_and_result(start_mock: StartMock) -> None:
    mock = start_mock()

    async def scenario(ch: Channel) -> None:
        hung = asyncio.create_task(generate(ch, make_request("hung-1", max_tokens=30, mock={"hang_after_tokens": 1})))
        await wait_for_load(ch, lambda load: load.running_requests == 1)
        assert (await abort(ch, "hung-1")).status == 1  # ABORTED
        await hung
        await abort(ch, "hung-1")  # ALREADY_FINISHED
        await abort(ch, all_requests=True)  # nothing running: ALREADY_FINISHED
        cancelled = asyncio.create_task(generate(ch, make_request(max_tokens=30, mock={"hang_after_tokens": 1})))
        await wait_for_load(ch, lambda load: load.running_requests == 1)
        cancelled.cancel()
        await wait_for_load(ch, lambda load: load.running_requests == 0)

    call(mock.address, scenario)
    log = stats(mock.address)
    assert count(log, "aborts_received") == 3
    assert (count(log, "aborts_by_request_id"), count(log, "aborts_by_all_requests")) == (2, 1)
    assert (count(log, "aborts_aborted"), count(log, "aborts_already_finished")) == (1, 2)
    assert count(log, "aborts_in_flight") == 1
    assert count(log, "requests_aborted") == 1
    assert count(log, "requests_cancelled") == 1, "a reset stream frees the request without any Abort"


# -- Unix socket ------------------------------------------------------------------------------------------------------


def test_uds_serves_and_the_port_file_names_the_socket(start_mock: StartMock, tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    mock = start_mock("--uds", str(path))
    assert mock.address == f"unix://{path}"

    async def over_uds() -> Outcome:
        channel = Channel(path=str(path))
        try:
            return await asyncio.wait_for(generate(channel, make_request(max_tokens=3, ignore_eos=True)), 20)
        finally:
            channel.close()

    out = asyncio.run(over_uds())
    assert out.status == Status.OK
    assert out.events[-1] == "finished"
    assert mock.stop() == 0
    assert not path.exists(), "the socket file is removed on exit"


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda tmp: tmp / "missing" / "e.sock", "does not exist"),
        (lambda tmp: tmp / "file", "is not a socket"),
        (lambda tmp: tmp / ("x" * 120), "a Unix socket path holds"),
    ],
    ids=["no-directory", "not-a-socket", "too-long"],
)
def test_a_bad_uds_path_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make_path: object, message: str
) -> None:
    (tmp_path / "file").write_text("")
    assert callable(make_path)
    with pytest.raises(SystemExit) as exited:
        parse_args(["--uds", str(make_path(tmp_path))])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err


# -- TLS flags --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", "cert.pem"], "--tls-cert needs --tls-key"),
        (["--tls-key", "cert.pem"], "--tls-key needs --tls-cert"),
        (["--tls-cert", "missing.pem", "--tls-key", "missing.pem"], "is not a readable file"),
    ],
    ids=["ca-without-cert", "cert-without-key", "key-without-cert", "missing-file"],
)
def test_incomplete_tls_flags_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    for name in ("ca.pem", "cert.pem"):
        (tmp_path / name).write_text("")
    argv = [str(tmp_path / f) if f.endswith(".pem") else f for f in flags]
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err


def test_a_certificate_that_does_not_load_is_one_line_and_exit_2(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    done = subprocess.run(
        [sys.executable, "-m", "sidecar.testing.mock", "--tls-cert", str(garbage), "--tls-key", str(garbage)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("openengine-mock: error: TLS"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_tls_with_a_client_ca_serves(start_mock: StartMock, tmp_path: Path) -> None:
    ca = trustme.CA()
    server = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(server))
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    mock = start_mock("--tls-cert", str(server), "--tls-key", str(server), "--tls-client-ca", str(ca_pem))
    assert mock.address.startswith("127.0.0.1:")


# -- engine-wide protocol violations ----------------------------------------------------------------------------------


def test_fault_violation_applies_to_every_request(start_mock: StartMock) -> None:
    mock = start_mock("--fault-violation", "wrong_request_id")
    for request_id in ("a", "b"):
        out = run(mock.address, make_request(request_id, max_tokens=2))
        assert out.messages[0].request_id == f"{request_id}-wrong"


def test_cumulative_deltas_repeat_every_earlier_token(start_mock: StartMock) -> None:
    lm = TinyLM.load(None)
    ids = lm.encode(" Alder carries leaves")
    mock = start_mock("--fault-violation", "cumulative_deltas")
    out = run(mock.address, make_request(max_tokens=3, mock={"tokens": ids}))
    events = [[t.token_id for t in m.token.tokens] for m in out.messages if m.WhichOneof("event") == "token"]
    assert events == [ids[:1], ids[:2], ids[:3]]
    texts = [m.token.text for m in out.messages if m.WhichOneof("event") == "token"]
    assert texts == [lm.decode(ids[:1]), lm.decode(ids[:2]), lm.decode(ids[:3])]


def test_usage_on_every_finish(start_mock: StartMock, trt_addr: str) -> None:
    mock = start_mock("--fault-violation", "usage_on_every_finish")
    out = run(mock.address, make_request(n=3, max_tokens=2, ignore_eos=True, temperature=1.0))
    finished = [m for m in out.messages if m.WhichOneof("event") == "finished"]
    assert len(finished) == 3
    assert all(m.HasField("usage") for m in finished)
    behaved = run(trt_addr, make_request(n=3, max_tokens=2, ignore_eos=True, temperature=1.0))
    assert [m.HasField("usage") for m in behaved.messages if m.WhichOneof("event") == "finished"] == [
        False,
        False,
        True,
    ]


def test_per_request_violation_wins_over_the_flag(start_mock: StartMock) -> None:
    mock = start_mock("--fault-violation", "wrong_request_id")
    out = run(mock.address, make_request("c", max_tokens=2, mock={"violation": "missing_output_index"}))
    assert out.messages[0].request_id == "c"
    assert not out.messages[0].token.HasField("output_index")


def test_an_unknown_violation_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--fault-violation", "late_tokens"])
    assert exited.value.code == 2
    assert "--fault-violation" in capsys.readouterr().err
