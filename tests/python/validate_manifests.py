#!/usr/bin/env python3
"""Offline checks of the Kubernetes manifests under deploy/kubernetes.

Every YAML document there is checked:

* core kinds (Deployment, Service, HorizontalPodAutoscaler, ConfigMap,
  NetworkPolicy) against
  the Kubernetes OpenAPI schemas bundled with the `kubernetes-validate` package,
  in strict mode (unknown fields fail), for each version in KUBERNETES_VERSIONS;
* custom kinds (InferencePool, ScaledObject) and the endpoint picker's plugin
  configuration against the JSON Schemas below, written from the published APIs;
* then the manifests against each other: the selectors pick the pods, the ports
  line up with the server's flags, the probes hit /health and /ready, the grace
  period covers preStop plus the drain, the autoscalers target the Deployment,
  and a network policy lets only pods it names reach the KV-event port.

`--self-test` breaks copies of the manifests in memory, one way at a time, and
fails unless every broken copy is rejected.

Needs: kubernetes-validate, jsonschema, pyyaml (no network).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

try:
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as e:  # pragma: no cover
    raise SystemExit(
        f"{e}: install the pinned packages first, e.g. "
        "pip install kubernetes-validate==1.37.0 jsonschema==4.26.0 PyYAML==6.0.3"
    )

ROOT = Path(__file__).resolve().parents[2]
MANIFEST_DIR = ROOT / "deploy" / "kubernetes"

# 1.30: the first release with the preStop `sleep` action on by default (beta;
# GA in 1.34). 1.32: the version the manifests are pinned to.
KUBERNETES_VERSIONS = ("1.30", "1.32")

CORE_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "NetworkPolicy"}

SERVER_CONTAINER = "gemma4"
HTTP_PORT_NAME = "http"
KV_EVENTS_PORT_NAME = "kv-events"
LIVENESS_PATH = "/health"
READINESS_PATH = "/ready"
WAITING_METRIC = "vllm:num_requests_waiting"
# The server's defaults for flags the Deployment may leave out.
DEFAULT_DRAIN_TIMEOUT = 30.0
DEFAULT_BLOCK_SIZE = 16

# ---------------------------------------------------------------------------
# Schemas of the custom kinds.

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_KEY = {
    "type": "string",
    "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$",
}
_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _NAME,
        "namespace": _NAME,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

# inference.networking.k8s.io/v1 InferencePool (Gateway API Inference Extension
# v1.0: selector, one target port and the endpoint picker reference are
# required; the picker's port is required when it is a Service).
INFERENCE_POOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": _OBJECT_META,
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "propertyNames": _LABEL_KEY,
                            "additionalProperties": _LABEL_VALUE,
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": _PORT_NUMBER},
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {
                            "type": "string",
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                            "maxLength": 63,
                        },
                        "name": _NAME,
                        "port": {
                            "type": "object",
                            "required": ["number"],
                            "additionalProperties": False,
                            "properties": {"number": _PORT_NUMBER},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    # kind defaults to Service, and a Service needs a port.
                    "if": {
                        "anyOf": [
                            {"not": {"required": ["kind"]}},
                            {"properties": {"kind": {"const": "Service"}}, "required": ["kind"]},
                        ]
                    },
                    "then": {"required": ["name", "port"]},
                },
            },
        },
    },
}

# keda.sh/v1alpha1 ScaledObject: the fields this repository uses, each with its
# published type; spec.scaleTargetRef.name and triggers[].type/metadata required.
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _OBJECT_META,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": _NAME,
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": _INT32,
                "cooldownPeriod": _INT32,
                "initialCooldownPeriod": _INT32,
                "idleReplicaCount": _INT32,
                "minReplicaCount": _INT32,
                "maxReplicaCount": _INT32,
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {"type": "object"},
                            },
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string", "minLength": 1},
                            "name": {"type": "string"},
                            "useCachedMetrics": {"type": "boolean"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": _NAME, "kind": {"type": "string"}},
                            },
                            # KEDA takes every trigger setting as a string.
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}

# The endpoint picker's EndpointPickerConfig, as carried in the ConfigMap.
EPP_CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "plugins", "schedulingProfiles"],
    "properties": {
        "apiVersion": {"type": "string", "pattern": r"^[a-z0-9.\-]+/v[0-9a-z]+$"},
        "kind": {"const": "EndpointPickerConfig"},
        "featureGates": {"type": "array", "items": {"type": "string"}},
        "plugins": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["type"],
                "additionalProperties": False,
                "properties": {
                    "type": {"type": "string", "minLength": 1},
                    "name": {"type": "string", "minLength": 1},
                    "parameters": {"type": "object"},
                },
            },
        },
        "schedulingProfiles": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "plugins"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "plugins": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["pluginRef"],
                            "additionalProperties": False,
                            "properties": {
                                "pluginRef": {"type": "string", "minLength": 1},
                                "weight": {"type": "number", "exclusiveMinimum": 0},
                            },
                        },
                    },
                },
            },
        },
        "dataLayer": {"type": "object"},
    },
}

PRECISE_PREFIX_PARAMS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["tokenProcessorConfig", "indexerConfig", "kvEventsConfig"],
    "properties": {
        "tokenProcessorConfig": {
            "type": "object",
            "required": ["blockSize"],
            "properties": {
                "blockSize": {"type": "integer", "minimum": 1},
                "hashSeed": {"type": "string"},
            },
        },
        "indexerConfig": {
            "type": "object",
            "required": ["tokenizersPoolConfig"],
            "properties": {
                "tokenizersPoolConfig": {
                    "type": "object",
                    "required": ["modelName"],
                    "properties": {"modelName": {"type": "string", "minLength": 1}},
                }
            },
        },
        "kvEventsConfig": {
            "type": "object",
            "required": ["topicFilter"],
            "properties": {
                "zmqEndpoint": {"type": "string"},
                "topicFilter": {"type": "string"},
                "concurrency": {"type": "integer", "minimum": 1},
                "discoverPods": {"type": "boolean"},
                "podDiscoveryConfig": {
                    "type": "object",
                    "properties": {
                        "podLabelSelector": {"type": "string"},
                        "podNamespace": {"type": "string"},
                        "socketPort": _PORT_NUMBER,
                    },
                },
            },
        },
    },
}

CUSTOM_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_SCHEMA,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT_SCHEMA,
}

# ---------------------------------------------------------------------------
# Loading and reporting.


@dataclass
class Doc:
    path: str  # relative to MANIFEST_DIR
    index: int  # position in its file
    body: dict[str, Any]

    @property
    def label(self) -> str:
        kind = self.body.get("kind", "?")
        name = (self.body.get("metadata") or {}).get("name", "?")
        return f"{self.path}#{self.index} {kind}/{name}"


@dataclass
class Report:
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str, why: str = "") -> bool:
        if ok:
            self.passed.append(what)
        else:
            self.failed.append(f"{what}: {why}" if why else what)
        return ok


def load_documents(directory: Path) -> list[Doc]:
    docs: list[Doc] = []
    files = sorted(p for p in directory.rglob("*") if p.suffix in (".yaml", ".yml"))
    if not files:
        raise SystemExit(f"no YAML files under {directory}")
    for path in files:
        with path.open(encoding="utf-8") as f:
            try:
                bodies = list(yaml.safe_load_all(f))
            except yaml.YAMLError as e:
                raise SystemExit(f"{path}: not valid YAML: {e}")
        for i, body in enumerate(b for b in bodies if b is not None):
            if not isinstance(body, dict):
                raise SystemExit(f"{path}: document {i} is not a mapping")
            docs.append(Doc(str(path.relative_to(directory)), i, body))
    return docs


def schema_error(e: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in e.absolute_path) or "(top)"
    return f"{where}: {e.message}"


# ---------------------------------------------------------------------------
# Server flags.


def flag_values(args: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` pairs (bare switches map to "")."""
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = str(args[i])
        if arg.startswith("--"):
            if "=" in arg:
                name, value = arg[2:].split("=", 1)
            elif i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
                name, value = arg[2:], str(args[i + 1])
                i += 1
            else:
                name, value = arg[2:], ""
            values[name] = value
        i += 1
    return values


