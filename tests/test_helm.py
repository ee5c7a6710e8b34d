"""The Helm chart in helm/, rendered and linted by real Helm (PyPI helm-python-sdk, Helm v4 as a library).

Every rendered Kubernetes object is validated against the Kubernetes 1.30 and the newest schemas that
kubernetes-validate ships (strict: unknown fields fail); custom resources get structural assertions. The
`helm test` hook script runs against the real service and against a small HTTPS / mutual-TLS stub, as do
the MTLS exec probes.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import helm_python as helm
except Exception as exc:  # ImportError, or HelmLibraryError: no native library for this platform
    pytest.skip(f"helm-python-sdk cannot load here ({exc}); the chart is untested", allow_module_level=True)

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (test extra)"
)

REPO = Path(__file__).resolve().parent.parent
CHART_DIR = REPO / "helm"
SMOKE_SCRIPT = CHART_DIR / "files" / "smoke_test.py"
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = "demo-nim-torch"
K8S_VERSION = "1.30.0"
WORKLOAD_KINDS = {"StatefulSet", "Deployment"}
CUSTOM_KINDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "InferencePool": "inference.networking.k8s.io/v1",
}
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
PROM = "http://prometheus-operated.monitoring.svc:9090"

Obj = dict[str, Any]
NIM_LLM_VALUES = Path(__file__).parent / "data" / "helm"


def nim_llm_values(name: str) -> Obj:
    """A values file written for NVIDIA's nim-llm chart (tests/data/helm/nim-llm-<name>.yaml)."""
    values: Obj = yaml.safe_load((NIM_LLM_VALUES / f"nim-llm-{name}.yaml").read_text())
    return values


SCENARIOS: dict[str, Obj] = {
    "defaults": {},
    "deployment-cpu": {
        "workload": {"kind": "Deployment", "replicas": 2},
        "image": {"flavor": "cpu"},
        "resources": {"gpu": 0, "requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
        "tolerations": [],
        "shm": {"sizeLimit": "1Gi"},
        # one claim shared by two replicas: ReadWriteMany (a ReadWriteOnce claim fails the render)
        "persistence": {"accessModes": ["ReadWriteMany"]},
    },
    "existing-claim-statefulset": {"persistence": {"existingClaim": "model-cache"}},
    "existing-claim-deployment": {
        "workload": {"kind": "Deployment"},
        "persistence": {"existingClaim": "model-cache"},
    },
    "no-persistence": {"persistence": {"enabled": False}},
    "hpa": {"autoscaling": {"enabled": True, "maxReplicas": 3, "targetAverageValue": "4"}},
    "hpa-full-metrics": {
        "workload": {"kind": "Deployment"},
        "persistence": {"accessModes": ["ReadWriteMany"]},
        "autoscaling": {
            "enabled": True,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "gpu_cache_usage_perc"},
                        "target": {"type": "AverageValue", "averageValue": "750m"},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
        },
    },
    "keda": {
        "keda": {"enabled": True, "prometheus": {"serverAddress": PROM}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "keda-kv-cache": {
        "keda": {"enabled": True, "prometheus": {"serverAddress": PROM, "metric": "kvCache"}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "gateway": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"},
            "tls": [{"hosts": ["nim.example.com"], "secretName": "nim-tls"}],
        },
        "networkPolicy": {
            "enabled": True,
            "ingressFrom": [{"namespaceSelector": {"matchLabels": {"name": "gateway"}}}],
        },
        "pdb": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True, "additionalLabels": {"release": "prometheus"}}},
        "inferencePool": {"enabled": True, "endpointPicker": {"name": "demo-epp", "failureMode": "FailOpen"}},
    },
    "secrets": {
        "model": {"hfTokenSecret": {"name": "hf-token"}, "name": "llama"},
        "auth": {"apiKeySecret": {"name": "nim-api-keys"}},
    },
    "tls": {
        "tls": {"mode": "TLS", "secretName": "nim-tls"},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "mtls": {"tls": {"mode": "MTLS", "secretName": "nim-tls", "clientSecretName": "nim-client"}},
    "lora": {
        "model": {
            "loraSource": "/loras",
            "lora": {"refreshInterval": 30, "maxRank": 64, "maxGpuLoras": 4, "maxCpuLoras": 12},
        },
        "extraVolumes": [{"name": "loras", "persistentVolumeClaim": {"claimName": "loras"}}],
        "extraVolumeMounts": [{"name": "loras", "mountPath": "/loras", "readOnly": True}],
    },
    # values written for the nim-llm chart: NGC secret alias, cache at /model-store, TP 2 and no GPU count
    "nim-llm-compat": {
        "model": {"ngcAPISecret": "ngc-api", "nimCache": "/model-store", "tensorParallelSize": 2},
        "workload": {"kind": "Deployment"},
    },
    "nim-llm-minimal": nim_llm_values("minimal"),
    "nim-llm-full": nim_llm_values("full"),
    # NVIDIA Dynamo: 3 workers (the StatefulSet) and the router Deployment, with auth, TLS and a policy
    "dynamo": {
        "dynamo": {
            "enabled": True,
            "etcdEndpoints": "http://etcd.dynamo.svc:2379",
            "router": {"replicas": 2},
        },
        "workload": {"replicas": 3},
        "auth": {"apiKeySecret": {"name": "nim-api-keys"}},
        "tls": {"mode": "TLS", "secretName": "nim-tls"},
        "networkPolicy": {"enabled": True, "allowAllEgress": False},
        "tracing": {"otlpEndpoint": "http://otel:4318"},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "everything": {
        "model": {
            "path": "meta-llama/Llama-3.1-8B-Instruct",
            "profile": "tensorrt_llm-h100-fp8-tp2-pp1-throughput",
            "name": "llama-3.1-8b",
            "maxModelLen": 8192,
            "tensorParallelSize": 2,
            "kvCachePercent": 0.85,
            "enableKvCacheReuse": False,
            "logLevel": "DEBUG",
            "jsonLogging": False,
            "hfHubOffline": True,
        },
        "resources": {"gpu": 2, "requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "128Gi"}},
        "image": {"tag": "nightly", "digest": "sha256:" + "a" * 64, "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "ghcr"}],
        "command": ["python3", "/app/entrypoint.py"],
        "args": ["serve", "--log-level", "debug"],
        "env": [{"name": "NIM_MAX_NUM_SEQS", "value": "64"}, {"name": "NIM_LOG_LEVEL", "value": "TRACE"}],
        "extraEnv": [{"name": "NIM_MAX_NUM_SEQS", "value": "128"}],
        "envFrom": [{"configMapRef": {"name": "nim-extra"}}],
        "extraVolumes": [{"name": "loras", "persistentVolumeClaim": {"claimName": "loras"}}],
        "extraVolumeMounts": [{"name": "loras", "mountPath": "/loras", "readOnly": True}],
        "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
        "podAnnotations": {"example.com/team": "llm"},
        "podLabels": {"team": "llm", "app.kubernetes.io/name": "hijack"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE}},
                        },
                    }
                ]
            }
        },
        "priorityClassName": "inference",
        "runtimeClassName": "nvidia",
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "serviceAccount": {"create": False, "name": "existing-sa"},
        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4318"},
        "persistence": {
            "storageClass": "-",
            "size": "200Gi",
            "annotations": {"helm.sh/resource-policy": "keep"},
        },
        "tmp": {"sizeLimit": "20Gi"},
        "workload": {"updateStrategy": {"type": "RollingUpdate"}, "annotations": {"example.com/owner": "ml"}},
        "service": {"annotations": {"example.com/lb": "internal"}, "labels": {"tier": "inference"}},
        "pdb": {"enabled": True, "minAvailable": "50%"},
        "networkPolicy": {
            "enabled": True,
            "allowAllEgress": False,
            "extraEgress": [{"ports": [{"port": 443}]}],
        },
        "inferencePool": {"enabled": True, "engineType": "vllm"},
    },
}


# ---------------------------------------------------------------- rendering helpers


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


@dataclass(frozen=True)
class Rendered:
    """One `helm template` run: parsed objects, the raw text and NOTES.txt."""

    objects: list[Obj]
    text: str
    notes: str

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> Obj:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]

    @property
    def workload(self) -> Obj:
        found = [o for o in self.objects if o["kind"] in WORKLOAD_KINDS and o is not self.router]
        assert len(found) == 1, [o["kind"] for o in found]
        return found[0]

    @property
    def router(self) -> Obj | None:
        """dynamo.enabled: the router's Deployment (the API), beside the workers' workload."""
        found = [o for o in self.objects if o["metadata"]["name"].endswith("-router")]
        return found[0] if found else None

    @property
    def pod_spec(self) -> Obj:
        return self.workload["spec"]["template"]["spec"]

    @property
    def server(self) -> Obj:
        return self.pod_spec["containers"][0]

    @property
    def test_pods(self) -> list[Obj]:
        return [o for o in self.of_kind("Pod") if o["metadata"].get("annotations", {}).get("helm.sh/hook")]


