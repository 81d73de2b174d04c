"""values.schema.json rejects bad values, accepts the shipped ones, and values.yaml documents every key.

Each bad value is checked twice: by Helm itself (helm-python-sdk's render, the code path of
`helm install`/`helm template`, which validates the coalesced values against the schema
before rendering) and by the Python `jsonschema` Draft-7 validator on Helm's coalesced
values, so the schema means the same to both.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml
from helm_render import CHART_DIR, VALUE_SETS, helm, load_values, merged_values, render

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())

# (case id, values overriding the defaults, JSON pointer of the error, text Helm's message
# must also hold). Both validators report the same pointer, Helm as "at '<pointer>'".
BAD_VALUES = [
    ("tp-zero", {"engine": {"tp": 0}}, "/engine/tp", "minimum"),
    ("tp-negative", {"engine": {"tp": -2}}, "/engine/tp", "minimum"),
    ("tp-fraction", {"engine": {"tp": 1.5}}, "/engine/tp", "want integer"),
    ("tp-string", {"engine": {"tp": "2"}}, "/engine/tp", "want integer"),
    ("dcp-zero", {"engine": {"dcp": 0}}, "/engine/dcp", "minimum"),
    ("dtype-unknown", {"engine": {"dtype": "fp8"}}, "/engine/dtype", "must be one of"),
    ("dtype-alias", {"engine": {"dtype": "bf16"}}, "/engine/dtype", "must be one of"),
    ("model-missing", {"model": {"dir": None}}, "/model", "missing property 'dir'"),
    ("model-empty", {"model": {"dir": ""}}, "/model/dir", "minLength"),
    ("model-absolute", {"model": {"dir": "/models/x"}}, "/model/dir", "does not match pattern"),
    ("model-escapes", {"model": {"dir": "../etc"}}, "/model/dir", "'not' failed"),
    ("max-model-len-zero", {"engine": {"maxModelLen": 0}}, "/engine/maxModelLen", "minimum"),
    (
        "block-size-not-power-of-two",
        {"engine": {"blockSize": 12}},
        "/engine/blockSize",
        "must be one of",
    ),
    (
        "gpu-memory-zero",
        {"engine": {"gpuMemoryUtilization": 0}},
        "/engine/gpuMemoryUtilization",
        "exclusiveMinimum",
    ),
    (
        "gpu-memory-above-one",
        {"engine": {"gpuMemoryUtilization": 1.2}},
        "/engine/gpuMemoryUtilization",
        "maximum",
    ),
    ("max-num-seqs-zero", {"engine": {"maxNumSeqs": 0}}, "/engine/maxNumSeqs", "minimum"),
    (
        "spec-method-unknown",
        {"engine": {"speculativeConfig": {"method": "medusa", "num_speculative_tokens": 2}}},
        "/engine/speculativeConfig/method",
        "must be one of",
    ),
    (
        "spec-tokens-zero",
        {"engine": {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 0}}},
        "/engine/speculativeConfig/num_speculative_tokens",
        "minimum",
    ),
    (
        "spec-key-unknown",
        {"engine": {"speculativeConfig": {"method": "ngram", "num_speculative_token": 2}}},
        "/engine/speculativeConfig",
        "'num_speculative_token' not allowed",
    ),
    (
        "engine-key-misspelled",
        {"engine": {"tensorParallelSize": 2}},
        "/engine",
        "'tensorParallelSize' not allowed",
    ),
    (
        "extra-args-not-strings",
        {"engine": {"extraArgs": ["--seed", 0]}},
        "/engine/extraArgs/1",
        "want string",
    ),
    ("gpus-per-pod-zero", {"worker": {"gpusPerPod": 0}}, "/worker/gpusPerPod", "minimum"),
    ("replicas-negative", {"replicaCount": -1}, "/replicaCount", "minimum"),
    ("port-out-of-range", {"server": {"port": 70000}}, "/server/port", "maximum"),
    (
        "storage-unknown",
        {"model": {"storage": {"type": "nfs"}}},
        "/model/storage/type",
        "must be one of",
    ),
    (
        "existing-claim-unnamed",
        {"model": {"storage": {"type": "existingClaim"}}},
        "/model/storage/existingClaim",
        "minLength",
    ),
    (
        "download-without-repo",
        {"model": {"download": {"enabled": True, "repo": ""}}},
        "/model/download/repo",
        "does not match",
    ),
    ("tls-without-certificate", {"tls": {"enabled": True}}, "/tls", "/tls/existingSecret"),
    ("tls-cert-without-key", {"tls": {"enabled": True, "cert": "PEM"}}, "/tls", "/tls/key"),
    ("auth-without-token", {"auth": {"enabled": True}}, "/auth", "/auth/token"),
    (
        "auth-token-too-short",
        {"auth": {"enabled": True, "token": "abc"}},
        "/auth",
        "/auth/token': minLength: got 3",
    ),
    ("probe-type-unknown", {"probes": {"type": "http"}}, "/probes/type", "must be one of"),
    (
        "probe-threshold-zero",
        {"probes": {"startup": {"failureThreshold": 0}}},
        "/probes/startup/failureThreshold",
        "minimum",
    ),
    (
        "shm-size-garbage",
        {"worker": {"shmSize": "lots"}},
        "/worker/shmSize",
        "does not match pattern",
    ),
    (
        "ray-start-param-not-string",
        {"head": {"rayStartParams": {"num-cpus": 4}}},
        "/head/rayStartParams/num-cpus",
        "want string",
    ),
    ("image-tag-number", {"image": {"tag": 1.0}}, "/image/tag", "want string"),
    ("image-repository-empty", {"image": {"repository": ""}}, "/image/repository", "minLength"),
    ("service-type-unknown", {"service": {"type": "Ingress"}}, "/service/type", "must be one of"),
    (
        "pdb-negative",
        {"podDisruptionBudget": {"maxUnavailable": -1}},
        "/podDisruptionBudget/maxUnavailable",
        "minimum",
    ),
    ("top-level-typo", {"replicas": 2}, "", "'replicas' not allowed"),
]
CASES = [pytest.param(*case[1:], id=case[0]) for case in BAD_VALUES]


def test_schema_is_valid_draft7():
    jsonschema.Draft7Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("values, pointer, detail", CASES)
def test_helm_rejects_bad_values(values, pointer, detail):
    with pytest.raises(helm().HelmValuesError) as raised:
        render(values)
    message = str(raised.value)
    assert "values don't meet the specifications of the schema" in message
    assert f"at '{pointer}'" in message, message
    assert detail in message, message


@pytest.mark.parametrize("values, pointer, detail", CASES)
def test_jsonschema_rejects_bad_values(values, pointer, detail):
    errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(merged_values(values)))
    locations = {"".join(f"/{part}" for part in error.absolute_path) for error in errors}
    assert locations == {pointer}, [error.message for error in errors]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_shipped_values_pass(name):
    jsonschema.Draft7Validator(SCHEMA).validate(merged_values(load_values(name)))
    assert render(load_values(name))


def _key_lines(text):
    """(line index, dotted path) of every mapping key in values.yaml, list items excluded."""
    stack: list[tuple[int, str]] = []
    for index, line in enumerate(text.splitlines()):
        match = re.match(r"^( *)([A-Za-z0-9_.-]+):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(2)))
        yield index, ".".join(key for _, key in stack)


def _schema_at(path):
    schema = SCHEMA
    for key in path.split("."):
        properties = schema.get("properties")
        if properties is None or key not in properties:
            return None
        schema = properties[key]
    return schema


def test_values_yaml_documents_every_key():
    """Every key the schema knows has a comment right above it, sections excepted."""
    text = (CHART_DIR / "values.yaml").read_text()
    lines = text.splitlines()
    undocumented = []
    seen = set()
    for index, path in _key_lines(text):
        parent = path.rpartition(".")[0]
        parent_schema = _schema_at(parent) if parent else SCHEMA
        if parent_schema is None or "properties" not in parent_schema or "$ref" in parent_schema:
            continue  # inside a pass-through Kubernetes object (resources, tolerations, ...)
        schema = _schema_at(path)
        assert schema is not None, f"values.yaml key {path} is not in values.schema.json"
        seen.add(path)
        is_section = "properties" in schema and "$ref" not in schema
        if not is_section and not lines[index - 1].lstrip().startswith("#"):
            undocumented.append(path)
    assert undocumented == []
    # And every key the schema declares has a documented default in values.yaml.
    declared = set()

    def walk(schema, prefix):
        for key, sub in schema.get("properties", {}).items():
            path = f"{prefix}{key}"
            declared.add(path)
            if "properties" in sub and "$ref" not in sub:
                walk(sub, path + ".")

    walk(SCHEMA, "")
    assert declared - seen == set()


def test_defaults_are_what_values_yaml_says():
    """Helm's coalesced defaults equal values.yaml parsed on its own (no hidden defaults)."""
    assert merged_values({}) == yaml.safe_load((CHART_DIR / "values.yaml").read_text())
