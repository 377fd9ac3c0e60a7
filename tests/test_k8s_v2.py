"""Offline checks of the Kubeflow Trainer v2 overlay, the Kueue component and the Chaos Mesh drills.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_k8s_v2.py

``k8s/overlays/trainer-v2`` is built with ``kubectl kustomize`` and its TrainJob and TrainingRuntime
are validated against the schemas in k8s/schemas/ (written from Kubeflow Trainer v2.3.0's CRDs);
tests/test_k8s.py runs its generic checks on the runtime's pod as well (Restricted PSS, the
``elastic-train`` command, network policies). ``k8s/components/kueue`` is built onto each workload
flavour. The experiments in ``k8s/drills/`` are validated against Chaos Mesh v2.8.3's schemas, and
their selectors are evaluated, with Chaos Mesh's rules, over the pods the controllers would create
from the rendered manifests (each pod: its template's labels plus the labels its controller adds,
as documented by Kubernetes, Kubeflow and JobSet), to show which pods each fault strikes.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_trainer.cli import launch
from elastic_trainer.drill.kinds import FAULTS
from elastic_trainer.rendezvous.handler import RendezvousOptions
from tests.helpers import k8s_pod, k8s_schemas

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
DRILLS = sorted((K8S / "drills").glob("*.yaml"))
K8S_VERSION = "1.31"  # as tests/test_k8s.py
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # the Job controller's, on Indexed Job pods
# The workload flavours and their workload kind: the drills must work on the first two as written.
FLAVOURS = {"overlays/pvc": "Job", "overlays/trainer-v2": "TrainJob", "overlays/pytorchjob": "PyTorchJob"}
POD_FIELDS = {"metadata.name": "pod-0", "metadata.namespace": "elastic-trainer", "status.podIP": "10.77.0.3"}

kubectl = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(kubectl is None, reason="kubectl is not installed: cannot run `kubectl kustomize`")


def _build_with(tmp_path: Path, base: str, components: list[str] = (), **extra) -> list[dict]:
    """``base`` (a path under k8s/) with components and any other kustomization keys, built."""
    folder = tmp_path / f"kustomize-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    rel = lambda p: os.path.relpath(K8S / p, folder)  # noqa: E731 - kustomize refuses absolute paths
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [rel(base)], "components": [rel(f"components/{c}") for c in components], **extra}))
    return k8s_pod.kustomize(folder)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {path: k8s_pod.kustomize(K8S / path) for path in FLAVOURS}


def _one(objs: list[dict], kind: str) -> dict:
    [obj] = [o for o in objs if o["kind"] == kind]
    return obj


def _config_maps(objs: list[dict]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}


def _run_config(objs: list[dict]) -> dict[str, str]:
    [data] = [d for n, d in _config_maps(objs).items() if n.startswith("elastic-trainer-config-")]
    return data


def _runtime_job(objs: list[dict]) -> dict:
    """The TrainingRuntime's replicated Job that runs the trainer (the one Trainer v2 gives numNodes pods)."""
    runtime = _one(objs, "TrainingRuntime")
    [job] = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]
             if j["template"]["metadata"]["labels"].get(ANCESTOR_LABEL) == "trainer"]
    return job


