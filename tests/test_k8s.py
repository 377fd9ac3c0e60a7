"""Offline checks of the Kubernetes manifests (k8s/) and the Dockerfile; no cluster is needed.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_k8s.py

Every kustomization under k8s/ (base and overlays) is built with ``kubectl kustomize``; every
rendered object is validated with kubernetes-validate against the Kubernetes version pinned
below (strict: unknown fields fail), the PyTorchJob against k8s/schemas/pytorchjob-kubeflow-v1.json;
the ``elastic-train`` command of every pod is expanded like the kubelet does ($(VAR) from the
container's env and the rendered ConfigMaps) and parsed with our CLI's parser; every pod template
is checked against the Restricted Pod Security Standard; no manifest holds a secret value.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_trainer.cli import launch
from tests.helpers import k8s_pod, k8s_schemas
from tests.helpers.k8s_network import DEFAULT_DENY
from tests.helpers.k8s_network import allowed as _allowed
from tests.helpers.k8s_network import selects as _selects
from tests.helpers.common import REPO

K8S = REPO / "k8s"
PYTORCHJOB_SCHEMA = K8S / "schemas" / "pytorchjob-kubeflow-v1.json"

# The oldest Kubernetes these manifests are for: elastic Indexed Jobs (scaling parallelism and
# completions together) are GA in 1.31; podReplacementPolicy and backoffLimitPerIndex are on by
# default since 1.29. Objects are also checked against the newest version kubernetes-validate has.
K8S_VERSION = "1.31"

# What users deploy: base and each overlay (base/common, base/etcd, base/job and components/* are
# parts of these, built through them).
OVERLAYS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.glob("overlays/*/kustomization.yaml"))
KUSTOMIZATIONS = ["base", *OVERLAYS]
# Components combined in one more way than the overlays do: they must patch a PyTorchJob as well.
COMBINED = {"combined/pytorchjob+s3+gpu": ("overlays/pytorchjob", ["s3", "gpu"])}
WORKLOAD_KINDS = {"Job", "StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "CronJob", "Pod", "PyTorchJob",
                  "TrainingRuntime"}

kubectl = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(kubectl is None, reason="kubectl is not installed: cannot run `kubectl kustomize`")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each kustomization's rendered objects (and the COMBINED ones), built once for the module."""
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot run `kubectl kustomize`")
    result = {path: k8s_pod.kustomize(K8S / path) for path in KUSTOMIZATIONS}
    for name, (overlay, components) in COMBINED.items():
        folder = tmp_path_factory.mktemp("kustomize")
        rel = lambda p: os.path.relpath(K8S / p, folder)  # noqa: E731 - kustomize refuses absolute paths
        (folder / "kustomization.yaml").write_text(yaml.safe_dump(
            {"resources": [rel(overlay)], "components": [rel(f"components/{c}") for c in components]}))
        result[name] = k8s_pod.kustomize(folder)
    return result


def _name(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(label, pod template) pairs of a workload object; the template has metadata and spec."""
    kind = obj["kind"]
    if kind == "Pod":
        return [(_name(obj), obj)]
    if kind == "CronJob":
        return [(_name(obj), obj["spec"]["jobTemplate"]["spec"]["template"])]
    if kind == "PyTorchJob":
        return [(f"{_name(obj)}[{role}]", spec["template"])
                for role, spec in obj["spec"]["pytorchReplicaSpecs"].items()]
    if kind == "TrainingRuntime":  # Kubeflow Trainer v2: a JobSet template (overlays/trainer-v2, tests/test_k8s_v2.py)
        return [(f"{_name(obj)}[{job['name']}]", job["template"]["spec"]["template"])
                for job in obj["spec"]["template"]["spec"]["replicatedJobs"]]
    if kind in WORKLOAD_KINDS:
        return [(_name(obj), obj["spec"]["template"])]
    return []


def _all_templates(rendered) -> list[tuple[str, str, dict, dict]]:
    """(kustomization, label, owning object, pod template) for every pod template rendered."""
    return [(path, label, obj, tmpl) for path, objs in rendered.items() for obj in objs
            for label, tmpl in pod_templates(obj)]


def _containers(pod_spec: dict) -> list[dict]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"], *pod_spec.get("ephemeralContainers", [])]


def _trainer_containers(rendered):
    """(kustomization, label, object, pod template, container) for every container running elastic-train."""
    return [(path, label, obj, tmpl, c) for path, label, obj, tmpl in _all_templates(rendered)
            for c in _containers(tmpl["spec"]) if "elastic-train" in [*c.get("command", []), *c.get("args", [])]]


def _config_maps(objs: list[dict]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}


def _run_config_map(objs: list[dict]) -> dict[str, str]:
    """The data of the run's ConfigMap, elastic-trainer-config-<hash>."""
    [data] = [d for n, d in _config_maps(objs).items() if n.startswith("elastic-trainer-config-")]
    return data


def expand_argv(container: dict, config_maps: dict[str, dict[str, str]]) -> list[str]:
    """The container's command + args after the kubelet's $(VAR) expansion.

    Values come from ``env``: literal values, ConfigMap keys (looked up in the rendered ConfigMaps;
    a missing one fails), and placeholders for fieldRef/secretKeyRef values that only exist in a
    cluster. A reference to an undefined variable stays as written, as the kubelet leaves it.
    """
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = config_maps.get(ref["name"])
            if ref.get("optional") and ref["key"] not in (data or {}):
                continue  # the kubelet leaves the variable unset
            assert data is not None and ref["key"] in data, \
                f"env {var['name']} reads ConfigMap {ref['name']} key {ref['key']}, which the kustomization lacks"
            env[var["name"]] = data[ref["key"]]
        elif "fieldRef" in source:
            env[var["name"]] = "fieldref-" + source["fieldRef"]["fieldPath"].replace(".", "-")
        else:
            env[var["name"]] = f"<{var['name']} from the cluster>"
    expand = lambda text: re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)  # noqa: E731
    return [expand(t) for t in [*container.get("command", []), *container.get("args", [])]]


