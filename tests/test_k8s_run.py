"""The manifests run as they are written: each rendered pod as processes in a network namespace.

There is no cluster here, so this test does what the kubelet would with the rendered objects: it
builds an overlay with ``kubectl kustomize``, takes the etcd StatefulSet's and the trainer Job's (or
PyTorchJob's) containers (command, args, env from the hashed ConfigMap, the downward-API fields, the
variables the training operator adds, Secrets as
mounted files: TLS certificates made by ``elastic-train etcd certs``), and runs each "pod" in a
network namespace of its own on a bridge, with a hosts file that gives the pod names the
headless Service would (``etcd-N.etcd-peer.elastic-trainer.svc``). The three etcd members start
from the StatefulSet's own init container and command line; then a trainer pod is killed and the
member the trainers use first loses its network (a lost node), the other trainer pod must train on
in the same worker process, and the member comes back with an empty volume (a lost PVC) and must
rejoin as a new member and serve.

Needs root (``ip netns``), kubectl and etcd; slow (about a minute per overlay).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_k8s_run.py
"""

from __future__ import annotations

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
from pathlib import Path

import pytest
import yaml

from tests.helpers import k8s_pod
from tests.helpers.common import REPO, wait_until

kubectl = shutil.which("kubectl")
etcd_binary = shutil.which("etcd")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(kubectl is None or etcd_binary is None or os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs kubectl, etcd, root and iproute2 (network namespaces)"),
]

NAMESPACE = "elastic-trainer"