def render(values: Obj) -> Rendered:
    manifests = chart().render(values, name=RELEASE, namespace=NAMESPACE)
    notes = next((text for path, text in manifests.items() if path.endswith("NOTES.txt")), "")
    text = "\n---\n".join(t for p, t in sorted(manifests.items()) if not p.endswith("NOTES.txt"))
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    return Rendered(objects, text, notes)


@functools.cache
def scenario(name: str) -> Rendered:
    return render(SCENARIOS[name])


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: Obj, name: str) -> str | None:
    entry = env_of(container).get(name)
    return None if entry is None else entry.get("value")


def volumes_by_name(pod_spec: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in pod_spec.get("volumes", [])}


def mounts_by_path(container: Obj) -> dict[str, Obj]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def render_error(values: Obj) -> str:
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    return str(caught.value)


def walk(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every (path, leaf) of a parsed YAML tree; list indices become "[i]"."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, (*path, f"[{i}]"))
    else:
        yield path, node


def walk_env(obj: Obj) -> Iterator[tuple[str, Obj]]:
    spec = obj.get("spec", {})
    pod_spec = spec.get("template", {}).get("spec", spec)
    for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        for entry in container.get("env", []):
            yield container["name"], entry


# ---------------------------------------------------------------- lint and schemas


def test_lora_settings_become_the_service_environment() -> None:
    assert chart().values["model"]["loraSource"] == ""
    assert "NIM_PEFT_SOURCE" not in scenario("everything").text
    container = scenario("lora").server
    expected = {
        "NIM_PEFT_SOURCE": "/loras",
        "NIM_PEFT_REFRESH_INTERVAL": "30",
        "NIM_MAX_LORA_RANK": "64",
        "NIM_MAX_GPU_LORAS": "4",
        "NIM_MAX_CPU_LORAS": "12",
    }
    assert {name: env_value(container, name) for name in expected} == expected


def test_readme_documents_the_chart_as_rendered() -> None:
    readme = (CHART_DIR / "README.md").read_text()
    # the endpoint picker Service the InferencePool points at by default
    assert "<fullname>-epp" in readme and "<release>-nim-torch-epp" not in readme
    # StatefulSet fields Kubernetes refuses to change after install
    for field in ("podManagementPolicy", "volumeClaimTemplates", "serviceName", "persistence.storageClass"):
        assert field in readme, field
    assert "immutable" in readme.lower()
    assert "helm test llama --timeout 15m" in readme
    assert "optional: true" in readme and "NVIDIA_VISIBLE_DEVICES=void" in readme


def test_helm_sdk_is_real_helm() -> None:
    assert helm.helm_sdk_version().startswith("v"), helm.helm_sdk_version()


@pytest.mark.parametrize(
    "name",
    [
        "defaults",
        "deployment-cpu",
        "gateway",
        "keda",
        "mtls",
        "everything",
        "nim-llm-minimal",
        "nim-llm-full",
        "dynamo",
    ],
)
def test_lint_is_clean(name: str) -> None:
    report = helm.lint(CHART_DIR, SCENARIOS[name], strict=True, kube_version=f"v{K8S_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report
    infos = {m["error"] for m in report["messages"]}
    assert infos <= {"icon is recommended"}, infos


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_object_is_valid_kubernetes(name: str) -> None:
    rendered = scenario(name)
    assert rendered.objects
    for obj in rendered.objects:
        kind = obj["kind"]
        if kind in CUSTOM_KINDS:
            assert obj["apiVersion"] == CUSTOM_KINDS[kind]
            continue
        for version in (K8S_VERSION, kubernetes_validate.latest_version()):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = f"{kind}/{obj['metadata']['name']} on Kubernetes {version}"
                pytest.fail(f"{where}: {exc.message} at {list(exc.absolute_path)}")
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", (kind, labels)
        assert labels.get("helm.sh/chart") == "nim-torch-0.1.0", (kind, labels)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param({"resources": {"gpu": -1}}, ["/resources/gpu", "minimum"], id="negative-gpus"),
        pytest.param({"replica": 2}, ["additional properties 'replica' not allowed"], id="top-level-typo"),
        pytest.param(
            {"model": {"nmae": "x"}}, ["/model", "additional properties 'nmae' not allowed"], id="nested-typo"
        ),
        pytest.param(
            {"workload": {"kind": "DaemonSet"}},
            ["/workload/kind", "'StatefulSet', 'Deployment'"],
            id="kind-enum",
        ),
        pytest.param({"image": {"flavor": "tpu"}}, ["/image/flavor", "'gpu', 'cpu'"], id="flavor-enum"),
        pytest.param({"tls": {"mode": "on"}}, ["/tls/mode", "'DISABLED', 'TLS', 'MTLS'"], id="tls-enum"),
        pytest.param({"model": {"openaiPort": 70000}}, ["/model/openaiPort", "maximum"], id="port-range"),
        pytest.param(
            {"model": {"maxModelLen": "long"}}, ["/model/maxModelLen", "got string"], id="wrong-type"
        ),
        pytest.param(
            {"inferencePool": {"endpointPicker": {"failureMode": "Open"}}},
            ["/inferencePool/endpointPicker/failureMode", "'FailOpen', 'FailClose'"],
            id="failure-mode-enum",
        ),
        pytest.param(
            {"startupProbe": {"successThreshold": 2}},
            ["/startupProbe/successThreshold", "maximum"],
            id="probe",
        ),
        pytest.param(
            {
                "autoscaling": {"enabled": True},
                "keda": {"enabled": True, "prometheus": {"serverAddress": PROM}},
            },
            ["autoscaling.enabled and keda.enabled are mutually exclusive"],
            id="hpa-and-keda",
        ),
        pytest.param({"keda": {"enabled": True}}, ["keda.prometheus.serverAddress"], id="keda-no-prometheus"),
        pytest.param(
            {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
            ["autoscaling.minReplicas (5) must not exceed autoscaling.maxReplicas (2)"],
            id="hpa-bounds",
        ),
        pytest.param({"tls": {"mode": "TLS"}}, ["tls.mode=TLS needs tls.secretName"], id="tls-no-secret"),
        pytest.param(
            {"terminationGracePeriodSeconds": 30},
            [
                "terminationGracePeriodSeconds (30) must be at least 50",
                "preStop hook (10 s) + model.shutdownGraceSeconds (30) + 10 s",
            ],
            id="grace-too-short",
        ),
        pytest.param(
            {"terminationGracePeriodSeconds": 49},
            ["terminationGracePeriodSeconds (49) must be at least 50"],
            id="grace-without-room-for-pre-stop",
        ),
        pytest.param(
            {"lifecycle": {"preStop": {"sleep": {"seconds": 25}}}},
            ["terminationGracePeriodSeconds (60) must be at least 65", "preStop hook (25 s)"],
            id="grace-vs-explicit-sleep-action",
        ),
        pytest.param(
            {"lifecycle": {"preStop": {"exec": {"command": ["/bin/sleep", "30"]}}}},
            ["terminationGracePeriodSeconds (60) must be at least 70", "preStop hook (30 s)"],
            id="grace-vs-explicit-sleep-command",
        ),
        pytest.param(
            {"workload": {"kind": "Deployment", "replicas": 2}},
            ["workload.kind=Deployment", "persistence.accessModes [ReadWriteOnce]", "Multi-Attach"],
            id="deployment-rwo-replicas",
        ),
        pytest.param(
            {"workload": {"kind": "Deployment"}, "autoscaling": {"enabled": True}},
            ["workload.kind=Deployment", "persistence.accessModes [ReadWriteOnce]", "ReadWriteMany"],
            id="deployment-rwo-hpa",
        ),
        pytest.param(
            {
                "workload": {"kind": "Deployment"},
                "persistence": {"accessModes": ["ReadWriteOncePod"]},
                "keda": {"enabled": True, "prometheus": {"serverAddress": PROM}},
                "metrics": {"serviceMonitor": {"enabled": True}},
            },
            ["workload.kind=Deployment", "persistence.accessModes [ReadWriteOncePod]"],
            id="deployment-rwop-keda",
        ),
        pytest.param(
            {
                "tls": {"mode": "MTLS", "secretName": "nim-tls"},
                "metrics": {"serviceMonitor": {"enabled": True}},
            },
            ["tls.mode=MTLS needs metrics.serviceMonitor.tlsConfig", "client certificate config"],
            id="mtls-service-monitor-without-client-cert",
        ),
        pytest.param(
            {"keda": {"enabled": True, "prometheus": {"serverAddress": PROM}}},
            ["needs metrics.serviceMonitor.enabled=true", "`service` label", "keda.prometheus.query"],
            id="keda-builtin-query-without-service-monitor",
        ),
        pytest.param(
            {
                "keda": {
                    "enabled": True,
                    "prometheus": {"serverAddress": PROM, "metric": "kvCache", "threshold": 80},
                },
                "metrics": {"serviceMonitor": {"enabled": True}},
            },
            ["keda.prometheus.threshold (80) is above 1", "vllm:kv_cache_usage_perc", "0 to 1"],
            id="keda-kv-cache-threshold-as-percent",
        ),
        pytest.param(
            {"model": {"tensorParallelSize": 4}, "resources": {"gpu": 2}},
            ["model.tensorParallelSize (4) needs one GPU per rank, but the pod gets 2"],
            id="tp-above-gpus",
        ),
        pytest.param(
            {"model": {"tensorParallelSize": 2}, "resources": {"limits": {"nvidia.com/gpu": 1}}},
            ["model.tensorParallelSize (2) needs one GPU per rank, but the pod gets 1"],
            id="tp-above-gpus-in-limits",
        ),
        pytest.param(
            {"model": {"tensorParallelSize": 2}, "resources": {"gpu": 0}},
            ["model.tensorParallelSize (2) needs one GPU per rank, but the pod gets 0"],
            id="tp-without-gpus",
        ),
        pytest.param(
            {"model": {"lora": {"maxGpuLoras": 4}}},
            ["model.lora settings need model.loraSource"],
            id="lora-settings-without-source",
        ),
        pytest.param(
            {"model": {"loraSource": "/loras", "lora": {"maxGpuLoras": 8, "maxCpuLoras": 4}}},
            ["model.lora.maxCpuLoras (4) is below model.lora.maxGpuLoras (8)"],
            id="lora-host-below-device",
        ),
        pytest.param(
            {"dynamo": {"enabled": True}}, ["dynamo.enabled needs dynamo.etcdEndpoints"], id="dynamo-etcd"
        ),
        pytest.param(
            {
                "dynamo": {"enabled": True, "etcdEndpoints": "http://e:2379"},
                "inferencePool": {"enabled": True},
            },
            ["Dynamo's KV router chooses the worker"],
            id="dynamo-inference-pool",
        ),
        pytest.param(
            {"dynamo": {"enabled": True, "etcdEndpoints": "http://e:2379"}, "autoscaling": {"enabled": True}},
            ["Dynamo workers do not serve"],
            id="dynamo-autoscaling",
        ),
        pytest.param(
            {"dynamo": {"router": {"mode": "random"}}},
            ["/dynamo/router/mode", "'kv', 'round-robin'"],
            id="dynamo-router-mode",
        ),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(values: Obj, expected: list[str]) -> None:
    message = render_error(values)
    for fragment in expected:
        assert fragment in message, message


def _schema_paths(schema: Obj, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Obj]]:
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _schema_paths(sub, (*path, key))


def test_schema_types_every_value_and_rejects_unknown_keys() -> None:
    schema = chart().schema
    assert schema is not None
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    declared = dict(_schema_paths(schema))
    defaults = chart().values

    def check(node: Any, path: tuple[str, ...]) -> None:
        assert path in declared, f"value {'.'.join(path)} is not in values.schema.json"
        assert "type" in declared[path], f"{'.'.join(path)} has no type"
        sub = declared[path]
        if isinstance(node, dict) and sub.get("properties"):
            for key, value in node.items():
                check(value, (*path, key))

    check(defaults, ())
    for path, sub in declared.items():
        parent: Any = defaults
        for key in path:
            if parent == {}:  # an override object that is empty by default (tests.image)
                break
            assert isinstance(parent, dict) and key in parent, (
                f"schema key {'.'.join(path)} not in values.yaml"
            )
            parent = parent[key]
        if sub.get("properties") and path not in {("podSecurityContext",), ("securityContext",)}:
            assert sub.get("additionalProperties") is False, f"{'.'.join(path) or 'top level'} is open"


# ---------------------------------------------------------------- workload


def test_default_is_a_gpu_statefulset_with_a_cache_claim_per_replica() -> None:
    rendered = scenario("defaults")
    sts = rendered.one("StatefulSet")
    assert sts["metadata"]["name"] == FULLNAME
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["serviceName"] == f"{FULLNAME}-headless"
    assert "updateStrategy" not in sts["spec"], "StatefulSet: Kubernetes' default RollingUpdate"
    assert rendered.server["image"] == "ghcr.io/nim-torch/nim-torch:0.1.0-gpu"
    assert rendered.server.get("args") is None and rendered.server.get("command") is None
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "nim-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert "nim-cache" not in volumes_by_name(rendered.pod_spec)
    assert not rendered.of_kind("PersistentVolumeClaim")
    assert rendered.pod_spec["terminationGracePeriodSeconds"] == 60
    assert int(env_value(rendered.server, "NIM_SHUTDOWN_GRACE_SECONDS") or 0) < 60
    assert rendered.pod_spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert not rendered.of_kind("HorizontalPodAutoscaler") and not rendered.of_kind("ScaledObject")


def test_deployment_on_the_cpu_image_has_no_gpu() -> None:
    rendered = scenario("deployment-cpu")
    deploy = rendered.one("Deployment")
    assert deploy["spec"]["progressDeadlineSeconds"] == 3600
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert rendered.server["image"] == "ghcr.io/nim-torch/nim-torch:0.1.0-cpu"
    assert "nvidia.com/gpu" not in rendered.text
    assert rendered.server["resources"] == {
        "limits": {"memory": "8Gi"},
        "requests": {"cpu": "2", "memory": "4Gi"},
    }
    assert "tolerations" not in rendered.pod_spec
    claim = rendered.one("PersistentVolumeClaim")
    assert claim["metadata"]["name"] == f"{FULLNAME}-cache"
    assert volumes_by_name(rendered.pod_spec)["nim-cache"]["persistentVolumeClaim"]["claimName"] == (
        f"{FULLNAME}-cache"
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, 1),
        ({"resources": {"gpu": 4}}, 4),
        ({"image": {"flavor": "cpu"}}, 0),
        ({"resources": {"limits": {"nvidia.com/gpu": 2}}}, 2),  # nim-llm style values
        ({"resources": {"gpu": 0, "limits": {"nvidia.com/gpu": 2}}}, 0),
        ({"model": {"tensorParallelSize": 4}}, 4),  # one GPU per tensor-parallel rank
        ({"model": {"tensorParallelSize": 2}, "resources": {"gpu": 4}}, 4),
        ({"model": {"tensorParallelSize": 2}, "resources": {"limits": {"nvidia.com/gpu": 2}}}, 2),
        ({"model": {"tensorParallelSize": 1}, "resources": {"gpu": 0}}, 0),
    ],
)
def test_gpu_count_goes_to_limits_and_requests(values: Obj, expected: int) -> None:
    resources = render(values).server["resources"]
    if expected:
        assert resources["limits"]["nvidia.com/gpu"] == expected
        assert resources["requests"]["nvidia.com/gpu"] == expected
    else:
        assert "nvidia.com/gpu" not in resources.get("limits", {})
        assert "nvidia.com/gpu" not in resources.get("requests", {})