def _run_config(path, container, rendered):
    argv = expand_argv(container, _config_maps(rendered[path]))
    unresolved = [t for t in argv if "$(" in t]
    assert not unresolved, f"k8s/{path}: $(VAR) references the kubelet cannot resolve: {unresolved}"
    cut = argv.index("elastic-train")
    return argv[cut + 1:], launch.parse_run_config(argv[cut + 1:])


def _trainer_flag(program: list[str], flag: str) -> str | None:
    return program[program.index(flag) + 1] if flag in program else None


# --------------------------------------------------------------------------------------- building

@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_kustomization_builds_with_kubectl_kustomize(path, rendered):
    objs = rendered[path]
    assert objs, f"k8s/{path} rendered nothing"
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), f"k8s/{path} renders an object twice: {names}"
    namespaced = [o for o in objs if o["kind"] not in ("Namespace",)]
    assert all(o["metadata"].get("namespace") == "elastic-trainer" for o in namespaced), \
        f"k8s/{path}: every object belongs in namespace elastic-trainer"
    assert any(pod_templates(o) for o in objs), f"k8s/{path} has no workload"


def test_expected_overlays_exist():
    assert set(OVERLAYS) >= {"overlays/pvc", "overlays/s3", "overlays/gpu", "overlays/pytorchjob",
                             "overlays/existing-etcd"}


# ------------------------------------------------------------------------------------- validation

def test_pinned_kubernetes_version_is_bundled_with_kubernetes_validate():
    from kubernetes_validate import utils
    versions = {utils.major_minor(v) for v in utils.all_versions()}
    assert K8S_VERSION in versions, f"kubernetes-validate bundles {sorted(versions)}, not {K8S_VERSION}"


def _pytorchjob_validator(version: str):
    """A jsonschema validator for our PyTorchJob schema whose Kubernetes refs resolve offline."""
    import importlib.resources

    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    bundled = [v for v in utils.all_versions() if utils.major_minor(v) == version][0]
    defs_file = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{bundled}-local-strict/_definitions.json")
    defs = json.loads(defs_file.read_text())
    schema = json.loads(PYTORCHJOB_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    registry = Registry().with_resources([(defs["$id"], Resource.from_contents(defs)),
                                          (schema["$id"], Resource.from_contents(schema))])
    return jsonschema.Draft202012Validator(schema, registry=registry)


@needs_kubectl
@pytest.mark.parametrize("version", [K8S_VERSION, "latest"])
def test_every_rendered_object_validates_offline(rendered, version):
    from kubernetes_validate import utils

    version = utils.major_minor(utils.latest_version()) if version == "latest" else version
    failures, checked = [], 0
    for path, objs in rendered.items():
        for obj in objs:
            checked += 1  # the PyTorchJob's and Trainer v2's against their schemas, the rest by kubernetes-validate
            failures += [f"k8s/{path} {_name(obj)}: {e}" for e in k8s_schemas.errors_of(obj, version)]
    assert checked > 0 and not failures, "\n".join(failures)


@needs_kubectl
def test_pytorchjob_schema_rejects_what_the_operator_rejects(rendered):
    crd = _pytorchjob_validator(K8S_VERSION)
    job = next(o for o in rendered["overlays/pytorchjob"] if o["kind"] == "PyTorchJob")
    assert not list(crd.iter_errors(job))

    def broken(change) -> list[str]:
        bad = copy.deepcopy(job)
        change(bad)
        return [e.message for e in crd.iter_errors(bad)]

    worker = lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]  # noqa: E731
    assert broken(lambda j: j["spec"]["elasticPolicy"].update(maxReplica=4))  # typo
    assert broken(lambda j: worker(j).update(replicas="2"))
    assert broken(lambda j: worker(j).update(restartPolicy="Sometimes"))
    assert broken(lambda j: worker(j)["template"]["spec"]["containers"][0].update(name="trainer"))  # no "pytorch"
    assert broken(lambda j: worker(j)["template"]["spec"]["containers"][0]["securityContext"].update(privileged="yes"))
    assert broken(lambda j: j["spec"]["pytorchReplicaSpecs"].update(Chief=worker(j)))
    assert broken(lambda j: j["spec"]["pytorchReplicaSpecs"].update(Master=worker(j)))  # Master needs 1 replica
    assert broken(lambda j: j["spec"].update(pytorchReplicaSpecs={"Master": {**worker(j), "replicas": 1}}))
    assert broken(lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Sometimes"))


# ------------------------------------------------------------------------------------ the ConfigMap

def _config_map_refs(obj: dict) -> list[str]:
    """Names of the ConfigMaps a workload's pod templates read (env, envFrom, volumes)."""
    names = []
    for _, tmpl in pod_templates(obj):
        spec = tmpl["spec"]
        for c in _containers(spec):
            names += [v["valueFrom"]["configMapKeyRef"]["name"] for v in c.get("env", [])
                      if "configMapKeyRef" in v.get("valueFrom", {})]
            names += [e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e]
        names += [v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v]
    return names


@needs_kubectl
@pytest.mark.parametrize("path", [*KUSTOMIZATIONS, *COMBINED])
def test_the_run_config_map_is_hash_named_and_immutable_and_every_reference_follows_it(rendered, path):
    """A re-applied, changed ConfigMap must not change in place under running pods (replacements would
    read another RUN_ID or CHECKPOINT_DIR): its name carries a hash of its data, it is immutable, and
    kustomize rewrites every reference to it (the PyTorchJob's too, a kind kustomize does not know)."""
    objs = rendered[path]
    cms = [o for o in objs if o["kind"] == "ConfigMap"]
    assert len(cms) == 1, [_name(o) for o in cms]
    name = cms[0]["metadata"]["name"]
    assert re.fullmatch(r"elastic-trainer-config-[a-z0-9]{10}", name), f"k8s/{path}: {name} has no hash suffix"
    assert cms[0].get("immutable") is True, f"k8s/{path}: {name} is not immutable"
    refs = [(o, ref) for o in objs for ref in _config_map_refs(o)]
    assert refs and all(ref == name for _, ref in refs), \
        f"k8s/{path}: references not rewritten to {name}: {sorted({(_name(o), r) for o, r in refs if r != name})}"


@needs_kubectl
@pytest.mark.parametrize("overlay", ["overlays/pvc", "overlays/pytorchjob"])
def test_a_changed_run_config_is_a_new_config_map_and_a_new_pod_template(tmp_path, overlay, rendered):
    folder = tmp_path / "next-run"
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / overlay, folder)],
        "configMapGenerator": [{"name": "elastic-trainer-config", "behavior": "merge", "options": {"immutable": True},
                                "literals": ["RUN_ID=next-run", "CHECKPOINT_DIR=/checkpoints/next-run"]}]}))
    before, after = rendered[overlay], k8s_pod.kustomize(folder)
    old = next(o for o in before if o["kind"] == "ConfigMap")["metadata"]["name"]
    new = next(o for o in after if o["kind"] == "ConfigMap")["metadata"]["name"]
    assert old != new
    workload = next(o for o in after if o["kind"] in ("Job", "PyTorchJob"))
    assert set(_config_map_refs(workload)) == {new}