def _trainer_pod_spec(objs: list[dict]) -> dict:
    """The trainer pods' spec, whichever the workload kind."""
    [workload] = [o for o in objs if o["kind"] in ("Job", "TrainJob", "PyTorchJob")]
    if workload["kind"] == "TrainJob":
        return _runtime_job(objs)["template"]["spec"]["template"]["spec"]
    if workload["kind"] == "PyTorchJob":
        return workload["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return workload["spec"]["template"]["spec"]


def _trainer_argv(container: dict, objs: list[dict]) -> list[str]:
    """The container's command line as the kubelet runs it (env from the rendered ConfigMaps)."""
    env = k8s_pod.container_env(container, _config_maps(objs), secrets={}, fields=POD_FIELDS)
    return [k8s_pod.expand(t, env) for t in [*container["command"], *container["args"]]]


def _run(container: dict, objs: list[dict]):
    argv = _trainer_argv(container, objs)
    assert not [t for t in argv if "$(" in t], f"unresolved $(VAR) in {argv}"
    return launch.parse_run_config(argv[argv.index("elastic-train") + 1:])


# ------------------------------------------------------------------------------ Trainer v2 overlay

@pytest.mark.parametrize("version", [K8S_VERSION, "latest"])
def test_trainjob_and_runtime_validate_and_the_trainjob_names_the_rendered_runtime(rendered, version):
    from kubernetes_validate import utils

    version = utils.major_minor(utils.latest_version()) if version == "latest" else version
    objs = rendered["overlays/trainer-v2"]
    job, runtime = _one(objs, "TrainJob"), _one(objs, "TrainingRuntime")
    for obj in (job, runtime):
        errors = [f"{'.'.join(map(str, e.path))}: {e.message[:200]}"
                  for e in k8s_schemas.validator_for(obj, version).iter_errors(obj)]
        assert not errors, f"{obj['kind']}: " + "\n".join(errors)
    ref = job["spec"]["runtimeRef"]
    # The CRD's default kind is ClusterTrainingRuntime: ours is namespaced, so the kind must be said.
    assert (ref["apiGroup"], ref["kind"], ref["name"]) == ("trainer.kubeflow.org", "TrainingRuntime",
                                                          runtime["metadata"]["name"])
    assert job["metadata"]["namespace"] == runtime["metadata"]["namespace"] == "elastic-trainer"
    assert "torch" in runtime["spec"]["mlPolicy"], "the torch plugin sets the trainer Job's pod count from numNodes"


def test_a_name_prefix_keeps_the_trainjob_on_its_runtime_and_the_runtime_on_its_config_map(tmp_path):
    """overlays/trainer-v2/kustomizeconfig.yaml tells kustomize where these custom kinds name other
    objects: renamed objects (a namePrefix, the ConfigMap's hash) must be renamed there too."""
    objs = _build_with(tmp_path, "overlays/trainer-v2", namePrefix="exp1-")
    job, runtime = _one(objs, "TrainJob"), _one(objs, "TrainingRuntime")
    assert runtime["metadata"]["name"] == "exp1-elastic-trainer" == job["spec"]["runtimeRef"]["name"]
    [config_map] = _config_maps(objs)
    pod = _trainer_pod_spec(objs)
    refs = {v["valueFrom"]["configMapKeyRef"]["name"] for c in pod["containers"] + pod["initContainers"]
            for v in c["env"] if "configMapKeyRef" in v.get("valueFrom", {})}
    assert config_map.startswith("exp1-elastic-trainer-config-") and refs == {config_map}


def test_the_trainjobs_node_count_is_the_pod_count_and_within_the_agents_bounds(rendered, tmp_path):
    """numNodes is the one knob: Trainer v2 gives the trainer Job that many pods (parallelism and
    completions), each an elastic agent that accepts 1..--max-nodes nodes; a count above
    --max-nodes would leave pods waiting as spares, one of 0 is refused by the schema."""
    def pods_and_bounds(objs):
        run = _run(_trainer_pod_spec(objs)["containers"][0], objs)
        pods = [p for p in _pods(objs) if p["workload"] == "TrainJob"]
        return len(pods), run.min_nodes, run.max_nodes

    objs = rendered["overlays/trainer-v2"]
    assert _one(objs, "TrainJob")["spec"]["trainer"]["numNodes"] == \
        _one(objs, "TrainingRuntime")["spec"]["mlPolicy"]["numNodes"] == 2
    assert pods_and_bounds(objs) == (2, 1, 4)
    # A user's overlay that sets another count: the pods follow, the agents' bounds hold it.
    resized = _build_with(tmp_path, "overlays/trainer-v2", patches=[{
        "target": {"kind": "TrainJob"}, "patch": yaml.safe_dump([{"op": "replace", "path": "/spec/trainer/numNodes",
                                                                  "value": 4}])}])
    assert pods_and_bounds(resized) == (4, 1, 4)
    assert k8s_schemas.validator_for(_one(resized, "TrainJob"), K8S_VERSION).is_valid(_one(resized, "TrainJob"))


def test_the_runtime_runs_the_jobs_pod_with_the_container_trainer_v2_expects(rendered):
    """overlays/trainer-v2/trainingruntime.yaml copies base/job/job.yaml's pod: keep them equal but for
    the container's name ("node", where Trainer v2 puts its settings)."""
    job = _one(rendered["overlays/pvc"], "Job")
    rjob = _runtime_job(rendered["overlays/trainer-v2"])
    assert rjob.get("replicas", 1) == 1 and rjob["name"] == "node"
    job_pod, rt_pod = copy.deepcopy(job["spec"]["template"]), copy.deepcopy(rjob["template"]["spec"]["template"])
    assert rt_pod["spec"]["containers"][0]["name"] == "node"
    rt_pod["spec"]["containers"][0]["name"] = "trainer"
    assert rt_pod == job_pod, "overlays/trainer-v2/trainingruntime.yaml drifted from base/job/job.yaml"
    # The Job's failure handling too: an index is replaced only once its pod has terminated.
    spec = {k: v for k, v in rjob["template"]["spec"].items() if k != "template"}
    assert spec == {k: job["spec"][k] for k in ("completionMode", "podReplacementPolicy", "backoffLimitPerIndex",
                                                "podFailurePolicy")}
    policy = _one(rendered["overlays/trainer-v2"], "TrainingRuntime")["spec"]["template"]["spec"]["failurePolicy"]
    assert policy["restartStrategy"] == "BlockingRecreate", "a JobSet restart must not overlap two generations"


def test_the_schemas_reject_what_trainer_v2_and_chaos_mesh_reject(rendered):
    """Each change below is refused by the CRD's schema, its CEL rules or the admission webhook (but
    the one marked "ours", a stricter rule of our schema); the schemas must refuse it too, or the
    validation above could never fail."""
    objs = rendered["overlays/trainer-v2"]
    drills = {d["metadata"]["name"]: d for d in (yaml.safe_load(p.read_text()) for p in DRILLS)}
    originals = [_one(objs, "TrainJob"), _one(objs, "TrainingRuntime"), *drills.values()]

    def broken(obj: dict, change) -> list[str]:
        bad = copy.deepcopy(obj)
        change(bad)
        return [e.message for e in k8s_schemas.validator_for(bad, K8S_VERSION).iter_errors(bad)]

    for obj in originals:
        assert not broken(obj, lambda o: None), obj["metadata"]["name"]
    job, runtime = originals[:2]
    trainer = lambda o: o["spec"]["trainer"]  # noqa: E731
    rjob = lambda o: o["spec"]["template"]["spec"]["replicatedJobs"][0]  # noqa: E731
    pod = lambda o: rjob(o)["template"]["spec"]["template"]["spec"]  # noqa: E731
    cases = {
        "TrainJob: numNode (a typo)": (job, lambda o: trainer(o).update(numNode=2)),
        "TrainJob: numNodes as a string": (job, lambda o: trainer(o).update(numNodes="2")),
        "TrainJob: numNodes 0 (ours)": (job, lambda o: trainer(o).update(numNodes=0)),
        "TrainJob: a reserved PET_ variable": (job, lambda o: trainer(o).update(env=[{"name": "PET_NNODES",
                                                                                     "value": "2"}])),
        "TrainJob: a runtime kind the webhook does not know": (job, lambda o: o["spec"]["runtimeRef"].update(
            kind="Runtime")),
        "TrainJob: no runtimeRef": (job, lambda o: o["spec"].pop("runtimeRef")),
        "TrainJob: a name that is no RFC 1035 label": (job, lambda o: o["metadata"].update(name="Elastic.Train")),
        "TrainingRuntime: no container named node": (runtime, lambda o: pod(o)["containers"][0].update(name="trainer")),
        "TrainingRuntime: 2 replicas of the trainer Job": (runtime, lambda o: rjob(o).update(replicas=2)),
        "TrainingRuntime: two ML policies": (runtime, lambda o: o["spec"]["mlPolicy"].update(mpi={})),
        "TrainingRuntime: an unknown restart strategy": (runtime, lambda o: o["spec"]["template"]["spec"]
                                                         ["failurePolicy"].update(restartStrategy="Sometimes")),
        "TrainingRuntime: a pod field that does not exist": (runtime, lambda o: pod(o).update(restartPolicyy="Never")),
        "PodChaos: pod-kil": (drills["elastic-train-pod-kill"], lambda o: o["spec"].update(action="pod-kil")),
        "PodChaos: mode fixed without a value": (drills["elastic-train-pod-kill"],
                                                 lambda o: o["spec"].update(mode="fixed")),
        "PodChaos: labelSelector (a typo)": (drills["elastic-train-pod-term"],
                                             lambda o: o["spec"]["selector"].update(labelSelector={})),
        "NetworkChaos: a duration Go cannot parse": (drills["elastic-train-partition"],
                                                     lambda o: o["spec"].update(duration="1 minute")),
        "NetworkChaos: direction sideways": (drills["elastic-train-partition"],
                                             lambda o: o["spec"].update(direction="sideways")),
        "NetworkChaos: a target without a selector": (drills["elastic-train-partition"],
                                                      lambda o: o["spec"]["target"].pop("selector")),
    }
    accepted = [case for case, (obj, change) in cases.items() if not broken(obj, change)]
    assert not accepted, f"the schemas accept: {accepted}"


# ------------------------------------------------------------------------------------------- Kueue

@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_kueue_queue_label_is_on_the_workload_only_and_only_with_the_component(rendered, flavour, tmp_path):
    without = rendered[flavour]
    assert QUEUE_LABEL not in yaml.safe_dump_all(without), f"k8s/{flavour} queues in Kueue without the component"
    queued = _build_with(tmp_path, flavour, ["kueue"])
    labelled = {(o["kind"], o["metadata"]["name"]) for o in queued if QUEUE_LABEL in o["metadata"].get("labels", {})}
    workload = _one(queued, FLAVOURS[flavour])
    assert labelled == {(workload["kind"], workload["metadata"]["name"])}, labelled
    assert workload["metadata"]["labels"][QUEUE_LABEL] == "elastic-trainer"
    # Nothing else changed: the same objects, the workload's labels aside.
    unlabelled = copy.deepcopy(workload)
    del unlabelled["metadata"]["labels"][QUEUE_LABEL]
    assert [unlabelled if o is workload else o for o in queued] == without
    check = k8s_schemas.validator_for(workload, K8S_VERSION)
    assert check is None or check.is_valid(workload)


def test_the_readmes_kueue_example_queues_the_trainjob(tmp_path):
    blocks = re.findall(r"```yaml\n(.*?)```", (K8S / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "# my-queued-job/kustomization.yaml" in b]
    example = yaml.safe_load(block)
    folder = tmp_path / "my-queued-job"
    folder.mkdir()
    # The example sits beside a checkout of the repository (../k8s/...): point it at this one.
    fix = lambda p: os.path.relpath(K8S / p.removeprefix("../k8s/"), folder)  # noqa: E731
    example = {**example, "resources": [fix(p) for p in example["resources"]],
               "components": [fix(p) for p in example["components"]]}
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(example))
    assert _one(k8s_pod.kustomize(folder), "TrainJob")["metadata"]["labels"][QUEUE_LABEL] == "elastic-trainer"


# ------------------------------------------------------------------------------------------ drills

def test_every_drill_validates_and_names_the_elastic_train_drill_fault_it_runs():
    assert {p.name for p in DRILLS} == {"pod-kill.yaml", "pod-term.yaml", "network-partition.yaml"}
    readme = (K8S / "README.md").read_text()
    for path in DRILLS:
        text = path.read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
        assert len(docs) == 1, f"{path.name}: one experiment per file, applied one at a time"
        obj = docs[0]
        errors = [e.message for e in k8s_schemas.validator_for(obj, K8S_VERSION).iter_errors(obj)]
        assert not errors, f"k8s/drills/{path.name}: {errors}"
        assert obj["metadata"]["namespace"] == "elastic-trainer"
        assert obj["spec"]["selector"]["namespaces"] == ["elastic-trainer"]
        kind = re.search(r"^# Drill fault `([a-z0-9-]+)`", text, re.M)
        assert kind and kind[1] in FAULTS, f"k8s/drills/{path.name}: name the drill fault kind it runs"
        assert f"drills/{path.name}" in readme and f"`{kind[1]}`" in readme, f"k8s/README.md: explain {path.name}"


def _pods(objs: list[dict]) -> list[dict]:
    """The pods the controllers would create from the rendered workloads, with the labels they add.

    Indexed Job (and the Job a TrainJob's JobSet makes): ``batch.kubernetes.io/job-completion-index``
    (Kubernetes >= 1.28); JobSet adds its own ``jobset.sigs.k8s.io/*`` labels; the training operator:
    ``training.kubeflow.org/replica-index``; a StatefulSet: ``apps.kubernetes.io/pod-index``."""
    pods = []
    for o in objs:
        kind = o["kind"]
        if kind == "Job":
            tmpl, count, index_key, extra = o["spec"]["template"], o["spec"]["parallelism"], INDEX_LABEL, {}
        elif kind == "TrainJob":
            rjob = _runtime_job(objs)
            tmpl, count, index_key = rjob["template"]["spec"]["template"], o["spec"]["trainer"]["numNodes"], INDEX_LABEL
            extra = {"jobset.sigs.k8s.io/jobset-name": o["metadata"]["name"],
                     "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"], "jobset.sigs.k8s.io/job-index": "0"}
        elif kind == "PyTorchJob":
            worker = o["spec"]["pytorchReplicaSpecs"]["Worker"]
            tmpl, count, index_key = worker["template"], worker["replicas"], "training.kubeflow.org/replica-index"
            extra = {"training.kubeflow.org/replica-type": "worker"}
        elif kind == "StatefulSet":
            tmpl, count, extra = o["spec"]["template"], o["spec"]["replicas"], {}
            index_key = "apps.kubernetes.io/pod-index"
        else:
            continue
        for i in range(count):
            pods.append({"name": f"{o['metadata']['name']}-{i}", "namespace": o["metadata"]["namespace"],
                         "phase": "Running", "workload": kind,
                         "labels": {**tmpl["metadata"]["labels"], **extra, index_key: str(i)}})
    return pods


