"""The manifests run as they are written: each rendered pod as processes in a network namespace.

There is no cluster here, so this test does what the kubelet would with the rendered objects: it
builds an overlay with ``kubectl kustomize``, takes the etcd StatefulSet's and the trainer pods'
containers (from the Job, the PyTorchJob or the TrainJob's TrainingRuntime: command, args, env from
the hashed ConfigMap, the downward-API fields, the variables and labels the controllers add,
Secrets as mounted files: TLS certificates made by ``elastic-train etcd certs``), and runs each
"pod" in a network namespace of its own on a bridge, with a hosts file that gives the etcd members
the names their clients use (``etcd-N.etcd-peer.elastic-trainer.svc``, the headless Service's).

* ``base``: the three etcd members start from the StatefulSet's own init container and command
  line; two trainer pods train; then one trainer pod is killed and the member the trainers use
  first loses its network (a lost node), and the other trainer pod must train on in the same worker
  process. The member then comes back with an empty volume (a lost PVC) and must rejoin as a new
  member and serve.
* ``s3``, ``pytorchjob``, ``trainer-v2``: they render base's StatefulSet (checked) and the same
  trainer command line: base's Job pod with the S3 component's volume and settings, or a copy of
  overlays/pvc's Job pod that ``test_k8s.py`` and ``test_k8s_v2.py`` keep equal to it but for the
  container's name. On one StatefulSet's etcd, each overlay's two pods, as its controller makes them
  (the env, labels and annotations it adds), start and train together in a world of 2. The losses
  above are not run again for each (each full run cost ~80-110 s of the suite at load 10-12, and
  how a pod survives them is the command line's and the ConfigMap's, which base's run covers; what
  differs between the overlays is what makes the pods start and meet, which this checks). ``pvc``
  is not run: its Job's pod is the PyTorchJob's and the TrainingRuntime's, with the same ConfigMap
  (both overlays take components/pvc).
* ``existing-etcd``: no StatefulSet; the etcd its user runs is three plain ``etcd`` members at the
  names RDZV_ENDPOINT gives (``etcd-N.etcd.platform.svc``), with TLS; its two pods train together.
* ``gpu``: its pod on this CPU-only machine must stop at once with one line (no GPU here to train on).

Every run but ``base``'s shortens one value of the rendered ConfigMap, the first rendezvous's
``last_call_timeout`` (``_short_last_call``).

Needs root (``ip netns``), kubectl and etcd; slow (30 to 100 s per test).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_k8s_run.py
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import k8s_pod
from tests.helpers.common import REPO, Processes, wait_until

kubectl = shutil.which("kubectl")
etcd_binary = shutil.which("etcd")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(kubectl is None or etcd_binary is None or os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs kubectl, etcd, root and iproute2 (network namespaces)"),
]

NAMESPACE = "elastic-trainer"


@functools.cache
def _rendered(overlay: str) -> list[dict]:
    return k8s_pod.kustomize(REPO / "k8s" / overlay)


def _render(overlay: str) -> list[dict]:
    """The overlay's objects, each ``kubectl kustomize`` once per session (``base``'s is also what
    every other overlay's StatefulSet is compared with); a copy the test may change."""
    return copy.deepcopy(_rendered(overlay))


def _local_argv(argv: list[str]) -> list[str]:
    """The image's programs as this machine has them (the container's own command line otherwise)."""
    if argv[:2] == ["tini", "--"]:
        argv = argv[2:]
    head = {"python": [sys.executable], "elastic-train": [sys.executable, "-m", "elastic_trainer.cli"],
            "/usr/local/bin/etcd": [etcd_binary]}
    return head.get(argv[0], argv[:1]) + argv[1:]


