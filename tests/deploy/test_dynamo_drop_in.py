"""``deploy/dynamo-drop-in/*.yaml``: Dynamo's own manifests for its TensorRT-LLM sidecar with only the sidecar
container's command (and image) changed to this worker (issue 36 §1), validated offline as ``deploy/`` is.

* The Kubernetes objects and every pod template against Kubernetes' schemas; the DynamoGraphDeployment against the
  operator's v1beta1 shape (``tests/deploy/test_manifests.py``'s).
* Only the command changed: each worker's sidecar runs ``openengine-sidecar`` (this package's command), and every
  argument it is given is a flag of Dynamo's own sidecar (``--help`` of the installed wheel), accepted here with a
  configuration that starts: nothing of this worker's own was added.
* Where they come from: the header names Dynamo's file and commit and keeps its license notice.

``tests/e2e/test_dynamo_drop_in.py`` starts the sidecars with exactly these arguments and serves through them.
"""

from __future__ import annotations

import tomllib
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from sidecar.cli import parse_config
from tests.helpers.cli import dynamo_sidecar_flags

from .test_manifests import DGD_SCHEMA, ROOT, k8s_validate

DROP_IN = ROOT / "deploy" / "dynamo-drop-in"
MANIFESTS = ("agg.yaml", "disagg.yaml")
#: Dynamo's commit the manifests were taken from (lib/sidecar/trtllm/deploy/ of ai-dynamo/dynamo).
SOURCE_COMMIT = "30811e3b9fd53f8a42182a1c33ca3803d621fd5a"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DROP_IN / name).read_text()) if d is not None]


def graph(name: str) -> dict[str, Any]:
    (found,) = [d for d in documents(name) if d["kind"] == "DynamoGraphDeployment"]
    return dict(found)


def workers(name: str) -> list[dict[str, Any]]:
    return [c for c in graph(name)["spec"]["components"] if c["type"] != "frontend"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in [*pod.get("initContainers", []), *pod.get("containers", [])] if c["name"] == name]
    return dict(found)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_kubernetes_objects_and_pod_templates_validate(name: str) -> None:
    for doc in documents(name):
        if doc["kind"] != "DynamoGraphDeployment":
            k8s_validate(doc)
    jsonschema.validate(graph(name), DGD_SCHEMA)
    for component in graph(name)["spec"]["components"]:
        spec = component["podTemplate"]["spec"]
        assert "main" in [c["name"] for c in spec["containers"]], "the operator injects its settings into main"
        k8s_validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": component["name"].lower()}, "spec": spec})


@pytest.mark.parametrize("name", MANIFESTS)
def test_only_the_sidecar_command_changed(name: str) -> None:
    theirs = {f.flag for f in dynamo_sidecar_flags()}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["openengine-sidecar"] == "sidecar.cli:main"
    roles = []
    for component in workers(name):
        main = container(component["podTemplate"]["spec"], "main")
        assert main["command"] == ["openengine-sidecar"]
        assert main["image"].endswith("/openengine-sidecar:0.1.0")
        assert "env" not in main, "Dynamo's sidecar is given no variables here; neither is this one"
        given = {arg for arg in main["args"] if arg.startswith("--")}
        assert given <= theirs, f"flags that are not Dynamo's: {given - theirs}"
        config = parse_config(main["args"])  # the arguments start this worker, as they start Dynamo's
        assert config.model_path == config.model_path_given == "Qwen/Qwen3-0.6B", "a Hugging Face id, fetched"
        roles.append(config.disaggregation_mode or "agg")
    assert sorted(roles) == (["agg"] if name == "agg.yaml" else ["decode", "prefill"])


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_sidecar_reaches_its_engine_on_loopback_with_its_window(name: str) -> None:
    for component in workers(name):
        pod = component["podTemplate"]["spec"]
        engine, main = container(pod, "trtllm-engine"), container(pod, "main")
        assert engine in pod["initContainers"]
        assert engine["restartPolicy"] == "Always"
        assert flag(engine["args"], "--host") == "127.0.0.1"
        assert flag(main["args"], "--grpc-endpoint") == f"127.0.0.1:{flag(engine['args'], '--port')}"
        assert flag(engine["args"], "--grpc-protocol") == "openengine"
        assert flag(main["args"], "--context-length") == flag(engine["args"], "--max_seq_len")
        assert flag(main["args"], "--model-path") == engine["args"][0]


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_header_says_where_it_comes_from_and_keeps_the_license(name: str) -> None:
    text = (DROP_IN / name).read_text()
    header = text[: text.index("apiVersion")]
    assert f"lib/sidecar/trtllm/deploy/{name} of ai-dynamo/dynamo at commit {SOURCE_COMMIT}" in header
    assert "SPDX-License-Identifier: Apache-2.0" in header
    assert "NVIDIA CORPORATION & AFFILIATES" in header
    assert "runs openengine-sidecar" in header
