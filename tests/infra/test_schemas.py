"""The deploy files pass the schemas of what runs them: the Ray cluster launcher's
ray-schema.json (shipped in the ray package) and KubeRay v1.7.0's CRDs (tests/data/kuberay)."""

from __future__ import annotations

import functools
import gzip
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
CRDS = ROOT / "tests" / "data" / "kuberay"


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    crd = yaml.safe_load(gzip.open(CRDS / f"ray.io_{kind}.yaml.gz"))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / name).read_text()) if d]


def validate(doc: dict, schema: dict) -> None:
    jsonschema.Draft7Validator(schema).validate(doc)


def test_launcher_config_passes_rays_own_schema():
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = yaml.safe_load((INFRA / "ray-cluster.yaml").read_text())
    validate(cluster, schema)
    head_cmds = " ".join(cluster["head_start_ray_commands"])
    worker_cmds = " ".join(cluster["worker_start_ray_commands"])
    for cmds in (head_cmds, worker_cmds):
        assert "ulimit -n 65536" in cmds and "RAY_AUTH_MODE=token" in cmds
    assert "--dashboard-host=127.0.0.1" in head_cmds  # reached through `ray dashboard` (SSH), as documented
    assert cluster["available_node_types"]["gpu_worker"]["min_workers"] == 0
    assert cluster["file_mounts"]["~/adt-tree-requirements.txt"] == "infra/docker/requirements.txt"
    assert any("-r ~/adt-tree-requirements.txt" in c for c in cluster["setup_commands"])
    text = (INFRA / "ray-cluster.yaml").read_text()
    assert "iam:PassRole" in text and "ec2:RunInstances" in text and "s3:PutObject" in text


def test_rayjob_passes_the_kuberay_crds():
    cm, job = docs("kuberay-rayjob.yaml")
    assert (cm["kind"], job["kind"]) == ("ConfigMap", "RayJob")
    validate(job, crd_schema("rayjobs"))
    spec = job["spec"]["rayClusterSpec"]
    validate({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "x"}, "spec": spec},
             crd_schema("rayclusters"))
    assert spec["authOptions"]["mode"] == "token" and spec["enableInTreeAutoscaling"] is True
    images = {c["image"] for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]] for c in g["template"]["spec"]["containers"]}
    assert images == {"<registry>/adt-tree:0.1.0"}  # the project's image, not the stock one
    from pipeline.config import build_config

    cfg = build_config(yaml.safe_load(cm["data"]["job.yaml"]))
    assert cfg.device == "cuda" and cfg.num_actors == spec["workerGroupSpecs"][0]["maxReplicas"]
    assert cfg.gpu_wait_s and spec["workerGroupSpecs"][0]["minReplicas"] == 0


def test_cronjob_submits_a_valid_rayjob_and_forbids_overlap():
    by_kind = {d["kind"]: d for d in docs("kuberay-cronjob.yaml")}
    cron = by_kind["CronJob"]
    assert cron["apiVersion"] == "batch/v1" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    template = by_kind["ConfigMap"]["data"]["rayjob.yaml"].replace("__DAY__", "20240601")
    job = yaml.safe_load(template)
    validate(job, crd_schema("rayjobs"))
    assert "--job-id daily-20240601" in job["spec"]["entrypoint"] and "--resume" in job["spec"]["entrypoint"]
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == ["python", "/template/submit.py"]
    compile(by_kind["ConfigMap"]["data"]["submit.py"], "submit.py", "exec")  # run for real in test_cronjob_submit.py
    rules = by_kind["Role"]["rules"][0]
    assert "rayjobs" in rules["resources"] and {"create", "get", "delete"} <= set(rules["verbs"])


REMOVED_IMAGES = re.compile(r"^(docker\.io/)?bitnami/")  # Bitnami's public Docker Hub tags are gone
PROJECT_IMAGE = "<registry>/adt-tree:0.1.0"  # built from infra/docker/Dockerfile by the user


def images(doc) -> list[str]:
    if isinstance(doc, dict):
        return [v for k, v in doc.items() if k == "image" and isinstance(v, str)] + \
            [i for v in doc.values() for i in images(v)]
    return [i for v in doc for i in images(v)] if isinstance(doc, list) else []


@pytest.mark.parametrize("name", ["kuberay-cronjob.yaml", "kuberay-rayjob.yaml"])
def test_every_image_exists_the_project_one_or_pinned_by_digest(name):
    """No removed tag (bitnami/*); any image other than the project's own is pinned by digest."""
    found = images(docs(name))
    cm = {d["kind"]: d for d in docs(name)}["ConfigMap"]
    for text in cm["data"].values():  # the RayJob template inside the CronJob's ConfigMap
        if text.lstrip().startswith("apiVersion"):
            found += images(yaml.safe_load(text.replace("__DAY__", "20240601")))
    assert found
    for image in found:
        assert not REMOVED_IMAGES.match(image), f"{image}: a removed tag"
        assert image == PROJECT_IMAGE or re.search(r"@sha256:[0-9a-f]{64}$", image), f"{image}: not pinned by digest"


def test_the_removed_tag_check_can_fail():
    assert REMOVED_IMAGES.match("bitnami/kubectl:1.31") and REMOVED_IMAGES.match("docker.io/bitnami/kubectl:latest")
    assert not re.search(r"@sha256:[0-9a-f]{64}$", "registry.k8s.io/kubectl:v1.31.0")


def test_crd_copies_name_their_source_and_licence():
    readme = (CRDS / "README.md").read_text()
    assert "v1.7.0" in readme and "Apache" in readme and (CRDS / "LICENSE").read_text().startswith(" " * 10)


@pytest.mark.parametrize("bad", [{"spec": {"rayClusterSpec": {"authOptions": {"mode": "tokens"}}}},
                                 {"spec": {"backoffLimit": "zero"}}])
def test_the_crd_check_catches_mistakes(bad):
    _, job = docs("kuberay-rayjob.yaml")
    broken = json.loads(json.dumps(job))
    for k, v in bad["spec"].items():
        broken["spec"][k] = {**broken["spec"][k], **v} if isinstance(v, dict) else v
    with pytest.raises(jsonschema.ValidationError):
        validate(broken, crd_schema("rayjobs"))
