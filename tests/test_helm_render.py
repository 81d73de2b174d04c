"""The Helm chart renders, lints, and produces valid, consistent Kubernetes objects.

Rendered by Helm's own engine (helm-python-sdk, Helm v4.2.3; see tests/helm_render.py), with
the chart defaults and the two examples under helm/kvloom/examples/. Kubernetes objects are
validated by kubernetes-validate against the bundled schemas of Kubernetes 1.27 and 1.37 in
strict mode (unknown fields fail); the RayCluster against the trimmed ray.io/v1 schema in
helm/schemas/ and its pod templates as core/v1 PodTemplates.
"""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
from helm_render import (
    CHART_DIR,
    KUBE_VERSIONS,
    NOTES,
    VALUE_SETS,
    by_kind,
    container,
    helm,
    lint,
    load_values,
    manifests,
    one,
    pod_templates,
    render,
    secret_value,
    validate_object,
)

GENERATION = "kvloom.v1.Generation"


def head_spec(raycluster):
    return raycluster["spec"]["headGroupSpec"]["template"]["spec"]


def worker_group(raycluster):
    (group,) = raycluster["spec"]["workerGroupSpecs"]
    return group


def serve_args(objects):
    return container(head_spec(one(objects, "RayCluster")), "kvloom")["args"]


def flag(args, name):
    """Value following `name` in an argument list, or None when absent."""
    return args[args.index(name) + 1] if name in args else None


def labels_match(selector, labels):
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def value_set(request):
    return request.param


@pytest.fixture(scope="module")
def rendered(value_set):
    return render(load_values(value_set))


def test_helm_engine_is_the_real_one():
    module = helm()
    assert module.helm_sdk_version().startswith("v4."), module.helm_sdk_version()


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_chart_lints_without_errors_or_warnings(name):
    report = lint(load_values(name))
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); 2 and 3 are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_renders_every_expected_object(value_set, rendered):
    kinds = sorted(obj["kind"] for obj in manifests(rendered))
    expected = {
        "default": ["PersistentVolumeClaim", "PodDisruptionBudget", "RayCluster", "Service"],
        "single-gpu": ["PodDisruptionBudget", "RayCluster", "Service"],
        "tp2-dcp2": ["ConfigMap", "PodDisruptionBudget", "RayCluster", "Service"],
    }[value_set]
    assert kinds == expected
    assert rendered[NOTES].strip()


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(rendered, kube_version):
    for obj in manifests(rendered):
        validate_object(obj, kube_version)


