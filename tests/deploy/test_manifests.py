"""``deploy/*.yaml`` and ``deploy/Containerfile``, validated offline.

* Plain Kubernetes objects, and every DynamoGraphDeployment component's pod template (as a Pod), against the
  Kubernetes JSON schemas bundled with ``kubernetes-validate`` (strict: unknown fields fail).
* The DynamoGraphDeployment itself against the shape Dynamo's operator expects:
  a hand-written JSON schema, since the operator's CRD is not bundled anywhere offline.
* What the worker pods promise: loopback gRPC between the containers, Control.Health probes on the engine, probes
  on the sidecar's system port, a termination grace longer than the drain budget, flags the sidecar accepts.
* What Dynamo's own OpenEngine sidecar examples do (``examples/backends/trtllm/`` in ai-dynamo/dynamo), point by
  point: backendFramework trtllm, explicit commands, a KV-routing frontend that migrates, the engine pinned by name
  and schema release, JSON logs, and the Dynamo runtime version named where the image tag is not one.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from sidecar.cli import build_parser
from sidecar.engine import PINNED_SCHEMA_RELEASE

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = (
    "agg.yaml",
    "disagg.yaml",
    "lora.yaml",
    "disagg_lora.yaml",
    "agg_multimodal.yaml",
    "disagg_multimodal.yaml",
    "agg_audio.yaml",
)
LORA = ("lora.yaml", "disagg_lora.yaml")
DISAGG = ("disagg.yaml", "disagg_lora.yaml", "disagg_multimodal.yaml")
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
            # v1beta1 graph-level fields (deploy/operator/api/v1beta1); v1alpha1's `envs` is not one of them: the
            # API server would drop it without a word, so it is refused here.
            "properties": {
                "backendFramework": {"enum": ["trtllm", "vllm", "sglang"]},
                "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                "annotations": {"type": "object"},
                "labels": {"type": "object"},
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
                            "runtimeVersionOverride": {"type": "string", "pattern": r"^\d{1,4}\.\d{1,4}\.\d{1,4}$"},
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


def frontend(name: str) -> dict[str, Any]:
    (found,) = [c for c in dgd(name)["spec"]["components"] if c["type"] == "frontend"]
    return dict(found)


def engine_config(name: str, component: dict[str, Any]) -> dict[str, Any]:
    """The engine's --extra_llm_api_options file, read from the ConfigMap its pod mounts."""
    configs = {d["metadata"]["name"]: d for d in documents(name) if d["kind"] == "ConfigMap"}
    pod = component["podTemplate"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    engine = container(pod, "engine")
    mount = next(m for m in engine["volumeMounts"] if m["name"] == volume["name"])
    assert flag(engine["args"], "--extra_llm_api_options") == f"{mount['mountPath']}/config.yaml"
    loaded = yaml.safe_load(configs[volume["configMap"]["name"]]["data"]["config.yaml"])
    assert isinstance(loaded, dict)
    return loaded


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


def test_the_graph_schema_refuses_fields_the_operator_would_drop() -> None:
    """``spec.envs`` (v1alpha1's name) is silently dropped by a v1beta1 API server; ``spec.env`` is the field."""
    graph = dgd("agg.yaml")
    variable = [{"name": "DYN_LOG", "value": "info"}]
    jsonschema.validate({**graph, "spec": {**graph["spec"], "env": variable}}, DGD_SCHEMA)
    with pytest.raises(jsonschema.ValidationError, match="envs"):
        jsonschema.validate({**graph, "spec": {**graph["spec"], "envs": variable}}, DGD_SCHEMA)
    component = {**graph["spec"]["components"][1], "runtimeVersionOverride": "0.1.0-sidecar"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**graph, "spec": {**graph["spec"], "components": [component]}}, DGD_SCHEMA)


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
        assert "DYN_SIDECAR_LOG_FORMAT" not in env, "the flag says it: --log-format json"
        system_port = int(env["DYN_SYSTEM_PORT"])
        assert env["DYN_SYSTEM_HOST"] == "0.0.0.0"  # the kubelet probes the pod IP
        (declared,) = main["ports"]
        assert declared["containerPort"] == system_port
        # The sidecar answers /live and /health itself, in every phase (sidecar/ops/health.py): /live while the
        # process answers, /health only while serving.
        probes = (("startupProbe", "/live"), ("livenessProbe", "/live"), ("readinessProbe", "/health"))
        for probe, path in probes:
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


