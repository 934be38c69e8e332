"""Which engine the mock behaves like: one frozen :class:`EngineProfile` record per ``--profile``.

Every behaviour that differs between engines is a field of the record, and the mock's code reads the field, never the
profile's name: a fourth engine is one new record in :data:`PROFILES`. The profile table of ``docs/mock.md`` is
generated from these records and :data:`TABLE` (``python scripts/gen_mock_profiles.py``; ``--check`` fails on drift),
and a test checks that every field has a row.

A profile sets defaults only where a flag exists (``--role``, ``--engine-name``, ``--schema-release``,
``--kv-events``, ``--capability guided``, ``--max-num-sequences``, ``--kv-transfer-backend``, ``--load-report``,
``--max-output-tokens``); an explicit flag always wins. Everything else a profile decides has no flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal

__all__ = [
    "PROFILES",
    "SCHEMA_RELEASE_FULL",
    "SCHEMA_RELEASE_PREFIX",
    "TABLE",
    "TRTLLM_ENGINE_NAME",
    "EngineProfile",
    "KvEventsFlag",
    "LoadReport",
    "Role",
    "Row",
    "render_table",
]

#: The Buf commit of OpenEngine v0.1.0 (the ``schema_release`` TensorRT-LLM pins) and its 12-hex prefix.
SCHEMA_RELEASE_FULL = "768a93c7b44e40f28c692ad0b471a8f2"
SCHEMA_RELEASE_PREFIX = SCHEMA_RELEASE_FULL[:12]
#: ``ServerInfo.engine_name`` of TensorRT-LLM's server.
TRTLLM_ENGINE_NAME = "tensorrt_llm"

Role = Literal["aggregated", "prefill", "decode", "unspecified"]
KvEventsFlag = Literal["grpc", "zmq", "disabled", "unimplemented"]
#: ``GetLoad`` detail: TensorRT-LLM's baseline (``running_requests`` only), its newer opt-in routing load (KV blocks,
#: ``ranks[]``), or everything the mock knows.
LoadReport = Literal["minimal", "routing", "full"]
#: The guides TensorRT-LLM's xgrammar backend builds (its ``capabilities.py``), in its order; never ``choice``.
XGRAMMAR_MODES = ("json_schema", "regex", "ebnf_grammar", "structural_tag", "json_object")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine the mock can be. Field docs say what each value means; :data:`TABLE` says it for the docs."""

    #: The ``--profile`` value.
    name: str
    #: One line for ``--help`` and the docs.
    summary: str

    # -- discovery (defaults of flags) ------------------------------------------------------------------------------
    engine_name: str
    #: Appended to the package version in ``ServerInfo.engine_version`` (the mock still says it is the mock).
    version_suffix: str
    #: ``--role`` default.
    role: Role
    #: When ``ServerInfo.kv_connector`` is sent: ``transceiver`` = whenever a KV cache transceiver is configured
    #: (``--no-cache-transceiver`` drops it); ``roles`` = only for the ``prefill``/``decode`` roles.
    kv_connector_when: Literal["transceiver", "roles"]
    #: ``trtllm``: no ``supported_protocols``, no ``local_endpoints``; ``mock``: ``["tcp"]`` and the KV listener.
    kv_connector_shape: Literal["trtllm", "mock"]
    #: ``--kv-transfer-backend`` default (``kv_connector.transfer_backend``, ``KvSessionRef.transfer_backend``).
    kv_transfer_backend: str
    #: ``--schema-release`` default.
    schema_release: Literal["full", "prefix"]
    #: ``ServerInfo.parallelism`` fields reported (each = 1).
    parallelism: tuple[str, ...]
    #: ``capacity.total_kv_blocks`` is reported.
    reports_total_kv_blocks: bool
    #: ``ServerInfo.extra`` carries TensorRT-LLM's newer capability flags.
    trtllm_extra_flags: bool
    #: Any model name (even an unknown one) is served; otherwise other names are ``NOT_FOUND``.
    serves_unknown_models: bool
    #: ``--max-output-tokens`` default: the window (``--max-context-length``) instead of unset.
    max_output_tokens_is_window: bool
    #: ``--max-num-sequences`` default (None: unset, no limit).
    max_num_sequences: int | None
    #: ``--capability guided`` default.
    guided: bool
    #: The guides advertised and accepted when guided decoding is on.
    guided_modes: tuple[str, ...]
    #: Who refuses a guide outside ``guided_modes`` (in the message).
    guided_backend: str
    #: ``--load-report`` default.
    load_report: LoadReport
    #: ``--kv-events`` default.
    kv_events: KvEventsFlag
    #: ``--startup-delay`` is spent with the port closed (no ``STARTING`` state) rather than listening.
    port_closed_while_loading: bool
    #: ``SubscribeKvEvents`` with no gRPC source (``--kv-events disabled``) is ``UNIMPLEMENTED``, as TensorRT-LLM's
    #: Control answers it whatever its configuration (else ``FAILED_PRECONDITION``: events are off).
    subscribe_unimplemented_without_grpc: bool

    # -- serve frontends (``--frontends N``: N processes on one port sharing one engine) -------------------------------
    #: ``--frontends N`` above 1 is served (TensorRT-LLM's ``--num_serve_frontends``); else refused at start-up.
    multi_frontend: bool
    #: With more than one frontend, request ids (``Generate``, ``Abort``) longer than this many UTF-8 bytes are
    #: ``INVALID_ARGUMENT`` (the coordinator's limit); None = no limit.
    frontend_request_id_limit: int | None

    # -- Generate: what is refused, accepted or failed ----------------------------------------------------------------
    #: ``openengine-target-dp-rank`` is accepted in ``[0, --data-parallel-size)`` (else ``UNIMPLEMENTED``).
    targets_dp_rank: bool
    #: ``openengine-*`` metadata keys it does not know (``openengine-routing-key`` among them) → ``UNIMPLEMENTED``.
    refuses_unknown_metadata: bool
    #: ``extra.detokenize`` must be a bool and ``extra.conversation_id`` a string (else ``INVALID_ARGUMENT``).
    checks_extra_types: bool
    #: An empty ``stop_text`` condition is refused (else it is kept and never matches).
    refuses_empty_stop_text: bool
    #: A request with ``kv.session`` is a decode leg whatever ``extra.request_type`` says (else ``context_only`` with
    #: ``kv.session`` is ``INVALID_ARGUMENT``).
    session_overrides_request_type: bool
    #: temperature 0, ``top_k`` 1 and ``top_p`` 0 are each greedy (else only temperature 0).
    greedy_by_top_k_or_top_p: bool
    #: top_p 0, min_p ∉ [0, 1], repetition_penalty ≤ 0, max_tokens 0: ``engine_error`` = accepted, then a terminal
    #: ``EngineError(INTERNAL)``; ``refused`` = ``INVALID_ARGUMENT`` before acceptance.
    invalid_sampling: Literal["engine_error", "refused"]
    #: ``max_tokens`` beyond the window (or ``--max-output-tokens``): served up to it, or refused.
    clamps_max_tokens: bool
    #: A context-only request without a KV cache transceiver: ``engine_error`` (``EngineError(INTERNAL)``) or
    #: ``plain`` (a one-token generation, ``finished(LENGTH)``).
    context_only_without_transceiver: Literal["engine_error", "plain"]

    # -- Generate: the stream ------------------------------------------------------------------------------------------
    #: ``tokens``: stop words are matched as token sequences at the end of the output and trimmed (not streamed, not
    #: counted) unless ``include_stop_in_output``; ``text``: matched on the detokenized text, the stopping token kept.
    stop_words: Literal["tokens", "text"]
    #: ``ignore_eos`` drops every stop word, not only EOS.
    ignore_eos_drops_stop_words: bool
    #: The EOS token that ends an output is streamed and counted in ``completion_tokens``.
    streams_eos: bool
    #: A decode leg's KV transfer failure: ``internal`` (``ERROR_CODE_INTERNAL``) or ``named``
    #: (``KV_SESSION_NOT_FOUND`` / ``KV_TRANSFER_FAILED``).
    kv_transfer_errors: Literal["internal", "named"]
    #: ``PrefillReady`` carries ``first_gen_log_probs`` (when logprobs were asked) and the decode leg replays them.
    carries_first_gen_log_probs: bool
    #: After the prompt-logprob limit's ``EngineError(INVALID_ARGUMENT)`` the stream goes on (tokens, ``finished``),
    #: as TensorRT-LLM's formatter does; else the error ends it.
    streams_after_prompt_logprob_error: bool

    # -- Control ----------------------------------------------------------------------------------------------------
    #: ``Abort{request_id: ""}`` is ``INVALID_ARGUMENT`` (else ``ALREADY_FINISHED``, like any unknown id).
    refuses_empty_abort_id: bool


