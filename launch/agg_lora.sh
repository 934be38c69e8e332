#!/usr/bin/env bash
# Aggregated serving with a LoRA adapter on one machine, loopback only:
#   Dynamo frontend (HTTP) -> openengine-sidecar (--lora-root) -> an OpenEngine engine that takes adapters
#   (openengine-mock unless given). Once the worker is ready the adapter is loaded through the worker's documented
#   control (POST /engine/load_lora on its system port, docs/lora.md); the frontend then lists it as a model of its
#   own, and a request with "model": "<adapter name>" runs on the engine with that adapter.
#
# usage: launch/agg_lora.sh [--demo] [--once] [--engine HOST:PORT --model-path DIR --lora-root DIR --adapter DIR
#                           [--adapter-name NAME] [--served-model-name NAME]] [--http-port N] [--system-port N]
#                           [--log-dir DIR] [--mock-profile NAME] [-- extra openengine-sidecar flags]
#   --demo               openengine-mock advertising supports_lora, the packaged tiny model and a tiny adapter made
#                        on the spot in a temporary LoRA root (also the default without --engine); once the adapter
#                        is listed, stream one chat completion under the adapter's name and print it; keep serving
#   --once               send that request and the same one to the base model, print both answers (openengine-mock's
#                        adapters change the text), the usage of the final chunks and the engine's load and adapters
#                        afterwards, then stop everything; exit 0 only if all of it was right and every process
#                        stopped cleanly
#   --engine HOST:PORT   a real engine instead of openengine-mock; it must advertise ModelInfo.supports_lora. For
#                        Qwen3-0.6B on TensorRT-LLM (lora.yaml: a lora_config as in deploy/agg_lora manifests,
#                        e.g. lora_config: {max_loras: 2, max_cpu_loras: 2, max_lora_rank: 64}):
#                          trtllm-serve Qwen/Qwen3-0.6B --grpc --grpc-protocol openengine --host 127.0.0.1 \
#                            --port 50051 --max_seq_len 4096 --extra_llm_api_options lora.yaml
#                        TensorRT-LLM's baseline OpenEngine server reports supports_lora=false (its LoRA RPCs answer
#                        UNIMPLEMENTED): against it the worker serves no LoRA controls (load_lora answers 404) and
#                        a request naming an adapter is refused with HTTP 400.
#   --model-path DIR     with --engine: the base model's directory (the sidecar reads its tokenizer and chat template)
#   --lora-root DIR      the only directory adapters are loaded from (the sidecar's --lora-root); the engine must see
#                        it at the same path (default for the demo: a temporary directory)
#   --adapter DIR        the adapter to load: a directory inside --lora-root with adapter_config.json
#   --adapter-name NAME  the name it is served under (default: the directory's name)
#   --served-model-name  the base model's name (default: tiny-oe for the demo, else the model directory's name)
#   --http-port N        the frontend's HTTP port (default 8000, or DYN_HTTP_PORT)
#   --system-port N      the sidecar's system port: /health, /live, /metrics, /engine/* (default 8081; at most 32767)
#   --log-dir DIR        write every process's log there (default: a new temporary directory); kept on exit
#   --mock-profile NAME  the demo engines' openengine-mock profile (docs/mock.md, "Profiles"): trtllm (default),
#                        TensorRT-LLM's merged server, whose guided decoding is xgrammar's (JSON schema, JSON object,
#                        regex, EBNF, structural tag: the OpenAI SDK's structured output works); trtllm-newer, with
#                        its open follow-ups; full, the richer engine (guided decoding: JSON object and choice only)
# Ctrl-C or SIGTERM stops everything: the sidecar first (it drains), then the engine, then the frontend.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_local.sh"

parse_flags lora_flag agg_flag -- "$@"
run_local agg agg-lora text --lora