# ---------------------------------------------------------------------------------------- commands

@needs_kubectl
def test_every_elastic_train_command_parses_with_the_cli(rendered):
    found = _trainer_containers(rendered)
    paths = {path for path, *_ in found}
    assert paths == {p for p in rendered if any(pod_templates(o) and o["kind"] != "StatefulSet"
                                                for o in rendered[p])}, paths
    for path, label, obj, tmpl, container in found:
        argv, run = _run_config(path, container, rendered)
        where = f"k8s/{path} {label} container {container['name']}"
        assert (run.min_nodes, run.max_nodes) == (1, 4), where
        assert run.rdzv_endpoint and not run.embedded_etcd, f"{where}: must meet through the shared etcd"
        assert run.local_addr == "fieldref-status-podIP", f"{where}: --local-addr should be the pod IP"
        assert run.run_id in run.checkpoint_dir, f"{where}: checkpoints should be under the run's folder"
        volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")
                    and ({"emptyDir", "persistentVolumeClaim"} & set(volumes[m["name"]]))}
        assert any(run.log_dir.startswith(m + "/") for m in writable), f"{where}: --log-dir must be on a volume"
        assert run.log_dir.endswith("/fieldref-metadata-name"), f"{where}: one log folder per pod"
        assert run.program[:2] == ["-m", "elastic_trainer.train"], where
        nproc_env = next(v for v in container["env"] if v["name"] == "NPROC_PER_NODE")
        assert nproc_env and run.nproc_per_node >= 1


@needs_kubectl
def test_trainers_get_more_time_to_stop_than_the_trainer_saves_for(rendered):
    for path, label, obj, tmpl, container in _trainer_containers(rendered):
        _, run = _run_config(path, container, rendered)
        grace = _trainer_flag(run.program, "--grace-seconds")
        assert grace is not None, f"k8s/{path} {label}: pass --grace-seconds to the trainer"
        env = {v["name"]: v.get("value") for v in container["env"]}
        agent_wait = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        period = tmpl["spec"]["terminationGracePeriodSeconds"]
        assert float(grace) < agent_wait < period, (
            f"k8s/{path} {label}: need --grace-seconds ({grace}) < TORCH_ELASTIC_SHUTDOWN_TIMEOUT "
            f"({agent_wait}) < terminationGracePeriodSeconds ({period})")


@needs_kubectl
def test_pytorchjob_runs_the_same_command_as_the_job(rendered):
    job = next(c for p, _, o, _, c in _trainer_containers(rendered) if p == "overlays/pvc" and o["kind"] == "Job"
               and c["name"] == "trainer")
    pj = next(c for p, _, o, _, c in _trainer_containers(rendered) if o["kind"] == "PyTorchJob")
    assert pj["command"] == job["command"] and pj["args"] == job["args"]
    # The PyTorchJob's pod is a copy of the Job's (overlays/pytorchjob/pytorchjob.yaml): keep them equal
    # but for what the operator needs (container name "pytorch", its port) or sets (restartPolicy).
    job_pod = copy.deepcopy(next(o for o in rendered["overlays/pvc"] if o["kind"] == "Job")["spec"]["template"])
    pj_pod = copy.deepcopy(next(o for o in rendered["overlays/pytorchjob"]
                                if o["kind"] == "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    job_pod["spec"].pop("restartPolicy")
    job_pod["spec"]["containers"][0]["name"] = "pytorch"
    pj_pod["spec"]["containers"][0].pop("ports")
    assert pj_pod == job_pod, "overlays/pytorchjob/pytorchjob.yaml drifted from base/job/job.yaml"
    assert pj["name"] == "pytorch"  # the operator's default container name
    _, run_pj = _run_config("overlays/pytorchjob", pj, rendered)
    obj = next(o for o in rendered["overlays/pytorchjob"] if o["kind"] == "PyTorchJob")
    policy = obj["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"]) == (run_pj.min_nodes, run_pj.max_nodes)
    # elasticPolicy names one host (the operator's PET_RDZV_ENDPOINT, which elastic-train does not
    # read): the client Service; the pods' own endpoint list names each member behind it.
    assert f"{policy['rdzvHost']}:{policy['rdzvPort']}" == "etcd:2379"
    sts = next(o for o in rendered["overlays/pytorchjob"] if o["kind"] == "StatefulSet")
    assert run_pj.rdzv_endpoint.split(",") == [
        f"etcd-{i}.{sts['spec']['serviceName']}.elastic-trainer.svc:2379" for i in range(sts["spec"]["replicas"])]
    assert {kv["key"]: kv["value"] for kv in policy["rdzvConf"]} == run_pj.rdzv_conf
    assert policy["maxRestarts"] >= 1 and "Master" not in obj["spec"]["pytorchReplicaSpecs"]
    assert policy["minReplicas"] <= obj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] <= policy["maxReplicas"]


@needs_kubectl
def test_rdzv_conf_and_trainer_flags_are_accepted_by_their_parsers(rendered):
    """The options after --rdzv-conf and the flags after `--` reach code with its own checks."""
    try:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from elastic_trainer.flags import build_train_parser
        from elastic_trainer.rendezvous.handler import RendezvousOptions
    except ImportError as exc:
        pytest.skip(f"the rendezvous or trainer module is not there yet: {exc}")
    for path, label, obj, tmpl, container in _trainer_containers(rendered):
        _, run = _run_config(path, container, rendered)
        params = RendezvousParameters(backend=run.rdzv_backend, endpoint=run.rdzv_endpoint, run_id=run.run_id,
                                      min_nodes=run.min_nodes, max_nodes=run.max_nodes, **run.rdzv_conf)
        RendezvousOptions(params)  # raises ValueError naming a bad or unknown option
        args, unknown = build_train_parser().parse_known_args(run.program[2:])
        assert not unknown, f"k8s/{path} {label}: the trainer does not know {unknown}"


