"""Disaggregated prefill/decode: handoff codec, legs, deferral, roles, and the mock's KV sessions."""