_TRT_PARALLELISM = ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size")

_TRTLLM = EngineProfile(
    name="trtllm",
    summary="TensorRT-LLM's merged server (PR #17992)",
    engine_name=TRTLLM_ENGINE_NAME,
    version_suffix="+openengine-mock",
    role="unspecified",
    kv_connector_when="transceiver",
    kv_connector_shape="trtllm",
    kv_transfer_backend="NIXL",
    schema_release="prefix",
    parallelism=_TRT_PARALLELISM,
    reports_total_kv_blocks=False,
    trtllm_extra_flags=False,
    serves_unknown_models=True,
    max_output_tokens_is_window=True,
    max_num_sequences=None,
    guided=True,
    guided_modes=XGRAMMAR_MODES,
    guided_backend="the xgrammar backend",
    load_report="minimal",
    kv_events="unimplemented",
    port_closed_while_loading=True,
    subscribe_unimplemented_without_grpc=True,
    multi_frontend=False,
    frontend_request_id_limit=None,
    targets_dp_rank=False,
    refuses_unknown_metadata=False,
    checks_extra_types=False,
    refuses_empty_stop_text=False,
    session_overrides_request_type=True,
    greedy_by_top_k_or_top_p=True,
    invalid_sampling="engine_error",
    clamps_max_tokens=True,
    context_only_without_transceiver="engine_error",
    stop_words="tokens",
    ignore_eos_drops_stop_words=True,
    streams_eos=False,
    kv_transfer_errors="internal",
    carries_first_gen_log_probs=True,
    streams_after_prompt_logprob_error=True,
    refuses_empty_abort_id=False,
)