def test_gpu_resource_name_can_be_a_mig_profile() -> None:
    resources = render({"resources": {"gpuResourceName": "nvidia.com/mig-3g.40gb"}}).server["resources"]
    assert resources == {"limits": {"nvidia.com/mig-3g.40gb": 1}, "requests": {"nvidia.com/mig-3g.40gb": 1}}


def test_deployment_defaults_to_recreate() -> None:
    # a rolling update's surge pod needs a spare GPU and, on a ReadWriteOnce claim, the claim's node
    for name in ("deployment-cpu", "existing-claim-deployment", "hpa-full-metrics", "nim-llm-compat"):
        assert scenario(name).one("Deployment")["spec"]["strategy"] == {"type": "Recreate"}, name
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    deploy = render({"workload": {"kind": "Deployment", "updateStrategy": rolling}}).one("Deployment")
    assert deploy["spec"]["strategy"] == rolling
    assert scenario("everything").one("StatefulSet")["spec"]["updateStrategy"] == {"type": "RollingUpdate"}


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({"workload": {"kind": "Deployment", "replicas": 1}}, id="rwo-one-replica"),
        pytest.param(
            {"workload": {"kind": "Deployment", "replicas": 3}, "persistence": {"existingClaim": "shared"}},
            id="existing-claim",
        ),
        pytest.param(
            {"workload": {"kind": "Deployment", "replicas": 3}, "persistence": {"enabled": False}},
            id="empty-dir",
        ),
        pytest.param(
            {
                "workload": {"kind": "Deployment"},
                "persistence": {"accessModes": ["ReadWriteOnce", "ReadWriteMany"]},
                "autoscaling": {"enabled": True},
            },
            id="rwx-hpa",
        ),
        pytest.param({"workload": {"replicas": 3}, "autoscaling": {"enabled": True}}, id="statefulset"),
    ],
)
def test_several_replicas_without_a_single_node_claim_render(values: Obj) -> None:
    assert render(values).workload["kind"] == values["workload"].get("kind", "StatefulSet")


