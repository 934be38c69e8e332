#!/usr/bin/env bash
# Disaggregated serving with a LoRA adapter (context-first, 1 prefill + 1 decode) on one machine, loopback only:
#   Dynamo frontend (HTTP) -> prefill openengine-sidecar -> prefill engine   (context phase under the adapter)
#                          -> decode  openengine-sidecar -> decode engine    (pulls the KV cache, generates)
# Each worker manages its own engine's adapters, so the adapter is loaded on both roles, through each worker's
# documented control (POST /engine/load_lora on its system port, docs/lora.md); the same name gives the same id
# everywhere. The frontend lists the adapter once the decode worker has it.
#
# usage: launch/disagg_lora.sh [--demo] [--once] [--prefill-engine HOST:PORT --decode-engine HOST:PORT
#                              --model-path DIR --lora-root DIR --adapter DIR [--adapter-name NAME]
#                              [--served-model-name NAME]] [--http-port N] [--system-ports P,D] [--log-dir DIR]
#                              [--mock-profile NAME] [-- extra openengine-sidecar flags, given to both sidecars]
#   --demo               two openengine-mock engines (--role prefill / --role decode) advertising supports_lora, the
#                        packaged tiny model and a tiny adapter made on the spot in a temporary LoRA root (also the
#                        default without engines); once the adapter is listed, stream one chat completion under its
#                        name, print it and which engine served which leg; keep serving
#   --once               send that request and the same one to the base model, print both answers (openengine-mock's
#                        adapters change the text), the usage of the final chunks and each engine's load, legs and
#                        adapters afterwards, then stop everything; exit 0 only if all of it was right and every
#                        process stopped cleanly
#   --prefill-engine HOST:PORT, --decode-engine HOST:PORT
#                        real engines instead of openengine-mock; both must advertise ModelInfo.supports_lora and
#                        have a cache transceiver. For Qwen3-0.6B on TensorRT-LLM:
#                          printf 'cache_transceiver_config:\n  backend: NIXL\nlora_config:\n  max_loras: 2\n  max_cpu_loras: 2\n  max_lora_rank: 64\n' > pd.yaml
#                          trtllm-serve Qwen/Qwen3-0.6B --grpc --grpc-protocol openengine --host 127.0.0.1 \
#                            --port 50051 --max_seq_len 4096 --extra_llm_api_options pd.yaml    (and 50052)
#                        TensorRT-LLM's baseline OpenEngine server reports supports_lora=false: against it the
#                        workers serve no LoRA controls (load_lora answers 404) and a request naming an adapter is
#                        refused with HTTP 400.
#   --model-path DIR     with real engines: the base model's directory (the sidecars read its tokenizer)
#   --lora-root DIR      the only directory adapters are loaded from (both sidecars' --lora-root); both engines must
#                        see it at the same path (default for the demo: a temporary directory)
#   --adapter DIR        the adapter to load: a directory inside --lora-root with adapter_config.json
#   --adapter-name NAME  the name it is served under (default: the directory's name)
#   --served-model-name  the base model's name (default: tiny-oe for the demo, else the model directory's name)
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

parse_flags lora_flag disagg_flag -- "$@"
run_local disagg disagg-lora text --lora