def serve_flags() -> set[str] | None:
    """The long flags of `$GEMMA4_BIN serve --help`, or None without a binary to ask."""
    binary = os.environ.get("GEMMA4_BIN")
    if not binary:
        return None
    out = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"--([a-z][a-z0-9-]*)", out))


def endpoint_port(endpoint: str) -> int | None:
    tail = endpoint.rsplit(":", 1)
    try:
        return int(tail[1]) if len(tail) == 2 else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------
# The checks.


def check_schemas(docs: list[Doc], report: Report) -> None:
    for doc in docs:
        body = doc.body
        kind, api = body.get("kind"), body.get("apiVersion")
        if not report.check(
            isinstance(kind, str) and isinstance(api, str) and bool((body.get("metadata") or {}).get("name")),
            f"{doc.label}: has apiVersion, kind and metadata.name",
        ):
            continue
        if kind in CORE_KINDS:
            for version in KUBERNETES_VERSIONS:
                what = f"{doc.label}: Kubernetes {version} schema (strict)"
                try:
                    kubernetes_validate.validate(copy.deepcopy(body), version, strict=True)
                    report.check(True, what)
                except kubernetes_validate.ValidationError as e:
                    report.check(False, what, schema_error(e))
                except kubernetes_validate.SchemaNotFoundError as e:
                    report.check(False, what, e.message)
        elif (api, kind) in CUSTOM_SCHEMAS:
            what = f"{doc.label}: {api} {kind} schema"
            errors = sorted(
                jsonschema.Draft202012Validator(CUSTOM_SCHEMAS[(api, kind)]).iter_errors(body),
                key=lambda e: [str(p) for p in e.absolute_path],
            )
            report.check(not errors, what, "; ".join(schema_error(e) for e in errors[:3]))
        else:
            report.check(False, f"{doc.label}: known kind", f"no schema for {api} {kind}")