def _matches(selector: dict, pod: dict) -> bool:
    """Chaos Mesh's pod selection (pkg/selector): every given criterion must hold; labelSelectors and
    expressionSelectors make one Kubernetes LabelSelector (matchLabels, matchExpressions), so NotIn
    also matches a pod without the key."""
    labels = pod["labels"]
    if selector.get("namespaces") and pod["namespace"] not in selector["namespaces"]:
        return False
    if any(labels.get(k) != v for k, v in selector.get("labelSelectors", {}).items()):
        return False
    if selector.get("podPhaseSelectors") and pod["phase"] not in selector["podPhaseSelectors"]:
        return False
    for req in selector.get("expressionSelectors", []):
        key, op, values = req["key"], req["operator"], req.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    unsupported = set(selector) - {"namespaces", "labelSelectors", "podPhaseSelectors", "expressionSelectors"}
    assert not unsupported, f"the model does not know {unsupported}"
    return True


def _drill(name: str) -> dict:
    return yaml.safe_load((K8S / "drills" / name).read_text())


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("drill", ["pod-kill.yaml", "pod-term.yaml"])
def test_pod_kill_drills_strike_one_trainer_pod_and_never_etcd(rendered, flavour, drill):
    chaos = _drill(drill)["spec"]
    pods = _pods(rendered[flavour])
    trainers = [p for p in pods if p["workload"] != "StatefulSet"]
    assert len(trainers) >= 2 and any(p["workload"] == "StatefulSet" for p in pods)
    assert [p for p in pods if _matches(chaos["selector"], p)] == trainers, f"{drill} on k8s/{flavour}"
    assert chaos["action"] == "pod-kill" and chaos["mode"] == "one"
    spec = _trainer_pod_spec(rendered[flavour])
    if drill == "pod-kill.yaml":
        assert chaos["gracePeriod"] == 0, "kill: SIGKILL, no time to save"
    else:  # term: the pod's own grace period, longer than the trainer's save on SIGTERM
        args = spec["containers"][0]["args"]
        save = float(args[args.index("--grace-seconds") + 1])
        assert chaos["gracePeriod"] == spec["terminationGracePeriodSeconds"] > save


