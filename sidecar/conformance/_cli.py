"""``openengine-conformance``: flags → :class:`KitConfig`, run, print, exit 0 / 1 (a check failed) / 2 (bad flags,
unreachable engine). Endpoints and TLS flags mean what they mean to ``openengine-sidecar``."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from sidecar.contract import EndpointError, parse_endpoint

from ._context import KitConfig
from ._model import CheckResult, Report
from ._render import header_line, json_text, markdown, result_line
from ._runner import Unreachable, run, selected_checks
from ._wire import Target

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main", "parse_config"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
PROG = "openengine-conformance"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage dump) and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


class FlagError(ValueError):
    """A flag value that cannot be used; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Check that a live OpenEngine v0.1.0 server behaves as the sidecar needs: discovery, validation, the"
            " Generate stream, abort, Health/GetLoad, and (when advertised) KV events, LoRA and disaggregation. One"
            " line per check, then 'N passed, N failed, N skipped'. Exit 0 only when nothing failed. Run it against"
            " an idle engine: some checks expect GetLoad to return to 0."
        ),
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--engine", metavar="ENDPOINT", help="host:port, http://host:port, [v6]:port, unix://PATH (with TLS: https://)"
    )
    engine.add_argument(
        "--decode-engine",
        metavar="ENDPOINT",
        help="a second engine for the decode leg of the disaggregation checks (default: --engine itself, unless its"
        " role is PREFILL)",
    )
    engine.add_argument("--model", help="which of the engine's supported_models to use (default: the first)")
    engine.add_argument(
        "--grpc-tls-ca", metavar="PEM", help="CA bundle to verify the engine's certificate; enables TLS"
    )
    engine.add_argument(
        "--grpc-tls-cert", metavar="PEM", help="client certificate for mutual TLS (with --grpc-tls-key)"
    )
    engine.add_argument("--grpc-tls-key", metavar="PEM", help="client private key for mutual TLS")
    out = parser.add_argument_group("output").add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object with every check and the totals")
    out.add_argument("--markdown", action="store_true", help="a Markdown table of the results")
    sel = parser.add_argument_group("selection")
    sel.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only checks whose id matches (glob) or whose group is PATTERN; repeatable",
    )
    sel.add_argument("--list", action="store_true", help="list the checks and the rules they test, then exit")
    sel.add_argument("--lora-dir", metavar="PATH", help="an adapter directory the engine can load (LoRA lifecycle)")
    stop = parser.add_argument_group("graceful stop (destructive)")
    stop.add_argument(
        "--include-stop",
        action="store_true",
        help="last, stop the engine while streams are open and check they finish (the engine is gone afterwards)",
    )
    stop.add_argument(
        "--stop-command",
        metavar="CMD",
        help="command that stops the engine gracefully, e.g. 'kill -TERM 1234' (default: ask on stderr and wait)",
    )
    stop.add_argument("--stop-wait-secs", type=float, default=60.0, metavar="S", help="bound on the stop [60]")
    bounds = parser.add_argument_group("bounds")
    bounds.add_argument("--rpc-timeout", type=float, default=10.0, metavar="S", help="deadline of every RPC [10]")
    bounds.add_argument(
        "--settle-secs",
        type=float,
        default=10.0,
        metavar="S",
        help="how long an abort or cancellation may take to show (stream end, GetLoad back to 0) [10]",
    )
    bounds.add_argument("--check-timeout", type=float, default=60.0, metavar="S", help="bound on one check [60]")
    return parser


def _file(raw: str | None, flag: str) -> Path | None:
    if raw is None:
        return None
    path = Path(raw)
    if not path.is_file():
        raise FlagError(f"{flag}: no such file: {raw}")
    return path