def test_pre_stop_sleep_covers_the_endpoint_lag() -> None:
    server = scenario("defaults").server
    assert server["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    assert render({"preStopSleepSeconds": 3}).server["lifecycle"]["preStop"]["exec"]["command"] == [
        "sleep",
        "3",
    ]
    # an explicit lifecycle replaces the default hook entirely
    assert scenario("everything").server["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    post_start = {"postStart": {"exec": {"command": ["true"]}}}
    assert render({"lifecycle": post_start}).server["lifecycle"] == post_start
    # 0 = no hook; the grace period then only needs shutdown grace + 10 s
    bare = render({"preStopSleepSeconds": 0, "terminationGracePeriodSeconds": 40})
    assert "lifecycle" not in bare.server and bare.pod_spec["terminationGracePeriodSeconds"] == 40


@pytest.mark.parametrize("kind", sorted(WORKLOAD_KINDS))
def test_existing_claim_is_mounted_for_both_kinds(kind: str) -> None:
    rendered = scenario(f"existing-claim-{kind.lower()}")
    assert rendered.workload["kind"] == kind
    assert volumes_by_name(rendered.pod_spec)["nim-cache"] == {
        "name": "nim-cache",
        "persistentVolumeClaim": {"claimName": "model-cache"},
    }
    assert "volumeClaimTemplates" not in rendered.workload["spec"]
    assert not rendered.of_kind("PersistentVolumeClaim")


def test_without_persistence_the_cache_is_an_empty_dir() -> None:
    rendered = scenario("no-persistence")
    assert volumes_by_name(rendered.pod_spec)["nim-cache"] == {"name": "nim-cache", "emptyDir": {}}
    assert "volumeClaimTemplates" not in rendered.workload["spec"]


def test_storage_class_dash_disables_dynamic_provisioning() -> None:
    (claim,) = scenario("everything").workload["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == ""
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert "storageClassName" not in scenario("defaults").workload["spec"]["volumeClaimTemplates"][0]["spec"]


@pytest.mark.parametrize("name", ["defaults", "deployment-cpu", "no-persistence", "tls", "everything"])
def test_read_only_root_with_writable_tmp_cache_and_shm(name: str) -> None:
    rendered = scenario(name)
    server, pod = rendered.server, rendered.pod_spec
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    mounts, volumes = mounts_by_path(server), volumes_by_name(pod)
    claims = {c["metadata"]["name"] for c in rendered.workload["spec"].get("volumeClaimTemplates", [])}
    for path in ("/tmp", "/opt/nim/.cache", "/dev/shm"):
        mount = mounts[path]
        assert not mount.get("readOnly"), path
        volume = volumes.get(mount["name"], {})
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume or mount["name"] in claims, path
    assert env_value(server, "NIM_CACHE_PATH") == "/opt/nim/.cache"
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert shm["sizeLimit"] == SCENARIOS[name].get("shm", {}).get("sizeLimit", "16Gi")


def test_security_contexts() -> None:
    rendered = scenario("defaults")
    assert rendered.pod_spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for pod_spec in [rendered.pod_spec, *(p["spec"] for p in rendered.test_pods)]:
        for container in pod_spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
        assert pod_spec["automountServiceAccountToken"] is False


def test_probes() -> None:
    rendered = scenario("defaults")
    server = rendered.server
    (port,) = server["ports"]
    assert port == {"name": "http-openai", "containerPort": 8000, "protocol": "TCP"}
    expected = {
        "livenessProbe": "/v1/health/live",
        "readinessProbe": "/v1/health/ready",
        "startupProbe": "/v1/health/ready",
    }
    for probe_name, path in expected.items():
        probe = server[probe_name]
        assert probe["httpGet"] == {"path": path, "port": "http-openai", "scheme": "HTTP"}, probe_name
    readiness = server["readinessProbe"]
    assert (readiness["initialDelaySeconds"], readiness["periodSeconds"], readiness["failureThreshold"]) == (
        15,
        10,
        3,
    )
    startup = server["startupProbe"]
    assert startup["failureThreshold"] == 180 and startup["periodSeconds"] == 10
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 1800


def test_probes_are_configurable_and_can_be_disabled() -> None:
    server = render({"startupProbe": {"failureThreshold": 360}, "livenessProbe": {"enabled": False}}).server
    assert server["startupProbe"]["failureThreshold"] == 360
    assert "livenessProbe" not in server


def test_tls_switches_probes_and_metrics_to_https() -> None:
    rendered = scenario("tls")
    server = rendered.server
    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert server[probe_name]["httpGet"]["scheme"] == "HTTPS"
    env = env_of(server)
    assert env["NIM_SSL_MODE"]["value"] == "TLS"
    assert env["NIM_SSL_KEY_PATH"]["value"] == "/etc/nim/tls/tls.key"
    assert env["NIM_SSL_CERTS_PATH"]["value"] == "/etc/nim/tls/tls.crt"
    assert "NIM_SSL_CA_CERTS_PATH" not in env
    assert mounts_by_path(server)["/etc/nim/tls"]["readOnly"] is True
    assert volumes_by_name(rendered.pod_spec)["tls"]["secret"]["secretName"] == "nim-tls"
    (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}, "no tlsConfig given: encrypted, unverified"
    for service in rendered.of_kind("Service"):
        assert service["spec"]["ports"][0]["appProtocol"] == "https"
    for pod in rendered.test_pods:
        assert str(env_value(pod["spec"]["containers"][0], "NIM_TEST_BASE_URL")).startswith("https://")
        tls_volume = volumes_by_name(pod["spec"])["tls"]["secret"]
        assert [item["key"] for item in tls_volume["items"]] == ["ca.crt"], "test pods get no private key"


def test_mtls_uses_exec_probes_with_the_client_certificate() -> None:
    rendered = scenario("mtls")
    server = rendered.server
    assert env_value(server, "NIM_SSL_CA_CERTS_PATH") == "/etc/nim/tls/ca.crt"
    for probe_name, path in (("livenessProbe", "/v1/health/live"), ("readinessProbe", "/v1/health/ready")):
        command = server[probe_name]["exec"]["command"]
        assert command[:2] == ["python3", "-c"]
        assert f"https://127.0.0.1:8000{path}" in command[2]
        assert "/etc/nim/tls-client/tls.crt" in command[2]
    assert mounts_by_path(server)["/etc/nim/tls-client"]["readOnly"] is True
    assert volumes_by_name(rendered.pod_spec)["tls-client"]["secret"]["secretName"] == "nim-client"


def test_service_monitor_tls_config_from_values_wins() -> None:
    tls_config = {
        "ca": {"secret": {"name": "nim-client", "key": "ca.crt"}},
        "cert": {"secret": {"name": "nim-client", "key": "tls.crt"}},
        "keySecret": {"name": "nim-client", "key": "tls.key"},
        "serverName": f"{FULLNAME}.{NAMESPACE}.svc",
    }
    for mode in ("TLS", "MTLS"):
        rendered = render(
            {
                "tls": {"mode": mode, "secretName": "nim-tls"},
                "metrics": {"serviceMonitor": {"enabled": True, "tlsConfig": tls_config}},
            }
        )
        (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
        assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == tls_config, mode
    (plain,) = scenario("gateway").one("ServiceMonitor")["spec"]["endpoints"]
    assert "tlsConfig" not in plain


# ---------------------------------------------------------------- environment and secrets


def test_env_from_values() -> None:
    server = scenario("everything").server
    names = [e["name"] for e in server["env"]]
    assert len(names) == len(set(names)), "duplicate env names break server-side apply"
    expected = {
        "NIM_MODEL_NAME": "meta-llama/Llama-3.1-8B-Instruct",
        "NIM_MODEL_PROFILE": "tensorrt_llm-h100-fp8-tp2-pp1-throughput",
        "NIM_SERVED_MODEL_NAME": "llama-3.1-8b",
        "NIM_MAX_MODEL_LEN": "8192",
        "NIM_TENSOR_PARALLEL_SIZE": "2",
        "NIM_KV_CACHE_PERCENT": "0.85",
        "NIM_ENABLE_KV_CACHE_REUSE": "0",
        "NIM_LOG_LEVEL": "TRACE",  # env passthrough replaces the chart's value
        "NIM_JSONL_LOGGING": "0",
        "HF_HUB_OFFLINE": "1",
        "NIM_SERVER_PORT": "8000",
        "NIM_CACHE_PATH": "/opt/nim/.cache",
        "HF_HOME": "/opt/nim/.cache/huggingface",
        "NIM_MAX_NUM_SEQS": "128",  # extraEnv comes after env
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector.observability:4318",
        "OTEL_SERVICE_NAME": FULLNAME,
    }
    assert {name: env_value(server, name) for name in expected} == expected
    assert server["envFrom"] == [{"configMapRef": {"name": "nim-extra"}}]
    assert server["command"] == ["python3", "/app/entrypoint.py"]
    assert server["args"] == ["serve", "--log-level", "debug"]
    assert server["image"] == "ghcr.io/nim-torch/nim-torch:nightly@sha256:" + "a" * 64


def test_defaults_set_only_what_the_values_say() -> None:
    env = env_of(scenario("defaults").server)
    assert set(env) == {
        "NIM_CACHE_PATH",
        "HF_HOME",
        "XDG_CACHE_HOME",
        "NIM_SERVER_PORT",
        "NIM_SHUTDOWN_GRACE_SECONDS",
        "NIM_LOG_LEVEL",
        "NIM_JSONL_LOGGING",
    }


def test_secrets_only_by_reference() -> None:
    rendered = scenario("secrets")
    env = env_of(rendered.server)
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
    }
    assert env["NIM_API_KEY"] == {
        "name": "NIM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "nim-api-keys", "key": "NIM_API_KEY"}},
    }
    assert not rendered.of_kind("Secret") and not rendered.of_kind("ConfigMap")
    for pod in rendered.test_pods:
        test_env = env_of(pod["spec"]["containers"][0])
        assert test_env["NIM_API_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": "nim-api-keys", "key": "NIM_API_KEY"}
        }
        assert test_env["NIM_TEST_MODEL"]["value"] == "llama"


def test_secret_names_appear_only_inside_secret_references() -> None:
    sentinel = "sentinel-secret-7c1f"
    rendered = render(
        {
            "model": {"hfTokenSecret": {"name": sentinel, "key": "token"}},
            "auth": {"apiKeySecret": {"name": sentinel, "key": "keys"}},
        }
    )
    hits = [path for obj in rendered.objects for path, leaf in walk(obj) if leaf == sentinel]
    assert hits
    for path in hits:
        assert path[-2:] == ("secretKeyRef", "name"), path
    assert rendered.text.count(sentinel) == len(hits), "the secret name leaked outside a secretKeyRef"
    sensitive = [
        e
        for obj in rendered.objects
        for _container, e in walk_env(obj)
        if re.search(r"(^|_)(TOKEN|API_KEY|PASSWORD)$", e["name"])
    ]
    assert sensitive and all("value" not in e and "secretKeyRef" in e["valueFrom"] for e in sensitive)


def test_ngc_api_secret_alias_feeds_hf_token_optionally() -> None:
    # a nim-llm NGC secret holds NGC_API_KEY: a required HF_TOKEN key would stop the container
    env = env_of(scenario("nim-llm-compat").server)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "ngc-api",
        "key": "HF_TOKEN",
        "optional": True,
    }
    both = env_of(
        render({"model": {"ngcAPISecret": "ngc-api", "hfTokenSecret": {"name": "hf-token"}}}).server
    )
    assert both["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}, (
        "model.hfTokenSecret wins, and is required"
    )


