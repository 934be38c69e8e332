"""Kubernetes manifests and the container build file under ``deploy/``, validated offline."""