def tls_context(ca: Path, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """The sidecar's client TLS: verify the engine with ``ca``, TLS ≥ 1.2, ALPN h2; a client pair for mutual TLS."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["h2"])
        if cert is not None and key is not None:
            context.load_cert_chain(str(cert), str(key))
    except (ssl.SSLError, OSError) as exc:
        raise FlagError(f"TLS files unusable: {exc}") from None
    return context


def parse_target(text: str, flag: str, tls: ssl.SSLContext | None) -> Target:
    """``unix://PATH`` (kept here until ``sidecar.contract`` parses it) or whatever ``parse_endpoint`` accepts."""
    if text.startswith("unix:"):
        path = text.removeprefix("unix://") if text.startswith("unix://") else text.removeprefix("unix:")
        if not path:
            raise FlagError(f"{flag}: {text!r} names no socket path; expected unix://PATH")
        if tls is not None:
            raise FlagError(f"{flag}: TLS over a Unix socket is not supported; drop --grpc-tls-ca or use host:port")
        return Target(text=text, path=path)
    try:
        endpoint = parse_endpoint(text, tls=tls is not None)
    except EndpointError as exc:
        raise FlagError(f"{flag}: {exc}") from None
    return Target(text=text, host=endpoint.host, port=endpoint.port, tls=tls)


def _positive(value: float, flag: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise FlagError(f"{flag}: must be a positive number of seconds, got {value}")
    return value


def parse_config(ns: argparse.Namespace) -> KitConfig:
    """Validate parsed flags; raise :class:`FlagError` naming the first bad one."""
    if not ns.engine:
        raise FlagError("--engine is required (host:port, unix://PATH, or https://host:port with --grpc-tls-ca)")
    ca = _file(ns.grpc_tls_ca, "--grpc-tls-ca")
    cert = _file(ns.grpc_tls_cert, "--grpc-tls-cert")
    key = _file(ns.grpc_tls_key, "--grpc-tls-key")
    if (cert is None) != (key is None):
        raise FlagError("--grpc-tls-cert and --grpc-tls-key go together (mutual TLS)")
    if cert is not None and ca is None:
        raise FlagError("--grpc-tls-cert needs --grpc-tls-ca: mutual TLS verifies the engine too")
    tls = tls_context(ca, cert, key) if ca is not None else None
    target = parse_target(ns.engine, "--engine", tls)
    decode = parse_target(ns.decode_engine, "--decode-engine", tls) if ns.decode_engine else None
    stop_command: tuple[str, ...] | None = None
    if ns.stop_command is not None:
        if not ns.include_stop:
            raise FlagError("--stop-command needs --include-stop")
        try:
            stop_command = tuple(shlex.split(ns.stop_command))
        except ValueError as exc:
            raise FlagError(f"--stop-command: {exc}") from None
        if not stop_command:
            raise FlagError("--stop-command is empty")
    if ns.lora_dir is not None and not os.path.isabs(ns.lora_dir):
        raise FlagError(f"--lora-dir: must be an absolute path (as the engine sees it), got {ns.lora_dir!r}")
    if ns.only and not selected_checks(tuple(ns.only)):
        raise FlagError(f"--only {ns.only}: matches no check (see --list)")
    return KitConfig(
        target=target,
        decode_target=decode,
        model=ns.model,
        rpc_timeout=_positive(ns.rpc_timeout, "--rpc-timeout"),
        settle=_positive(ns.settle_secs, "--settle-secs"),
        check_timeout=_positive(ns.check_timeout, "--check-timeout"),
        include_stop=ns.include_stop,
        stop_command=stop_command,
        stop_wait=_positive(ns.stop_wait_secs, "--stop-wait-secs"),
        lora_dir=ns.lora_dir,
        only=tuple(ns.only),
    )


def _list_checks() -> None:
    for check in selected_checks():
        print(f"{check.id:<34} {check.rule}  [{check.cites}]")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``openengine-conformance`` (and ``python -m sidecar.conformance``)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.list:
        _list_checks()
        sys.exit(EXIT_OK)
    try:
        config = parse_config(ns)
    except FlagError as exc:
        parser.error(str(exc))
    text = not (ns.json or ns.markdown)

    def stream_line(result: CheckResult) -> None:
        if text:
            print(result_line(result), flush=True)

    def header(report: Report) -> None:
        if text:
            print(header_line(report), flush=True)

    try:
        report = asyncio.run(run(config, stream_line, header))
    except Unreachable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
    if ns.json:
        print(json_text(report))
    elif ns.markdown:
        print(markdown(report))
    else:
        print(report.totals_line())
    sys.exit(EXIT_OK if report.ok else EXIT_FAILED)