@pytest.mark.parametrize("flavour", ["overlays/pvc", "overlays/trainer-v2"])
def test_the_partition_isolates_one_trainer_pod_from_the_others_and_from_etcd_past_its_lease(rendered, flavour):
    chaos = _drill("network-partition.yaml")["spec"]
    objs = rendered[flavour]
    pods = _pods(objs)
    cut = [p for p in pods if _matches(chaos["selector"], p)]
    others = [p for p in pods if _matches(chaos["target"]["selector"], p)]
    assert len(cut) == 1 and cut[0]["workload"] != "StatefulSet" and cut[0]["labels"][INDEX_LABEL] == "1"
    assert cut[0] not in others, "a pod in its own target would lose its own address"
    assert sorted(p["name"] for p in others) == sorted(p["name"] for p in pods if p is not cut[0])
    assert {p["workload"] for p in others} == {"StatefulSet", FLAVOURS[flavour]}
    assert chaos["action"] == "partition" and chaos["direction"] == "both" and chaos["target"]["mode"] == "all"
    # Longer than the lease, so that the others drop the pod (the drill's `cut` does the same).
    run = _run(_trainer_pod_spec(objs)["containers"][0], objs)
    params = RendezvousParameters(backend=run.rdzv_backend, endpoint=run.rdzv_endpoint, run_id=run.run_id,
                                  min_nodes=run.min_nodes, max_nodes=run.max_nodes, **run.rdzv_conf)
    seconds = float(re.fullmatch(r"(\d+)s", chaos["duration"])[1])
    assert seconds > 10 * RendezvousOptions(params).lease_ttl


def test_the_partition_on_a_pytorchjob_needs_its_own_index_label(rendered):
    """The PyTorchJob's pods carry no job-completion-index (the README and the file say which label to
    use): as written, the partition selects none of them (Chaos Mesh reports that no pod is selected)."""
    pods = _pods(rendered["overlays/pytorchjob"])
    chaos = _drill("network-partition.yaml")["spec"]
    assert not [p for p in pods if _matches(chaos["selector"], p)]
    readme = (K8S / "README.md").read_text()
    assert "training.kubeflow.org/replica-index" in readme and \
        "training.kubeflow.org/replica-index" in (K8S / "drills" / "network-partition.yaml").read_text()
