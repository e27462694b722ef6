"""The cluster manifests are accepted by their tools' own checks.

- ``cluster/ray_cluster.yaml`` passes Ray's cluster-launcher schema the way ``ray up`` checks it
  (``ray.autoscaler._private.util.prepare_config`` fills the provider's defaults, then ``validate_config``);
- the KubeRay manifests (RayJob, RayService) carry the fields their CRDs (``ray.io/v1``) require: a container
  image and name per pod template, a head group, worker groups with a group name and replicas, and an
  entrypoint (RayJob) or a Serve config (RayService) that runs this project's modules.

Run: python -m pytest -q tests/test_manifests.py
"""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"


def test_ray_cluster_launcher_config_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((CLUSTER / "ray_cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(cfg)))  # raises on a schema violation
    bad = copy.deepcopy(cfg)
    bad["max_worker"] = 1  # a typo: Ray's schema refuses unknown keys, so the check has teeth
    with pytest.raises(Exception, match="max_worker"):
        validate_config(prepare_config(bad))
    assert cfg["max_workers"] == len(cfg["provider"]["worker_ips"])
    assert any("--dashboard-host=127.0.0.1" in c for c in cfg["head_start_ray_commands"])


def _check_pod_template(tpl: dict, where: str) -> None:
    containers = tpl["spec"]["containers"]
    assert containers, f"{where}: no containers"
    for c in containers:
        assert c.get("name") and c.get("image"), f"{where}: container needs name and image"


def _check_ray_cluster_spec(spec: dict, where: str) -> None:
    head = spec["headGroupSpec"]
    assert isinstance(head.get("rayStartParams", {}), dict)
    _check_pod_template(head["template"], f"{where}.headGroupSpec")
    for g in spec.get("workerGroupSpecs", []):
        assert g.get("groupName"), f"{where}: worker group needs groupName"
        assert isinstance(g.get("replicas"), int) and g["replicas"] >= 0
        assert g.get("minReplicas", 0) <= g["replicas"] <= g.get("maxReplicas", g["replicas"])
        _check_pod_template(g["template"], f"{where}.workerGroupSpecs[{g['groupName']}]")


def test_kuberay_rayjob_manifest():
    doc = yaml.safe_load((CLUSTER / "kuberay_rayjob.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob" and doc["metadata"]["name"]
    spec = doc["spec"]
    assert "python -m adaflash_ray.pipeline" in spec["entrypoint"]
    yaml.safe_load(spec["runtimeEnvYAML"])  # an embedded YAML string: must parse
    _check_ray_cluster_spec(spec["rayClusterSpec"], "RayJob.rayClusterSpec")


def test_kuberay_rayservice_manifests():
    docs = [d for p in sorted(CLUSTER.glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if isinstance(d, dict) and d.get("kind") == "RayService"]
    assert docs, "cluster/ has no RayService manifest"
    for doc in docs:
        assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"]
        spec = doc["spec"]
        serve = yaml.safe_load(spec["serveConfigV2"])
        for app in serve["applications"]:
            module, _, attr = app["import_path"].partition(":")
            assert hasattr(importlib.import_module(module), attr), app["import_path"]
        _check_ray_cluster_spec(spec["rayClusterSpec"], "RayService.rayClusterSpec")
