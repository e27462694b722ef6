"""The cluster manifests are accepted by their tools' own checks.

- ``cluster/ray_cluster.yaml`` passes Ray's cluster-launcher schema the way ``ray up`` checks it
  (``ray.autoscaler._private.util.prepare_config`` fills the provider's defaults, then ``validate_config``);
- the KubeRay manifests (RayJob, RayService) use only the field names of their CRDs (``ray.io/v1``) and carry
  the ones those CRDs require: the cluster under ``rayClusterConfig`` (RayService) / ``rayClusterSpec`` (RayJob),
  a head group, worker groups with a group name and min/max replicas, a container image and name per pod
  template, and an entrypoint (RayJob) or a Serve config (RayService) that runs this project's modules; no
  field KubeRay marks deprecated. The field names are KubeRay v1.7.0's (below, with where they come from).

Run: python -m pytest -q tests/test_manifests.py
"""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"

# KubeRay v1.7.0 (github.com/ray-project/kuberay, tag v1.7.0): the JSON field names of the ray.io/v1 spec structs
# in ray-operator/apis/ray/v1/{rayservice,rayjob,raycluster}_types.go, the same as the OpenAPI properties /
# `required` lists of ray-operator/config/crd/bases/ray.io_{rayservices,rayjobs}.yaml. A Kubernetes API server
# with the CRD installed prunes or (kubectl apply's strict field validation) refuses any other field.
KUBERAY_VERSION = "v1.7.0"
RAYSERVICE_SPEC = {"rayClusterDeletionDelaySeconds", "serviceUnhealthySecondThreshold",
                   "deploymentUnhealthySecondThreshold", "serveService", "upgradeStrategy", "managedBy",
                   "serveConfigV2", "rayClusterConfig", "excludeHeadPodFromServeSvc", "suspend"}
RAYSERVICE_REQUIRED = {"rayClusterConfig"}
# "Deprecated: This field is not used anymore. ref: https://github.com/ray-project/kuberay/issues/1685"
RAYSERVICE_DEPRECATED = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint", "runtimeEnvYAML",
               "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus", "entrypointNumGpus",
               "ttlSecondsAfterFinished", "preRunningDeadlineSeconds", "shutdownAfterJobFinishes", "suspend"}
RAYCLUSTER_SPEC = {"upgradeStrategy", "authOptions", "suspend", "managedBy", "autoscalerOptions",
                   "headServiceAnnotations", "enableInTreeAutoscaling", "gcsFaultToleranceOptions",
                   "historyServerOptions", "networkPolicy", "tlsOptions", "headGroupSpec", "rayVersion",
                   "workerGroupSpecs"}
RAYCLUSTER_REQUIRED = {"headGroupSpec"}
HEAD_GROUP_SPEC = {"template", "headService", "enableIngress", "ingressOptions", "resources", "labels",
                   "rayStartParams", "serviceType"}
HEAD_GROUP_REQUIRED = {"template"}
WORKER_GROUP_SPEC = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
                     "priority", "resources", "labels", "rayStartParams", "template", "scaleStrategy", "numOfHosts"}
WORKER_GROUP_REQUIRED = {"groupName", "minReplicas", "maxReplicas", "template"}


def _check_fields(obj: dict, known: set[str], required: set[str], where: str) -> None:
    unknown = sorted(set(obj) - known)
    assert not unknown, f"{where}: {unknown} not field(s) of KubeRay {KUBERAY_VERSION} (known: {sorted(known)})"
    missing = sorted(required - set(obj))
    assert not missing, f"{where}: required field(s) {missing} missing (KubeRay {KUBERAY_VERSION})"


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


def _check_ray_start_params(params: dict, where: str) -> None:
    assert isinstance(params, dict), f"{where}.rayStartParams must be a mapping"
    # the CRD types rayStartParams as map[string]string: 0 or true unquoted is refused by the API server
    bad = {k: v for k, v in params.items() if not isinstance(v, str)}
    assert not bad, f"{where}.rayStartParams values must be strings (quote them): {bad}"


def _check_ray_cluster_spec(spec: dict, where: str) -> None:
    _check_fields(spec, RAYCLUSTER_SPEC, RAYCLUSTER_REQUIRED, where)
    head = spec["headGroupSpec"]
    _check_fields(head, HEAD_GROUP_SPEC, HEAD_GROUP_REQUIRED, f"{where}.headGroupSpec")
    _check_ray_start_params(head.get("rayStartParams", {}), f"{where}.headGroupSpec")
    _check_pod_template(head["template"], f"{where}.headGroupSpec")
    for g in spec.get("workerGroupSpecs", []):
        assert g.get("groupName"), f"{where}: worker group needs groupName"
        _check_fields(g, WORKER_GROUP_SPEC, WORKER_GROUP_REQUIRED, f"{where}.workerGroupSpecs[{g['groupName']}]")
        _check_ray_start_params(g.get("rayStartParams", {}), f"{where}.workerGroupSpecs[{g['groupName']}]")
        assert isinstance(g.get("replicas"), int) and g["replicas"] >= 0
        assert g.get("minReplicas", 0) <= g["replicas"] <= g.get("maxReplicas", g["replicas"])
        _check_pod_template(g["template"], f"{where}.workerGroupSpecs[{g['groupName']}]")


def test_kuberay_rayjob_manifest():
    doc = yaml.safe_load((CLUSTER / "kuberay_rayjob.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob" and doc["metadata"]["name"]
    spec = doc["spec"]
    _check_fields(spec, RAYJOB_SPEC, set(), "RayJob.spec")
    assert "rayClusterConfig" not in spec  # RayService's name; a RayJob's cluster is rayClusterSpec
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
        _check_fields(spec, RAYSERVICE_SPEC, RAYSERVICE_REQUIRED, "RayService.spec")
        deprecated = sorted(RAYSERVICE_DEPRECATED & set(spec))
        assert not deprecated, f"RayService.spec sets {deprecated}: deprecated and unused in KubeRay {KUBERAY_VERSION}"
        serve = yaml.safe_load(spec["serveConfigV2"])
        for app in serve["applications"]:
            module, _, attr = app["import_path"].partition(":")
            assert hasattr(importlib.import_module(module), attr), app["import_path"]
        _check_ray_cluster_spec(spec["rayClusterConfig"], "RayService.rayClusterConfig")


def test_kuberay_field_check_has_teeth():
    """The old manifest's mistakes fail: RayJob's cluster key in a RayService, an unknown worker-group key."""
    doc = next(d for d in yaml.safe_load_all((CLUSTER / "rayservice.yaml").read_text()) if d.get("kind") == "RayService")
    bad = copy.deepcopy(doc["spec"])
    bad["rayClusterSpec"] = bad.pop("rayClusterConfig")
    with pytest.raises(AssertionError, match="rayClusterSpec"):
        _check_fields(bad, RAYSERVICE_SPEC, RAYSERVICE_REQUIRED, "RayService.spec")
    spec = copy.deepcopy(doc["spec"]["rayClusterConfig"])
    spec["workerGroupSpecs"][0]["replica"] = 1
    with pytest.raises(AssertionError, match="replica"):
        _check_ray_cluster_spec(spec, "RayService.rayClusterConfig")
    spec = copy.deepcopy(doc["spec"]["rayClusterConfig"])
    spec["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0
    with pytest.raises(AssertionError, match="strings"):
        _check_ray_cluster_spec(spec, "RayService.rayClusterConfig")