_TRTLLM_NEWER = dataclasses.replace(
    _TRTLLM,
    name="trtllm-newer",
    summary="the same plus its open follow-up PRs (#19371, #19440) where they differ",
    schema_release="full",
    parallelism=(*_TRT_PARALLELISM, "data_parallel_size"),
    reports_total_kv_blocks=True,
    trtllm_extra_flags=True,
    max_output_tokens_is_window=False,
    load_report="routing",
    # KV events are off unless kv_cache_config configures them: GetKvEventSources answers an empty list
    # (`--kv-events zmq` is the configured publisher).
    kv_events="disabled",
    multi_frontend=True,
    frontend_request_id_limit=1024,
    targets_dp_rank=True,
    refuses_unknown_metadata=True,
    checks_extra_types=True,
)

_FULL = EngineProfile(
    name="full",
    summary="the richer engine the mock has always been (roles, a MOCK KV connector, a detailed GetLoad, KV events "
    "over gRPC), for engines that do more",
    engine_name="openengine-mock",
    version_suffix="",
    role="aggregated",
    kv_connector_when="roles",
    kv_connector_shape="mock",
    kv_transfer_backend="MOCK",
    schema_release="full",
    parallelism=(*_TRT_PARALLELISM, "data_parallel_size"),
    reports_total_kv_blocks=True,
    trtllm_extra_flags=False,
    serves_unknown_models=False,
    max_output_tokens_is_window=False,
    max_num_sequences=4,
    guided=False,
    guided_modes=("json_object", "choice"),
    guided_backend="openengine-mock",
    load_report="full",
    kv_events="grpc",
    port_closed_while_loading=False,
    subscribe_unimplemented_without_grpc=False,
    multi_frontend=True,
    frontend_request_id_limit=None,
    targets_dp_rank=False,
    refuses_unknown_metadata=False,
    checks_extra_types=True,
    refuses_empty_stop_text=True,
    session_overrides_request_type=False,
    greedy_by_top_k_or_top_p=False,
    invalid_sampling="refused",
    clamps_max_tokens=False,
    context_only_without_transceiver="plain",
    stop_words="text",
    ignore_eos_drops_stop_words=False,
    streams_eos=True,
    kv_transfer_errors="named",
    carries_first_gen_log_probs=False,
    streams_after_prompt_logprob_error=False,
    refuses_empty_abort_id=True,
)

