"""``deploy/*.yaml`` and ``deploy/Containerfile``, validated offline.

* Plain Kubernetes objects, and every DynamoGraphDeployment component's pod template (as a Pod), against the
  Kubernetes JSON schemas bundled with ``kubernetes-validate`` (strict: unknown fields fail).
* The DynamoGraphDeployment itself against the shape Dynamo's operator expects (``dynamo-sidecar.md`` §14):
  a hand-written JSON schema, since the operator's CRD is not bundled anywhere offline.
* What the worker pods promise: loopback gRPC between the containers, Control.Health probes on the engine, probes
  on the sidecar's system port, a termination grace longer than the drain budget, flags the sidecar accepts.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from sidecar.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = ("agg.yaml", "disagg.yaml", "lora.yaml")
KUBERNETES = "1.32.0"  # native sidecars (init containers with restartPolicy: Always) are GA from 1.29

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
DGD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "nvidia.com/v1beta1"},
        "kind": {"const": "DynamoGraphDeployment"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _NAME, "namespace": _NAME, "labels": {"type": "object"}},
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "required": ["components"],
            "additionalProperties": False,
            "properties": {
                "backendFramework": {"enum": ["trtllm", "vllm", "sglang"]},
                "envs": {"type": "array"},
                "components": {
                    "type": "array",
                    "minItems": 2,
                    "items": {
                        "type": "object",
                        "required": ["name", "type", "replicas", "podTemplate"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "pattern": r"^[A-Za-z][A-Za-z0-9]*$"},
                            "type": {"enum": ["frontend", "worker", "prefill", "decode", "planner"]},
                            "replicas": {"type": "integer", "minimum": 0},
                            "podTemplate": {
                                "type": "object",
                                "required": ["spec"],
                                "additionalProperties": False,
                                "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
                            },
                        },
                    },
                },
            },
        },
    },
}


def documents(name: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]
    assert all(isinstance(d, dict) for d in docs)
    return docs


def dgd(name: str) -> dict[str, Any]:
    (found,) = [d for d in documents(name) if d["kind"] == "DynamoGraphDeployment"]
    return dict(found)


def workers(name: str) -> list[dict[str, Any]]:
    return [c for c in dgd(name)["spec"]["components"] if c["type"] != "frontend"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    everything = [*pod.get("initContainers", []), *pod.get("containers", [])]
    (found,) = [c for c in everything if c["name"] == name]
    return dict(found)


def k8s_validate(resource: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(resource, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{resource['kind']} {resource['metadata']['name']}: {where}: {exc.message}")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_offline_validator_rejects_what_kubernetes_would() -> None:
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}
    pod["spec"] = {"containers": [{"name": "main"}]}
    kubernetes_validate.validate(pod, KUBERNETES, strict=True)
    pod["spec"]["containers"][0]["terminationGracePeriodSeconds"] = 60  # a pod field, misplaced on a container
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES, strict=True)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**dgd("agg.yaml"), "spec": {"services": {}}}, DGD_SCHEMA)  # the v1alpha1 shape


@pytest.mark.parametrize("name", MANIFESTS)
def test_plain_kubernetes_objects_validate(name: str) -> None:
    for doc in documents(name):
        if doc["kind"] != "DynamoGraphDeployment":
            k8s_validate(doc)


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_graph_deployment_has_the_operators_shape(name: str) -> None:
    jsonschema.validate(dgd(name), DGD_SCHEMA)
    components = dgd(name)["spec"]["components"]
    assert [c["type"] for c in components].count("frontend") == 1
    for component in components:
        names = [c["name"] for c in component["podTemplate"]["spec"]["containers"]]
        assert "main" in names, "the operator injects its environment and probes into the container named main"


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_template_is_a_valid_pod(name: str) -> None:
    for component in dgd(name)["spec"]["components"]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": component["name"].lower()},
            "spec": component["podTemplate"]["spec"],
        }
        k8s_validate(pod)


@pytest.mark.parametrize("name", MANIFESTS)
def test_worker_pods_keep_grpc_on_loopback_and_probe_both_containers(name: str) -> None:
    for component in workers(name):
        pod = component["podTemplate"]["spec"]
        assert not pod.get("hostNetwork")
        engine, main = container(pod, "engine"), container(pod, "main")
        assert engine in pod["initContainers"]
        assert engine["restartPolicy"] == "Always"
        assert flag(engine["args"], "--host") == "127.0.0.1"
        port = flag(engine["args"], "--port")
        assert flag(main["args"], "--grpc-endpoint") == f"127.0.0.1:{port}"
        assert flag(engine["args"], "--grpc-protocol") == "openengine"

        for probe in ("startupProbe", "readinessProbe"):
            command = engine[probe]["exec"]["command"]
            assert command[:2] == ["python3", "-c"]
            compile(command[2], f"{component['name']}.{probe}", "exec")  # it is Python
            assert "Health" in command[2]
            assert "HEALTH_STATE_READY" in command[2]
            assert f"'127.0.0.1:{port}'" in command[2]
            assert engine[probe]["timeoutSeconds"] > 3  # longer than the RPC's own timeout

        env = {e["name"]: e.get("value") for e in main["env"]}
        system_port = int(env["DYN_SYSTEM_PORT"])
        assert env["DYN_SYSTEM_HOST"] == "0.0.0.0"  # the kubelet probes the pod IP
        (declared,) = main["ports"]
        assert declared["containerPort"] == system_port
        for probe, path in (("startupProbe", "/live"), ("livenessProbe", "/live"), ("readinessProbe", "/health")):
            assert main[probe]["httpGet"] == {"path": path, "port": declared["name"]}


@pytest.mark.parametrize("name", MANIFESTS)
def test_termination_grace_outlasts_the_drain(name: str) -> None:
    defaults = build_parser().parse_args(["--grpc-endpoint", "x:1"])
    for component in workers(name):
        pod = component["podTemplate"]["spec"]
        args = container(pod, "main")["args"]
        drain = (
            float(flag(args, "--drain-timeout-secs")) if "--drain-timeout-secs" in args else defaults.drain_timeout_secs
        )
        abort = (
            float(flag(args, "--abort-timeout-secs")) if "--abort-timeout-secs" in args else defaults.abort_timeout_secs
        )
        # drain + aborts + deregistration and runtime shutdown (bounded by the RPC timeout in the worker) + margin
        assert pod["terminationGracePeriodSeconds"] >= drain + abort + 15, component["name"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_sidecar_arguments_are_flags_the_sidecar_accepts(name: str) -> None:
    parser = build_parser()
    for component in workers(name):
        main = container(component["podTemplate"]["spec"], "main")
        ns = parser.parse_args(main["args"])  # unknown flags and bad choices exit 2
        assert ns.ops_host == "127.0.0.1"  # the live state page stays inside the pod (kubectl port-forward)
        expected = {"worker": (None, "agg"), "prefill": ("prefill",), "decode": ("decode",)}[component["type"]]
        assert ns.disaggregation_mode in expected, component["name"]


def test_disagg_engines_get_their_transceiver_config() -> None:
    configs = {d["metadata"]["name"]: yaml.safe_load(d["data"]["config.yaml"]) for d in documents("disagg.yaml")[:-1]}
    for component in workers("disagg.yaml"):
        pod = component["podTemplate"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "configMap" in v]
        config = configs[volume["configMap"]["name"]]
        assert config["cache_transceiver_config"]["backend"] == "NIXL"
        engine = container(pod, "engine")
        mount = next(m for m in engine["volumeMounts"] if m["name"] == volume["name"])
        assert flag(engine["args"], "--extra_llm_api_options") == f"{mount['mountPath']}/config.yaml"


def test_lora_cache_is_shared_at_the_same_path() -> None:
    (component,) = workers("lora.yaml")
    pod = component["podTemplate"]["spec"]
    paths = {
        name: {m["mountPath"] for m in container(pod, name)["volumeMounts"] if m["name"] == "lora-cache"}
        for name in ("engine", "main")
    }
    assert paths["engine"] == paths["main"] == {"/lora-cache"}
    env = {e["name"]: e.get("value") for e in container(pod, "main")["env"]}
    assert env["DYN_LORA_PATH"] == "/lora-cache"


def test_containerfile() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    lines = [
        line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")
    ]
    image = re.search(r"ARG PYTHON_IMAGE=(\S+)", text)
    assert image is not None
    assert re.search(r":3\.11\.\d+-", image.group(1)), "pin the Python image to the project's 3.11 patch"
    assert sum(line.startswith("FROM ") for line in lines) == 2, "build stage + slim runtime stage"
    for needed in ("pyproject.toml", "protos/", "sidecar/", "statemachines/"):
        assert any(line.startswith("COPY") and needed in line for line in lines), needed
    (user,) = [line for line in lines if line.startswith("USER ")]
    assert user.split()[1] not in ("0", "root")
    (entrypoint,) = [line for line in lines if line.startswith("ENTRYPOINT ")]
    assert entrypoint == 'ENTRYPOINT ["openengine-sidecar"]'
    env = " ".join(line for line in lines if line.startswith("ENV "))
    assert "DYN_SYSTEM_PORT=9090" in env
    assert "DYN_SYSTEM_HOST=0.0.0.0" in env
    # the system port the image announces is the one the manifests probe
    for name in MANIFESTS:
        for component in workers(name):
            main = container(component["podTemplate"]["spec"], "main")
            assert f"EXPOSE {main['ports'][0]['containerPort']}" in lines
            assert shlex.join(main["args"])  # plain strings only