# ------------------------------------------------------------------------------------ the workload

@needs_kubectl
def test_indexed_job_replaces_a_pod_only_after_it_has_terminated(rendered):
    for path in rendered:
        for obj in rendered[path]:
            if obj["kind"] != "Job":
                continue
            spec = obj["spec"]
            assert spec["completionMode"] == "Indexed" and spec["podReplacementPolicy"] == "Failed"
            assert 1 <= spec["parallelism"] == spec["completions"] <= 4, "scale parallelism and completions together"
            assert spec["template"]["spec"]["restartPolicy"] == "Never"
            rules = spec["podFailurePolicy"]["rules"]
            assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules


@needs_kubectl
def test_storage_overlays_share_checkpoints_between_pods(rendered):
    for path in rendered:
        objs = rendered[path]
        for _, label, obj, tmpl, container in _trainer_containers({path: objs}):
            _, run = _run_config(path, container, rendered)
            volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
            if path == "base":
                continue  # base alone keeps checkpoints per pod; README says to deploy an overlay
            if run.checkpoint_dir.startswith("s3://"):
                assert _run_config_map(objs)["CHECKPOINT_DIR"] == run.checkpoint_dir
                env = {v["name"]: v for v in container["env"]}
                secret_mounts = {m["mountPath"]: volumes[m["name"]]["secret"]["secretName"]
                                 for m in container["volumeMounts"] if "secret" in volumes[m["name"]]}
                folder = env["AWS_SHARED_CREDENTIALS_FILE"]["value"].rsplit("/", 1)[0]
                assert secret_mounts.get(folder) == "elastic-trainer-s3", f"k8s/{path}: S3 keys come from the Secret"
                assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env), \
                    f"k8s/{path}: static keys in env would override workload identity"
            else:
                assert run.checkpoint_dir.startswith("/checkpoints/"), f"k8s/{path} {label}"
                claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
                pvc = next(o for o in objs if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim)
                assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], f"k8s/{path}: the claim must be RWX"


S3_PATHS = ["overlays/s3", *COMBINED]
# What the EKS pod identity webhook adds to a pod whose ServiceAccount names an IAM role (IRSA).
IRSA_ENV = {"AWS_ROLE_ARN": "arn:aws:iam::111122223333:role/elastic-trainer",
            "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/serviceaccount/token"}


def _credential_method(env: dict[str, str]) -> str | None:
    """Which of botocore's credential providers answers in a process with exactly ``env``."""
    code = ("import botocore.session as s; c = s.Session().get_credentials(); "
            "print(c.method if c else None)")
    clean = {**{k: v for k, v in env.items()}, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
             "AWS_CONFIG_FILE": env.get("AWS_CONFIG_FILE", "/nonexistent/aws-config"),
             "AWS_EC2_METADATA_DISABLED": "true"}
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return None if out.stdout.strip() == "None" else out.stdout.strip()


@needs_kubectl
@pytest.mark.parametrize("path", S3_PATHS)
def test_s3_pods_start_without_the_key_secret_and_web_identity_wins_over_static_keys(rendered, path, tmp_path):
    """IRSA / Workload Identity (what the README recommends): no key Secret, so every reference to it
    must be optional; and where a Secret with static keys exists too, the web identity must win."""
    cms = _config_maps(rendered[path])
    fields = {"metadata.name": "pod-0", "metadata.namespace": "elastic-trainer", "status.podIP": "10.77.0.3"}
    others = {"etcd-client-tls": {"ca.crt": "", "tls.crt": "", "tls.key": ""}}  # required where mounted
    static = {**others, "elastic-trainer-s3": {"credentials": "[default]\naws_access_key_id = testing\n"
                                                              "aws_secret_access_key = testing\n"}}
    for n, (_, label, obj, tmpl, container) in enumerate(_trainer_containers({path: rendered[path]})):
        where = f"k8s/{path} {label}"
        for case, secrets, irsa, expected in [("IRSA, no Secret", others, True, "assume-role-with-web-identity"),
                                              ("IRSA and a key Secret", static, True, "assume-role-with-web-identity"),
                                              ("a key Secret only", static, False, "shared-credentials-file")]:
            root = tmp_path / f"{n}-{len(secrets)}-{irsa}"  # one pod per case
            try:
                env = k8s_pod.container_env(container, cms, secrets, fields)
                claims = {o["metadata"]["name"]: tmp_path / "claim" for o in rendered[path]
                          if o["kind"] == "PersistentVolumeClaim"}
                mounts = k8s_pod.mount_volumes(tmpl["spec"], container, secrets, root,
                                               claims=claims, config_maps=cms)
            except k8s_pod.CreateContainerConfigError as exc:
                pytest.fail(f"{where}, {case}: the pod would not start: {exc}")
            env = {k: k8s_pod.localize(v, mounts) for k, v in env.items()}
            env.update(IRSA_ENV if irsa else {})
            assert _credential_method(env) == expected, f"{where}, {case}"


