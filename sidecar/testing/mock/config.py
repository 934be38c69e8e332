"""Command-line flags of ``openengine-mock`` → one frozen :class:`MockConfig` (contract: ``docs/mock.md``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args

from .faults import VIOLATIONS
from .profiles import (
    PROFILES,
    SCHEMA_RELEASE_FULL,
    SCHEMA_RELEASE_PREFIX,
    TRTLLM_ENGINE_NAME,
    EngineProfile,
    KvEventsFlag,
    LoadReport,
    Role,
)

__all__ = [
    "CAPABILITY_NAMES",
    "KV_FAULT_KINDS",
    "PROFILES",
    "SCHEMA_RELEASE_FULL",
    "SCHEMA_RELEASE_PREFIX",
    "TRTLLM_ENGINE_NAME",
    "Capabilities",
    "MockConfig",
    "build_parser",
    "parse_args",
]

HealthFlag = Literal["ready", "not_ready", "degraded"]
StepClockKind = Literal["per-request", "engine"]
#: ``--kv-fault`` kinds (``kvevents.py``): what happens to one batch of the KV event stream.
KV_FAULT_KINDS = ("gap", "repeat", "drop", "error", "eof")
#: The command line's default ``--profile``: TensorRT-LLM's merged server.
DEFAULT_PROFILE = next(iter(PROFILES))


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What the mock advertises in ``ModelInfo`` and therefore accepts; defaults are TensorRT-LLM's."""

    priority: bool = False
    stop_in_output: bool = True
    cache_salt: bool = True
    prefix_cache_bypass: bool = False
    lora: bool = False
    multimodal: bool = False
    text_input: bool = True
    prompt_logprobs: bool = True
    output_logprobs: bool = True
    guided: bool = False


CAPABILITY_NAMES = tuple(field.name for field in dataclasses.fields(Capabilities))


@dataclasses.dataclass(frozen=True, slots=True)
class MockConfig:
    """Everything the mock needs to know, resolved from flags. Field names follow the flags."""

    host: str = "127.0.0.1"
    port: int = 0
    port_file: Path | None = None
    model_dir: Path | None = None
    served_model_name: str = "tiny-oe"
    model_aliases: tuple[str, ...] = ()
    role: Role = "aggregated"
    engine_name: str = "openengine-mock"
    engine_version: str = ""
    instance_id: str = ""
    schema_release: str = SCHEMA_RELEASE_FULL
    max_context_length: int = 2048
    max_output_tokens: int | None = None
    kv_block_size: int = 16
    total_kv_blocks: int = 4096
    max_running_requests: int = 256
    max_batched_tokens: int = 8192
    #: ``None``: not advertised and not limited (TensorRT-LLM leaves it unset).
    max_num_sequences: int | None = 4
    max_top_n: int = 20
    max_loras: int = 4
    #: HTTP/2 streams one client connection may hold at once; 0 = no limit (grpcio, TensorRT-LLM's server, sends none).
    max_concurrent_streams: int = 0
    speedup: float = 1.0
    prefill_tokens_per_s: float = 20000.0
    decode_ms_per_token: float = 10.0
    stream_interval: int = 1
    #: ``per-request``: every request paces its decode steps on a timer of its own; ``engine``: one engine-wide step
    #: for every decoding sequence, its messages written together (engine.StepClock).
    step_clock: StepClockKind = "per-request"
    startup_delay: float = 0.0
    capabilities: Capabilities = Capabilities()
    health: HealthFlag = "ready"
    fault_exit_after_requests: int | None = None
    #: Health answers only after this long (an engine so busy its control RPCs lag behind its token streams).
    fault_health_delay_ms: float = 0.0
    faults_from_prompt: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    stall_timeout: float = 30.0
    kv_session_timeout: float = 60.0
    kv_transfer_ms: float = 2.0
    no_cache_transceiver: bool = False
    log_level: str = "INFO"
    kv_events: KvEventsFlag = "grpc"
    kv_snapshot: bool = True
    #: ``(batch sequence number, fault kind)`` pairs from ``--kv-fault KIND@N``.
    kv_faults: tuple[tuple[int, str], ...] = ()
    #: Which engine the mock behaves like (``profiles.py``; ``docs/mock.md`` has the table). The dataclass defaults
    #: are the ``full`` engine's; the command line's default profile is ``trtllm`` (:func:`parse_args` fills in its
    #: defaults).
    profile: str = "full"
    #: ``ServerInfo.kv_connector.transfer_backend`` and ``KvSessionRef.transfer_backend``.
    kv_transfer_backend: str = "MOCK"
    load_report: LoadReport = "full"
    #: SIGTERM/SIGINT: how long open streams may run after the GOAWAY before they are cut (grpc-core's grace).
    stop_grace_secs: float = 5.0
    #: Milliseconds between an output's last token message and its ``finished`` (0: written back to back).
    split_finish_ms: float = 0.0
    #: CPU burnt per detokenized token (microseconds): the engine-side cost ``extra.detokenize=false`` saves.
    detokenize_cost_us: float = 0.0
    #: A ``violation`` applied to every ``Generate`` (the conformance kit's misbehaving engine).
    fault_violation: str | None = None
    #: Serve on this Unix domain socket instead of TCP.
    uds: Path | None = None

    @property
    def model_names(self) -> tuple[str, ...]:
        """The served name first, then the aliases (``ServerInfo.supported_models``)."""
        return (self.served_model_name, *self.model_aliases)

    @property
    def engine(self) -> EngineProfile:
        """The profile's record: every behaviour that differs between engines (``profiles.py``)."""
        return PROFILES[self.profile]

    @property
    def reports_kv_connector(self) -> bool:
        """``ServerInfo.kv_connector`` is sent (the profile says when; never without a cache transceiver)."""
        if self.no_cache_transceiver:
            return False
        return self.engine.kv_connector_when == "transceiver" or self.role in ("prefill", "decode")