def test_validators_reject_an_unknown_field(rendered):
    """The schema checks are not vacuous: a misspelled field fails each of them."""
    objects = manifests(rendered)
    service = copy.deepcopy(one(objects, "Service"))
    service["spec"]["selectr"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(service, KUBE_VERSIONS[0])
    cluster = copy.deepcopy(one(objects, "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 1
    with pytest.raises(Exception, match="replica"):
        validate_object(cluster, KUBE_VERSIONS[0])
    cluster = copy.deepcopy(one(objects, "RayCluster"))
    head_spec(cluster)["containers"][1]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(cluster, KUBE_VERSIONS[0])
    cluster = copy.deepcopy(one(objects, "RayCluster"))
    cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4
    with pytest.raises(Exception, match="is not of type 'string'"):
        validate_object(cluster, KUBE_VERSIONS[0])


def test_default_serve_command_uses_the_cli_flags():
    objects = manifests(render())
    head = head_spec(one(objects, "RayCluster"))
    serve = container(head, "kvloom")
    assert serve["args"] == [
        "--model", "/models/Qwen3-0.6B",
        "--host", "0.0.0.0",
        "--port", "50051",
        "--tp", "1",
        "--dcp", "1",
        "--dtype", "auto",
        "--max-model-len", "8192",
        "--block-size", "16",
        "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256",
        "--metrics-port", "9090",
    ]  # fmt: skip
    # bash -c SCRIPT NAME ARGS...: the script waits for the GCS, then execs `kvloom serve "$@"`.
    assert serve["command"][:2] == ["/bin/bash", "-c"]
    assert 'exec kvloom serve "$@"' in serve["command"][2]
    env = {e["name"]: e for e in serve["env"]}
    assert env["RAY_ADDRESS"]["value"] == "$(POD_IP):6379"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # KubeRay starts `ray start --head` in the first container; the driver shares its /tmp/ray.
    assert head["containers"][0]["name"] == "ray-head"
    ray_tmp = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert (
        ray_tmp["ray-tmp"]
        == "/tmp/ray"
        == {m["name"]: m["mountPath"] for m in serve["volumeMounts"]}["ray-tmp"]
    )


def test_tp2_dcp2_example_serves_with_tls_and_token():
    objects = manifests(render(load_values("tp2-dcp2")))
    args = serve_args(objects)
    assert (flag(args, "--tp"), flag(args, "--dcp"), flag(args, "--dtype")) == (
        "2",
        "2",
        "bfloat16",
    )
    assert flag(args, "--max-model-len") == "131072"
    assert flag(args, "--tls-cert") == "/etc/kvloom/tls/tls.crt"
    assert flag(args, "--tls-key") == "/etc/kvloom/tls/tls.key"
    assert flag(args, "--auth-token-file") == "/etc/kvloom/auth/token"
    assert args[-2:] == ["--seed", "0"]
    head = head_spec(one(objects, "RayCluster"))
    volumes = {v["name"]: v for v in head["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kvloom-grpc-tls"
    assert volumes["auth"]["secret"]["secretName"] == "kvloom-grpc-token"
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "llm-models"
    assert by_kind(objects, "Secret") == []  # existing secrets are referenced, not created


@pytest.mark.parametrize(
    "overrides, flag_name, expected",
    [
        ({"engine": {"prefixCaching": False}}, "--no-prefix-caching", True),
        ({"engine": {"prefixCaching": True}}, "--no-prefix-caching", False),
        ({"server": {"metrics": {"enabled": False}}}, "--metrics-port", False),
        (
            {"engine": {"maxModelLen": 1048576}},
            "1048576",
            True,
        ),  # no float formatting (1.048576e+06)
        ({"engine": {"gpuMemoryUtilization": 0.95}}, "0.95", True),
    ],
)
def test_optional_flags(overrides, flag_name, expected):
    assert (flag_name in serve_args(manifests(render(overrides)))) is expected


@pytest.mark.parametrize(
    "tp, dcp, gpus_per_pod, workers",
    [(1, 1, 1, 1), (2, 2, 4, 1), (2, 2, 2, 2), (4, 2, 8, 1), (4, 2, 4, 2), (8, 1, 1, 8)],
)
def test_worker_group_holds_tp_times_dcp_gpus(tp, dcp, gpus_per_pod, workers):
    values = {"engine": {"tp": tp, "dcp": dcp}, "worker": {"gpusPerPod": gpus_per_pod}}
    cluster = one(manifests(render(values)), "RayCluster")
    group = worker_group(cluster)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == workers
    assert group["rayStartParams"]["num-gpus"] == str(gpus_per_pod)
    resources = container(group["template"]["spec"], "ray-worker")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == gpus_per_pod
    assert workers * gpus_per_pod == tp * dcp
    # The head holds no GPU, so Ray places every GPU worker actor on the worker group.
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in str(head_spec(cluster)["containers"])
    validate_object(cluster, KUBE_VERSIONS[0])


@pytest.mark.parametrize(
    "dp, tp, gpus_per_pod, workers", [(3, 1, 1, 3), (2, 2, 2, 2), (2, 4, 2, 4), (4, 2, 1, 8)]
)
def test_data_parallel_replicas_share_one_raycluster(dp, tp, gpus_per_pod, workers):
    values = {
        "engine": {"tp": tp, "dataParallelSize": dp, "routing": "least-loaded"},
        "worker": {"gpusPerPod": gpus_per_pod},
    }
    objects = manifests(render(values))
    cluster = one(objects, "RayCluster")  # one front door for all replicas
    group = worker_group(cluster)
    assert group["replicas"] == workers and workers * gpus_per_pod == dp * tp
    args = serve_args(objects)
    assert flag(args, "--data-parallel-size") == str(dp)
    assert flag(args, "--routing") == "least-loaded"
    validate_object(cluster, KUBE_VERSIONS[0])


def test_one_data_parallel_replica_adds_no_flags():
    args = serve_args(manifests(render({"engine": {"dataParallelSize": 1}})))
    assert "--data-parallel-size" not in args and "--routing" not in args


def test_speculative_config_reaches_serve_as_one_json_argument():
    """engine.speculativeConfig renders as `--speculative-config JSON`, the value the CLI
    parses back to the same object; empty (the default) adds no flag."""
    import json

    from kvloom.cluster.commands.serve import parse_speculative_config

    spec = {
        "method": "draft_model",
        "model": "/models/draft",
        "num_speculative_tokens": 3,
        "placement": "remote",
    }
    args = serve_args(manifests(render({"engine": {"speculativeConfig": spec}})))
    assert args.count("--speculative-config") == 1
    assert parse_speculative_config(flag(args, "--speculative-config")) == spec
    assert json.loads(flag(args, "--speculative-config"))["num_speculative_tokens"] == 3
    assert "--speculative-config" not in serve_args(manifests(render({})))


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"engine": {"tp": 3}, "worker": {"gpusPerPod": 2}},
            r"worker.gpusPerPod \(2\) must divide",
        ),
        ({"server": {"port": 6379}}, "server.port 6379 collides with a Ray head port"),
        ({"server": {"metrics": {"port": 8080}}}, "server.metrics.port 8080 collides"),
        ({"server": {"port": 9090}}, "server.metrics.port must differ from server.port"),
        (
            {"probes": {"type": "grpc"}, "tls": {"enabled": True, "existingSecret": "s"}},
            "probes.type grpc cannot check a TLS server",
        ),
    ],
)
def test_inconsistent_values_fail_the_render(values, message):
    with pytest.raises(helm().HelmRenderError, match=message):
        render(values)


def test_probes_use_native_grpc_health_checks():
    serve = container(head_spec(one(manifests(render()), "RayCluster")), "kvloom")
    assert serve["startupProbe"]["grpc"] == {"port": 50051, "service": GENERATION}
    assert serve["readinessProbe"]["grpc"] == {"port": 50051, "service": GENERATION}
    assert serve["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    startup = serve["startupProbe"]
    # Long enough to load weights of a large model: at least 10 minutes.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert {p["name"]: p["containerPort"] for p in serve["ports"]} == {
        "grpc": 50051,
        "metrics": 9090,
    }


def test_tls_switches_probes_to_the_exec_health_check():
    values = {
        "tls": {"enabled": True, "cert": "CERT", "key": "KEY"},
        "auth": {"enabled": True, "token": "t" * 32},
    }
    objects = manifests(render(values))
    serve = container(head_spec(one(objects, "RayCluster")), "kvloom")
    for probe, service in (
        ("startupProbe", GENERATION),
        ("readinessProbe", GENERATION),
        ("livenessProbe", ""),
    ):
        command = serve[probe]["exec"]["command"]
        assert command[:2] == ["python", "/etc/kvloom/probe/grpc_health_probe.py"]
        assert flag(command, "--service") == service
        assert flag(command, "--addr") == "127.0.0.1:50051"
        assert flag(command, "--tls-ca") == "/etc/kvloom/tls/tls.crt"
        assert flag(command, "--tls-server-name") == "kvloom.llm.svc"
        assert flag(command, "--auth-token-file") == "/etc/kvloom/auth/token"
        assert "grpc" not in serve[probe]
    # The script the probe runs is the one in the chart, byte for byte.
    configmap = one(objects, "ConfigMap")
    script = (CHART_DIR / "files" / "grpc_health_probe.py").read_text()
    assert configmap["data"]["grpc_health_probe.py"] == script
    secrets = {s["metadata"]["name"]: s for s in by_kind(objects, "Secret")}
    assert secrets["kvloom-tls"]["type"] == "kubernetes.io/tls"
    assert secret_value(secrets["kvloom-tls"], "tls.crt") == "CERT"
    assert secret_value(secrets["kvloom-tls"], "tls.key") == "KEY"
    assert secret_value(secrets["kvloom-auth"], "token") == "t" * 32
    service = one(objects, "Service")
    assert "appProtocol" not in service["spec"]["ports"][0]  # not h2c once TLS is on
    for obj in objects:
        validate_object(obj, KUBE_VERSIONS[0])


def test_service_routes_to_head_pods_only():
    values = {"model": {"download": {"enabled": True}}}
    objects = manifests(render(values))
    service = one(objects, "Service")
    cluster = one(objects, "RayCluster")
    head_template = cluster["spec"]["headGroupSpec"]["template"]
    selector = service["spec"]["selector"]
    assert labels_match(selector, head_template["metadata"]["labels"])
    assert not labels_match(selector, worker_group(cluster)["template"]["metadata"]["labels"])
    job = one(objects, "Job")
    assert not labels_match(selector, job["spec"]["template"]["metadata"]["labels"])
    port_names = {p["name"] for p in container(head_template["spec"], "kvloom")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    # KubeRay adds app.kubernetes.io/name=kuberay to Ray pods; the selector must not use it.
    assert "app.kubernetes.io/name" not in selector


def test_each_replica_is_a_raycluster_with_its_own_disruption_budget():
    objects = manifests(render({"replicaCount": 3, "podDisruptionBudget": {"maxUnavailable": 1}}))
    clusters = by_kind(objects, "RayCluster")
    budgets = by_kind(objects, "PodDisruptionBudget")
    assert [c["metadata"]["name"] for c in clusters] == ["kvloom-0", "kvloom-1", "kvloom-2"]
    assert [b["metadata"]["name"] for b in budgets] == ["kvloom-0", "kvloom-1", "kvloom-2"]
    for budget in budgets:
        assert budget["spec"]["maxUnavailable"] == 1
        selector = budget["spec"]["selector"]["matchLabels"]
        covered = [
            (c["metadata"]["name"], t["metadata"]["labels"]["app.kubernetes.io/component"])
            for c in clusters
            for t in pod_templates(c)
            if labels_match(selector, t["metadata"]["labels"])
        ]
        name = budget["metadata"]["name"]
        assert covered == [(name, "head"), (name, "worker")]
    service_selector = one(objects, "Service")["spec"]["selector"]
    heads = [c["spec"]["headGroupSpec"]["template"]["metadata"]["labels"] for c in clusters]
    assert all(labels_match(service_selector, labels) for labels in heads)


def test_zero_replicas_renders_no_cluster():
    objects = manifests(render({"replicaCount": 0}))
    assert by_kind(objects, "RayCluster") == by_kind(objects, "PodDisruptionBudget") == []
    assert one(objects, "Service")


STORAGE_CASES = {
    "pvc": {"type": "pvc"},
    "existingClaim": {"type": "existingClaim", "existingClaim": "shared-models"},
    "hostPath": {"type": "hostPath", "hostPath": {"path": "/data/models"}},
    "emptyDir": {"type": "emptyDir", "emptyDir": {"sizeLimit": "20Gi"}},
}


@pytest.mark.parametrize("download", [False, True])
@pytest.mark.parametrize("storage", sorted(STORAGE_CASES))
def test_model_storage_and_download(storage, download):
    values = {
        "model": {
            "storage": STORAGE_CASES[storage],
            "download": {"enabled": download, "hfTokenSecret": {"name": "hf", "key": "tok"}},
        }
    }
    objects = manifests(render(values))
    cluster = one(objects, "RayCluster")
    on_claim = storage in ("pvc", "existingClaim")
    for template in pod_templates(cluster):
        spec = template["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
        if on_claim:
            claim = "kvloom-models" if storage == "pvc" else "shared-models"
            assert volume["persistentVolumeClaim"]["claimName"] == claim
        elif storage == "hostPath":
            assert volume["hostPath"] == {
                "path": "/data/models",
                "type": "DirectoryOrCreate" if download else "Directory",
            }
        else:
            assert volume["emptyDir"] == {"sizeLimit": "20Gi"}
        init_names = [c["name"] for c in spec.get("initContainers", [])]
        if not download:
            assert init_names == []
        elif on_claim:
            assert init_names == ["wait-for-model"]
        else:
            assert init_names == ["model-download"]
            downloader = container(spec, "model-download")
            assert (
                "hf download Qwen/Qwen3-0.6B --revision main --local-dir /models/Qwen3-0.6B"
                in downloader["command"][2]
            )
            token = {e["name"]: e for e in downloader["env"]}["HF_TOKEN"]
            assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "tok"}
        for c in spec["containers"]:
            mount = {m["name"]: m for m in c["volumeMounts"]}["models"]
            assert (mount["mountPath"], mount["readOnly"]) == ("/models", True)
    jobs = by_kind(objects, "Job")
    assert len(jobs) == (1 if download and on_claim else 0)
    if jobs:
        script = container(jobs[0]["spec"]["template"]["spec"], "download")["command"][2]
        assert "touch /models/Qwen3-0.6B/.kvloom-download-complete" in script
    assert len(by_kind(objects, "PersistentVolumeClaim")) == (1 if storage == "pvc" else 0)
    for obj in objects:
        validate_object(obj, KUBE_VERSIONS[-1])


def test_download_job_name_follows_what_it_downloads():
    """A Job's pod template is immutable: a new model must become a new Job, not a failed upgrade."""

    def job_name(revision):
        values = {"model": {"download": {"enabled": True, "revision": revision}}}
        return one(manifests(render(values)), "Job")["metadata"]["name"]

    assert job_name("main") == job_name("main")
    assert job_name("main") != job_name("v2")
    assert re.fullmatch(r"kvloom-download-[0-9a-f]{8}", job_name("main"))


def test_scheduling_and_shm_settings_reach_the_pods():
    values = {
        "worker": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
            "shmSize": "32Gi",
        },
        "head": {"nodeSelector": {"pool": "cpu"}, "shmSize": "4Gi"},
    }
    cluster = one(manifests(render(values)), "RayCluster")
    head = head_spec(cluster)
    worker = worker_group(cluster)["template"]["spec"]
    assert head["nodeSelector"] == {"pool": "cpu"}
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert worker["tolerations"][0]["key"] == "dedicated"
    shm = {
        name: {v["name"]: v for v in spec["volumes"]}["dshm"]["emptyDir"]
        for name, spec in (("head", head), ("worker", worker))
    }
    assert shm == {
        "head": {"medium": "Memory", "sizeLimit": "4Gi"},
        "worker": {"medium": "Memory", "sizeLimit": "32Gi"},
    }
    for spec in (head, worker):
        for c in spec["containers"]:
            assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["dshm"] == "/dev/shm"
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_notes_tell_how_to_connect(value_set, rendered):
    notes = rendered[NOTES]
    assert "kubectl -n llm port-forward svc/kvloom 50051:50051" in notes
    assert "grpc.health.v1.Health/Check" in notes
    assert "kvloom.v1.Generation/Generate" in notes
    secured = value_set == "tp2-dcp2"  # TLS and a bearer token
    assert ("grpcurl -plaintext" in notes) is not secured
    assert ("-cacert ca.pem -servername kvloom.llm.svc" in notes) is secured
    assert ('-H "authorization: Bearer $KVLOOM_TOKEN"' in notes) is secured
    # The Python client line is printed for plaintext servers only.
    client = 'Client("localhost:50051").generate("Hello", max_tokens=32)'
    assert (client in notes) is not secured
