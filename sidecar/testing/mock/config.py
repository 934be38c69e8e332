"""Command-line flags of ``openengine-mock`` → one frozen :class:`MockConfig` (contract: ``docs/mock.md``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

__all__ = [
    "CAPABILITY_NAMES",
    "KV_FAULT_KINDS",
    "SCHEMA_RELEASE_FULL",
    "SCHEMA_RELEASE_PREFIX",
    "Capabilities",
    "MockConfig",
    "build_parser",
    "parse_args",
]

#: The Buf commit of OpenEngine v0.1.0 (the ``schema_release`` TensorRT-LLM pins) and its 12-hex prefix.
SCHEMA_RELEASE_FULL = "768a93c7b44e40f28c692ad0b471a8f2"
SCHEMA_RELEASE_PREFIX = SCHEMA_RELEASE_FULL[:12]

Role = Literal["aggregated", "prefill", "decode", "unspecified"]
HealthFlag = Literal["ready", "not_ready", "degraded"]
KvEventsFlag = Literal["grpc", "zmq", "disabled", "unimplemented"]
#: ``--kv-fault`` kinds (``kvevents.py``): what happens to one batch of the KV event stream.
KV_FAULT_KINDS = ("gap", "repeat", "drop", "error", "eof")


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
    max_num_sequences: int = 4
    max_top_n: int = 20
    max_loras: int = 4
    #: HTTP/2 streams one client connection may hold at once; 0 = no limit (grpcio, TensorRT-LLM's server, sends none).
    max_concurrent_streams: int = 0
    speedup: float = 1.0
    prefill_tokens_per_s: float = 20000.0
    decode_ms_per_token: float = 10.0
    stream_interval: int = 1
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

    @property
    def model_names(self) -> tuple[str, ...]:
        """The served name first, then the aliases (``ServerInfo.supported_models``)."""
        return (self.served_model_name, *self.model_aliases)


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


def build_parser() -> argparse.ArgumentParser:
    """The flag set of ``docs/mock.md`` (plus a few documented extras)."""
    p = argparse.ArgumentParser(prog="openengine-mock", description="A simulated OpenEngine v0.1.0 engine.")
    d = MockConfig()
    p.add_argument("--host", default=d.host, help="listen address [%(default)s]")
    p.add_argument("--port", type=int, default=d.port, help="listen port; 0 = the OS picks [%(default)s]")
    p.add_argument("--port-file", type=Path, default=None, help="write HOST:PORT here (atomically) once listening")
    p.add_argument("--model-dir", type=Path, default=None, help="tokenizer/model directory [packaged tiny model]")
    p.add_argument("--served-model-name", default=d.served_model_name, help="[%(default)s]")
    p.add_argument("--model-alias", action="append", default=[], help="extra accepted model name (repeatable)")
    p.add_argument("--role", choices=["aggregated", "prefill", "decode", "unspecified"], default=d.role)
    p.add_argument("--engine-name", default=d.engine_name)
    p.add_argument("--engine-version", default=None, help="[the openengine-sidecar package version]")
    p.add_argument("--instance-id", default=None, help="[openengine-mock-<random hex>]")
    p.add_argument("--schema-release", default="full", help="full | prefix | empty | a literal string [%(default)s]")
    p.add_argument("--max-context-length", type=_positive_int, default=d.max_context_length)
    p.add_argument("--max-output-tokens", type=_positive_int, default=None)
    p.add_argument("--kv-block-size", type=_positive_int, default=d.kv_block_size)
    p.add_argument("--total-kv-blocks", type=_positive_int, default=d.total_kv_blocks)
    p.add_argument("--max-running-requests", type=_positive_int, default=d.max_running_requests)
    p.add_argument("--max-batched-tokens", type=_positive_int, default=d.max_batched_tokens)
    p.add_argument("--max-num-sequences", type=_positive_int, default=d.max_num_sequences)
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
    p.add_argument("--startup-delay", type=_non_negative_float, default=d.startup_delay)
    p.add_argument(
        "--capability",
        type=_capability,
        action="append",
        default=[],
        metavar="NAME=BOOL",
        help=f"advertise/accept a feature; NAME in {', '.join(CAPABILITY_NAMES)} (repeatable)",
    )
    p.add_argument("--health", choices=["ready", "not_ready", "degraded"], default=d.health)
    p.add_argument("--fault-exit-after-requests", type=_positive_int, default=None, metavar="N")
    p.add_argument("--fault-health-delay-ms", type=_non_negative_float, default=0.0, metavar="MS")
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
        "--no-cache-transceiver",
        action="store_true",
        help="behave like TensorRT-LLM without cache_transceiver_config: no kv_connector, and a context-only "
        "request is a plain one-token generation (finished LENGTH, no PrefillReady)",
    )
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument(
        "--kv-events",
        choices=["grpc", "zmq", "disabled", "unimplemented"],
        default=d.kv_events,
        help="grpc: stream KV events over SubscribeKvEvents; zmq: publish them on a ZeroMQ PUB socket (vLLM msgpack) "
        "advertised by GetKvEventSources; disabled: no sources; unimplemented: both KV-event RPCs answer "
        "UNIMPLEMENTED, as TensorRT-LLM's baseline [%(default)s]",
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


def parse_args(argv: Sequence[str] | None = None) -> MockConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a :class:`MockConfig`; exits with status 2 on bad flags."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.max_top_n < 0:
        parser.error("--max-top-n must be >= 0")
    caps = dataclasses.replace(Capabilities(), **dict(ns.capability))
    return MockConfig(
        host=ns.host,
        port=ns.port,
        port_file=ns.port_file,
        model_dir=ns.model_dir,
        served_model_name=ns.served_model_name,
        model_aliases=tuple(ns.model_alias),
        role=ns.role,
        engine_name=ns.engine_name,
        engine_version=ns.engine_version if ns.engine_version is not None else _package_version(),
        instance_id=ns.instance_id or f"openengine-mock-{uuid.uuid4().hex[:12]}",
        schema_release=_schema_release(ns.schema_release),
        max_context_length=ns.max_context_length,
        max_output_tokens=ns.max_output_tokens,
        kv_block_size=ns.kv_block_size,
        total_kv_blocks=ns.total_kv_blocks,
        max_running_requests=ns.max_running_requests,
        max_batched_tokens=ns.max_batched_tokens,
        max_num_sequences=ns.max_num_sequences,
        max_top_n=ns.max_top_n,
        max_loras=ns.max_loras,
        max_concurrent_streams=ns.max_concurrent_streams,
        speedup=ns.speedup,
        prefill_tokens_per_s=ns.prefill_tokens_per_s,
        decode_ms_per_token=ns.decode_ms_per_token,
        stream_interval=ns.stream_interval,
        startup_delay=ns.startup_delay,
        capabilities=caps,
        health=ns.health,
        fault_exit_after_requests=ns.fault_exit_after_requests,
        fault_health_delay_ms=ns.fault_health_delay_ms,
        faults_from_prompt=ns.faults_from_prompt,
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        tls_client_ca=ns.tls_client_ca,
        stall_timeout=ns.stall_timeout,
        kv_session_timeout=ns.kv_session_timeout,
        kv_transfer_ms=ns.kv_transfer_ms,
        no_cache_transceiver=ns.no_cache_transceiver,
        log_level=ns.log_level.upper(),
        kv_events=ns.kv_events,
        kv_snapshot=ns.kv_snapshot,
        kv_faults=tuple(ns.kv_fault),
    )
