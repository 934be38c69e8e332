"""Shared helpers for end-to-end tests: process launchers, a Dynamo environment, a tiny model directory."""
