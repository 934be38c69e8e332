#!/usr/bin/env bash
# Aggregated multimodal serving (images and video) on one machine, loopback only:
#   Dynamo frontend (HTTP) -> openengine-sidecar -> an OpenEngine engine that takes media (openengine-mock unless
#   given). The frontend passes image_url / video_url parts through untouched (data: URLs and http(s) URLs; it
#   refuses loopback http URLs); the sidecar sends them to the engine in message order, whatever their modality.
#
# usage: launch/agg_multimodal.sh [--demo] [--once] [--engine HOST:PORT --model-path DIR [--served-model-name NAME]]
#                                 [--http-port N] [--system-port N] [--log-dir DIR] [--mock-profile NAME]
#                                 [-- extra openengine-sidecar flags]
#   --demo               openengine-mock advertising supports_multimodal and the packaged tiny model (also the
#                        default without --engine); once the worker is ready, stream one chat with an image, a video
#                        and a second image (made on the spot, sent as data: URLs) and print the answer; keep serving
#   --once               send that one request, print the answer, the usage of its final chunk and the engine's load
#                        and media afterwards, then stop everything; exit 0 only if all of it was right and every
#                        process stopped cleanly
#   --engine HOST:PORT   a real engine instead of openengine-mock; it must advertise ModelInfo.supports_multimodal.
#                        For Qwen3-VL-2B-Instruct on TensorRT-LLM:
#                          trtllm-serve Qwen/Qwen3-VL-2B-Instruct --grpc --grpc-protocol openengine \
#                            --host 127.0.0.1 --port 50051 --backend pytorch --trust_remote_code \
#                            --max_seq_len 8192 --max_num_tokens 2048 --max_batch_size 8 \
#                            --kv_cache_free_gpu_memory_fraction 0.3
#                        TensorRT-LLM's baseline OpenEngine server reports supports_multimodal=false: against it the
#                        sidecar refuses every request with media with HTTP 400 ("multi_modal_data: the engine does
#                        not advertise supports_multimodal") before anything reaches the engine.
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

mock_args=(--capability multimodal=true)
parse_flags agg_flag -- "$@"
run_local agg agg-multimodal image-video