@needs_kubectl
def test_a_lost_nodes_trainer_pod_is_evicted_after_30_seconds_not_5_minutes(rendered):
    """Kubernetes adds not-ready/unreachable tolerations of 300 s to every pod; the trainers say 30 s,
    in every overlay (the gpu component adds its own toleration beside them, not instead)."""
    for path, label, obj, tmpl, _ in _trainer_containers(rendered):
        tolerations = tmpl["spec"].get("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            found = [t for t in tolerations if t.get("key") == key and t.get("effect") == "NoExecute"]
            assert len(found) == 1 and found[0].get("operator") == "Exists", f"k8s/{path} {label}: {key}"
            assert found[0].get("tolerationSeconds") == 30, f"k8s/{path} {label}: {key} after 30 s"


def _readme_overlay_example() -> dict:
    """The ``my-overlay/kustomization.yaml`` block of k8s/README.md (Deploy, step 1)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (K8S / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "# my-overlay/kustomization.yaml" in b]
    return yaml.safe_load("\n".join(line[3:] if line.startswith("   ") else line for line in block.splitlines()))


@needs_kubectl
@pytest.mark.parametrize("overlay", ["overlays/pvc", "overlays/gpu", "overlays/pytorchjob"])
def test_the_readme_example_pins_every_trainer_image_by_digest(tmp_path, overlay):
    example = _readme_overlay_example()
    folder = tmp_path / "my-overlay"
    folder.mkdir()
    example["resources"] = [os.path.relpath(K8S / overlay, folder)]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(example))
    objs = k8s_pod.kustomize(folder)
    images = {c["image"] for _, _, o, t in _all_templates({overlay: objs}) if o["kind"] != "StatefulSet"
              for c in _containers(t["spec"])}
    assert images and all(re.fullmatch(r"[a-z0-9./-]+/elastic-trainer@sha256:[0-9a-f]{64}", i) for i in images), images


def _operator_counts_against_backoff_limit(replica: dict) -> bool:
    """Whether the training operator's backoffLimit can ever stop this replica's failures.

    training-operator (pkg/controller.v1/common/job.go, PastBackoffLimit, v1.7-v1.9) sums the
    containers' restartCount of the replica's Running pods, for restartPolicy OnFailure or Always
    (v1.8+ also lists ExitCode). With ExitCode a failed pod whose code is retryable (128+: an OOM kill)
    is deleted and created anew, with restartCount 0: nothing ever adds up, and the pod is recreated
    forever. With OnFailure the kubelet restarts the container in place (with its crash-loop
    back-off) and every restart counts."""
    return replica["restartPolicy"] in ("OnFailure", "Always")


@needs_kubectl
def test_a_pytorchjob_that_keeps_failing_is_stopped_by_its_backoff_limit(rendered):
    for path, objs in rendered.items():
        for job in (o for o in objs if o["kind"] == "PyTorchJob"):
            limit = job["spec"]["runPolicy"].get("backoffLimit")
            assert isinstance(limit, int) and 0 < limit <= 50, f"k8s/{path}: runPolicy.backoffLimit"
            for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
                assert replica["restartPolicy"] != "Always", f"k8s/{path} {role}: a finished run must end"
                assert _operator_counts_against_backoff_limit(replica), \
                    f"k8s/{path} {role}: restartPolicy {replica['restartPolicy']} is not counted against backoffLimit"


@needs_kubectl
def test_the_pvc_component_says_which_owner_and_mode_the_shared_volume_needs(rendered):
    """fsGroup is not applied by every CSI driver to ReadWriteMany volumes (NFS-like ones skip it):
    the volume's root must then be made writable for the pods' uid/gid by hand, and the claim says how."""
    text = (K8S / "components" / "pvc" / "pvc.yaml").read_text()
    readme = (K8S / "README.md").read_text()
    for path, label, obj, tmpl, _ in _trainer_containers(rendered):
        sc = tmpl["spec"]["securityContext"]
        owner = f"{sc['runAsUser']}:{sc['fsGroup']}"
        assert owner in text and owner in readme, f"k8s/{path} {label}: name the owner {owner} of the volume"
    assert re.search(r"\b[02]77[05]\b", text), "name the mode, e.g. 0770 or 2770"


@needs_kubectl
def test_gpu_overlay_runs_one_worker_per_gpu(rendered):
    gpu = {p: objs for p, objs in rendered.items() if "gpu" in p}
    assert len(gpu) == 2
    for path, label, obj, tmpl, container in _trainer_containers(gpu):
        _, run = _run_config(path, container, rendered)
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) == run.nproc_per_node > 1, f"k8s/{path} {label}"
        assert container["image"].endswith("-cuda")
        assert _trainer_flag(run.program, "--device") == "cuda", f"k8s/{path} {label}: ask for CUDA explicitly"
        assert any(t["key"] == "nvidia.com/gpu" for t in tmpl["spec"]["tolerations"])
        if obj["kind"] == "PyTorchJob":
            assert obj["spec"]["nprocPerNode"] == str(run.nproc_per_node)


@needs_kubectl
def test_every_trainer_pod_names_its_device(rendered):
    """--device is said, never left to auto: cpu with the CPU image, cuda with the CUDA one (a GPU pod
    whose GPUs torch cannot use then stops with one line instead of training on the CPU)."""
    for path, label, obj, tmpl, container in _trainer_containers(rendered):
        _, run = _run_config(path, container, rendered)
        expected = "cuda" if container["image"].endswith("-cuda") else "cpu"
        assert _trainer_flag(run.program, "--device") == expected, f"k8s/{path} {label}"


# ------------------------------------------------------------------------------------------ etcd

def _etcd_flags(sts: dict) -> dict[str, str]:
    """etcd's flags: the args of the member init container, which writes them to the config file
    that the etcd container starts with (``etcd --config-file``, on the data volume)."""
    spec = sts["spec"]["template"]["spec"]
    [member] = [c for c in spec["initContainers"] if c["name"] == "member"]
    [etcd] = [c for c in spec["containers"] if c["name"] == "etcd"]
    assert member["command"][:3] == ["python", "-m", "elastic_trainer.etcd.member"]
    out = next(a.split("=", 1)[1] for a in member["command"] if a.startswith("--config-out="))
    assert etcd["command"][1:] == [f"--config-file={out}"] and not etcd.get("args")
    data = {m["mountPath"] for m in etcd["volumeMounts"] if m["name"] == "data"}
    assert data == {m["mountPath"] for m in member["volumeMounts"] if m["name"] == "data"} and \
        out.startswith(f"{data.pop()}/"), "the config file must be on the data volume both containers mount"
    return dict(a.lstrip("-").split("=", 1) for a in member["args"])


@needs_kubectl
def test_etcd_members_bootstrap_from_their_stable_dns_names(rendered):
    for path, objs in rendered.items():
        for sts in (o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd"):
            spec = sts["spec"]
            assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
            assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
            peer = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == spec["serviceName"])
            assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True
            args = _etcd_flags(sts)
            members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
            svc = spec["serviceName"]
            assert members == {f"etcd-{i}": f"https://etcd-{i}.{svc}.$(POD_NAMESPACE).svc:2380" for i in range(3)}
            assert args["initial-advertise-peer-urls"] == f"https://$(POD_NAME).{svc}.$(POD_NAMESPACE).svc:2380"
            # Trainers get every member (a client fails over between them), by the names advertised.
            assert args["advertise-client-urls"].split("://")[1] == f"$(POD_NAME).{svc}.$(POD_NAMESPACE).svc:2379"
            assert _run_config_map(objs)["RDZV_ENDPOINT"].split(",") == \
                [f"etcd-{i}.{svc}.{sts['metadata']['namespace']}.svc:2379" for i in range(3)]
            # Dual stack: [::] takes IPv4 and IPv6 clients (etcd_member writes 0.0.0.0 without IPv6);
            # no address literal is advertised.
            for key in ("listen-client-urls", "listen-peer-urls", "listen-metrics-urls"):
                assert args[key].split("://")[1].startswith("[::]:"), f"k8s/{path}: {key}={args[key]}"


@needs_kubectl
def test_etcd_members_never_share_a_node_and_spread_over_zones(rendered):
    """Two members on one node: losing that node loses the quorum. Preferred anti-affinity allows it."""
    for path, objs in rendered.items():
        for sts in (o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd"):
            spec = sts["spec"]["template"]["spec"]
            labels = sts["spec"]["template"]["metadata"]["labels"]
            required = spec["affinity"]["podAntiAffinity"].get("requiredDuringSchedulingIgnoredDuringExecution", [])
            assert any(t["topologyKey"] == "kubernetes.io/hostname" and _selects(t["labelSelector"], labels)
                       for t in required), f"k8s/{path}: etcd members must be on different nodes"
            spread = [c for c in spec.get("topologySpreadConstraints", [])
                      if c["topologyKey"] == "topology.kubernetes.io/zone"]
            assert spread and _selects(spread[0]["labelSelector"], labels) and spread[0]["maxSkew"] == 1, \
                f"k8s/{path}: spread the members over zones"


@needs_kubectl
@pytest.mark.parametrize("path", [*KUSTOMIZATIONS, *COMBINED])
def test_etcd_serves_only_tls_by_default_and_trainers_present_a_client_certificate(rendered, path):
    """Issue 19: whoever reaches etcd's client port can steer the run; with client-certificate TLS
    only a holder of a certificate from the CA gets in (the NetworkPolicy is the second fence).
    Issue 29: the members talk to each other over TLS too, with the same certificates."""
    objs = rendered[path]
    mounted = lambda c, spec: {m["mountPath"]: next((v for v in spec["volumes"] if v["name"] == m["name"]), {})  # noqa: E731
                               for m in c["volumeMounts"]}  # {} for a StatefulSet's claim template
    trainers = _trainer_containers({path: objs})
    assert trainers
    for _, label, _, tmpl, container in trainers:
        _, run = _run_config(path, container, rendered)
        assert run.rdzv_conf["protocol"] == "https", f"k8s/{path} {label}: etcd without TLS"
        assert "password" not in run.rdzv_conf and "password_file" not in run.rdzv_conf
        trainer_mounts = mounted(container, tmpl["spec"])
        for key in ("ca_cert", "cert", "key"):
            folder = run.rdzv_conf[key].rsplit("/", 1)[0]
            assert trainer_mounts[folder]["secret"]["secretName"] == "etcd-client-tls", f"{label}: {key}"
    sts = next((o for o in objs if o["kind"] == "StatefulSet"), None)
    if sts is None:
        return  # overlays/existing-etcd: your etcd, with its CA's client certificate in etcd-client-tls
    args = _etcd_flags(sts)
    assert args["listen-client-urls"].startswith("https://") and args["advertise-client-urls"].startswith("https://")
    assert args["client-cert-auth"] == "true"
    for key in ("listen-peer-urls", "initial-advertise-peer-urls"):
        assert args[key].startswith("https://"), f"k8s/{path}: {key}={args[key]}: peer traffic in clear"
    assert all(m.split("=", 1)[1].startswith("https://") for m in args["initial-cluster"].split(","))
    assert args["peer-client-cert-auth"] == "true"
    # The etcd container serves (clients and peers) with the files; the member init container asks
    # the other members with them (the server certificate carries clientAuth).
    for c in [*sts["spec"]["template"]["spec"]["initContainers"], *sts["spec"]["template"]["spec"]["containers"]]:
        etcd_mounts = mounted(c, sts["spec"]["template"]["spec"])
        for flag in ("trusted-ca-file", "cert-file", "key-file"):
            for prefix in ("", "peer-"):
                folder = args[prefix + flag].rsplit("/", 1)[0]
                assert etcd_mounts[folder]["secret"]["secretName"] == "etcd-server-tls", f"{c['name']}: {prefix}{flag}"


@needs_kubectl
def test_only_trainer_pods_and_peers_reach_etcd(rendered):
    for path, objs in rendered.items():
        etcd = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd"]
        if not etcd:
            continue
        etcd_labels = etcd[0]["spec"]["template"]["metadata"]["labels"]
        policies = [o for o in objs if o["kind"] == "NetworkPolicy" and _selects(o["spec"]["podSelector"], etcd_labels)]
        assert len(policies) == 1, f"k8s/{path}: one NetworkPolicy must select the etcd pods"
        policy = policies[0]["spec"]
        assert policy["policyTypes"] == ["Ingress", "Egress"]
        trainer_labels = [t["metadata"]["labels"] for _, _, o, t in _all_templates({path: objs}) if o is not etcd[0]]
        assert trainer_labels
        for rule in policy["ingress"]:
            peers = rule["from"]
            assert all(set(p) == {"podSelector"} for p in peers), "no namespaceSelector/ipBlock: this namespace only"
            ports = {p["port"] for p in rule["ports"]}
            assert ports <= {2379, 2380}
            for peer in peers:
                is_etcd = _selects(peer["podSelector"], etcd_labels)
                is_trainer = all(_selects(peer["podSelector"], lbl) for lbl in trainer_labels)
                assert is_etcd or is_trainer, f"k8s/{path}: {peer} admits pods that are neither etcd nor trainers"
                assert is_etcd or ports == {2379}, "trainers reach the client port only"
                assert not (is_etcd and is_trainer)


# ------------------------------------------------------------------------------- trainer network

def test_the_network_policy_model_denies_by_default_and_allows_what_a_rule_names():
    pod = lambda **labels: {"ns": "elastic-trainer", "labels": labels}  # noqa: E731
    allow_web = {"kind": "NetworkPolicy", "metadata": {"name": "w", "namespace": "elastic-trainer"},
                 "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                          "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                                       "ports": [{"protocol": "TCP", "port": 80}]}]}}
    assert _allowed([], pod(app="a"), pod(app="b"), 1)
    assert not _allowed([DEFAULT_DENY], pod(app="a"), pod(app="b"), 1)
    assert _allowed([allow_web], pod(app="client"), pod(app="web"), 80)
    assert not _allowed([allow_web], pod(app="client"), pod(app="web"), 81)
    assert not _allowed([allow_web], {"ns": "other", "labels": {"app": "client"}}, pod(app="web"), 80)


@needs_kubectl
@pytest.mark.parametrize("path", [p for p in [*KUSTOMIZATIONS, *COMBINED]])
def test_trainers_reach_each_other_dns_etcd_and_storage_under_default_deny_and_nothing_else_reaches_them(
        rendered, path):
    objs = rendered[path]
    policies = [copy.deepcopy(DEFAULT_DENY)] + [o for o in objs if o["kind"] == "NetworkPolicy"]
    trainers = {json.dumps(t["metadata"]["labels"], sort_keys=True): t["metadata"]["labels"]
                for _, _, o, t in _all_templates({path: objs}) if o["kind"] != "StatefulSet"}
    assert trainers
    etcd = [t["metadata"]["labels"] for _, _, o, t in _all_templates({path: objs}) if o["kind"] == "StatefulSet"]
    dns = {"ns": "kube-system", "labels": {"k8s-app": "kube-dns"}}
    for labels in trainers.values():
        me, peer = {"ns": "elastic-trainer", "labels": labels}, {"ns": "elastic-trainer", "labels": labels}
        where = f"k8s/{path} trainer {labels}"
        for port in (29500, 29400, 45123, 60999):  # rank 0's store, gloo/NCCL: any port
            assert _allowed(policies, me, peer, port), f"{where}: trainer to trainer on {port}"
        assert _allowed(policies, me, dns, 53, "UDP") and _allowed(policies, me, dns, 53, "TCP"), f"{where}: DNS"
        assert _allowed(policies, me, {"ip": "52.216.0.1"}, 443), f"{where}: S3 / W&B over HTTPS"
        for stranger in ({"ns": "elastic-trainer", "labels": {"app": "debug"}},
                         {"ns": "other", "labels": labels}, {"ip": "203.0.113.9"}):
            assert not _allowed(policies, stranger, me, 29500), f"{where}: {stranger} must not reach the store"
        assert not _allowed(policies, me, {"ip": "203.0.113.9"}, 22), f"{where}: egress is not open"
        for member in etcd:
            pod = {"ns": "elastic-trainer", "labels": member}
            assert _allowed(policies, me, pod, 2379), f"{where}: etcd's client port"
            assert not _allowed(policies, me, pod, 2380), f"{where}: etcd's peer port"
        if path == "overlays/existing-etcd":
            assert _allowed(policies, me, {"ip": "192.0.2.10"}, 2379), f"{where}: the etcd outside"
    for member in etcd:  # the members find each other by name and talk on both ports
        pod = {"ns": "elastic-trainer", "labels": member}
        assert _allowed(policies, pod, pod, 2380) and _allowed(policies, pod, pod, 2379), f"k8s/{path}: etcd peers"
        assert _allowed(policies, pod, dns, 53, "UDP"), f"k8s/{path}: etcd's DNS"
        assert not _allowed(policies, pod, {"ip": "203.0.113.9"}, 443), f"k8s/{path}: etcd needs no other egress"


# ---------------------------------------------------------------------------- pod security standard

RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}


@needs_kubectl
def test_namespace_enforces_the_restricted_pod_security_standard(rendered):
    for path, objs in rendered.items():
        ns = next(o for o in objs if o["kind"] == "Namespace")
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted", path


@needs_kubectl
def test_every_pod_template_meets_the_restricted_pod_security_standard(rendered):
    templates = _all_templates(rendered)
    assert {o["kind"] for _, _, o, _ in templates} >= {"Job", "StatefulSet", "PyTorchJob"}
    problems = []
    for path, label, obj, tmpl in templates:
        spec = tmpl["spec"]
        pod_sc = spec.get("securityContext", {})
        where = f"k8s/{path} {label}"
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(key):
                problems.append(f"{where}: {key}")
        for vol in spec.get("volumes", []):
            kinds = set(vol) - {"name"}
            if not kinds <= RESTRICTED_VOLUME_TYPES:
                problems.append(f"{where}: volume {vol['name']} of type {kinds}")
        if pod_sc.get("runAsUser") == 0 or pod_sc.get("runAsGroup") == 0:
            problems.append(f"{where}: pod runs as root")
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: mounts a service account token it does not need")
        if "terminationGracePeriodSeconds" not in spec:
            problems.append(f"{where}: no terminationGracePeriodSeconds")
        mounts_needed = {"/tmp"} if obj["kind"] != "StatefulSet" else set()
        for c in _containers(spec):
            sc, cw = c.get("securityContext", {}), f"{where} container {c['name']}"
            effective = lambda key: sc.get(key, pod_sc.get(key))  # noqa: E731
            if effective("runAsNonRoot") is not True:
                problems.append(f"{cw}: runAsNonRoot is not true")
            if not isinstance(effective("runAsUser"), int) or effective("runAsUser") == 0:
                problems.append(f"{cw}: runAsUser must be a non-zero uid (the image's USER is not checked here)")
            if (effective("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{cw}: seccompProfile must be RuntimeDefault")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{cw}: allowPrivilegeEscalation is not false")
            if sc.get("privileged"):
                problems.append(f"{cw}: privileged")
            caps = sc.get("capabilities", {})
            if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
                problems.append(f"{cw}: capabilities must drop ALL and add at most NET_BIND_SERVICE")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{cw}: readOnlyRootFilesystem is not true")
            if any(p.get("hostPort") for p in c.get("ports", [])):
                problems.append(f"{cw}: hostPort")
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                if not {"cpu", "memory"} <= set(resources.get(kind, {})):
                    problems.append(f"{cw}: resources.{kind} needs cpu and memory")
            if c in spec["containers"] and not mounts_needed <= {m["mountPath"] for m in c.get("volumeMounts", [])}:
                problems.append(f"{cw}: mount a writable emptyDir at {mounts_needed}")
    assert not problems, "\n".join(problems)


# -------------------------------------------------------------------------------------- secrets

SECRET_PATTERNS = {
    "AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "AWS secret access key": re.compile(r"(?i)aws.{0,20}secret.{0,20}[:=]\s*['\"]?[A-Za-z0-9/+=]{40}\b"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "W&B API key": re.compile(r"(?i)wandb.{0,30}[:=]\s*['\"]?[0-9a-f]{40}\b"),
}


def _manifest_files() -> list[Path]:
    files = [p for p in K8S.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".json")]
    return files + [REPO / "Dockerfile", REPO / ".dockerignore"]


def test_no_manifest_contains_a_secret_value():
    for path in _manifest_files():
        text = path.read_text()
        for what, pattern in SECRET_PATTERNS.items():
            assert not pattern.search(text), f"{path.relative_to(REPO)} looks like it holds a {what}"
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(text):
                if isinstance(doc, dict) and doc.get("kind") == "Secret":
                    pytest.fail(f"{path.relative_to(REPO)}: Secrets are created by the user (README), not kept here")


@needs_kubectl
def test_rendered_env_takes_credentials_from_secrets_only(rendered):
    sensitive = re.compile(r"(?i)(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)")
    for path, objs in rendered.items():
        assert not [o for o in objs if o["kind"] == "Secret"], f"k8s/{path} renders a Secret"
        for _, label, _, tmpl in _all_templates({path: objs}):
            secret_volumes = {v["name"] for v in tmpl["spec"].get("volumes", []) if "secret" in v}
            for c in _containers(tmpl["spec"]):
                secret_folders = tuple(m["mountPath"] + "/" for m in c.get("volumeMounts", [])
                                       if m["name"] in secret_volumes)
                for var in c.get("env", []):
                    if var["name"].endswith("_FILE") and var.get("value", "").startswith(secret_folders or ("\0",)):
                        continue  # the path of a file in a mounted Secret
                    if sensitive.search(var["name"]):
                        assert "secretKeyRef" in var.get("valueFrom", {}), \
                            f"k8s/{path} {label}: {var['name']} must come from a Secret (secretKeyRef)"
        for cm in (o for o in objs if o["kind"] == "ConfigMap"):
            assert not [k for k in cm.get("data", {}) if sensitive.search(k)], f"k8s/{path}: secret-like key in {_name(cm)}"


@needs_kubectl
def test_trainer_pods_get_every_secret_as_a_file_and_the_wandb_key_from_an_optional_secret(rendered):
    """Issue 21: secrets as files, not env (every process of a pod inherits its env). The W&B key is
    a file in the optional Secret elastic-trainer-wandb, so pods start (and log offline) without it."""
    for path, label, _, tmpl, c in _trainer_containers(rendered):
        assert not [v["name"] for v in c.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})], \
            f"k8s/{path} {label}: a secret in the environment"
        env = {v["name"]: v.get("value") for v in c.get("env", [])}
        key_file = env.get("ELASTIC_TRAINER_WANDB_KEY_FILE")
        assert key_file, f"k8s/{path} {label}: no W&B key file"
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        folder = key_file.rsplit("/", 1)[0]
        volume = next(v for v in tmpl["spec"]["volumes"] if v["name"] == mounts[folder])
        assert volume["secret"] == {"secretName": "elastic-trainer-wandb", "optional": True, "defaultMode": 0o440}
        assert key_file.rsplit("/", 1)[1] == "api-key"  # the Secret's key, as the README creates it


# ------------------------------------------------------------------------------------- Dockerfile

def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_dockerfile_builds_cpu_and_cuda_variants_and_runs_as_non_root():
    steps = _dockerfile()
    froms = [a for i, a in steps if i == "FROM"]
    assert froms and all(a.split()[0].startswith("python:3.11-slim") for a in froms), froms
    args = {a.split("=", 1)[0]: (a.split("=", 1) + [""])[1] for i, a in steps if i == "ARG"}
    assert args.get("TORCH_VARIANT") == "cpu", "ARG TORCH_VARIANT=cpu (or cu126, cu128, ...) picks the torch build"
    runs = " ".join(a for i, a in steps if i == "RUN")
    assert 'torch==${TORCH_VERSION}+cpu' in runs and 'torch==${TORCH_VERSION}+${TORCH_VARIANT}' in runs
    # CUDA images carry the RDMA user libraries NCCL opens for InfiniBand/RoCE (else: TCP sockets, silently)
    assert "libibverbs1" in runs and "ibverbs-providers" in runs
    text = (REPO / "Dockerfile").read_text()
    for variant, driver in (("cu126", "560.28"), ("cu128", "570.26")):  # the driver each CUDA build needs
        assert re.search(rf"{variant} >= {re.escape(driver)}", text), f"say which driver {variant} needs"
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"} <= set(args), "the builder passes pip its indexes"
    assert "://" not in runs, "the Dockerfile names no package index (pip gets them from build args)"
    users = [a for i, a in steps if i == "USER"]
    assert users, "the image must set USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit() and int(user) == 10001, \
        f"USER {users[-1]}: use the numeric uid the manifests run as (10001)"
    assert not [a for i, a in steps if i in ("ENV", "ARG") and re.search(r"(?i)(KEY|SECRET|TOKEN|PASSWORD)", a)]
    entry = [a for i, a in steps if i == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1])[0] == "tini"


def test_dockerignore_keeps_local_state_out_of_the_image():
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", "runs", "checkpoints", "wandb"} <= {i.strip("/*") for i in ignored}
