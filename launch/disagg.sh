#!/usr/bin/env bash
# Disaggregated serving (context-first, 1 prefill + 1 decode) on one machine, loopback only:
#   Dynamo frontend (HTTP) -> prefill openengine-sidecar -> prefill engine   (context phase, KV handoff)
#                          -> decode  openengine-sidecar -> decode engine    (pulls the KV cache, generates)
#
# usage: launch/disagg.sh [--demo] [--once] [--prefill-engine HOST:PORT --decode-engine HOST:PORT --model-path DIR
#                         [--served-model-name NAME]] [--http-port N] [--system-ports P,D] [--log-dir DIR]
#                         [--mock-profile NAME] [-- extra openengine-sidecar flags, given to both sidecars]
#   --demo               two openengine-mock engines (--role prefill / --role decode) and the packaged tiny model
#                        (also the default without engines); stream one chat completion once both workers are
#                        ready, print it and which engine served which leg, keep serving
#   --once               send that one request, print the answer, the usage of its final chunk and each engine's
#                        load and legs afterwards, then stop everything; exit 0 only if all of it was right and
#                        every process stopped cleanly
#   --prefill-engine HOST:PORT, --decode-engine HOST:PORT
#                        real engines instead of openengine-mock, e.g. TensorRT-LLM with Qwen3-0.6B, each with a
#                        cache transceiver (it reports no role; --disaggregation-mode gives it one):
#                          printf 'cache_transceiver_config:\n  backend: NIXL\n' > pd.yaml
#                          trtllm-serve Qwen/Qwen3-0.6B --grpc --grpc-protocol openengine --host 127.0.0.1 \
#                            --port 50051 --max_seq_len 4096 --extra_llm_api_options pd.yaml    (and --port 50052)
#   --model-path DIR     with real engines: the model's directory (the sidecars read its tokenizer and chat template)
#   --served-model-name  the model name clients use (default: tiny-oe for the demo, else the directory's name)
#   --http-port N        the frontend's HTTP port (default 8000, or DYN_HTTP_PORT)
#   --system-ports P,D   the prefill and decode sidecars' system ports (default 8081,8082; at most 32767)
#   --log-dir DIR        write every process's log there (default: a new temporary directory); kept on exit
#   --mock-profile NAME  the demo engines' openengine-mock profile (docs/mock.md, "Profiles"): trtllm (default),
#                        TensorRT-LLM's merged server, whose guided decoding is xgrammar's (JSON schema, JSON object,
#                        regex, EBNF, structural tag: the OpenAI SDK's structured output works); trtllm-newer, with
#                        its open follow-ups; full, the richer engine (guided decoding: JSON object and choice only)
# Ctrl-C or SIGTERM stops everything: the sidecars first (they drain), then the engines, then the frontend.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_local.sh"

parse_flags disagg_flag -- "$@"
run_local disagg disagg text