def test_hf_home_and_xdg_cache_follow_the_cache_path() -> None:
    server = scenario("nim-llm-compat").server
    assert env_value(server, "NIM_CACHE_PATH") == "/model-store"
    assert env_value(server, "HF_HOME") == "/model-store/huggingface"
    assert env_value(server, "XDG_CACHE_HOME") == "/model-store/xdg"
    assert "/model-store" in mounts_by_path(server)
    override = render(
        {
            "model": {"nimCache": "/model-store/"},
            "env": [{"name": "HF_HOME", "value": "/hf"}],
            "extraEnv": [{"name": "XDG_CACHE_HOME", "value": "/xdg"}],
        }
    ).server
    names = [e["name"] for e in override["env"]]
    assert names.count("HF_HOME") == 1 and names.count("XDG_CACHE_HOME") == 1
    assert (env_value(override, "HF_HOME"), env_value(override, "XDG_CACHE_HOME")) == ("/hf", "/xdg")


# ---------------------------------------------------------------- networking and scaling


def test_service_port_is_named_http_openai() -> None:
    rendered = scenario("defaults")
    service = services(rendered)[0]
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http-openai" and port["port"] == 8000 and port["targetPort"] == "http-openai"
    assert service["spec"]["selector"] == rendered.workload["spec"]["selector"]["matchLabels"]


def test_pod_labels_keep_the_selector_and_carry_the_engine_type() -> None:
    rendered = scenario("everything")
    labels = rendered.workload["spec"]["template"]["metadata"]["labels"]
    selector = rendered.workload["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items(), "podLabels must not override the selector labels"
    assert labels["team"] == "llm"
    assert labels[ENGINE_TYPE_LABEL] == "vllm"
    assert ENGINE_TYPE_LABEL in scenario("defaults").workload["spec"]["template"]["metadata"]["labels"]


def test_inference_pool() -> None:
    rendered = scenario("gateway")
    pool = rendered.one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod_labels = rendered.workload["spec"]["template"]["metadata"]["labels"]
    match = pool["spec"]["selector"]["matchLabels"]
    assert match.items() <= pod_labels.items()
    assert match[ENGINE_TYPE_LABEL] == "vllm" == pod_labels[ENGINE_TYPE_LABEL]
    for pod in rendered.test_pods:
        assert not match.items() <= pod["metadata"]["labels"].items(), "the pool must not select test pods"
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "demo-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    default_ref = render({"inferencePool": {"enabled": True}}).one("InferencePool")["spec"][
        "endpointPickerRef"
    ]
    assert default_ref["name"] == f"{FULLNAME}-epp" and default_ref["failureMode"] == "FailClose"


def services(rendered: Rendered) -> tuple[Obj, Obj | None]:
    """The main Service and the StatefulSet's headless Service (None for a Deployment)."""
    by_name = {s["metadata"]["name"]: s for s in rendered.of_kind("Service")}
    main = by_name.pop(FULLNAME)
    headless = by_name.pop(f"{FULLNAME}-headless", None)
    assert not by_name, sorted(by_name)
    return main, headless


def test_statefulset_gets_a_headless_governing_service() -> None:
    rendered = scenario("defaults")
    main, headless = services(rendered)
    assert headless is not None
    assert rendered.workload["spec"]["serviceName"] == headless["metadata"]["name"]
    spec = headless["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    assert spec["selector"] == rendered.workload["spec"]["selector"]["matchLabels"]
    assert spec["ports"] == [
        {
            "name": "http-openai",
            "port": 8000,
            "targetPort": "http-openai",
            "protocol": "TCP",
            "appProtocol": "http",
        }
    ]
    assert "clusterIP" not in main["spec"] and "publishNotReadyAddresses" not in main["spec"]
    for name in ("deployment-cpu", "existing-claim-deployment", "hpa-full-metrics"):
        assert services(scenario(name))[1] is None, f"{name}: a Deployment needs no headless Service"
    long_name = render({"fullnameOverride": "x" * 63}).one("StatefulSet")["spec"]["serviceName"]
    assert len(long_name) <= 63 and long_name.endswith("-headless")


@pytest.mark.parametrize("name", ["gateway", "keda", "tls"])
def test_service_monitor_selects_only_the_main_service(name: str) -> None:
    rendered = scenario(name)
    match = rendered.one("ServiceMonitor")["spec"]["selector"]["matchLabels"]
    main, headless = services(rendered)
    assert match.items() <= main["metadata"]["labels"].items()
    assert headless is not None
    assert not match.items() <= headless["metadata"]["labels"].items(), "pods would be scraped twice"
    # service.labels cannot take the component label away from the main Service
    relabeled = render(
        {
            "metrics": {"serviceMonitor": {"enabled": True}},
            "service": {"labels": {"app.kubernetes.io/component": "x", "tier": "a"}},
        }
    )
    labels = services(relabeled)[0]["metadata"]["labels"]
    assert match.items() <= labels.items() and labels["tier"] == "a"


def test_service_monitor() -> None:
    monitor = scenario("gateway").one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = scenario("gateway").one("StatefulSet")["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["selector"]["matchLabels"] == {**selector, "app.kubernetes.io/component": "api"}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "http-openai",
        "path": "/v1/metrics",
        "scheme": "http",
        "interval": "15s",
        "scrapeTimeout": "10s",
    }


def test_ingress_network_policy_and_pdb() -> None:
    rendered = scenario("gateway")
    ingress = rendered.one("Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "3600"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": FULLNAME, "port": {"name": "http-openai"}}
    assert ingress["spec"]["tls"] == [{"hosts": ["nim.example.com"], "secretName": "nim-tls"}]

    policy = rendered.one("NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"] == rendered.workload["spec"]["selector"]["matchLabels"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert {"namespaceSelector": {"matchLabels": {"name": "gateway"}}} in rule["from"]
    test_labels = rendered.test_pods[0]["metadata"]["labels"]
    assert any(
        peer.get("podSelector", {}).get("matchLabels", {}).items() <= test_labels.items()
        and "podSelector" in peer
        for peer in rule["from"]
    ), "helm test pods must be allowed in"
    dns, allow_all = policy["egress"]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert allow_all == {}

    pdb = rendered.one("PodDisruptionBudget")["spec"]
    assert pdb == {"selector": {"matchLabels": policy["podSelector"]["matchLabels"]}, "maxUnavailable": 1}
    assert scenario("everything").one("PodDisruptionBudget")["spec"]["minAvailable"] == "50%"


def test_network_policy_without_open_egress_keeps_dns() -> None:
    egress = scenario("everything").one("NetworkPolicy")["spec"]["egress"]
    assert {} not in egress
    assert egress[0]["ports"][0]["port"] == 53
    assert egress[1] == {"ports": [{"port": 443}]}
    assert "from" not in scenario("everything").one("NetworkPolicy")["spec"]["ingress"][0], "[] = anyone"


@pytest.mark.parametrize("name", ["hpa", "hpa-full-metrics"])
def test_hpa_owns_replicas(name: str) -> None:
    rendered = scenario(name)
    hpa = rendered.one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert "replicas" not in rendered.workload["spec"]
    target = hpa["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": rendered.workload["kind"], "name": FULLNAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        1,
        SCENARIOS[name]["autoscaling"].get("maxReplicas", 4),
    )
    if name == "hpa":
        assert hpa["spec"]["metrics"] == [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "num_requests_waiting"},
                    "target": {"type": "AverageValue", "averageValue": "4"},
                },
            }
        ]
    else:
        assert hpa["spec"]["metrics"] == SCENARIOS[name]["autoscaling"]["metrics"]
        assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 600}}


