"""The whole kit against ``openengine-mock``: it passes, and every verdict is the one the mock's behaviour implies."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import trustme

from sidecar.conformance import selected_checks
from tests.mock.conftest import MockProcess

from .conftest import MOCK_SPEED, MockFactory, failed, run_kit

ALL_IDS = [c.id for c in selected_checks()]

#: The default mock (``--profile trtllm``, TensorRT-LLM's merged server): where it differs from the letter of the wire
#: reference in a known way (docs/mock.md's profile table says why for each).
DEFAULT_VARIANTS = {
    "discovery.schema_release",  # a 12-hex prefix of the release
    "discovery.role",  # UNSPECIFIED: the phase is chosen per request
    "discovery.unknown_model",  # any model name is served
    "discovery.limits",  # max_output_tokens = the window
    "validation.both_inputs",  # protobuf keeps the last member of the oneof
    "stream.stop_token",  # ignore_eos drops every stop word
    "stream.stop_text",  # ditto
    "stream.max_tokens_over_window",  # clamped to the window
    "abort.unknown_id",  # ALREADY_FINISHED
}
DEFAULT_SKIPS = {
    "kv.sources",  # both KV event RPCs UNIMPLEMENTED
    "kv.snapshot",
    "kv.sequence",
    "lora.controls",
    "lora.lifecycle",
    "stop.graceful",  # destructive: only with --include-stop
}


def test_the_default_mock_passes_every_check(default_mock: MockProcess, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_kit(capsys, "--engine", default_mock.address, "--json")
    assert run.code == 0, failed(run)
    verdicts = run.verdicts()
    assert list(verdicts) == ALL_IDS
    assert {k for k, v in verdicts.items() if v == "variant"} == DEFAULT_VARIANTS
    assert {k for k, v in verdicts.items() if v == "skip"} == DEFAULT_SKIPS
    assert {k for k, v in verdicts.items() if v == "pass"} == set(ALL_IDS) - DEFAULT_VARIANTS - DEFAULT_SKIPS
    # The n = 2 stream is among those judged (usage_on_every_finish shows only there).
    assert "1 with n > 1" in run.evidence("stream.usage_on_last")
    assert "running_requests 0" in run.evidence("abort.mid_stream")
    # The stops themselves are honoured (STOP where asked, the stop trimmed); only with ignore_eos do they lapse.
    assert "stop_token_id 336 (position 2): STOP after 2 tokens; with ignore_eos it ran on" in run.evidence(
        "stream.stop_token"
    )
    assert "stop_text ' old': STOP, output '. The' withholds it" in run.evidence("stream.stop_text")
    assert "ignore_eos drops every stop word" in run.evidence("stream.stop_text")


def test_json_shape(default_mock: MockProcess, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_kit(capsys, "--engine", default_mock.address, "--json", "--only", "discovery", "--only", "abort.*")
    report = run.report
    assert set(report) == {"engine", "server", "checks", "totals", "seconds", "ok"}
    assert report["engine"] == default_mock.address
    assert report["ok"] is True
    server = report["server"]
    assert isinstance(server, dict)
    assert server["engine_name"] == "tensorrt_llm"
    assert server["engine_role"] == "UNSPECIFIED"
    checks = report["checks"]
    assert isinstance(checks, list)
    assert [c["id"] for c in checks] == [i for i in ALL_IDS if i.startswith(("discovery.", "abort."))]
    for c in checks:
        assert set(c) == {"id", "group", "rule", "cites", "verdict", "evidence", "seconds"}
        assert c["verdict"] in {"pass", "variant", "fail", "skip"}
        assert c["evidence"]
        assert c["cites"]
    totals = report["totals"]
    assert totals == {
        "passed": sum(c["verdict"] in ("pass", "variant") for c in checks),
        "failed": 0,
        "skipped": sum(c["verdict"] == "skip" for c in checks),
        "variants": sum(c["verdict"] == "variant" for c in checks),
    }


def test_text_output_is_one_line_per_check_and_the_totals(
    default_mock: MockProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_kit(capsys, "--engine", default_mock.address, "--only", "validation")
    lines = run.out.strip().splitlines()
    ids = [i for i in ALL_IDS if i.startswith("validation.")]
    assert lines[0].startswith(f"engine {default_mock.address}: tensorrt_llm")
    assert [line.split()[1] for line in lines[1:-1]] == ids
    assert all(re.match(r"^(PASS|VARIANT|FAIL|SKIP) ", line) for line in lines[1:-1])
    assert all(line.endswith("]") for line in lines[1:-1]), "each line cites its rule"
    assert re.fullmatch(rf"{len(ids)} passed, 0 failed, 0 skipped \(1 of the passes are known variants\)", lines[-1])


def test_markdown_table(default_mock: MockProcess, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_kit(capsys, "--engine", default_mock.address, "--markdown", "--only", "discovery.role")
    assert run.code == 0
    assert "| `discovery.role` | engine_role is a v0.1.0 value" in run.out
    assert "| variant | ENGINE_ROLE_UNSPECIFIED: phase per request" in run.out
    assert run.out.strip().endswith("1 passed, 0 failed, 0 skipped (1 of the passes are known variants)")


def test_a_richer_mock_passes_lora_and_the_known_variants(
    mock_factory: MockFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mock = mock_factory(
        *MOCK_SPEED,
        "--profile",
        "full",
        "--role",
        "unspecified",
        "--schema-release",
        "prefix",
        "--max-output-tokens",
        "2048",
        "--capability",
        "lora=true",
        "--capability",
        "guided=true",
    )
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    run = run_kit(capsys, "--engine", mock.address, "--json", "--lora-dir", str(adapter))
    assert run.code == 0, failed(run)
    verdicts = run.verdicts()
    assert verdicts["lora.controls"] == "pass"
    assert verdicts["lora.lifecycle"] == "pass"
    assert "served, unloaded; then status NOT_FOUND" in run.evidence("lora.lifecycle")
    assert verdicts["discovery.role"] == "variant"
    assert verdicts["discovery.schema_release"] == "variant"
    assert "= the window" in run.evidence("discovery.limits")
    # The richer engine matches stops on text and keeps them with ignore_eos.
    assert verdicts["stream.stop_token"] == verdicts["stream.stop_text"] == "pass"
    assert "honoured with ignore_eos too" in run.evidence("stream.stop_text")
    # guided=true advertises JSON_OBJECT and CHOICE: the other guide modes are still probed.
    assert "guided json_schema" in run.evidence("validation.unadvertised_feature")
    assert "guided choice" not in run.evidence("validation.unadvertised_feature")


def test_graceful_stop_with_open_streams(mock_factory: MockFactory, capsys: pytest.CaptureFixture[str]) -> None:
    mock = mock_factory("--decode-ms-per-token", "5")
    stop = f"kill -{int(signal.SIGTERM)} {mock.proc.pid}"
    run = run_kit(
        capsys, "--engine", mock.address, "--json", "--only", "stop", "--include-stop", "--stop-command", stop
    )
    assert run.code == 0, failed(run)
    assert run.verdicts() == {"stop.graceful": "pass"}
    evidence = run.evidence("stop.graceful")
    assert "2 open streams" in evidence
    assert "finished, OK" in evidence
    assert mock.proc.wait(15) == 0, "the mock stopped gracefully"


def _tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    ca = trustme.CA()
    paths = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "client.pem"
    ca.cert_pem.write_to_path(str(paths[0]))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(paths[1]))
    ca.issue_cert("conformance.client").private_key_and_cert_chain_pem.write_to_path(str(paths[2]))
    return paths


def test_mutual_tls_flags_mean_what_they_mean_to_the_sidecar(
    mock_factory: MockFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca, server, client = _tls_files(tmp_path)
    mock = mock_factory(*MOCK_SPEED, "--tls-cert", str(server), "--tls-key", str(server), "--tls-client-ca", str(ca))
    endpoint = f"https://{mock.address}"
    tls = ("--grpc-tls-ca", str(ca), "--grpc-tls-cert", str(client), "--grpc-tls-key", str(client))
    run = run_kit(capsys, "--engine", endpoint, *tls, "--json", "--only", "discovery", "--only", "stream.plain_request")
    assert run.code == 0, failed(run)
    assert run.verdicts()["stream.plain_request"] == "pass"
    # Without the client pair the engine refuses the handshake: unreachable, one line, exit 2.
    refused = run_kit(capsys, "--engine", endpoint, "--grpc-tls-ca", str(ca), "--json")
    assert refused.code == 2
    assert refused.out == ""
    assert refused.err.count("\n") == 1
    assert refused.err.startswith(f"openengine-conformance: cannot reach an engine at {endpoint}")
