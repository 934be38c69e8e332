#!/usr/bin/env bash
# Disaggregated multimodal serving (images and video; context-first, 1 prefill + 1 decode) on one machine:
#   Dynamo frontend (HTTP) -> prefill openengine-sidecar -> prefill engine   (context phase with the media, KV handoff)
#                          -> decode  openengine-sidecar -> decode engine    (pulls the KV cache, generates)
# Both legs carry the media in message order: a decode engine of a vision model needs them too (Qwen3-VL rebuilds
# its multimodal rotary positions from them while it consumes the handoff).
#
# usage: launch/disagg_multimodal.sh [--demo] [--once] [--prefill-engine HOST:PORT --decode-engine HOST:PORT
#                                    --model-path DIR [--served-model-name NAME]] [--http-port N] [--system-ports P,D]
#                                    [--log-dir DIR] [--mock-profile NAME]
#                                    [-- extra openengine-sidecar flags, given to both sidecars]
#   --demo               two openengine-mock engines (--role prefill / --role decode) advertising supports_multimodal
#                        and the packaged tiny model (also the default without engines); once both workers are
#                        ready, stream one chat with an image, a video and a second image (made on the spot, sent
#                        as data: URLs), print the answer and which engine served which leg; keep serving
#   --once               send that one request, print the answer, the usage of its final chunk and each engine's load,
#                        legs and media afterwards, then stop everything; exit 0 only if all of it was right and
#                        every process stopped cleanly
#   --prefill-engine HOST:PORT, --decode-engine HOST:PORT
#                        real engines instead of openengine-mock; both must advertise ModelInfo.supports_multimodal
#                        and have a cache transceiver. For Qwen3-VL-2B-Instruct on TensorRT-LLM:
#                          printf 'cache_transceiver_config:\n  backend: NIXL\nkv_cache_config:\n  enable_block_reuse: false\n' > pd.yaml
#                          trtllm-serve Qwen/Qwen3-VL-2B-Instruct --grpc --grpc-protocol openengine \
#                            --host 127.0.0.1 --port 50051 --backend pytorch --trust_remote_code \
#                            --max_seq_len 8192 --max_num_tokens 2048 --max_batch_size 8 \
#                            --kv_cache_free_gpu_memory_fraction 0.3 --extra_llm_api_options pd.yaml   (and 50052)
#                        TensorRT-LLM's baseline OpenEngine server reports supports_multimodal=false: against it the
#                        sidecar refuses every request with media with HTTP 400 ("multi_modal_data: the engine does
#                        not advertise supports_multimodal") before anything reaches an engine.
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

mock_args=(--capability multimodal=true)
parse_flags disagg_flag -- "$@"
run_local disagg disagg-multimodal image-video