@pytest.mark.parametrize("name", DISAGG)
def test_disagg_engines_get_their_transceiver_config(name: str) -> None:
    roles = []
    for component in workers(name):
        assert engine_config(name, component)["cache_transceiver_config"]["backend"] == "NIXL"
        roles.append(flag(container(component["podTemplate"]["spec"], "main")["args"], "--disaggregation-mode"))
    assert sorted(roles) == ["decode", "prefill"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_graph_matches_dynamos_own_sidecar_examples(name: str) -> None:
    """backendFramework trtllm; explicit commands; a frontend that routes by KV cache and migrates; the engine pinned
    by name and schema release; JSON logs; the Dynamo runtime version named for the sidecar image."""
    assert dgd(name)["spec"]["backendFramework"] == "trtllm"
    main = container(frontend(name)["podTemplate"]["spec"], "main")
    assert main["command"] == ["python3", "-m", "dynamo.frontend"]
    assert flag(main["args"], "--router-mode") == "kv"
    assert int(flag(main["args"], "--migration-limit")) >= 1, "Dynamo's default 0 fails requests of a dead worker"
    assert flag(main["args"], "--http-port") == "8000"
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (runtime,) = [d for d in pinned if d.startswith("ai-dynamo-runtime==")]
    for component in workers(name):
        assert component["runtimeVersionOverride"] == runtime.split("==")[1], component["name"]
        sidecar = container(component["podTemplate"]["spec"], "main")
        assert sidecar["command"] == ["openengine-sidecar"]
        ns = build_parser().parse_args(sidecar["args"])
        assert ns.expected_engine == "tensorrt_llm"
        assert len(ns.expected_schema_release) >= 12
        assert PINNED_SCHEMA_RELEASE.startswith(ns.expected_schema_release)
        assert ns.log_format == "json"


@pytest.mark.parametrize("name", MANIFESTS)
def test_context_length_is_the_engines_window(name: str) -> None:
    for component in workers(name):
        pod = component["podTemplate"]["spec"]
        engine, main = container(pod, "engine"), container(pod, "main")
        assert flag(main["args"], "--context-length") == flag(engine["args"], "--max_seq_len"), component["name"]
        assert flag(main["args"], "--model-path") == engine["args"][0], "the sidecar reads the engine's tokenizer"


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("agg_multimodal.yaml", "Qwen3-VL-2B-Instruct"),
        ("disagg_multimodal.yaml", "Qwen3-VL-2B-Instruct"),
        ("agg_audio.yaml", "Phi-4-multimodal-instruct"),
    ],
)
def test_media_manifests_serve_their_model(name: str, model: str) -> None:
    for component in workers(name):
        pod = component["podTemplate"]["spec"]
        assert container(pod, "engine")["args"][0].endswith(f"/{model}")
        config = engine_config(name, component)
        assert config["trust_remote_code"] is True, "the processor code comes with the checkpoint"
        if model.startswith("Phi-4"):
            assert config["lora_config"]["max_lora_rank"] >= 320, "Phi-4 hears through its bundled speech-lora"


@pytest.mark.parametrize("name", LORA)
def test_lora_cache_is_shared_at_the_same_path(name: str) -> None:
    for component in workers(name):
        pod = component["podTemplate"]["spec"]
        paths = {
            box: {m["mountPath"] for m in container(pod, box)["volumeMounts"] if m["name"] == "lora-cache"}
            for box in ("engine", "main")
        }
        assert paths["engine"] == paths["main"] == {"/lora-cache"}
        env = {e["name"]: e.get("value") for e in container(pod, "main")["env"]}
        assert env["DYN_LORA_PATH"] == "/lora-cache"
        assert engine_config(name, component)["lora_config"]["max_loras"] >= 1
        (volume,) = [v for v in pod["volumes"] if v["name"] == "lora-cache"]
        (claim,) = [d for d in documents(name) if d["kind"] == "PersistentVolumeClaim"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every pod mounts the same adapters"


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