@pytest.mark.parametrize(
    ("name", "metric", "metric_type", "threshold"),
    [
        ("keda", "sum(vllm:num_requests_waiting{", "AverageValue", "5"),  # waiting requests per replica
        ("keda-kv-cache", "avg(vllm:kv_cache_usage_perc{", "Value", "0.8"),  # a fraction 0-1
    ],
)
def test_keda_scaled_object(name: str, metric: str, metric_type: str, threshold: str) -> None:
    rendered = scenario(name)
    assert not rendered.of_kind("HorizontalPodAutoscaler")
    assert "replicas" not in rendered.workload["spec"]
    scaled = rendered.one("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": FULLNAME}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == metric_type
    meta = trigger["metadata"]
    assert meta["serverAddress"] == PROM
    assert meta["query"].startswith(metric)
    assert f'namespace="{NAMESPACE}"' in meta["query"] and f'service="{FULLNAME}"' in meta["query"]
    assert meta["threshold"] == threshold
    assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata must be strings"
    assert rendered.one("ServiceMonitor"), (
        "the query's `service` label comes from the ServiceMonitor's scrape"
    )


@pytest.mark.parametrize(
    ("prometheus", "threshold"),
    [
        ({"metric": "kvCache", "threshold": 0.9}, "0.9"),
        ({"metric": "kvCache", "threshold": "1"}, "1"),
        ({"metric": "queue", "threshold": 12}, "12"),
        # a custom query is the user's own scale: no 0-1 check, no ServiceMonitor needed
        ({"metric": "kvCache", "query": "avg(my_kv_percent)", "threshold": 80}, "80"),
    ],
)
def test_keda_threshold_from_values(prometheus: Obj, threshold: str) -> None:
    values: Obj = {"keda": {"enabled": True, "prometheus": {"serverAddress": PROM, **prometheus}}}
    if "query" not in prometheus:
        values["metrics"] = {"serviceMonitor": {"enabled": True}}
    (trigger,) = render(values).one("ScaledObject")["spec"]["triggers"]
    assert trigger["metadata"]["threshold"] == threshold
    if "query" in prometheus:
        assert trigger["metadata"]["query"] == prometheus["query"]


# ---------------------------------------------------------------- helm test hooks and NOTES


def test_helm_test_pods_call_models_completion_and_streaming_chat() -> None:
    rendered = scenario("defaults")
    pods = rendered.test_pods
    assert [p["metadata"]["name"] for p in pods] == [
        f"{FULLNAME}-test-{check}" for check in ("models", "completion", "chat")
    ]
    script = SMOKE_SCRIPT.read_text()
    for pod, check in zip(pods, ("models", "completion", "chat"), strict=True):
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
        (container,) = pod["spec"]["containers"]
        assert container["image"] == rendered.server["image"], "tests use the service's own image"
        assert container["command"] == ["python3", "-c", script, check]
        assert env_value(container, "NIM_TEST_BASE_URL") == f"http://{FULLNAME}.{NAMESPACE}.svc:8000"
        assert "NIM_TEST_MODEL" not in env_of(container), "no model.name: the script asks /v1/models"
        assert "NIM_API_KEY" not in env_of(container)
        assert env_value(container, "NVIDIA_VISIBLE_DEVICES") == "void", "no GPUs in a client pod"
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert "data: [DONE]" in script
    assert not render({"tests": {"enabled": False}}).test_pods


def test_notes_explain_how_to_reach_and_call_the_service() -> None:
    notes = scenario("secrets").notes
    assert f"kubectl -n {NAMESPACE} port-forward svc/{FULLNAME} 8000:8000" in notes
    assert f"rollout status statefulset/{FULLNAME}" in notes
    assert "/v1/models" in notes and "/v1/chat/completions" in notes
    assert f"helm test demo -n {NAMESPACE} --timeout 15m" in notes, "Helm's 5 minutes are too short"
    assert "--timeout 32m" in render({"tests": {"timeoutSeconds": 1800}}).notes
    assert "Authorization: Bearer $NIM_API_KEY" in notes
    assert "1800 s" in notes


# ---------------------------------------------------------------- the hook script, run for real