#: Every profile by ``--profile`` name, in the docs' column order; the first is the command line's default.
PROFILES: Mapping[str, EngineProfile] = {p.name: p for p in (_TRTLLM, _TRTLLM_NEWER, _FULL)}


# -- the docs' table ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One row of ``docs/mock.md``'s profile table: what it is about, the fields it shows, one cell per profile."""

    label: str
    fields: tuple[str, ...]
    cell: Callable[[EngineProfile], str]


def _yes(flag: bool, yes: str, no: str) -> str:
    return yes if flag else no


def _codes(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _kv_connector(p: EngineProfile) -> str:
    when = _yes(
        p.kv_connector_when == "transceiver",
        "whenever the cache transceiver is on (`--no-cache-transceiver` drops it)",
        "only for roles `prefill`/`decode`",
    )
    shape = _yes(
        p.kv_connector_shape == "trtllm",
        "no endpoints or protocols",
        '`supported_protocols ["tcp"]`, `local_endpoints` = the KV transfer listener',
    )
    return (
        f'`{{enabled, transfer_backend "{p.kv_transfer_backend}", supports_remote_prefill, no decode pull, no abort '
        f"cleanup, schema_version 1}}`, {shape}; {when}"
    )


def _guided(p: EngineProfile) -> str:
    modes = ", ".join(m.upper() for m in p.guided_modes)
    refused = "" if "choice" in p.guided_modes else "; `choice` → `UNIMPLEMENTED`"
    return f"{_yes(p.guided, 'on', 'off')}; modes `{modes}`{refused}"


_LOAD = {
    "minimal": "`minimal`: `instance_id`, `timestamp_unix_nanos`, `running_requests` (every live stream, queued ones "
    "and health probes too); `include_per_rank` ignored",
    "routing": "`routing`: + `used_kv_blocks`, `total_kv_blocks`, `ranks[]` with `include_per_rank`",
    "full": "`full`: everything (see *Control*)",
}
_KV_EVENTS = {
    "unimplemented": "`unimplemented`: both `UNIMPLEMENTED`",
    "zmq": "`zmq`: `GetKvEventSources` → one ZMQ/msgpack source; `SubscribeKvEvents` `UNIMPLEMENTED`",
    "grpc": "`grpc`: both served",
    "disabled": "`disabled`: `GetKvEventSources` → an empty list (events not configured)",
}


def _kv_events(p: EngineProfile) -> str:
    subscribe = _yes(
        p.subscribe_unimplemented_without_grpc,
        "`SubscribeKvEvents` without a `grpc` source: `UNIMPLEMENTED`",
        "`SubscribeKvEvents` with `disabled`: `FAILED_PRECONDITION`",
    )
    return f"{_KV_EVENTS[p.kv_events]}; {subscribe}"


def _frontends(p: EngineProfile) -> str:
    if not p.multi_frontend:
        return "refused (the merged server runs one frontend)"
    limit = p.frontend_request_id_limit
    ids = (
        f"request ids above {limit} UTF-8 bytes (`Generate`, `Abort`) → `INVALID_ARGUMENT`"
        if limit is not None
        else "no request id limit"
    )
    return f"N processes on one port (`SO_REUSEPORT`) sharing one engine; {ids}"


def _stop_words(p: EngineProfile) -> str:
    if p.stop_words == "tokens":
        text = (
            "matched as token sequences at the end of the output (a stop string inside one token does not stop); the "
            "matched ids are trimmed — not streamed, not counted — unless `include_stop_in_output`; a stop on the "
            "first token ends with `finished(STOP)`, no token event, completion 0"
        )
    else:
        text = (
            "matched on the detokenized text (may stop mid-token); the stopping token stays in `tokens` and is "
            "counted, its text only with `include_stop_in_output`"
        )
    return text + _yes(p.ignore_eos_drops_stop_words, "; `ignore_eos` drops every stop word", "")


TABLE: tuple[Row, ...] = (
    Row(
        "`engine_name` / `engine_version`",
        ("engine_name", "version_suffix"),
        lambda p: f"`{p.engine_name}` / `<package version>{p.version_suffix}`",
    ),
    Row(
        "`engine_role` (`--role`)",
        ("role",),
        lambda p: _yes(
            p.role == "unspecified",
            "`UNSPECIFIED`: any leg on any engine",
            f"`{p.role.upper()}`; `prefill`/`decode` refuse a wrong-role leg (`FAILED_PRECONDITION`)",
        ),
    ),
    Row(
        "`kv_connector`, `KvSessionRef.transfer_backend` (`--kv-transfer-backend`)",
        ("kv_connector_when", "kv_connector_shape", "kv_transfer_backend"),
        _kv_connector,
    ),
    Row(
        "`schema_release` (`--schema-release`)",
        ("schema_release",),
        lambda p: _yes(
            p.schema_release == "prefix",
            f"12-hex prefix `{SCHEMA_RELEASE_PREFIX}`",
            f"full `{SCHEMA_RELEASE_FULL}`",
        ),
    ),
    Row(
        "`parallelism` (each 1; `data_parallel_size` = `--data-parallel-size`)",
        ("parallelism",),
        lambda p: _codes(p.parallelism),
    ),
    Row(
        "`capacity.total_kv_blocks`",
        ("reports_total_kv_blocks",),
        lambda p: _yes(p.reports_total_kv_blocks, "`--total-kv-blocks`", "unset"),
    ),
    Row(
        "`ServerInfo.extra`",
        ("trtllm_extra_flags",),
        lambda p: _yes(
            p.trtllm_extra_flags,
            "mock keys + `trtllm_supports_dp_rank_targeting: true`, `trtllm_supports_subagent_affinity: false`",
            "mock keys only (see *Discovery*)",
        ),
    ),
    Row(
        "model names",
        ("serves_unknown_models",),
        lambda p: _yes(
            p.serves_unknown_models,
            "any name, even unknown, is served (never `NOT_FOUND`)",
            "served name or alias; other names `NOT_FOUND`",
        ),
    ),
    Row(
        "`max_output_tokens` (`--max-output-tokens`)",
        ("max_output_tokens_is_window",),
        lambda p: _yes(p.max_output_tokens_is_window, "= `--max-context-length`", "unset"),
    ),
    Row(
        "`max_num_sequences` (`--max-num-sequences`)",
        ("max_num_sequences",),
        lambda p: "unset, no limit (n = 5 served)" if p.max_num_sequences is None else str(p.max_num_sequences),
    ),
    Row(
        "Guided decoding (`--capability guided`)",
        ("guided", "guided_modes", "guided_backend"),
        _guided,
    ),
    Row("`GetLoad` (`--load-report`)", ("load_report",), lambda p: _LOAD[p.load_report]),
    Row(
        "KV-event RPCs (`--kv-events`)",
        ("kv_events", "subscribe_unimplemented_without_grpc"),
        _kv_events,
    ),
    Row(
        "`--frontends N` (N > 1)",
        ("multi_frontend", "frontend_request_id_limit"),
        _frontends,
    ),
    Row(
        "`--startup-delay`",
        ("port_closed_while_loading",),
        lambda p: _yes(
            p.port_closed_while_loading,
            'the port stays closed while "loading" (no `STARTING` state)',
            "listens at once, Health `STARTING`, `Generate` `UNAVAILABLE`",
        ),
    ),
    Row(
        "Metadata `openengine-target-dp-rank`",
        ("targets_dp_rank",),
        lambda p: _yes(
            p.targets_dp_rank,
            "accepted in `[0, --data-parallel-size)`; out of range, not an integer, or with n > 1 → `INVALID_ARGUMENT`",
            "`UNIMPLEMENTED`",
        ),
    ),
    Row(
        "Metadata `openengine-routing-key`, unknown `openengine-*` keys",
        ("refuses_unknown_metadata",),
        lambda p: _yes(
            p.refuses_unknown_metadata,
            "`UNIMPLEMENTED`",
            "routing key: non-empty, else ignored; unknown keys ignored",
        ),
    ),
    Row(
        "`extra.detokenize` not a bool, `extra.conversation_id` not a string",
        ("checks_extra_types",),
        lambda p: _yes(p.checks_extra_types, "`INVALID_ARGUMENT`", "ignored (the merged server never reads them)"),
    ),
    Row(
        "an empty `stop_text` condition",
        ("refuses_empty_stop_text",),
        lambda p: _yes(p.refuses_empty_stop_text, "`INVALID_ARGUMENT`", "accepted; it never matches"),
    ),
    Row(
        "`kv.session` with `extra.request_type=context_only`",
        ("session_overrides_request_type",),
        lambda p: _yes(
            p.session_overrides_request_type,
            "a decode leg: the session wins over `request_type`",
            "`INVALID_ARGUMENT`",
        ),
    ),
    Row(
        "Greedy",
        ("greedy_by_top_k_or_top_p",),
        lambda p: _yes(
            p.greedy_by_top_k_or_top_p,
            "temperature 0, top_k 1 or top_p 0; any of them with n > 1 → `INVALID_ARGUMENT`",
            "temperature 0 only",
        ),
    ),
    Row(
        "top_p 0, min_p ∉ [0, 1], repetition_penalty ≤ 0, max_tokens 0",
        ("invalid_sampling",),
        lambda p: _yes(
            p.invalid_sampling == "engine_error",
            "accepted, then one terminal `EngineError(INTERNAL)` with usage (the executor refuses them)",
            "`INVALID_ARGUMENT` before acceptance",
        ),
    ),
    Row(
        "`max_tokens` beyond the window",
        ("clamps_max_tokens",),
        lambda p: _yes(p.clamps_max_tokens, "served to the window (clamped)", "`INVALID_ARGUMENT`"),
    ),
    Row(
        "context-only request without a cache transceiver",
        ("context_only_without_transceiver",),
        lambda p: _yes(
            p.context_only_without_transceiver == "engine_error",
            "terminal `EngineError(INTERNAL)`",
            "a plain one-token generation, `finished(LENGTH)`",
        ),
    ),
    Row("Stop words", ("stop_words", "ignore_eos_drops_stop_words"), _stop_words),
    Row(
        "EOS",
        ("streams_eos",),
        lambda p: _yes(
            p.streams_eos,
            "the EOS token is streamed (`tokens`, no text) and counted",
            "neither streamed nor counted: `finished(STOP)` with `stop_match.eos_token_id` names it",
        ),
    ),
    Row(
        "KV transfer failures (decode leg)",
        ("kv_transfer_errors",),
        lambda p: _yes(
            p.kv_transfer_errors == "internal",
            "terminal `EngineError(INTERNAL)`",
            "`KV_SESSION_NOT_FOUND` / `KV_TRANSFER_FAILED`",
        ),
    ),
    Row(
        "Logprobs across the handoff",
        ("carries_first_gen_log_probs",),
        lambda p: _yes(
            p.carries_first_gen_log_probs,
            "`PrefillReady` carries `first_gen_log_probs` when output logprobs were asked; the decode leg's replayed "
            "first token has its logprob, rank and candidates",
            "not carried: the replayed token has none",
        ),
    ),
    Row(
        "prompt logprobs over the limit (prompt × candidates > 1,000,000)",
        ("streams_after_prompt_logprob_error",),
        lambda p: _yes(
            p.streams_after_prompt_logprob_error,
            "`EngineError(INVALID_ARGUMENT)` with usage after the first step, then the stream goes on (tokens, "
            "`finished`, status `OK`) as TensorRT-LLM's formatter does",
            "terminal `EngineError(INVALID_ARGUMENT)` with usage, status `OK`",
        ),
    ),
    Row(
        '`Abort{request_id: ""}`',
        ("refuses_empty_abort_id",),
        lambda p: _yes(p.refuses_empty_abort_id, "`INVALID_ARGUMENT`", "`ALREADY_FINISHED` (an unknown id)"),
    ),
)


def render_table(profiles: Mapping[str, EngineProfile] = PROFILES) -> str:
    """The Markdown table: one column per profile; a cell equal to the one on its left says "same"."""
    names = list(profiles)
    lines = ["| | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for row in TABLE:
        cells: list[str] = []
        previous: str | None = None
        for name in names:
            cell = row.cell(profiles[name]).replace("|", "\\|")
            cells.append("same" if cell == previous else cell)
            previous = cell
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