class Pod:
    """One rendered pod: its namespace, folder, containers' processes and logs."""

    def __init__(self, cluster: "Cluster", name: str, spec: dict, node, added_env: dict[str, str] | None = None,
                 fields: dict[str, str] | None = None) -> None:
        self.cluster, self.name, self.spec, self.node = cluster, name, spec, node
        self.added_env = added_env or {}  # what a controller adds (the training operator's PET_* and so on)
        self.fields = fields or {}  # the labels and annotations a controller puts on the pod (downward API)
        self.root = cluster.root / name
        self.procs: list[subprocess.Popen] = []

    def _env_argv(self, container: dict, claims: dict[str, Path]) -> tuple[dict[str, str], list[str]]:
        fields = {"metadata.name": self.name, "metadata.namespace": NAMESPACE, "status.podIP": self.node.address,
                  **self.fields}
        env = k8s_pod.container_env(container, self.cluster.config_maps, self.cluster.secrets, fields)
        if container is self.spec["containers"][0]:
            env.update(self.added_env)
        mounts = k8s_pod.mount_volumes(self.spec, container, self.cluster.secrets, self.root, claims=claims,
                                       config_maps=self.cluster.config_maps)
        argv = [k8s_pod.localize(k8s_pod.expand(t, env), mounts)
                for t in [*container.get("command", []), *container.get("args", [])]]
        env = {k: k8s_pod.localize(v, mounts) for k, v in env.items()}
        # What the image provides besides the pod's env: its PATH and the code (this checkout).
        env.update(PATH=os.environ["PATH"], PYTHONPATH=str(REPO))
        if "HOME" in env:
            env["HOME"] = str(mounts.get(env["HOME"], self.root))
        return env, _local_argv(argv)

    def run(self, container: dict, claims: dict[str, Path], wait: bool) -> subprocess.Popen:
        env, argv = self._env_argv(container, claims)
        log = open(self.root / f"{container['name']}.log", "ab")
        proc = self.cluster.processes.start(["ip", "netns", "exec", self.node.namespace, *argv], env=env, stdout=log,
                                            stderr=subprocess.STDOUT)
        if wait:
            assert proc.wait(timeout=120) == 0, f"{self.name} {container['name']} failed: {self.log(container['name'])}"
        else:
            self.procs.append(proc)
        return proc

    def start(self, claims: dict[str, Path] | None = None) -> "Pod":
        self.root.mkdir(parents=True, exist_ok=True)
        for c in self.spec.get("initContainers", []):
            self.run(c, claims or {}, wait=True)
        for c in self.spec["containers"]:
            self.run(c, claims or {}, wait=False)
        return self

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []

    def log(self, container: str) -> str:
        path = self.root / f"{container}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