@dataclass(frozen=True)
class Hook:
    """What a rendered helm test pod runs: its script (after the YAML round trip) and its environment."""

    script: str
    env: dict[str, str]

    def run(self, check: str, **env: str) -> subprocess.CompletedProcess[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "HTTP", "http"))}
        return subprocess.run(
            [sys.executable, "-c", self.script, check],
            env={**base, **self.env, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def run_all(self, **env: str) -> list[str]:
        """Every check, as the three hook pods do; return their outputs (asserting exit status 0)."""
        outputs = []
        for check in ("models", "completion", "chat"):
            proc = self.run(check, **env)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            outputs.append(proc.stdout)
        return outputs


def hook(rendered: Rendered, base_url: str) -> Hook:
    """The rendered test pods' script and plain env, pointed at base_url instead of the Service."""
    container = rendered.test_pods[0]["spec"]["containers"][0]
    python, flag, script, _check = container["command"]
    assert (python, flag) == ("python3", "-c")
    assert script == SMOKE_SCRIPT.read_text()
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    # 50 s a request: the first completion on a loaded two-core CI machine took over 20 s
    return Hook(script, {**env, "NIM_TEST_BASE_URL": base_url, "NIM_TEST_TIMEOUT_SECONDS": "50"})


def test_hook_script_passes_against_the_real_service(base_url: str) -> None:
    out = hook(scenario("defaults"), base_url).run_all()
    assert out[0].startswith("PASS /v1/models")
    assert "data: [DONE]" in out[2]


@dataclass
class Stub:
    url: str
    port: int
    seen_auth: list[str | None]


class StubHandler(BaseHTTPRequestHandler):
    """Just enough of the OpenAI API for the hook script: health, models, completions, streaming chat."""

    api_key: str | None = None
    ready = True
    end_with_done = True
    seen_auth: list[str | None]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 503:
            self.send_header("Retry-After", "5")
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization")
        self.seen_auth.append(auth)
        if self.api_key and auth != f"Bearer {self.api_key}":
            self._json(401, {"error": {"message": "bad key", "type": "invalid_request_error", "code": None}})
            return False
        return True

    def do_GET(self) -> None:
        if self.path == "/v1/health/ready":
            self._json(200 if self.ready else 503, {"status": "ready" if self.ready else "loading"})
        elif self.path == "/v1/health/live":
            self._json(200, {"status": "live"})
        elif self.path == "/v1/models" and self._authorized():
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorized():
            return
        if body.get("model") != "stub-model":
            self._json(404, {"error": {"message": "no such model", "code": "model_not_found"}})
        elif self.path == "/v1/completions":
            self._json(200, {"object": "text_completion", "choices": [{"index": 0, "text": " Paris"}]})
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for piece in ("Hel", "lo"):
                delta = {"index": 0, "delta": {"content": piece}}
                chunk = {"object": "chat.completion.chunk", "choices": [delta]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.end_with_done:
                self.wfile.write(b"data: [DONE]\n\n")


@contextlib.contextmanager
def serve_stub(context: ssl.SSLContext | None = None, **options: Any) -> Iterator[Stub]:
    """A stub server on 127.0.0.1 (HTTPS with `context`); options override StubHandler attributes."""
    seen: list[str | None] = []
    handler = type("Handler", (StubHandler,), {**options, "seen_auth": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        yield Stub(f"{'https' if context else 'http'}://127.0.0.1:{port}", port, seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_hook_script_sends_the_first_api_key() -> None:
    with serve_stub(api_key="key-one") as stub:
        smoke = hook(scenario("secrets"), stub.url)
        assert smoke.env["NIM_TEST_MODEL"] == "llama"
        # NIM_API_KEY is what the pod's secretKeyRef resolves to
        smoke.run_all(NIM_API_KEY="key-one, key-two", NIM_TEST_MODEL="stub-model")
        assert set(stub.seen_auth) == {"Bearer key-one"}
        failed = smoke.run("models", NIM_API_KEY="wrong")
    assert failed.returncode == 1 and "FAIL: /v1/models answered 401" in failed.stdout


def test_hook_script_fails_a_stream_without_done() -> None:
    with serve_stub(end_with_done=False) as stub:
        failed = hook(scenario("defaults"), stub.url).run("chat")
    assert failed.returncode == 1
    assert "FAIL: stream did not end with data: [DONE]" in failed.stdout


# ---------------------------------------------------------------- TLS and mutual TLS, with real certificates


@dataclass(frozen=True)
class Pki:
    """tls.crt, tls.key and ca.crt in one directory, like a cert-manager kubernetes.io/tls Secret mount."""

    directory: Path

    def server_context(self, *, mutual: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.directory / "tls.crt", self.directory / "tls.key")
        if mutual:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.directory / "ca.crt")
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA and one certificate (127.0.0.1, no extended key usage: good for server and client auth)."""
    x509 = pytest.importorskip("cryptography.x509", reason="cryptography is needed to make test certificates")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def build(subject: str, public_key: Any, *, ca: bool) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    directory = tmp_path_factory.mktemp("tls")
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(build("test-ca", ca_key.public_key(), ca=True).public_bytes(pem))
    (directory / "tls.crt").write_bytes(build("nim", key.public_key(), ca=False).public_bytes(pem))
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (directory / "tls.key").write_bytes(private)
    return Pki(directory)


def render_tls(pki: Pki, mode: str, port: int) -> Rendered:
    """The chart with the TLS Secret "mounted" at the test certificates and the server on `port`."""
    tls = {"mode": mode, "secretName": "nim-tls", "mountPath": str(pki.directory)}
    return render({"tls": tls, "model": {"openaiPort": port, "name": "stub-model"}})


def run_probe(rendered: Rendered, probe: str) -> subprocess.CompletedProcess[str]:
    command = rendered.server[probe]["exec"]["command"]
    assert command[0] == "python3"
    return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=30)


def test_hook_script_over_tls_verifies_the_ca(pki: Pki) -> None:
    with serve_stub(pki.server_context(mutual=False)) as stub:
        rendered = render_tls(pki, "TLS", stub.port)
        smoke = hook(rendered, stub.url)
        assert smoke.env["NIM_TEST_CA_FILE"] == str(pki.directory / "ca.crt")
        smoke.run_all()


def test_mtls_exec_probes_and_hook_script_present_the_client_certificate(pki: Pki) -> None:
    with serve_stub(pki.server_context(mutual=True)) as stub:
        rendered = render_tls(pki, "MTLS", stub.port)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            result = run_probe(rendered, probe)
            assert result.returncode == 0, result.stderr
        smoke = hook(rendered, stub.url)
        assert smoke.env["NIM_TEST_CLIENT_CERT"] == str(pki.directory / "tls.crt")
        smoke.run_all()
        no_cert = ssl.create_default_context(cafile=pki.directory / "ca.crt")
        with pytest.raises(OSError):  # the stub really demands a client certificate
            urllib.request.urlopen(f"{stub.url}/v1/health/live", context=no_cert, timeout=10).read()


def test_mtls_readiness_probe_fails_while_not_ready(pki: Pki) -> None:
    with serve_stub(pki.server_context(mutual=True), ready=False) as stub:
        rendered = render_tls(pki, "MTLS", stub.port)
        assert run_probe(rendered, "livenessProbe").returncode == 0
        result = run_probe(rendered, "readinessProbe")
    assert result.returncode != 0 and "503" in result.stderr


# ---------------------------------------------------------------- values written for NVIDIA's nim-llm chart


def test_minimal_nim_llm_values_install_with_nvidias_meaning() -> None:
    rendered = scenario("nim-llm-minimal")
    workload, server = rendered.workload, rendered.server
    assert workload["kind"] == "Deployment", "statefulSet.enabled: false"
    assert workload["spec"]["replicas"] == 1
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "inference", "model.labels go on the pods"
    assert workload["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "nim-torch",
        "app.kubernetes.io/instance": RELEASE,
    }
    claim = rendered.one("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"], "persistence.accessMode"
    assert claim["spec"]["resources"]["requests"]["storage"] == "80Gi"
    assert volumes_by_name(rendered.pod_spec)["nim-cache"]["persistentVolumeClaim"] == {
        "claimName": f"{FULLNAME}-cache"
    }
    assert server["image"] == "nvcr.io/nim/meta/llama-3.1-8b-instruct:1.3.3"
    assert rendered.pod_spec["imagePullSecrets"] == [{"name": "ngc-secret"}]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    # model.name is the API's name for the model, not the model to load
    assert env_value(server, "NIM_SERVED_MODEL_NAME") == "meta/llama-3.1-8b-instruct"
    assert "NIM_MODEL_NAME" not in env_of(server)
    assert env_of(server)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ngc-api"
    for pod in rendered.test_pods:
        assert env_value(pod["spec"]["containers"][0], "NIM_TEST_MODEL") == "meta/llama-3.1-8b-instruct"
    assert "loads its embedded default model under that name" in rendered.notes


def test_full_nim_llm_values_install_with_nvidias_meaning() -> None:
    rendered = scenario("nim-llm-full")
    workload, server, pod_spec = rendered.workload, rendered.server, rendered.pod_spec
    spec = workload["spec"]
    assert workload["kind"] == "StatefulSet" and spec["replicas"] == 2
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "120Gi"
    assert claim["metadata"]["annotations"] == {"example.com/backup": "false"}
    assert not rendered.of_kind("PersistentVolumeClaim"), "one claim per replica, none shared"
    # the model to load from env (the multi-LLM NIM's way), the API name from model.name
    assert env_value(server, "NIM_MODEL_NAME") == "meta-llama/Llama-3.1-8B-Instruct"
    assert env_value(server, "NIM_SERVED_MODEL_NAME") == "llama-3.1-8b"
    assert env_value(server, "NIM_MAX_MODEL_LEN") == "16384"
    assert env_value(server, "NIM_SERVER_PORT") == "8080"
    assert env_value(server, "NIM_CACHE_PATH") == "/model-store"
    assert env_value(server, "NIM_LOG_LEVEL") == "DEBUG" and env_value(server, "NIM_JSONL_LOGGING") == "0"
    assert server["ports"] == [{"name": "http-openai", "containerPort": 8080, "protocol": "TCP"}]
    assert server["image"] == "nvcr.io/nim/nvidia/llm-nim:1.14.0" and server["imagePullPolicy"] == "Always"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert server["securityContext"]["readOnlyRootFilesystem"] is False, "containerSecurityContext"
    liveness, readiness, startup = (server[p] for p in ("livenessProbe", "readinessProbe", "startupProbe"))
    assert liveness["httpGet"]["path"] == "/v1/health/live" and liveness["failureThreshold"] == 4
    assert (readiness["initialDelaySeconds"], readiness["periodSeconds"]) == (25, 12)
    assert startup["failureThreshold"] == 360
    # nim-llm's map forms of extraVolumes, extraVolumeMounts and initContainers.extraInit
    assert volumes_by_name(pod_spec)["loras"] == {
        "name": "loras",
        "persistentVolumeClaim": {"claimName": "lora-adapters"},
    }
    assert mounts_by_path(server)["/loras"] == {"name": "loras", "mountPath": "/loras", "readOnly": True}
    assert [c["name"] for c in pod_spec["initContainers"]] == ["warm-cache"]
    assert pod_spec["serviceAccountName"] == "nim-sa"
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert workload["spec"]["template"]["metadata"]["labels"]["team"] == "inference"
    # service.name names the Service, and everything that reaches it
    names = sorted(s["metadata"]["name"] for s in rendered.of_kind("Service"))
    assert names == [f"{FULLNAME}-headless", "llama-svc"]
    ingress = rendered.one("Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "llama-svc", "port": {"name": "http-openai"}}
    for pod in rendered.test_pods:
        url = env_value(pod["spec"]["containers"][0], "NIM_TEST_BASE_URL")
        assert url == f"http://llama-svc.{NAMESPACE}.svc:8000"
    assert "port-forward svc/llama-svc 8000:8000" in rendered.notes
    monitor = rendered.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert "embedded default model" not in rendered.notes


def test_nim_llm_read_write_many_statefulset_shares_one_claim() -> None:
    rendered = render(
        {"statefulSet": {"enabled": True}, "replicaCount": 3, "persistence": {"accessMode": "ReadWriteMany"}}
    )
    assert rendered.workload["kind"] == "StatefulSet"
    assert "volumeClaimTemplates" not in rendered.workload["spec"]
    claim = rendered.one("PersistentVolumeClaim")
    assert claim["metadata"]["name"] == f"{FULLNAME}-cache" and claim["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]
    assert volumes_by_name(rendered.pod_spec)["nim-cache"]["persistentVolumeClaim"] == {
        "claimName": f"{FULLNAME}-cache"
    }
    # this chart's own accessModes keep a claim per replica
    ours = render({"persistence": {"accessModes": ["ReadWriteMany"]}})
    assert ours.workload["spec"]["volumeClaimTemplates"] and not ours.of_kind("PersistentVolumeClaim")


def test_nim_llm_host_path_and_nfs_caches() -> None:
    host = render({"persistence": {"enabled": False}, "hostPath": {"enabled": True, "path": "/raid/nim"}})
    assert volumes_by_name(host.pod_spec)["nim-cache"] == {
        "name": "nim-cache",
        "hostPath": {"path": "/raid/nim", "type": "DirectoryOrCreate"},
    }
    nfs = {"enabled": True, "server": "10.0.0.5", "path": "/exports/nim", "readOnly": True}
    shared = render({"persistence": {"enabled": False}, "nfs": nfs})
    assert volumes_by_name(shared.pod_spec)["nim-cache"] == {
        "name": "nim-cache",
        "nfs": {"server": "10.0.0.5", "path": "/exports/nim", "readOnly": True},
    }
    for rendered in (host, shared):
        kubernetes_validate.validate(rendered.workload, K8S_VERSION, strict=True)
    # as in nim-llm, a claim wins over hostPath
    both = render({"hostPath": {"enabled": True}})
    assert "hostPath" not in volumes_by_name(both.pod_spec).get("nim-cache", {})


def test_model_path_loads_and_served_name_is_a_deprecated_alias() -> None:
    loaded = render({"model": {"path": "Qwen/Qwen3-0.6B"}}).server
    assert env_value(loaded, "NIM_MODEL_NAME") == "Qwen/Qwen3-0.6B"
    # NIM 2.x's model-free launch: env NIM_MODEL_PATH names the model (alone, or agreeing with model.path)
    nim2 = {"env": [{"name": "NIM_MODEL_PATH", "value": "hf://Qwen/Qwen3-0.6B@main"}]}
    rendered = render({**nim2, "model": {"name": "qwen"}})
    assert env_value(rendered.server, "NIM_MODEL_PATH") == "hf://Qwen/Qwen3-0.6B@main"
    assert "embedded" not in rendered.notes  # the model to load is named: no warning
    agreeing = {"env": [{"name": "NIM_MODEL_PATH", "value": "hf://Qwen/Qwen3-0.6B"}]}
    assert env_value(render({**agreeing, "model": {"path": "Qwen/Qwen3-0.6B"}}).server, "NIM_MODEL_PATH")
    assert (
        render({}).pod_spec["enableServiceLinks"] is False
    )  # no NIM_* service links from a Service named nim
    assert "NIM_SERVED_MODEL_NAME" not in env_of(loaded)
    old = render({"model": {"servedName": "qwen"}})
    assert env_value(old.server, "NIM_SERVED_MODEL_NAME") == "qwen"
    assert "Deprecated: model.servedName" in old.notes
    assert "Deprecated" not in render({"model": {"name": "qwen"}}).notes


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param(
            {"model": {"legacyCompat": True}}, ["model.legacyCompat", "pre-1.0"], id="legacy-compat"
        ),
        pytest.param(
            {"model": {"ngcAPIKey": "nvapi-x"}}, ["model.ngcAPIKey", "Secret"], id="ngc-api-key-literal"
        ),
        pytest.param(
            {"multiNode": {"enabled": True}}, ["multiNode.enabled", "not supported"], id="multi-node"
        ),
        pytest.param(
            {"initContainers": {"ngcInit": {"imageName": "ngc-cli"}}},
            ["initContainers.ngcInit", "download-to-cache"],
            id="ngc-init",
        ),
        pytest.param(
            {
                "model": {"path": "Qwen/Qwen3-0.6B"},
                "env": [{"name": "NIM_MODEL_PATH", "value": "hf://meta-llama/Llama-3.1-8B-Instruct"}],
            },
            ["model.path (Qwen/Qwen3-0.6B) and env NIM_MODEL_PATH", "set one of them"],
            id="nim-2-model-path-disagrees",
        ),
        pytest.param(
            {"model": {"name": "a", "servedName": "b"}},
            ["model.name (a) and model.servedName (b"],
            id="names-disagree",
        ),
        pytest.param(
            {"persistence": {"enabled": False}, "nfs": {"enabled": True}},
            ["nfs.enabled needs nfs.server and nfs.path"],
            id="nfs-without-export",
        ),
        pytest.param({"livenessProbe": {"method": "script"}}, ["livenessProbe", "method"], id="probe-script"),
        pytest.param(
            {
                "ingress": {
                    "enabled": True,
                    "hosts": [{"paths": [{"path": "/", "pathType": "Prefix", "serviceType": "nemo"}]}],
                }
            },
            ["serviceType"],
            id="ingress-nemo-port",
        ),
        pytest.param({"model": {"nemo_port": 8006}}, ["nemo_port"], id="legacy-nemo-port"),
    ],
)
def test_nim_llm_keys_this_chart_cannot_honour_are_refused(values: Obj, expected: list[str]) -> None:
    message = render_error(values)
    for fragment in expected:
        assert fragment in message, message


# ---------------------------------------------------------------- NVIDIA Dynamo


def test_dynamo_runs_workers_and_a_router_in_front_of_them() -> None:
    rendered = scenario("dynamo")
    workers, router = rendered.workload, rendered.router
    assert router is not None and router["kind"] == "Deployment" and router["spec"]["replicas"] == 2
    assert workers["kind"] == "StatefulSet" and workers["spec"]["replicas"] == 3
    worker, api = rendered.server, router["spec"]["template"]["spec"]["containers"][0]
    assert worker["args"] == ["dynamo-worker"] and api["args"] == ["dynamo-router"]
    shared = {"NIM_DYNAMO_NAMESPACE": f"{RELEASE}-nim-torch", "NIM_DYNAMO_DISCOVERY": "etcd",
              "ETCD_ENDPOINTS": "http://etcd.dynamo.svc:2379"}  # fmt: skip
    for container in (worker, api):
        assert {name: env_value(container, name) for name in shared} == shared
    # each role gets the settings it reads: the API's (auth, TLS, tracing, the drain) only the router
    api_only = ("NIM_API_KEY", "NIM_SSL_MODE", "OTEL_EXPORTER_OTLP_ENDPOINT", "NIM_SERVER_PORT")
    assert all(name in env_of(api) and name not in env_of(worker) for name in api_only)
    assert env_value(api, "NIM_DYNAMO_ROUTER_MODE") == "kv"
    assert env_value(worker, "DYN_SYSTEM_PORT") == "8000" and "DYN_SYSTEM_PORT" not in env_of(api)
    # a worker has no HTTP API: its probes ask Dynamo's status server; the router's are the API's
    assert worker["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http-openai", "scheme": "HTTP"}
    for probe in ("readinessProbe", "startupProbe"):
        assert worker[probe]["httpGet"]["path"] == "/health"
        assert api[probe]["httpGet"] == {"path": "/v1/health/ready", "port": "http-openai", "scheme": "HTTPS"}
    # no GPU for the router; the Service (and so the ServiceMonitor and helm test) reaches it, not a worker
    assert "nvidia.com/gpu" not in json.dumps(api["resources"])
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    worker_labels = workers["spec"]["template"]["metadata"]["labels"]
    main, headless = services(rendered)
    selector = main["spec"]["selector"]
    assert selector.items() <= router_labels.items() and not selector.items() <= worker_labels.items()
    assert not workers["spec"]["selector"]["matchLabels"].items() <= router_labels.items()
    assert headless is not None and headless["spec"]["selector"].items() <= worker_labels.items()
    # the workers let the router in on the ports they pick, and stream back to it
    policy = rendered.one("NetworkPolicy")["spec"]
    router_peer = {"podSelector": {"matchLabels": main["spec"]["selector"]}}
    assert {"from": [router_peer]} in policy["ingress"] and {"to": [router_peer]} in policy["egress"]


def test_dynamo_is_off_by_default() -> None:
    rendered = scenario("defaults")
    assert rendered.router is None and "args" not in rendered.server
    assert not any(name.startswith(("NIM_DYNAMO", "DYN_", "ETCD")) for name in env_of(rendered.server))