def _render(overlay: str) -> list[dict]:
    out = subprocess.run([kubectl, "kustomize", str(REPO / "k8s" / overlay)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _local_argv(argv: list[str]) -> list[str]:
    """The image's programs as this machine has them (the container's own command line otherwise)."""
    if argv[:2] == ["tini", "--"]:
        argv = argv[2:]
    head = {"python": [sys.executable], "elastic-train": [sys.executable, "-m", "elastic_trainer.cli"],
            "/usr/local/bin/etcd": [etcd_binary]}
    return head.get(argv[0], argv[:1]) + argv[1:]


class Pod:
    """One rendered pod: its namespace, folder, containers' processes and logs."""

    def __init__(self, cluster: "Cluster", name: str, spec: dict, node,
                 added_env: dict[str, str] | None = None) -> None:
        self.cluster, self.name, self.spec, self.node = cluster, name, spec, node
        self.added_env = added_env or {}  # what a controller adds (the training operator's PET_* and so on)
        self.root = cluster.root / name
        self.procs: list[subprocess.Popen] = []

    def _env_argv(self, container: dict, claims: dict[str, Path]) -> tuple[dict[str, str], list[str]]:
        fields = {"metadata.name": self.name, "metadata.namespace": NAMESPACE, "status.podIP": self.node.address}
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
        proc = subprocess.Popen(["ip", "netns", "exec", self.node.namespace, *argv], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.cluster.all_procs.append(proc)
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

        self.root, self.objs, self.secrets = root, objs, secrets
        self.config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
        self.net = netns.Network()
        self.all_procs: list[subprocess.Popen] = []
        self.pods: dict[str, Pod] = {}
        self.hosts_dirs: list[Path] = []
        # Each rendered PersistentVolumeClaim: one folder that every pod mounting it shares.
        self.claims = {o["metadata"]["name"]: root / "pvc" / o["metadata"]["name"]
                       for o in objs if o["kind"] == "PersistentVolumeClaim"}
        for folder in self.claims.values():
            folder.mkdir(parents=True)

    def obj(self, kind: str, name: str) -> dict:
        [o] = [o for o in self.objs if o["kind"] == kind and o["metadata"]["name"] == name]
        return o

    def up(self, pod_names: list[str]) -> None:
        self.net.up()
        nodes = {name: self.net.add_node(i) for i, name in enumerate(pod_names)}
        lines = [f"{n.address} {name}.etcd-peer.{NAMESPACE}.svc {name}.etcd-peer.{NAMESPACE}.svc.cluster.local"
                 for name, n in nodes.items() if name.startswith("etcd-")]
        for name, node in nodes.items():
            folder = Path("/etc/netns") / node.namespace
            folder.mkdir(parents=True, exist_ok=True)
            self.hosts_dirs.append(folder)
            # As the kubelet's hosts file: the pod's own name (gloo resolves the host name) first.
            own = f"{node.address} {socket.gethostname()} {name}"
            (folder / "hosts").write_text("\n".join(["127.0.0.1 localhost", own, *lines]) + "\n")
        self.nodes = nodes

    def pod(self, name: str, spec: dict, added_env: dict[str, str] | None = None) -> Pod:
        self.pods[name] = Pod(self, name, spec, self.nodes[name], added_env)
        return self.pods[name]

    def teardown(self) -> None:
        for proc in self.all_procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self.net.teardown()
        for folder in self.hosts_dirs:
            shutil.rmtree(folder, ignore_errors=True)


def _secrets(tmp_path: Path, tls: bool) -> dict[str, dict[str, str]]:
    if not tls:
        return {}
    hosts = [f"etcd-{i}.etcd-peer.{NAMESPACE}.svc" for i in range(3)]
    out = tmp_path / "certs"
    args = ["etcd", "certs", "--out", str(out), *[a for h in hosts for a in ("--host", h)]]
    done = subprocess.run([sys.executable, "-m", "elastic_trainer.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr

    def secret(cert: str) -> dict[str, str]:
        return {"ca.crt": (out / "ca.pem").read_text(), "tls.crt": (out / f"{cert}.pem").read_text(),
                "tls.key": (out / f"{cert}-key.pem").read_text()}
    return {"etcd-server-tls": secret("server"), "etcd-client-tls": secret("client")}


def _etcdctl(cluster: Cluster, tls: bool, member: str, *args: str) -> subprocess.CompletedProcess:
    """``etcdctl`` against ``member`` by its DNS name, from inside etcd-2's namespace (its certificate)."""
    node = cluster.nodes["etcd-2"]
    scheme = "https" if tls else "http"
    cmd = ["ip", "netns", "exec", node.namespace, shutil.which("etcdctl"), "--command-timeout=3s", "--endpoints",
           f"{scheme}://{member}.etcd-peer.{NAMESPACE}.svc:2379", *args]
    if tls:
        certs = cluster.root / "etcd-2" / "volumes" / "tls"
        cmd += ["--cacert", str(certs / "ca.crt"), "--cert", str(certs / "tls.crt"), "--key", str(certs / "tls.key")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, env={**os.environ, "ETCDCTL_API": "3"})


def _members(cluster: Cluster, tls: bool) -> list[dict]:
    """``etcdctl member list`` as JSON members ([] while etcd-2 does not answer)."""
    out = _etcdctl(cluster, tls, "etcd-2", "-w", "json", "member", "list")
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


def _trainer_pods(objs: list[dict]) -> tuple[dict, list[str], Callable[[int], dict[str, str]]]:
    """The trainer pod template, the names of two pods, and what the controller adds to their env."""
    job = next((o for o in objs if o["kind"] == "Job"), None)
    if job is not None:  # the Job controller: pods <job>-<index>-<random>; the env is the template's
        return job["spec"]["template"]["spec"], ["elastic-train-0", "elastic-train-1"], lambda i: {}
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
    return (pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], [f"{name}-worker-{i}" for i in range(2)],
            operator_env)


@pytest.fixture
def moto_on(tmp_path):
    """Start moto's S3 on an address of the test's bridge (the pods reach it there): ``start(address)``."""
    from moto.server import ThreadedMotoServer

    servers = []

    def start(address: str) -> str:
        from elastic_trainer.etcd_server import free_port
        port = free_port(address)
        server = ThreadedMotoServer(ip_address=address, port=port)
        server.start()
        servers.append(server)
        return f"http://{address}:{port}"
    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize("overlay", ["base", "overlays/pvc", "overlays/s3", "overlays/pytorchjob"])
def test_the_rendered_manifests_train_on_through_a_lost_trainer_pod_and_a_lost_etcd_volume(tmp_path, overlay, moto_on):
    objs = _render(overlay)
    statefulset = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd")
    tls = "--client-cert-auth=true" in statefulset["spec"]["template"]["spec"]["initContainers"][0]["args"]
    assert tls, "etcd serves client TLS by default (issue 19)"
    trainer_spec, trainers, controller_env = _trainer_pods(objs)
    cluster = Cluster(tmp_path, objs, _secrets(tmp_path, tls))
    try:
        cluster.up(["etcd-0", "etcd-1", "etcd-2", *trainers])
        run_config = next(data for name, data in cluster.config_maps.items()
                          if name.startswith("elastic-trainer-config-"))
        bucket = None
        if run_config["CHECKPOINT_DIR"].startswith("s3://"):
            # What the README says to set for an S3-compatible store: its URL and region in the
            # ConfigMap, the keys in the Secret elastic-trainer-s3 as an AWS credentials file.
            endpoint = moto_on(cluster.net.host_address)
            run_config.update(S3_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1")
            cluster.secrets["elastic-trainer-s3"] = {
                "credentials": "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"}
            import boto3
            bucket = run_config["CHECKPOINT_DIR"][len("s3://"):].split("/")[0]
            s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
            s3.create_bucket(Bucket=bucket)
        data = {i: tmp_path / "pvc" / f"data-etcd-{i}" for i in range(3)}

        def etcd_spec(i: int) -> dict:
            spec = json.loads(json.dumps(statefulset["spec"]["template"]["spec"]))
            # What the StatefulSet controller does with volumeClaimTemplates: a claim per member.
            spec.setdefault("volumes", []).append(
                {"name": "data", "persistentVolumeClaim": {"claimName": f"data-etcd-{i}"}})
            return spec

        def start_etcd(i: int) -> Pod:
            data[i].mkdir(parents=True, exist_ok=True)
            return cluster.pod(f"etcd-{i}", etcd_spec(i)).start(claims={f"data-etcd-{i}": data[i]})

        # All three together (podManagementPolicy: Parallel): each init container finds no other member.
        threads = [threading.Thread(target=start_etcd, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
        first = wait_until(lambda: _members(cluster, tls), 60, "a 3-member etcd",
                           until=lambda ms: len(ms) == 3 and all(m.get("name") for m in ms),
                           details=lambda: cluster.pods["etcd-0"].log("etcd"))

        container = trainer_spec["containers"][0]["name"]
        pods = {name: cluster.pod(name, trainer_spec, controller_env(i)).start(claims=cluster.claims)
                for i, name in enumerate(trainers)}
        wait_until(lambda: [_steps(cluster, n) for n in trainers], 240, "both trainer pods training",
                   until=lambda s: all(x >= 3 for x in s),
                   details=lambda: "\n".join(pods[n].log(container) for n in trainers))

        # A lost trainer pod, and a lost node under the etcd member the trainers talk to (the first
        # listed): its address stops answering, nothing refuses a connection. The other pod trains
        # on, in the same worker process: its client fails over to the next member.
        before = _step_records(cluster, trainers[0])
        pods[trainers[1]].kill()
        cluster.net.cut(cluster.nodes["etcd-0"])
        last = max(r["step"] for recs in before.values() for r in recs)
        wait_until(lambda: _step_records(cluster, trainers[0]), 120,
                   "pod 0 training on alone, etcd-0 unreachable",
                   until=lambda recs: max(r["step"] for rs in recs.values() for r in rs) >= last + 5,
                   details=lambda: pods[trainers[0]].log(container))
        after = _step_records(cluster, trainers[0])
        assert set(after) == set(before), f"pod 0's workers were replaced: {sorted(before)} -> {sorted(after)}"

        # The member's pod is gone with its node, and comes back elsewhere on a new, empty volume:
        # it must join as a new member, not crash-loop.
        cluster.pods["etcd-0"].kill()
        cluster.net.restore(cluster.nodes["etcd-0"])
        shutil.rmtree(data[0])
        start_etcd(0)
        old_id = next(m["ID"] for m in first if m["name"] == "etcd-0")
        members = wait_until(lambda: _members(cluster, tls), 60, "etcd-0 back as a started member",
                             until=lambda ms: len(ms) == 3 and all(m.get("name") for m in ms),
                             details=lambda: cluster.pods["etcd-0"].log("member") + cluster.pods["etcd-0"].log("etcd"))
        # It serves, and keeps serving once the leader has sent it the log (where a member that
        # restarted with --initial-cluster-state=new and an empty volume exits: "member ... has
        # already been bootstrapped").
        wait_until(lambda: _etcdctl(cluster, tls, "etcd-0", "endpoint", "health").returncode == 0, 30,
                   "etcd-0 healthy", details=lambda: cluster.pods["etcd-0"].log("etcd"))
        assert _etcdctl(cluster, tls, "etcd-0", "put", "/k8s-run-test", "after-rejoin").returncode == 0
        time.sleep(3)
        assert cluster.pods["etcd-0"].procs[0].poll() is None, cluster.pods["etcd-0"].log("etcd")
        assert "after-rejoin" in _etcdctl(cluster, tls, "etcd-0", "get", "/k8s-run-test").stdout
        new_id = next(m["ID"] for m in members if m["name"] == "etcd-0")
        assert new_id != old_id, "etcd-0 came back with its old identity and no data"
        before = _steps(cluster, trainers[0])
        wait_until(lambda: _steps(cluster, trainers[0]), 60, "pod 0 training on after etcd-0 rejoined",
                   until=lambda s: s >= before + 3, details=lambda: pods[trainers[0]].log(container))
        assert pods[trainers[0]].procs[0].poll() is None, pods[trainers[0]].log(container)
        assert set(_step_records(cluster, trainers[0])) == set(after), "pod 0's workers were replaced"
    finally:
        cluster.teardown()