def _schema_release(value: str) -> str:
    return {"full": SCHEMA_RELEASE_FULL, "prefix": SCHEMA_RELEASE_PREFIX, "empty": ""}.get(value, value)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _capability(text: str) -> tuple[str, bool]:
    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in CAPABILITY_NAMES:
        raise argparse.ArgumentTypeError(f"expected NAME=BOOL with NAME in {', '.join(CAPABILITY_NAMES)}; got {text!r}")
    return name, _parse_bool(value)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0.0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def _kv_fault(text: str) -> tuple[int, str]:
    kind, sep, number = text.partition("@")
    if not sep or kind not in KV_FAULT_KINDS or not number.isdigit() or int(number) <= 0:
        kinds = ", ".join(KV_FAULT_KINDS)
        raise argparse.ArgumentTypeError(f"expected KIND@N with KIND in {kinds} and N >= 1; got {text!r}")
    return int(number), kind


def _package_version() -> str:
    try:
        return importlib.metadata.version("openengine-sidecar")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


class _Parser(argparse.ArgumentParser):
    """argparse with one line per bad flag (the usage banner would bury the problem), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def build_parser() -> argparse.ArgumentParser:
    """The flag set of ``docs/mock.md`` (plus a few documented extras)."""
    p = _Parser(prog="openengine-mock", description="A simulated OpenEngine v0.1.0 engine.")
    d = MockConfig()
    p.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default=DEFAULT_PROFILE,
        help="which engine to behave like: "
        + "; ".join(f"{p.name} = {p.summary}" for p in PROFILES.values())
        + "; sets the defaults marked [profile] [%(default)s]",
    )
    p.add_argument("--host", default=d.host, help="listen address [%(default)s]")
    p.add_argument("--port", type=int, default=d.port, help="listen port; 0 = the OS picks [%(default)s]")
    p.add_argument("--uds", default=None, help="serve on this Unix domain socket instead of TCP")
    p.add_argument("--port-file", type=Path, default=None, help="write HOST:PORT (or unix://PATH) here once listening")
    p.add_argument("--model-dir", type=Path, default=None, help="tokenizer/model directory [packaged tiny model]")
    p.add_argument("--served-model-name", default=d.served_model_name, help="[%(default)s]")
    p.add_argument("--model-alias", action="append", default=[], help="extra accepted model name (repeatable)")
    p.add_argument("--role", choices=["aggregated", "prefill", "decode", "unspecified"], default=None, help="[profile]")
    p.add_argument("--engine-name", default=None, help="[profile: tensorrt_llm or openengine-mock]")
    p.add_argument(
        "--engine-version", default=None, help="[the package version; +openengine-mock under the trtllm profiles]"
    )
    p.add_argument("--instance-id", default=None, help="[openengine-mock-<random hex>]")
    p.add_argument("--schema-release", default=None, help="full | prefix | empty | a literal string [profile]")
    p.add_argument("--max-context-length", type=_positive_int, default=d.max_context_length)
    p.add_argument(
        "--max-output-tokens", type=_positive_int, default=None, help="[trtllm: the context length; else unset]"
    )
    p.add_argument("--kv-block-size", type=_positive_int, default=d.kv_block_size)
    p.add_argument("--total-kv-blocks", type=_positive_int, default=d.total_kv_blocks)
    p.add_argument("--max-running-requests", type=_positive_int, default=d.max_running_requests)
    p.add_argument("--max-batched-tokens", type=_positive_int, default=d.max_batched_tokens)
    p.add_argument(
        "--max-num-sequences", type=_positive_int, default=None, help="[profile: full 4; trtllm unset, no limit]"
    )
    p.add_argument("--max-top-n", type=int, default=d.max_top_n)
    p.add_argument("--max-loras", type=_positive_int, default=d.max_loras, help="resident LoRA adapters [%(default)s]")
    p.add_argument(
        "--max-concurrent-streams",
        type=_non_negative_int,
        default=d.max_concurrent_streams,
        help="HTTP/2 streams per connection; 0 = no limit, as grpcio [%(default)s]",
    )
    p.add_argument("--speedup", type=_non_negative_float, default=d.speedup, help="0 = no model-time delays")
    p.add_argument("--prefill-tokens-per-s", type=_positive_float, default=d.prefill_tokens_per_s)
    p.add_argument("--decode-ms-per-token", type=_non_negative_float, default=d.decode_ms_per_token)
    p.add_argument("--stream-interval", type=_positive_int, default=d.stream_interval)
    p.add_argument(
        "--step-clock",
        choices=get_args(StepClockKind),
        default=d.step_clock,
        help="per-request: each request paces its own decode steps; engine: one engine-wide step for every decoding "
        "sequence, its messages written together, as TensorRT-LLM's executor [%(default)s]",
    )
    p.add_argument("--startup-delay", type=_non_negative_float, default=d.startup_delay)
    p.add_argument(
        "--capability",
        type=_capability,
        action="append",
        default=[],
        metavar="NAME=BOOL",
        help=f"advertise/accept a feature; NAME in {', '.join(CAPABILITY_NAMES)} (repeatable) [guided: profile]",
    )
    p.add_argument("--health", choices=["ready", "not_ready", "degraded"], default=d.health)
    p.add_argument("--fault-exit-after-requests", type=_positive_int, default=None, metavar="N")
    p.add_argument("--fault-health-delay-ms", type=_non_negative_float, default=0.0, metavar="MS")
    p.add_argument(
        "--fault-violation",
        choices=VIOLATIONS,
        default=None,
        metavar="KIND",
        help=f"break the stream contract of every Generate this way; KIND in {', '.join(VIOLATIONS)}",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="serve TLS with this certificate (and --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--tls-client-ca", type=Path, default=None, help="require client certificates signed by this CA")
    p.add_argument(
        "--faults-from-prompt",
        action="store_true",
        help="honour a `[mock-fault key=value ...]` directive in the prompt text (tests through the real frontend)",
    )
    p.add_argument(
        "--stall-timeout", type=_positive_float, default=d.stall_timeout, help="stalled-consumer watchdog seconds"
    )
    p.add_argument(
        "--stop-grace-secs",
        type=_non_negative_float,
        default=d.stop_grace_secs,
        help="after SIGTERM/SIGINT (GOAWAY sent), open streams may run this long before they are cut [%(default)s]",
    )
    p.add_argument(
        "--split-finish-ms",
        type=_non_negative_float,
        default=d.split_finish_ms,
        help="write an output's last token message alone and its finished this many ms later [%(default)s]",
    )
    p.add_argument(
        "--detokenize-cost-us",
        type=_non_negative_float,
        default=d.detokenize_cost_us,
        help="CPU microseconds burnt per detokenized token (what extra.detokenize=false saves) [%(default)s]",
    )
    p.add_argument(
        "--kv-session-timeout",
        type=_non_negative_float,
        default=d.kv_session_timeout,
        help="seconds a prefill leg's KV session is held for a decode claim before it is released; 0 = forever",
    )
    p.add_argument(
        "--kv-transfer-ms",
        type=_non_negative_float,
        default=d.kv_transfer_ms,
        help="model time of one KV transfer to a decode engine (divided by --speedup)",
    )
    p.add_argument(
        "--kv-transfer-backend",
        default=None,
        help="the KV connector's transfer backend label [profile: NIXL under trtllm, MOCK under full]",
    )
    p.add_argument(
        "--no-cache-transceiver",
        action="store_true",
        help="behave like TensorRT-LLM without cache_transceiver_config: no kv_connector, and a context-only "
        "request fails (trtllm: EngineError INTERNAL) or is a plain one-token generation (full)",
    )
    p.add_argument(
        "--load-report",
        choices=["minimal", "routing", "full"],
        default=None,
        help="GetLoad detail: minimal = running_requests only (trtllm), routing = + KV blocks and ranks "
        "(trtllm-newer), full = everything (full) [profile]",
    )
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument(
        "--kv-events",
        choices=["grpc", "zmq", "disabled", "unimplemented"],
        default=None,
        help="grpc: stream KV events over SubscribeKvEvents; zmq: publish them on a ZeroMQ PUB socket (vLLM msgpack) "
        "advertised by GetKvEventSources; disabled: no sources; unimplemented: both KV-event RPCs answer "
        "UNIMPLEMENTED [profile: trtllm unimplemented, trtllm-newer zmq, full grpc]",
    )
    p.add_argument(
        "--kv-snapshot",
        action=argparse.BooleanOptionalAction,
        default=d.kv_snapshot,
        help="honour SubscribeKvEvents.include_snapshot (--no-kv-snapshot: refuse it with UNIMPLEMENTED)",
    )
    p.add_argument(
        "--kv-fault",
        type=_kv_fault,
        action="append",
        default=[],
        metavar="KIND@N",
        help=f"break KV event batch #N once; KIND in {', '.join(KV_FAULT_KINDS)} (repeatable)",
    )
    return p


#: Longest Unix socket path the kernel takes (``sun_path`` holds 108 bytes including the terminating NUL).
_MAX_UDS_PATH = 107


def _check_uds(parser: argparse.ArgumentParser, text: str) -> Path:
    if not text:
        _refuse(parser, "--uds: the socket path is empty")
    path = Path(text)
    raw = os.fsencode(text)
    if len(raw) > _MAX_UDS_PATH:
        _refuse(parser, f"--uds: {str(path)!r} is {len(raw)} bytes long; a Unix socket path holds {_MAX_UDS_PATH}")
    parent = path.parent
    if not parent.is_dir():
        _refuse(parser, f"--uds: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        _refuse(parser, f"--uds: cannot create a socket in {str(parent)!r} (permission denied)")
    if (path.exists() or path.is_symlink()) and not stat.S_ISSOCK(path.lstat().st_mode):
        _refuse(parser, f"--uds: {str(path)!r} exists and is not a socket")
    return path


def _check_tls(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.tls_client_ca is not None and ns.tls_cert is None:
        _refuse(parser, "--tls-client-ca needs --tls-cert and --tls-key (client certificates are checked over TLS)")
    if (ns.tls_cert is None) != (ns.tls_key is None):
        given, missing = ("--tls-cert", "--tls-key") if ns.tls_key is None else ("--tls-key", "--tls-cert")
        _refuse(parser, f"{given} needs {missing}")
    for flag, path in (("--tls-cert", ns.tls_cert), ("--tls-key", ns.tls_key), ("--tls-client-ca", ns.tls_client_ca)):
        if path is not None and not path.is_file():
            _refuse(parser, f"{flag}: {str(path)!r} is not a readable file")


def parse_args(argv: Sequence[str] | None = None) -> MockConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a :class:`MockConfig`; exits with status 2 on bad flags."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.max_top_n < 0:
        _refuse(parser, "--max-top-n must be >= 0")
    _check_tls(parser, ns)
    uds = _check_uds(parser, ns.uds) if ns.uds is not None else None
    engine = PROFILES[ns.profile]
    defaults: dict[str, object] = {
        "role": engine.role,
        "engine_name": engine.engine_name,
        "schema_release": engine.schema_release,
        "kv_events": engine.kv_events,
        "max_num_sequences": engine.max_num_sequences,
        "kv_transfer_backend": engine.kv_transfer_backend,
        "load_report": engine.load_report,
    }

    def pick(name: str) -> Any:
        value = getattr(ns, name)
        return defaults[name] if value is None else value

    caps = dataclasses.replace(Capabilities(guided=engine.guided), **dict(ns.capability))
    version = ns.engine_version
    if version is None:
        version = _package_version() + engine.version_suffix
    max_output_tokens = ns.max_output_tokens
    if max_output_tokens is None and engine.max_output_tokens_is_window:
        max_output_tokens = ns.max_context_length  # TensorRT-LLM's baseline reports max_seq_len here
    return MockConfig(
        profile=engine.name,
        host=ns.host,
        port=ns.port,
        uds=uds,
        port_file=ns.port_file,
        model_dir=ns.model_dir,
        served_model_name=ns.served_model_name,
        model_aliases=tuple(ns.model_alias),
        role=pick("role"),
        engine_name=pick("engine_name"),
        engine_version=version,
        instance_id=ns.instance_id or f"openengine-mock-{uuid.uuid4().hex[:12]}",
        schema_release=_schema_release(pick("schema_release")),
        max_context_length=ns.max_context_length,
        max_output_tokens=max_output_tokens,
        kv_block_size=ns.kv_block_size,
        total_kv_blocks=ns.total_kv_blocks,
        max_running_requests=ns.max_running_requests,
        max_batched_tokens=ns.max_batched_tokens,
        max_num_sequences=pick("max_num_sequences"),
        max_top_n=ns.max_top_n,
        max_loras=ns.max_loras,
        max_concurrent_streams=ns.max_concurrent_streams,
        speedup=ns.speedup,
        prefill_tokens_per_s=ns.prefill_tokens_per_s,
        decode_ms_per_token=ns.decode_ms_per_token,
        stream_interval=ns.stream_interval,
        step_clock=ns.step_clock,
        startup_delay=ns.startup_delay,
        capabilities=caps,
        health=ns.health,
        fault_exit_after_requests=ns.fault_exit_after_requests,
        fault_health_delay_ms=ns.fault_health_delay_ms,
        fault_violation=ns.fault_violation,
        faults_from_prompt=ns.faults_from_prompt,
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        tls_client_ca=ns.tls_client_ca,
        stall_timeout=ns.stall_timeout,
        stop_grace_secs=ns.stop_grace_secs,
        split_finish_ms=ns.split_finish_ms,
        detokenize_cost_us=ns.detokenize_cost_us,
        kv_session_timeout=ns.kv_session_timeout,
        kv_transfer_ms=ns.kv_transfer_ms,
        kv_transfer_backend=pick("kv_transfer_backend"),
        no_cache_transceiver=ns.no_cache_transceiver,
        load_report=pick("load_report"),
        log_level=ns.log_level.upper(),
        kv_events=pick("kv_events"),
        kv_snapshot=ns.kv_snapshot,
        kv_faults=tuple(ns.kv_fault),
    )
