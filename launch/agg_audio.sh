#!/usr/bin/env bash
# Aggregated audio serving on one machine, loopback only:
#   Dynamo frontend (HTTP) -> openengine-sidecar -> an OpenEngine engine that takes audio (openengine-mock unless
#   given). Send audio as audio_url content parts ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;..."}}):
#   the frontend drops input_audio parts (OpenAI's base64 form), and the sidecar then refuses the request (HTTP 400)
#   rather than send the engine fewer clips than the prompt names.
#
# usage: launch/agg_audio.sh [--demo] [--once] [--engine HOST:PORT --model-path DIR [--served-model-name NAME]]
#                            [--http-port N] [--system-port N] [--log-dir DIR] [--mock-profile NAME]
#                            [-- extra openengine-sidecar flags]
#   --demo               openengine-mock advertising supports_multimodal and the packaged tiny model (also the
#                        default without --engine); once the worker is ready, stream one chat with two audio clips
#                        (WAV tones made on the spot, sent as data: URLs) and print the answer; keep serving
#   --once               send that one request, print the answer, the usage of its final chunk and the engine's load
#                        and media afterwards, then stop everything; exit 0 only if all of it was right and every
#                        process stopped cleanly
#   --engine HOST:PORT   a real engine instead of openengine-mock; it must advertise ModelInfo.supports_multimodal.
#                        For Phi-4-multimodal-instruct on TensorRT-LLM (a raw git clone of the model repository,
#                        with its speech-lora directory; audio.yaml holds the lora_config of that bundled adapter):
#                          trtllm-serve /models/Phi-4-multimodal-instruct --grpc --grpc-protocol openengine \
#                            --host 127.0.0.1 --port 50051 --backend pytorch --trust_remote_code \
#                            --max_seq_len 4096 --max_num_tokens 1024 --max_batch_size 4 \
#                            --extra_llm_api_options audio.yaml
#                        (deploy/agg_audio.yaml has that audio.yaml.) TensorRT-LLM's baseline OpenEngine server
#                        reports supports_multimodal=false: against it the sidecar refuses every request with audio
#                        with HTTP 400 before anything reaches the engine.
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
run_local agg agg-audio audio