def find(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.body.get("kind") == kind]


def epp_configs(docs: list[Doc]) -> list[tuple[Doc, str, Any]]:
    """(ConfigMap, key, parsed config) for each EndpointPickerConfig in a ConfigMap."""
    found = []
    for doc in find(docs, "ConfigMap"):
        for key, text in (doc.body.get("data") or {}).items():
            if not isinstance(text, str) or "EndpointPickerConfig" not in text:
                continue
            try:
                found.append((doc, key, yaml.safe_load(text)))
            except yaml.YAMLError as e:
                found.append((doc, key, e))
    return found


def check_consistency(docs: list[Doc], report: Report) -> None:
    deployments = find(docs, "Deployment")
    if not report.check(len(deployments) == 1, "exactly one Deployment", f"found {len(deployments)}"):
        return
    dep = deployments[0]
    dep_name = dep.body["metadata"]["name"]
    spec = dep.body.get("spec") or {}
    pod = (spec.get("template") or {}).get("spec") or {}
    pod_labels: dict[str, str] = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    selector = ((spec.get("selector") or {}).get("matchLabels")) or {}

    def selects_pods(sel: dict[str, Any]) -> bool:
        return bool(sel) and all(pod_labels.get(k) == v for k, v in sel.items())

    report.check(
        pod_labels.get("app") == "gemma4", f"{dep.label}: pods labelled app=gemma4", f"labels {pod_labels}"
    )
    report.check(
        selects_pods(selector), f"{dep.label}: selector matches its pod labels", f"{selector} vs {pod_labels}"
    )

    containers = pod.get("containers") or []
    server = next((c for c in containers if c.get("name") == SERVER_CONTAINER), None)
    if not report.check(server is not None, f"{dep.label}: container {SERVER_CONTAINER!r}"):
        return
    ports = {p.get("name"): p.get("containerPort") for p in server.get("ports") or []}
    http_port = ports.get(HTTP_PORT_NAME)
    kv_port = ports.get(KV_EVENTS_PORT_NAME)
    report.check(
        http_port == 8000, f"{dep.label}: container port {HTTP_PORT_NAME} is 8000", f"got {http_port}"
    )
    report.check(
        kv_port == 5557, f"{dep.label}: container port {KV_EVENTS_PORT_NAME} is 5557", f"got {kv_port}"
    )

    def port_is_http(port: Any) -> bool:
        return port == HTTP_PORT_NAME or (port is not None and port == http_port)

    # Probes.
    for probe, path in (
        ("startupProbe", READINESS_PATH),
        ("livenessProbe", LIVENESS_PATH),
        ("readinessProbe", READINESS_PATH),
    ):
        get = (server.get(probe) or {}).get("httpGet") or {}
        report.check(
            get.get("path") == path and port_is_http(get.get("port")),
            f"{dep.label}: {probe} is GET {path} on the http port",
            f"got {get or 'no httpGet probe'}",
        )

    # Server flags against the container.
    args = [str(a) for a in server.get("args") or []]
    report.check(
        bool(args) and args[0] == "serve", f"{dep.label}: args start with 'serve'", f"args {args[:1]}"
    )
    flags = flag_values(args)
    report.check(
        flags.get("host") in ("0.0.0.0", "::"),
        f"{dep.label}: --host listens on all interfaces (probes come from the node)",
        f"--host {flags.get('host')!r}",
    )
    try:
        port_flag = int(flags.get("port", "8000"))
    except ValueError:
        port_flag = None
    report.check(
        port_flag == http_port,
        f"{dep.label}: --port equals the http container port",
        f"{port_flag} vs {http_port}",
    )
    model = flags.get("model", "")
    report.check(model.startswith("/models/"), f"{dep.label}: --model is under /models", f"--model {model!r}")
    served_name = flags.get("served-model-name", "")
    report.check(bool(served_name), f"{dep.label}: --served-model-name is set")
    known = serve_flags()
    if known is not None:
        unknown = sorted(set(flags) - known)
        report.check(not unknown, f"{dep.label}: every flag is one `gemma4 serve` takes", f"unknown {unknown}")

    # Model volume.
    mounts = {m.get("mountPath"): m for m in server.get("volumeMounts") or []}
    models_mount = mounts.get("/models") or {}
    report.check(models_mount.get("readOnly") is True, f"{dep.label}: /models is mounted read-only")
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    claim = (volumes.get(models_mount.get("name")) or {}).get("persistentVolumeClaim") or {}
    report.check(
        claim.get("claimName") == "gemma4-models" and claim.get("readOnly") is True,
        f"{dep.label}: /models comes read-only from PVC gemma4-models",
        f"got {claim or 'no persistentVolumeClaim'}",
    )

    # Security.
    pod_sc = pod.get("securityContext") or {}
    sc = server.get("securityContext") or {}
    report.check(
        sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True,
        f"{dep.label}: runAsNonRoot",
    )
    report.check(sc.get("readOnlyRootFilesystem") is True, f"{dep.label}: readOnlyRootFilesystem")
    report.check(sc.get("allowPrivilegeEscalation") is False, f"{dep.label}: allowPrivilegeEscalation false")
    report.check(
        "ALL" in ((sc.get("capabilities") or {}).get("drop") or []),
        f"{dep.label}: drops ALL capabilities",
    )

    # Resources.
    resources = server.get("resources") or {}
    for part in ("requests", "limits"):
        for res in ("cpu", "memory"):
            report.check(
                res in (resources.get(part) or {}),
                f"{dep.label}: resources.{part}.{res} is set",
            )

    # Drain: the grace period must outlast the preStop sleep plus the drain.
    pre_stop = (server.get("lifecycle") or {}).get("preStop") or {}
    report.check(
        "sleep" in pre_stop and "exec" not in pre_stop,
        f"{dep.label}: preStop uses the sleep action (the image has no shell)",
        f"preStop {pre_stop}",
    )
    sleep_s = (pre_stop.get("sleep") or {}).get("seconds", 0)
    try:
        drain_s = float(flags.get("drain-timeout", DEFAULT_DRAIN_TIMEOUT))
    except ValueError:
        drain_s = float("inf")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    report.check(
        isinstance(sleep_s, int) and grace > sleep_s + drain_s,
        f"{dep.label}: terminationGracePeriodSeconds ({grace}) > preStop sleep ({sleep_s}) + --drain-timeout ({drain_s:g})",
    )

    # KV events.
    kv_endpoint = flags.get("kv-events-endpoint", "")
    report.check(
        kv_endpoint.startswith("tcp://") and endpoint_port(kv_endpoint) == kv_port,
        f"{dep.label}: --kv-events-endpoint binds the kv-events port",
        f"{kv_endpoint!r} vs port {kv_port}",
    )
    topic = flags.get("kv-events-topic", "")
    topic_parts = topic.split("@")
    report.check(
        len(topic_parts) == 3 and topic_parts[0] == "kv" and topic_parts[2] == served_name,
        f"{dep.label}: --kv-events-topic is kv@<pod>@<served model name>",
        f"topic {topic!r}, served name {served_name!r}",
    )
    if "$(POD_IP)" in topic:
        env_names = {e.get("name") for e in server.get("env") or []}
        report.check("POD_IP" in env_names, f"{dep.label}: POD_IP is defined for the topic")
    try:
        block_size = int(flags.get("block-size", DEFAULT_BLOCK_SIZE))
    except ValueError:
        block_size = None

    # Service.
    for svc in find(docs, "Service"):
        s = svc.body.get("spec") or {}
        report.check(
            selects_pods(s.get("selector") or {}),
            f"{svc.label}: selector picks the gemma4 pods",
            f"{s.get('selector')}",
        )
        report.check(
            any(port_is_http(p.get("targetPort")) for p in s.get("ports") or []),
            f"{svc.label}: a port targets the http container port",
        )

    # InferencePool.
    pools = find(docs, "InferencePool")
    report.check(len(pools) == 1, "exactly one InferencePool", f"found {len(pools)}")
    for pool in pools:
        ps = pool.body.get("spec") or {}
        sel = (ps.get("selector") or {}).get("matchLabels") or {}
        report.check(
            selects_pods(sel),
            f"{pool.label}: selector matches the Deployment's pod labels",
            f"{sel} vs {pod_labels}",
        )
        numbers = [p.get("number") for p in ps.get("targetPorts") or []]
        report.check(
            numbers == [http_port],
            f"{pool.label}: targetPorts is the http container port",
            f"{numbers} vs {http_port}",
        )
        report.check(
            bool((ps.get("endpointPickerRef") or {}).get("name")), f"{pool.label}: names an endpoint picker"
        )

    # Endpoint picker configuration.
    configs = epp_configs(docs)
    report.check(
        len(configs) == 1, "exactly one EndpointPickerConfig in a ConfigMap", f"found {len(configs)}"
    )
    for cm, key, config in configs:
        where = f"{cm.label} [{key}]"
        if isinstance(config, Exception):
            report.check(False, f"{where}: parses as YAML", str(config))
            continue
        errors = list(jsonschema.Draft202012Validator(EPP_CONFIG_SCHEMA).iter_errors(config))
        if not report.check(
            not errors,
            f"{where}: EndpointPickerConfig schema",
            "; ".join(schema_error(e) for e in errors[:3]),
        ):
            continue
        plugins = config["plugins"]
        names = {p.get("name", p["type"]) for p in plugins}
        refs = [r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"]]
        missing = [r for r in refs if r not in names]
        report.check(not missing, f"{where}: every pluginRef names a plugin", f"undefined {missing}")
        types = {p["type"] for p in plugins}
        for wanted in ("precise-prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"):
            report.check(wanted in types, f"{where}: has {wanted}")
        precise = next((p for p in plugins if p["type"] == "precise-prefix-cache-scorer"), None)
        if precise is None:
            continue
        params = precise.get("parameters") or {}
        errors = list(jsonschema.Draft202012Validator(PRECISE_PREFIX_PARAMS_SCHEMA).iter_errors(params))
        if not report.check(
            not errors,
            f"{where}: precise-prefix-cache-scorer parameters",
            "; ".join(schema_error(e) for e in errors[:3]),
        ):
            continue
        events = params["kvEventsConfig"]
        discovery = events.get("podDiscoveryConfig") or {}
        report.check(
            events.get("discoverPods") is True and discovery.get("socketPort", 5557) == kv_port,
            f"{where}: subscribes to each pod's kv-events port",
            f"discoverPods {events.get('discoverPods')}, socketPort {discovery.get('socketPort', 5557)} vs {kv_port}",
        )
        label_sel = discovery.get("podLabelSelector")
        if label_sel is not None:
            pairs = dict(part.split("=", 1) for part in label_sel.split(",") if "=" in part)
            report.check(
                selects_pods(pairs), f"{where}: podLabelSelector picks the gemma4 pods", f"{label_sel!r}"
            )
        report.check(
            topic.startswith(events["topicFilter"]),
            f"{where}: topicFilter is a prefix of the server's topic",
            f"{events['topicFilter']!r} vs {topic!r}",
        )
        report.check(
            params["tokenProcessorConfig"]["blockSize"] == block_size,
            f"{where}: blockSize equals --block-size",
            f"{params['tokenProcessorConfig']['blockSize']} vs {block_size}",
        )
        report.check(
            params["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == served_name,
            f"{where}: tokenizer modelName equals --served-model-name",
        )

    check_network_policy(docs, report, selects_pods, http_port, kv_port)

    # Autoscalers.
    def targets_deployment(ref: dict[str, Any], kind_required: bool) -> bool:
        kind_ok = (
            ref.get("kind") == "Deployment"
            if kind_required
            else ref.get("kind", "Deployment") == "Deployment"
        )
        return kind_ok and ref.get("name") == dep_name and ref.get("apiVersion", "apps/v1") == "apps/v1"

    for hpa in find(docs, "HorizontalPodAutoscaler"):
        hs = hpa.body.get("spec") or {}
        report.check(
            targets_deployment(hs.get("scaleTargetRef") or {}, True),
            f"{hpa.label}: scales Deployment/{dep_name}",
            f"scaleTargetRef {hs.get('scaleTargetRef')}",
        )
        metric_names = [
            ((m.get("pods") or {}).get("metric") or {}).get("name")
            for m in hs.get("metrics") or []
            if m.get("type") == "Pods"
        ]
        report.check(
            WAITING_METRIC in metric_names,
            f"{hpa.label}: Pods metric {WAITING_METRIC}",
            f"got {metric_names}",
        )
    for so in find(docs, "ScaledObject"):
        ss = so.body.get("spec") or {}
        report.check(
            targets_deployment(ss.get("scaleTargetRef") or {}, False),
            f"{so.label}: scales Deployment/{dep_name}",
            f"scaleTargetRef {ss.get('scaleTargetRef')}",
        )
        queries = [
            (t.get("metadata") or {}).get("query", "")
            for t in ss.get("triggers") or []
            if t.get("type") == "prometheus"
        ]
        report.check(
            any(WAITING_METRIC in q for q in queries),
            f"{so.label}: a prometheus trigger queries {WAITING_METRIC}",
            f"queries {queries}",
        )


def check_network_policy(
    docs: list[Doc], report: Report, selects_pods: Callable[[dict[str, Any]], bool], http_port: Any, kv_port: Any
) -> None:
    """The KV-event port carries every prompt's token ids: a NetworkPolicy on
    the gemma4 pods must admit it only from named pods, and still admit the
    HTTP port."""
    policies = [
        p for p in find(docs, "NetworkPolicy")
        if selects_pods(((p.body.get("spec") or {}).get("podSelector") or {}).get("matchLabels") or {})
    ]
    if not report.check(bool(policies), "a NetworkPolicy selects the gemma4 pods"):
        return
    rules = [
        rule
        for p in policies
        if "Ingress" in ((p.body.get("spec") or {}).get("policyTypes") or [])
        for rule in (p.body["spec"].get("ingress") or [])
    ]

    def opens(rule: dict[str, Any], names: tuple[str, Any]) -> bool:
        ports = rule.get("ports")
        return ports is None or any(port.get("port") in names for port in ports)

    kv_rules = [r for r in rules if opens(r, (KV_EVENTS_PORT_NAME, kv_port))]
    report.check(
        bool(kv_rules)
        and all(
            r.get("from") and all(set(peer) == {"podSelector"} and peer["podSelector"] for peer in r["from"])
            for r in kv_rules
        ),
        "NetworkPolicy: only named pods reach the kv-events port",
        f"rules {kv_rules}",
    )
    report.check(
        any(opens(r, (HTTP_PORT_NAME, http_port)) for r in rules),
        "NetworkPolicy: the http port is reachable",
    )


def validate(docs: list[Doc]) -> Report:
    report = Report()
    check_schemas(docs, report)
    check_consistency(docs, report)
    return report


# ---------------------------------------------------------------------------
# Self-test: each mutation must make validation fail.


def one(docs: list[Doc], kind: str) -> dict[str, Any]:
    matches = find(docs, kind)
    if len(matches) != 1:
        raise LookupError(f"expected one {kind}, found {len(matches)}")
    return matches[0].body


def server_container(docs: list[Doc]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == SERVER_CONTAINER)


def set_flag(docs: list[Doc], name: str, value: str) -> None:
    args = server_container(docs)["args"]
    for i, a in enumerate(args):
        if a == f"--{name}" or str(a).startswith(f"--{name}="):
            args[i] = f"--{name}={value}"
            if a == f"--{name}":
                del args[i + 1]
            return
    args.append(f"--{name}={value}")


def edit_epp(docs: list[Doc], change: Callable[[dict[str, Any]], None]) -> None:
    cm, key, config = epp_configs(docs)[0]
    change(config)
    cm.body["data"][key] = yaml.safe_dump(config)


def precise(config: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]


def ports_of(docs: list[Doc]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in server_container(docs)["ports"]}


def _pool(d: list[Doc]) -> dict[str, Any]:
    return one(d, "InferencePool")["spec"]


def _hpa(d: list[Doc]) -> dict[str, Any]:
    return one(d, "HorizontalPodAutoscaler")


def _scaled(d: list[Doc]) -> dict[str, Any]:
    return one(d, "ScaledObject")["spec"]


def _pod(d: list[Doc]) -> dict[str, Any]:
    return one(d, "Deployment")["spec"]["template"]["spec"]


def _models_mount(d: list[Doc]) -> dict[str, Any]:
    return next(m for m in server_container(d)["volumeMounts"] if m["mountPath"] == "/models")


def _discovery(c: dict[str, Any]) -> dict[str, Any]:
    return precise(c)["kvEventsConfig"]["podDiscoveryConfig"]


def _policy(d: list[Doc]) -> dict[str, Any]:
    return one(d, "NetworkPolicy")["spec"]


def _unknown_kind(d: list[Doc]) -> None:
    d.append(
        Doc("extra.yaml", 0, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
    )


# (what is broken, a piece of the failure it must cause, how to break it)
MUTATIONS: list[tuple[str, str, Callable[[list[Doc]], None]]] = [
    (
        "http container port 8000 -> 8080",
        "--port equals the http container port",
        lambda d: ports_of(d)["http"].__setitem__("containerPort", 8080),
    ),
    ("--port 8001", "--port equals the http container port", lambda d: set_flag(d, "port", "8001")),
    ("--host 127.0.0.1", "--host listens on all interfaces", lambda d: set_flag(d, "host", "127.0.0.1")),
    (
        "InferencePool targetPort 9000",
        "targetPorts is the http container port",
        lambda d: _pool(d)["targetPorts"][0].__setitem__("number", 9000),
    ),
    (
        "InferencePool targetPort as a string",
        "is not of type 'integer'",
        lambda d: _pool(d)["targetPorts"][0].__setitem__("number", "8000"),
    ),
    (
        "InferencePool two targetPorts",
        "is too long",
        lambda d: _pool(d)["targetPorts"].append({"number": 8001}),
    ),
    (
        "InferencePool selector app=other",
        "InferencePool/gemma4: selector matches",
        lambda d: _pool(d)["selector"]["matchLabels"].__setitem__("app", "other"),
    ),
    (
        "InferencePool without endpointPickerRef",
        "'endpointPickerRef' is a required property",
        lambda d: _pool(d).pop("endpointPickerRef"),
    ),
    (
        "InferencePool picker Service without port",
        "'port' is a required property",
        lambda d: _pool(d)["endpointPickerRef"].pop("port"),
    ),
    (
        "InferencePool with v1alpha2's targetPortNumber",
        "'targetPortNumber' was unexpected",
        lambda d: _pool(d).__setitem__("targetPortNumber", 8000),
    ),
    (
        "Service selector app=other",
        "Service/gemma4: selector picks the gemma4 pods",
        lambda d: one(d, "Service")["spec"]["selector"].__setitem__("app", "other"),
    ),
    (
        "Service targetPort 9000",
        "a port targets the http container port",
        lambda d: one(d, "Service")["spec"]["ports"][0].__setitem__("targetPort", 9000),
    ),
    (
        "Deployment without spec.selector",
        "'selector' is a required property",
        lambda d: one(d, "Deployment")["spec"].pop("selector"),
    ),
    (
        "misspelt container field",
        "'imagePulPolicy' was unexpected",
        lambda d: server_container(d).__setitem__("imagePulPolicy", "Always"),
    ),
    (
        "replicas as a string",
        "spec.replicas",
        lambda d: one(d, "Deployment")["spec"].__setitem__("replicas", "2"),
    ),
    (
        "no readinessProbe",
        "readinessProbe is GET /ready",
        lambda d: server_container(d).pop("readinessProbe"),
    ),
    (
        "livenessProbe on /healthz",
        "livenessProbe is GET /health",
        lambda d: server_container(d)["livenessProbe"]["httpGet"].__setitem__("path", "/healthz"),
    ),
    (
        "readinessProbe on /health",
        "readinessProbe is GET /ready",
        lambda d: server_container(d)["readinessProbe"]["httpGet"].__setitem__("path", "/health"),
    ),
    (
        "startupProbe on port 9000",
        "startupProbe is GET /ready",
        lambda d: server_container(d)["startupProbe"]["httpGet"].__setitem__("port", 9000),
    ),
    (
        "grace period 60",
        "terminationGracePeriodSeconds (60)",
        lambda d: _pod(d).__setitem__("terminationGracePeriodSeconds", 60),
    ),
    ("--drain-timeout 300", "--drain-timeout (300)", lambda d: set_flag(d, "drain-timeout", "300")),
    (
        "preStop exec sleep",
        "preStop uses the sleep action",
        lambda d: server_container(d)["lifecycle"].__setitem__(
            "preStop", {"exec": {"command": ["sleep", "10"]}}
        ),
    ),
    (
        "readOnlyRootFilesystem false",
        ": readOnlyRootFilesystem",
        lambda d: server_container(d)["securityContext"].__setitem__("readOnlyRootFilesystem", False),
    ),
    (
        "runAsNonRoot false",
        ": runAsNonRoot",
        lambda d: _pod(d)["securityContext"].__setitem__("runAsNonRoot", False),
    ),
    (
        "capabilities not dropped",
        "drops ALL capabilities",
        lambda d: server_container(d)["securityContext"].pop("capabilities"),
    ),
    (
        "no memory limit",
        "resources.limits.memory is set",
        lambda d: server_container(d)["resources"]["limits"].pop("memory"),
    ),
    ("models mounted read-write", "/models is mounted read-only", lambda d: _models_mount(d).pop("readOnly")),
    (
        "kv-events container port 5556",
        "--kv-events-endpoint binds the kv-events port",
        lambda d: ports_of(d)["kv-events"].__setitem__("containerPort", 5556),
    ),
    (
        "topic names another model",
        "--kv-events-topic is kv@<pod>@<served model name>",
        lambda d: set_flag(d, "kv-events-topic", "kv@$(POD_IP):8000@other"),
    ),
    (
        "EPP socketPort 5556",
        "subscribes to each pod's kv-events port",
        lambda d: edit_epp(d, lambda c: _discovery(c).__setitem__("socketPort", 5556)),
    ),
    (
        "EPP blockSize 64",
        "blockSize equals --block-size",
        lambda d: edit_epp(d, lambda c: precise(c)["tokenProcessorConfig"].__setitem__("blockSize", 64)),
    ),
    (
        "EPP pluginRef to an undefined plugin",
        "every pluginRef names a plugin",
        lambda d: edit_epp(d, lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "nope"})),
    ),
    (
        "EPP without queue-scorer",
        "has queue-scorer",
        lambda d: edit_epp(
            d, lambda c: c.__setitem__("plugins", [p for p in c["plugins"] if p["type"] != "queue-scorer"])
        ),
    ),
    (
        "EPP podLabelSelector app=vllm",
        "podLabelSelector picks the gemma4 pods",
        lambda d: edit_epp(d, lambda c: _discovery(c).__setitem__("podLabelSelector", "app=vllm")),
    ),
    (
        "EPP tokenizer for another model",
        "tokenizer modelName equals --served-model-name",
        lambda d: edit_epp(
            d, lambda c: precise(c)["indexerConfig"]["tokenizersPoolConfig"].__setitem__("modelName", "x")
        ),
    ),
    (
        "HPA targets Deployment/other",
        "HorizontalPodAutoscaler/gemma4: scales Deployment/gemma4",
        lambda d: _hpa(d)["spec"]["scaleTargetRef"].__setitem__("name", "other"),
    ),
    (
        "HPA autoscaling/v2beta2 (removed in 1.26)",
        "Couldn't find schema",
        lambda d: _hpa(d).__setitem__("apiVersion", "autoscaling/v2beta2"),
    ),
    (
        "HPA on another metric",
        "Pods metric vllm:num_requests_waiting",
        lambda d: _hpa(d)["spec"]["metrics"][0]["pods"]["metric"].__setitem__(
            "name", "vllm:num_requests_running"
        ),
    ),
    (
        "ScaledObject without triggers",
        "'triggers' is a required property",
        lambda d: _scaled(d).pop("triggers"),
    ),
    (
        "ScaledObject threshold as a number",
        "is not of type 'string'",
        lambda d: _scaled(d)["triggers"][0]["metadata"].__setitem__("threshold", 4),
    ),
    (
        "ScaledObject targets Deployment/other",
        "ScaledObject/gemma4: scales Deployment/gemma4",
        lambda d: _scaled(d)["scaleTargetRef"].__setitem__("name", "other"),
    ),
    (
        "kv-events port open to every peer",
        "only named pods reach the kv-events port",
        lambda d: _policy(d)["ingress"][1].pop("from"),
    ),
    (
        "kv-events port open to a namespace",
        "only named pods reach the kv-events port",
        lambda d: _policy(d)["ingress"][1]["from"].append({"namespaceSelector": {}}),
    ),
    (
        "no NetworkPolicy",
        "a NetworkPolicy selects the gemma4 pods",
        lambda d: d.remove(find(d, "NetworkPolicy")[0]),
    ),
    (
        "NetworkPolicy without the http port",
        "the http port is reachable",
        lambda d: _policy(d)["ingress"].pop(0),
    ),
    ("unknown kind", "no schema for example.com/v1 Widget", _unknown_kind),
]


def self_test(docs: list[Doc]) -> int:
    baseline = validate(docs)
    if baseline.failed:
        print("FAIL the unmodified manifests do not validate:")
        for line in baseline.failed:
            print(f"  {line}")
        return 1
    print(f"ok   unmodified manifests pass ({len(baseline.passed)} checks)")
    passed = failed = skipped = 0
    for title, expected, mutate in MUTATIONS:
        mutated = copy.deepcopy(docs)
        try:
            mutate(mutated)
        except LookupError as e:  # an optional manifest that is not there
            print(f"skip {title}: {e}")
            skipped += 1
            continue
        report = validate(mutated)
        hit = next((line for line in report.failed if expected in line), None)
        if hit:
            print(f"ok   {title}: rejected ({hit})")
            passed += 1
        elif report.failed:
            print(f"FAIL {title}: rejected, but not for {expected!r}: {report.failed[0]}")
            failed += 1
        else:
            print(f"FAIL {title}: accepted")
            failed += 1
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir", type=Path, default=MANIFEST_DIR, help="manifest folder (default: %(default)s)"
    )
    parser.add_argument(
        "--self-test", action="store_true", help="check that broken copies of the manifests are rejected"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print failures and the summary only")
    args = parser.parse_args()

    docs = load_documents(args.dir)
    print(
        f"{len(docs)} documents under {args.dir}; Kubernetes schemas {', '.join(KUBERNETES_VERSIONS)} "
        f"(kubernetes-validate {kubernetes_validate.__version__}, strict)"
    )
    if args.self_test:
        return self_test(docs)

    report = validate(docs)
    if not args.quiet:
        for line in report.passed:
            print(f"ok   {line}")
    for line in report.failed:
        print(f"FAIL {line}")
    print(f"{len(report.passed)} passed, {len(report.failed)} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