class Cluster:
    """The bridge, one namespace per pod with its hosts file, and every process started."""

    def __init__(self, root: Path, objs: list[dict], secrets: dict[str, dict[str, str]]) -> None:
        from elastic_trainer.drill import netns

        self.root, self.secrets = root, secrets
        self.config_maps: dict[str, dict[str, str]] = {}
        self.net = netns.Network()
        self.processes = Processes()  # every pod's and spawned process, killed at teardown
        self.pods: dict[str, Pod] = {}
        self.nodes: dict = {}  # pod name -> its namespace (netns.NetNode)
        self.hosts_dirs: list[Path] = []
        self.dns: dict[str, str] = {}  # pod name -> the DNS name etcd's clients reach it by (up())
        self.etcdctl_tls: tuple[Path, Path, Path] | None = None  # ca, cert, key for _etcdctl
        self.use(objs, root)

    def use(self, objs: list[dict], folder: Path) -> None:
        """Start the pods of ``objs`` (an overlay's objects) from now on: its ConfigMaps beside those
        before (a ConfigMap's name is the hash of its data), each of its PersistentVolumeClaims a new
        folder under ``folder`` that every pod mounting it shares."""
        self.objs = objs
        self.config_maps.update({o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"})
        self.claims = {o["metadata"]["name"]: folder / "pvc" / o["metadata"]["name"]
                       for o in objs if o["kind"] == "PersistentVolumeClaim"}
        for claim in self.claims.values():
            claim.mkdir(parents=True)

    def obj(self, kind: str, name: str) -> dict:
        [o] = [o for o in self.objs if o["kind"] == kind and o["metadata"]["name"] == name]
        return o

    def up(self, pod_names: list[str], dns: dict[str, str] | None = None) -> None:
        """One namespace per pod (more may be added later); ``dns`` maps a pod to the name others
        reach it by (default: the etcd members' names under the headless Service etcd-peer), in the
        hosts file of every pod added from then on."""
        if not self.nodes:
            self.net.up()
        nodes = {name: self.net.add_node(len(self.nodes) + i) for i, name in enumerate(pod_names)}
        self.dns.update(dns or {name: f"{name}.etcd-peer.{NAMESPACE}.svc" for name in nodes
                                if name.startswith("etcd-")})
        lines = [f"{self.nodes.get(name, nodes.get(name)).address} {host} {host}.cluster.local"
                 for name, host in self.dns.items()]
        for name, node in nodes.items():
            folder = Path("/etc/netns") / node.namespace
            folder.mkdir(parents=True, exist_ok=True)
            self.hosts_dirs.append(folder)
            # As the kubelet's hosts file: the pod's own name (gloo resolves the host name) first.
            own = f"{node.address} {socket.gethostname()} {name}"
            (folder / "hosts").write_text("\n".join(["127.0.0.1 localhost", own, *lines]) + "\n")
        self.nodes.update(nodes)

    def pod(self, name: str, spec: dict, added_env: dict[str, str] | None = None,
            fields: dict[str, str] | None = None) -> Pod:
        self.pods[name] = Pod(self, name, spec, self.nodes[name], added_env, fields)
        return self.pods[name]

    def spawn(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        """A process that is no rendered pod (an etcd the user runs) in ``name``'s namespace."""
        with open(log, "ab") as out:
            return self.processes.start(["ip", "netns", "exec", self.nodes[name].namespace, *argv], stdout=out,
                                        stderr=subprocess.STDOUT)

    def teardown(self) -> None:
        self.processes.kill_all()
        self.net.teardown()
        for folder in self.hosts_dirs:
            shutil.rmtree(folder, ignore_errors=True)


def _certs(tmp_path: Path, hosts: list[str]) -> Path:
    """``elastic-train etcd certs`` for etcd reached at ``hosts``: ca, server and client PEM files."""
    out = tmp_path / "certs"
    args = ["etcd", "certs", "--out", str(out), *[a for h in hosts for a in ("--host", h)]]
    done = subprocess.run([sys.executable, "-m", "elastic_trainer.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return out


def _tls_secret(certs: Path, cert: str) -> dict[str, str]:
    """A Secret made as the README says: ``ca.crt``, ``tls.crt``, ``tls.key``."""
    return {"ca.crt": (certs / "ca.pem").read_text(), "tls.crt": (certs / f"{cert}.pem").read_text(),
            "tls.key": (certs / f"{cert}-key.pem").read_text()}


def _secrets(tmp_path: Path) -> dict[str, dict[str, str]]:
    """The StatefulSet's server Secret and the trainers' client Secret, for the members' DNS names."""
    certs = _certs(tmp_path, [f"etcd-{i}.etcd-peer.{NAMESPACE}.svc" for i in range(3)])
    return {"etcd-server-tls": _tls_secret(certs, "server"), "etcd-client-tls": _tls_secret(certs, "client")}


@pytest.fixture(scope="module")
def statefulset_secrets(tmp_path_factory) -> dict[str, dict[str, str]]:
    """``_secrets`` made once for the module (each ``elastic-train etcd certs`` is a Python start-up,
    seconds on a loaded machine): every StatefulSet run names the same members. Each test gets a copy."""
    return _secrets(tmp_path_factory.mktemp("statefulset-certs"))


def _etcdctl(cluster: Cluster, member: str, *args: str) -> subprocess.CompletedProcess:
    """``etcdctl`` against ``member`` by its DNS name, from inside etcd-2's namespace, with the client
    certificate in ``cluster.etcdctl_tls`` (ca, cert, key)."""
    ca, cert, key = cluster.etcdctl_tls
    cmd = ["ip", "netns", "exec", cluster.nodes["etcd-2"].namespace, shutil.which("etcdctl"),
           "--command-timeout=3s", "--endpoints", f"https://{cluster.dns[member]}:2379",
           "--cacert", str(ca), "--cert", str(cert), "--key", str(key), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, env={**os.environ, "ETCDCTL_API": "3"})


def _members(cluster: Cluster) -> list[dict]:
    """``etcdctl member list`` as JSON members ([] while etcd-2 does not answer)."""
    out = _etcdctl(cluster, "etcd-2", "-w", "json", "member", "list")
    return json.loads(out.stdout)["members"] if out.returncode == 0 else []


def _step_records(cluster: Cluster, pod: str) -> dict[str, list[dict]]:
    """A trainer pod's step records by worker log file (one file per worker process)."""
    return {p.name: [json.loads(line) for line in p.read_text().splitlines() if line.endswith("}")]
            for p in cluster.root.rglob("steps/rank-*.jsonl") if pod in p.parts}


def _steps(cluster: Cluster, pod: str) -> int:
    """Steps a trainer pod's workers have logged (every rank's step log, in the pod's log dir
    $(LOG_DIR)/$(RUN_ID)/$(POD_NAME): an emptyDir of the pod, or the shared volume)."""
    logs = [p for p in cluster.root.rglob("steps/rank-*.jsonl") if pod in p.parts]
    return sum(1 for p in logs for line in p.read_text().splitlines() if line.strip())


@dataclass
class Trainers:
    """The trainer pod template, the names of two of its pods, and what the controllers add to pod
    ``i``: to its first container's env (``env``) and to its labels and annotations (``fields``,
    fieldRef paths for the downward API)."""

    spec: dict
    names: list[str]
    env: Callable[[int], dict[str, str]] = lambda i: {}
    fields: Callable[[int], dict[str, str]] = lambda i: {}


def _trainer_pods(objs: list[dict]) -> Trainers:
    """The trainer pods as the overlay's controller would make them (Job, PyTorchJob or TrainJob)."""
    job = next((o for o in objs if o["kind"] == "Job"), None)
    if job is not None:  # the Job controller: pods <job>-<index>-<random>; the env is the template's
        return Trainers(job["spec"]["template"]["spec"], ["elastic-train-0", "elastic-train-1"])
    if any(o["kind"] == "TrainJob" for o in objs):
        return _trainjob_pods(objs)
    pj = next(o for o in objs if o["kind"] == "PyTorchJob")
    policy, name = pj["spec"]["elasticPolicy"], pj["metadata"]["name"]

    # The Kubeflow training operator (v1.7+, elasticPolicy, Worker replicas only) appends these to the
    # container "pytorch" (its docs and pkg/controller.v1/pytorch: envvar.go, elastic.go): torchrun's
    # PET_* options from elasticPolicy and nprocPerNode, and the MASTER_*/WORLD_SIZE/RANK of
    # non-elastic jobs. elastic-train must run from its own arguments whatever these say.
    def operator_env(i: int) -> dict[str, str]:
        return {"MASTER_ADDR": f"{name}-worker-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": str(i),
                "PET_MASTER_ADDR": f"{name}-worker-0", "PET_MASTER_PORT": "23456", "PET_NODE_RANK": str(i),
                "PET_NPROC_PER_NODE": str(pj["spec"]["nprocPerNode"]),
                "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                "PET_RDZV_BACKEND": policy["rdzvBackend"],
                "PET_RDZV_ENDPOINT": f"{policy['rdzvHost']}:{policy['rdzvPort']}",
                "PET_RDZV_ID": name, "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
                "PET_RDZV_CONF": ",".join(f"{kv['key']}={kv['value']}" for kv in policy["rdzvConf"])}
    return Trainers(pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"],
                    [f"{name}-worker-{i}" for i in range(2)], operator_env)


def _trainjob_pods(objs: list[dict]) -> Trainers:
    """The pods Kubeflow Trainer v2 (v2.3) and JobSet make of the TrainJob and its TrainingRuntime.

    Trainer v2 makes a JobSet named after the TrainJob from the runtime's template; JobSet makes a
    Job ``<jobset>-<replicatedJob>-<job index>`` of each replicated Job, and that Indexed Job makes
    pods ``<job>-<completion index>-<random>``. What they add to the pod:
    * Trainer v2's torch plugin (kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go,
      ``EnforceMLPolicy``; names in pkg/constants/constants.go) upserts into the container named
      ``node`` of the Job labelled ``trainer.kubeflow.org/trainjob-ancestor-step: trainer``: the
      TrainJob's ``trainer.env``, then ``PET_NNODES`` (numNodes), ``PET_NPROC_PER_NODE`` (the
      TrainJob's or the runtime's numProcPerNode, default ``auto``), ``PET_NODE_RANK`` (a fieldRef to
      the annotation ``batch.kubernetes.io/job-completion-index``), ``PET_MASTER_ADDR``
      (``<trainjob>-node-0-0.<trainjob>``) and ``PET_MASTER_PORT`` (29500), and container port 29500.
    * The Job controller: ``JOB_COMPLETION_INDEX`` and that annotation.
    * JobSet (api/jobset/v1alpha2/jobset_types.go): the labels and annotations
      ``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``, ``job-index``, ``job-global-index``.
    elastic-train reads none of them (its arguments carry the rendezvous), as with the PyTorchJob.
    """
    trainjob = next(o for o in objs if o["kind"] == "TrainJob")
    ref, name = trainjob["spec"]["runtimeRef"], trainjob["metadata"]["name"]
    runtime = next(o for o in objs if o["kind"] == ref["kind"] and o["metadata"]["name"] == ref["name"])
    # The TrainJob sets only the node count: nothing of it (image, command, env) replaces the runtime's.
    assert set(trainjob["spec"]["trainer"]) == {"numNodes"}, trainjob["spec"]["trainer"]
    [rjob] = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
              if r["template"]["metadata"]["labels"].get("trainer.kubeflow.org/trainjob-ancestor-step") == "trainer"]
    spec = rjob["template"]["spec"]["template"]["spec"]
    assert spec["containers"][0]["name"] == "node"
    job = f"{name}-{rjob['name']}-0"
    nproc = runtime["spec"]["mlPolicy"]["torch"].get("numProcPerNode", "auto")

    def plugin_env(i: int) -> dict[str, str]:
        return {"JOB_COMPLETION_INDEX": str(i), "PET_NNODES": str(trainjob["spec"]["trainer"]["numNodes"]),
                "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": f"{job}-0.{name}",
                "PET_MASTER_PORT": "29500"}

    def fields(i: int) -> dict[str, str]:
        both = {"batch.kubernetes.io/job-completion-index": str(i), "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"], "jobset.sigs.k8s.io/job-index": "0",
                "jobset.sigs.k8s.io/job-global-index": "0"}
        return {f"metadata.{kind}['{k}']": v for k, v in both.items() for kind in ("labels", "annotations")}
    return Trainers(spec, [f"{job}-{i}-{suffix}" for i, suffix in enumerate(["7kq2x", "m4d9p"])], plugin_env, fields)


@pytest.fixture
def moto_on(tmp_path):
    """Start moto's S3 on an address of the test's bridge (the pods reach it there): ``start(address)``."""
    from moto.server import ThreadedMotoServer

    servers = []

    def start(address: str) -> str:
        from elastic_trainer.etcd.server import free_port
        port = free_port(address)
        server = ThreadedMotoServer(ip_address=address, port=port)
        server.start()
        servers.append(server)
        return f"http://{address}:{port}"
    yield start
    for server in servers:
        server.stop()


def _run_config(cluster: Cluster) -> dict[str, str]:
    """The data of the hashed ConfigMap elastic-trainer-config-<hash> of the objects in use."""
    return cluster.config_maps[next(o["metadata"]["name"] for o in cluster.objs if o["kind"] == "ConfigMap"
                                    and o["metadata"]["name"].startswith("elastic-trainer-config-"))]


def _short_last_call(cluster: Cluster) -> None:
    """The one value a run other than ``base`` changes in the rendered ConfigMap: the first
    rendezvous waits ``last_call_timeout`` (15 s) for more pods, up to --max-nodes (4), once
    --min-nodes have joined; here both pods start together, and 1 s saves 14 s a run. ``base``
    runs with 15 s, as rendered."""
    run_config = _run_config(cluster)
    assert "last_call_timeout=15," in run_config["RDZV_CONF"], run_config["RDZV_CONF"]
    run_config["RDZV_CONF"] = run_config["RDZV_CONF"].replace("last_call_timeout=15,", "last_call_timeout=1,")


def _start_statefulset_etcd(cluster: Cluster, objs: list[dict]) -> tuple[Callable[[int], Pod], list[dict]]:
    """The etcd StatefulSet's three pods, all at once (podManagementPolicy: Parallel: each init
    container finds no other member); returns how to start member ``i`` again and the members."""
    statefulset = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd")
    assert "--client-cert-auth=true" in statefulset["spec"]["template"]["spec"]["initContainers"][0]["args"], \
        "etcd serves client TLS by default (issue 19)"

    def start_etcd(i: int) -> Pod:
        data = cluster.root / "pvc" / f"data-etcd-{i}"
        data.mkdir(parents=True, exist_ok=True)
        spec = json.loads(json.dumps(statefulset["spec"]["template"]["spec"]))
        # What the StatefulSet controller does with volumeClaimTemplates: a claim per member.
        spec.setdefault("volumes", []).append({"name": "data", "persistentVolumeClaim": {"claimName": data.name}})
        return cluster.pod(f"etcd-{i}", spec).start(claims={data.name: data})

    threads = [threading.Thread(target=start_etcd, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    certs = cluster.root / "etcd-2" / "volumes" / "tls"
    cluster.etcdctl_tls = (certs / "ca.crt", certs / "tls.crt", certs / "tls.key")
    members = wait_until(lambda: _members(cluster), 60, "a 3-member etcd",
                         until=lambda ms: len(ms) == 3 and all(m.get("name") for m in ms),
                         details=lambda: cluster.pods["etcd-0"].log("etcd"))
    return start_etcd, members


def _start_plain_etcd(cluster: Cluster, certs: Path, members: list[str]) -> None:
    """An etcd cluster of ``members`` (pod names, reached at ``cluster.dns``) from etcd's own command
    line, serving clients TLS with ``certs`` and asking them for a certificate of its CA."""
    initial = ",".join(f"{m}=http://{cluster.dns[m]}:2380" for m in members)
    for m in members:
        address, folder = cluster.nodes[m].address, cluster.root / m
        folder.mkdir(parents=True, exist_ok=True)
        cluster.spawn(m, [etcd_binary, f"--name={m}", f"--data-dir={folder / 'data'}",
                          f"--listen-client-urls=https://{address}:2379",
                          f"--advertise-client-urls=https://{cluster.dns[m]}:2379",
                          f"--listen-peer-urls=http://{address}:2380",
                          f"--initial-advertise-peer-urls=http://{cluster.dns[m]}:2380",
                          f"--initial-cluster={initial}", "--initial-cluster-state=new",
                          "--client-cert-auth=true", f"--trusted-ca-file={certs / 'ca.pem'}",
                          f"--cert-file={certs / 'server.pem'}", f"--key-file={certs / 'server-key.pem'}"],
                      folder / "etcd.log")
    cluster.etcdctl_tls = (certs / "ca.pem", certs / "client.pem", certs / "client-key.pem")


def _train_on_without_a_pod_and_a_member(cluster: Cluster, trainers: Trainers) -> dict[str, list[dict]]:
    """Two trainer pods train; then the second is killed and the etcd member named first in
    RDZV_ENDPOINT loses its network (a lost node: its address stops answering, nothing refuses a
    connection). The first pod must train on, in the same worker process: its client fails over to
    the next member. Returns the first pod's step records by worker log file."""
    pod0, pod1 = trainers.names
    container = trainers.spec["containers"][0]["name"]
    pods = {name: cluster.pod(name, trainers.spec, trainers.env(i), trainers.fields(i)).start(claims=cluster.claims)
            for i, name in enumerate(trainers.names)}
    wait_until(lambda: [_steps(cluster, n) for n in trainers.names], 240, "both trainer pods training",
               until=lambda s: all(x >= 3 for x in s),
               details=lambda: "\n".join(pods[n].log(container) for n in trainers.names))
    first_host = _run_config(cluster)["RDZV_ENDPOINT"].split(",")[0].rpartition(":")[0]
    [first] = [name for name, host in cluster.dns.items() if host == first_host]

    before = _step_records(cluster, pod0)
    pods[pod1].kill()
    cluster.net.cut(cluster.nodes[first])
    last = max(r["step"] for recs in before.values() for r in recs)
    wait_until(lambda: _step_records(cluster, pod0), 120, f"pod 0 training on alone, {first} unreachable",
               until=lambda recs: max(r["step"] for rs in recs.values() for r in rs) >= last + 5,
               details=lambda: pods[pod0].log(container))
    after = _step_records(cluster, pod0)
    assert set(after) == set(before), f"pod 0's workers were replaced: {sorted(before)} -> {sorted(after)}"
    return after


def _etcd_0_rejoins_from_an_empty_volume(cluster: Cluster, start_etcd: Callable[[int], Pod], first: list[dict],
                                         trainers: Trainers, after: dict[str, list[dict]]) -> None:
    """etcd-0's pod is gone with its node and comes back elsewhere on a new, empty volume: it must
    join as a new member, not crash-loop, and serve; pod 0 trains on in the same workers."""
    cluster.pods["etcd-0"].kill()
    cluster.net.restore(cluster.nodes["etcd-0"])
    shutil.rmtree(cluster.root / "pvc" / "data-etcd-0")
    start_etcd(0)
    old_id = next(m["ID"] for m in first if m["name"] == "etcd-0")
    members = wait_until(lambda: _members(cluster), 60, "etcd-0 back as a started member",
                         until=lambda ms: len(ms) == 3 and all(m.get("name") for m in ms),
                         details=lambda: cluster.pods["etcd-0"].log("member") + cluster.pods["etcd-0"].log("etcd"))
    # It serves, and keeps serving once the leader has sent it the log (where a member that
    # restarted with --initial-cluster-state=new and an empty volume exits: "member ... has
    # already been bootstrapped").
    wait_until(lambda: _etcdctl(cluster, "etcd-0", "endpoint", "health").returncode == 0, 30,
               "etcd-0 healthy", details=lambda: cluster.pods["etcd-0"].log("etcd"))
    assert _etcdctl(cluster, "etcd-0", "put", "/k8s-run-test", "after-rejoin").returncode == 0
    time.sleep(3)
    assert cluster.pods["etcd-0"].procs[0].poll() is None, cluster.pods["etcd-0"].log("etcd")
    assert "after-rejoin" in _etcdctl(cluster, "etcd-0", "get", "/k8s-run-test").stdout
    new_id = next(m["ID"] for m in members if m["name"] == "etcd-0")
    assert new_id != old_id, "etcd-0 came back with its old identity and no data"
    pod0 = cluster.pods[trainers.names[0]]
    container = trainers.spec["containers"][0]["name"]
    before = _steps(cluster, pod0.name)
    wait_until(lambda: _steps(cluster, pod0.name), 60, "pod 0 training on after etcd-0 rejoined",
               until=lambda s: s >= before + 3, details=lambda: pod0.log(container))
    assert pod0.procs[0].poll() is None, pod0.log(container)
    assert set(_step_records(cluster, pod0.name)) == set(after), "pod 0's workers were replaced"


def _train_together(cluster: Cluster, trainers: Trainers) -> None:
    """Two trainer pods start from the rendered spec and train together: each logs steps of a world
    of 2 (the first round may form with one of them, the other then joins it); then both are killed."""
    container = trainers.spec["containers"][0]["name"]
    pods = [cluster.pod(name, trainers.spec, trainers.env(i), trainers.fields(i)).start(claims=cluster.claims)
            for i, name in enumerate(trainers.names)]

    def steps_at_2() -> list[int]:
        return [sum(r["world_size"] == 2 for recs in _step_records(cluster, pod.name).values() for r in recs)
                for pod in pods]
    try:
        wait_until(steps_at_2, 240, "both trainer pods training in a world of 2", until=lambda s: min(s) >= 2,
                   details=lambda: "\n".join(pod.log(container) for pod in pods))
    finally:
        for pod in pods:
            pod.kill()


def _s3_store(cluster: Cluster, moto_on) -> None:
    """What the README says to set for an S3-compatible store: its URL and region in the ConfigMap,
    the keys in the Secret elastic-trainer-s3 as an AWS credentials file; the bucket made."""
    import boto3

    run_config = _run_config(cluster)
    endpoint = moto_on(cluster.net.host_address)
    run_config.update(S3_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1")
    cluster.secrets["elastic-trainer-s3"] = {
        "credentials": "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"}
    bucket = run_config["CHECKPOINT_DIR"][len("s3://"):].split("/")[0]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket=bucket)


@pytest.mark.trial  # 94 s on CI; the existing-etcd overlay's pods below run in network namespaces in the suite
def test_the_rendered_manifests_train_on_through_a_lost_trainer_pod_and_a_lost_etcd_member(tmp_path,
                                                                                          statefulset_secrets):
    """base: then the lost member comes back on an empty volume and rejoins. The other overlays'
    trainer pods are the same but for what their controllers add (test_k8s.py, test_k8s_v2.py) and
    their StatefulSet is base's (checked below): they start and train together on it; the losses
    are not run again for each."""
    objs = _render("base")
    trainers = _trainer_pods(objs)
    cluster = Cluster(tmp_path, objs, copy.deepcopy(statefulset_secrets))
    try:
        cluster.up(["etcd-0", "etcd-1", "etcd-2", *trainers.names])
        start_etcd, first = _start_statefulset_etcd(cluster, objs)
        after = _train_on_without_a_pod_and_a_member(cluster, trainers)
        _etcd_0_rejoins_from_an_empty_volume(cluster, start_etcd, first, trainers, after)
    finally:
        cluster.teardown()


OVERLAYS = ["overlays/s3", "overlays/pytorchjob", "overlays/trainer-v2"]
"""Overlays that render base's StatefulSet and trainer pods of their own controllers (a Job with S3
checkpoints, a PyTorchJob, a TrainJob): each one's pods start and train on one StatefulSet's etcd."""


@pytest.mark.trial  # 117 s on CI; base's run above, and test_k8s*.py keep the overlays' pods equal to it
def test_each_overlays_trainer_pods_start_and_train_together_on_the_statefulsets_etcd(tmp_path, moto_on,
                                                                                     statefulset_secrets):
    """One etcd StatefulSet (base's, which each overlay renders unchanged) and, in turn, each
    overlay's two trainer pods as its controller makes them (its env, labels and annotations), with
    the overlay's ConfigMap, Secrets and volumes: they start, rendezvous over TLS and train in a
    world of 2. Between overlays their pods are gone and etcd's keys are deleted (a new run; the
    overlays name the same RUN_ID)."""
    cluster = Cluster(tmp_path, _render("base"), copy.deepcopy(statefulset_secrets))
    base = cluster.obj("StatefulSet", "etcd")
    try:
        cluster.up(["etcd-0", "etcd-1", "etcd-2"])
        _start_statefulset_etcd(cluster, cluster.objs)
        for overlay in OVERLAYS:
            objs = _render(overlay)
            assert next(o for o in objs if o["kind"] == "StatefulSet") == base, f"{overlay} renders its own etcd"
            cluster.use(objs, tmp_path / overlay.replace("/", "-"))
            trainers = _trainer_pods(objs)
            cluster.up(trainers.names)
            _short_last_call(cluster)
            if _run_config(cluster)["CHECKPOINT_DIR"].startswith("s3://"):
                _s3_store(cluster, moto_on)
            _train_together(cluster, trainers)
            deleted = _etcdctl(cluster, "etcd-2", "del", "--prefix", "/")
            assert deleted.returncode == 0, deleted.stderr
    finally:
        cluster.teardown()


def test_the_existing_etcd_overlays_trainer_pods_train_together_on_the_users_etcd(tmp_path):
    """overlays/existing-etcd against the etcd its user runs: three members named as RDZV_ENDPOINT
    names them (etcd-N.etcd.platform.svc), started here from etcd's plain command line with TLS
    certificates for those names; the trainers get the client certificate as the Secret
    etcd-client-tls, as the README says. The trainer pods are base's (test_k8s.py), whose run above
    loses a pod and the member its client uses: here they start and train together. (Its members'
    own recovery is that user's business, not this overlay's.)"""
    objs = _render("overlays/existing-etcd")
    assert not [o for o in objs if o["kind"] == "StatefulSet"]
    trainers = _trainer_pods(objs)
    run_config = next(o["data"] for o in objs
                      if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("elastic-trainer-config-"))
    hosts = [endpoint.rpartition(":")[0] for endpoint in run_config["RDZV_ENDPOINT"].split(",")]
    assert hosts == [f"etcd-{i}.etcd.platform.svc" for i in range(3)], hosts  # a client fails over among them
    certs = _certs(tmp_path, hosts)
    cluster = Cluster(tmp_path, objs, {"etcd-client-tls": _tls_secret(certs, "client")})
    try:
        members = [f"etcd-{i}" for i in range(3)]
        cluster.up([*members, *trainers.names], dns=dict(zip(members, hosts)))
        _short_last_call(cluster)
        _start_plain_etcd(cluster, certs, members)
        wait_until(lambda: _members(cluster), 60, "the user's 3-member etcd",
                   until=lambda ms: len(ms) == 3 and all(m.get("name") for m in ms),
                   details=lambda: (tmp_path / "etcd-0" / "etcd.log").read_text()[-3000:])
        _train_together(cluster, trainers)
    finally:
        cluster.teardown()


def test_the_gpu_overlay_on_a_node_whose_gpus_torch_cannot_use_stops_at_once_with_one_line(tmp_path):
    """overlays/gpu's trainer pod as rendered (DEVICE=cuda, NPROC_PER_NODE=4) on this machine, where
    torch has no CUDA. Without a GPU this is what can be checked of what the manifests promise: a
    pod whose GPUs torch cannot use (a driver older than the image's CUDA build, GPUs not mounted)
    stops at once with one line and status 2, before any worker starts, instead of training on the
    CPU. (Training on GPUs is not run here.) The pod's init container waits for etcd's port: one
    plain etcd member at etcd-0's name stands in for the StatefulSet, which the other tests run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: the pod would train")
    objs = _render("overlays/gpu")
    trainers = _trainer_pods(objs)
    container = trainers.spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    certs = _certs(tmp_path, ["etcd-0.etcd-peer.elastic-trainer.svc"])
    cluster = Cluster(tmp_path, objs, {"etcd-client-tls": _tls_secret(certs, "client")})
    try:
        pod = trainers.names[0]
        cluster.up(["etcd-0", pod])
        assert _run_config(cluster)["DEVICE"] == "cuda"
        _start_plain_etcd(cluster, certs, ["etcd-0"])
        trainer = cluster.pod(pod, trainers.spec).start(claims=cluster.claims)
        status = trainer.procs[0].wait(timeout=60)
        log = trainer.log(container["name"])
        lines = [line for line in log.splitlines() if line.strip()]
        assert status == 2, log
        assert len(lines) == 1 and lines[0].startswith("elastic-train: error: --device cuda"), log
        assert not list(tmp_path.rglob("torchelastic")) and not list(tmp_path.rglob("steps")), "a worker started"
        assert not [p for p in cluster.claims["elastic-trainer-checkpoints"].rglob("*") if p.is_file()], \
            "something was written to the checkpoints volume"
    finally:
        cluster.teardown()
