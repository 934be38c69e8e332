#!/usr/bin/env bash
# Aggregated serving on one machine, loopback only:
#   Dynamo frontend (HTTP) -> openengine-sidecar (Dynamo worker) -> OpenEngine engine (openengine-mock unless given).
#
# usage: launch/agg.sh [--demo] [--once] [--engine HOST:PORT --model-path DIR [--served-model-name NAME]]
#                      [--http-port N] [--system-port N] [--log-dir DIR] [--mock-profile NAME]
#                      [-- extra openengine-sidecar flags]
#   --demo               openengine-mock and the packaged tiny model (also the default without --engine); send one
#                        streamed chat completion once the worker is ready, print it, keep serving
#   --once               send that one request, print the answer, the usage of its final chunk and each engine's
#                        load afterwards, then stop everything; exit 0 only if all of it was right and every
#                        process stopped cleanly
#   --engine HOST:PORT   a real engine instead of openengine-mock, e.g. TensorRT-LLM with Qwen3-0.6B:
#                          trtllm-serve Qwen/Qwen3-0.6B --grpc --grpc-protocol openengine --host 127.0.0.1 \
#                            --port 50051 --max_seq_len 4096
#   --model-path DIR     with --engine: the model's directory (the sidecar reads its tokenizer and chat template)
#   --served-model-name  the model name clients use (default: tiny-oe for the demo, else the directory's name)
#   --http-port N        the frontend's HTTP port (default 8000, or DYN_HTTP_PORT)
#   --system-port N      the sidecar's system port: /health, /live, /metrics (default 8081; at most 32767)
#   --log-dir DIR        write every process's log there (default: a new temporary directory); kept on exit
#   --mock-profile NAME  the demo engines' openengine-mock profile (docs/mock.md, "Profiles"): trtllm (default),
#                        TensorRT-LLM's merged server, whose guided decoding is xgrammar's (JSON schema, JSON object,
#                        regex, EBNF, structural tag: the OpenAI SDK's structured output works); trtllm-newer, with
#                        its open follow-ups; full, the richer engine (guided decoding: JSON object and choice only)
# Ctrl-C or SIGTERM stops everything: the sidecar first (it drains), then the engine, then the frontend.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_local.sh"

parse_flags agg_flag -- "$@"
run_local agg agg text
