"""Render and check the kvloom Helm chart offline, for the tests/test_helm_*.py suites.

Engine: Helm's own Go library (Helm v4.2.3) through the PyPI package `helm-python-sdk`
(0.2.2, import name `helm_python`), which bundles `libhelm_c.so` and calls it with ctypes:
no `helm` binary, no download at run time, no cluster. `render()` is what `helm template`
does (schema validation of the values included); `lint()` is `helm lint`. There is no
fallback renderer: the package ships a manylinux x86_64 wheel only, so on other platforms
the chart tests are skipped with that reason, and on x86_64 Linux a missing package is an
error.

Kubernetes objects are validated with `kubernetes-validate` (JSON schemas of each
Kubernetes release bundled in the package). The RayCluster custom resource is validated
against helm/schemas/raycluster.ray.io_v1.trimmed.schema.json, and each pod template inside
it as a core/v1 PodTemplate.
"""

from __future__ import annotations

import base64
import json
import platform
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "helm" / "kvloom"
RAYCLUSTER_SCHEMA = REPO / "helm" / "schemas" / "raycluster.ray.io_v1.trimmed.schema.json"
GOLDEN_DIR = REPO / "tests" / "golden" / "helm"

RELEASE = "kvloom"
NAMESPACE = "llm"
# The chart's floor (native gRPC probes are GA in 1.27) and the newest bundled release.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
# Named value sets: the chart defaults and the two shipped examples.
VALUE_SETS = {
    "default": None,
    "single-gpu": CHART_DIR / "examples" / "single-gpu.yaml",
    "tp2-dcp2": CHART_DIR / "examples" / "tp2-dcp2.yaml",
}
NOTES = f"{CHART_DIR.name}/templates/NOTES.txt"


def helm():
    """The `helm_python` module; skips off x86_64 Linux, where no wheel exists."""
    try:
        import helm_python
    except ImportError as error:
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            raise ImportError(
                "the Helm chart tests need helm-python-sdk (pip install helm-python-sdk==0.2.2)"
            ) from error
        pytest.skip("helm-python-sdk ships only a manylinux x86_64 wheel")
    return helm_python


def load_values(name: str) -> dict[str, Any]:
    path = VALUE_SETS[name]
    return {} if path is None else yaml.safe_load(path.read_text())


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template kvloom helm/kvloom -n llm -f ...`."""
    with helm().Chart.load(CHART_DIR) as chart:
        return chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE)


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return helm().lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)


def merged_values(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Chart defaults coalesced with `values` by Helm (null deletes a key, as in Helm)."""
    with helm().Chart.load(CHART_DIR) as chart:
        return chart.merge_values(values or {})


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object the render produced (NOTES.txt left out)."""
    objects = []
    for path in sorted(rendered):
        if path != NOTES:
            objects += [doc for doc in yaml.safe_load_all(rendered[path]) if doc]
    return objects


def manifest_text(rendered: dict[str, str]) -> str:
    """The render as one multi-document YAML stream, in the layout `helm template` prints."""
    parts = []
    for path in sorted(rendered):
        text = rendered[path].strip("\n")
        if path == NOTES or not text.strip():
            continue
        for document in text.split("\n---\n"):
            document = document.removeprefix("---\n").strip("\n")
            if document.strip():
                parts.append(f"---\n# Source: {path}\n{document}\n")
    return "".join(parts)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [
        c for c in pod_spec["containers"] + pod_spec.get("initContainers", []) if c["name"] == name
    ]
    assert len(matches) == 1, f"expected one container {name!r}"
    return matches[0]


def secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def pod_templates(raycluster: dict[str, Any]) -> list[dict[str, Any]]:
    spec = raycluster["spec"]
    return [spec["headGroupSpec"]["template"]] + [
        g["template"] for g in spec.get("workerGroupSpecs", [])
    ]


def _check_pod_references(template: dict[str, Any], where: str) -> None:
    """What schemas cannot see: every volumeMount names a pod volume, names are unique."""
    spec = template["spec"]
    volumes = [v["name"] for v in spec.get("volumes", [])]
    assert len(volumes) == len(set(volumes)), f"{where}: duplicate volume names {volumes}"
    containers = spec["containers"] + spec.get("initContainers", [])
    names = [c["name"] for c in containers]
    assert len(names) == len(set(names)), f"{where}: duplicate container names {names}"
    for c in containers:
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes, (
                f"{where}/{c['name']}: mount of unknown volume {mount['name']!r}"
            )


def validate_raycluster(obj: dict[str, Any], kube_version: str) -> None:
    """The fields KubeRay's CRD defines, the webhook's rules, and each pod template."""
    schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
    jsonschema.Draft7Validator(schema).validate(obj)
    name = obj["metadata"]["name"]
    groups = obj["spec"].get("workerGroupSpecs", [])
    assert len({g["groupName"] for g in groups}) == len(groups), f"{name}: duplicate groupName"
    for group in groups:
        low, want, high = group["minReplicas"], group.get("replicas", 0), group["maxReplicas"]
        assert 0 <= low <= want <= high, (
            f"{name}/{group['groupName']}: replicas {low}<={want}<={high}"
        )
    for index, template in enumerate(pod_templates(obj)):
        where = f"RayCluster {name} pod template {index}"
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{name}-{index}"},
            "template": template,
        }
        kubernetes_validate.validate(wrapped, kube_version, strict=True)
        _check_pod_references(template, where)


def validate_object(obj: dict[str, Any], kube_version: str) -> None:
    """Raises if `obj` is not a valid object for Kubernetes `kube_version` (or KubeRay)."""
    if obj["apiVersion"] == "ray.io/v1":
        validate_raycluster(obj, kube_version)
        return
    kubernetes_validate.validate(obj, kube_version, strict=True)
    template = obj.get("spec", {}).get("template")
    if template is not None:
        _check_pod_references(template, f"{obj['kind']} {obj['metadata']['name']}")
