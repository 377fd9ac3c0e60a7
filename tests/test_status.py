"""`elastic-train status`: what rank 0 publishes into etcd, and the command that reads it.

The publisher is tested against the real etcd fixture; the command against a live 2-node job
(real `elastic-train` agents, the first with its embedded etcd, found through its log dir).
"""

from __future__ import annotations

import json
import math
import subprocess
import time

import pytest

from elastic_trainer.etcd.server import free_port
from elastic_trainer.rendezvous.etcd_backend import run_prefix
from elastic_trainer.etcd.client import EtcdConnection
from elastic_trainer.cli.status import format_status, read_status
from elastic_trainer.training.status import MAX_EVENTS, StatusPublisher
from tests.helpers.architecture import unnamed
from tests.helpers.common import cli_cmd, etcd_conn, wait_until
from tests.helpers.runs import TINY

def connect(etcd) -> EtcdConnection:
    return etcd_conn(etcd, retry_timeout=5)


def test_publisher_writes_at_most_once_an_interval_and_keeps_the_newest_events(etcd, run_id):
    prefix = run_prefix(None, run_id)
    pub = StatusPublisher(connect(etcd), prefix, interval=0.3)
    try:
        for step in range(1, 50):
            pub.update(step=step, loss=1.0 / step, world_size=2)
        for i in range(MAX_EVENTS + 5):
            pub.event({"time": time.time(), "event": "live_reform", "step": i})
        reader = connect(etcd)
        writes = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # count the revisions the key goes through
            _, meta = reader.client.get(prefix + "status")
            if meta is not None and (not writes or writes[-1] != meta.mod_revision):
                writes.append(meta.mod_revision)
            time.sleep(0.02)
        assert len(writes) == 1, "nothing changed after the first write: no second write"
        status = read_status(reader, prefix)["training"]
        assert status["step"] == 49 and status["world_size"] == 2
        assert [e["step"] for e in status["events"]] == list(range(5, MAX_EVENTS + 5))
    finally:
        pub.close()
    # a new rank 0 (a restart, live recovery) keeps the events the last one published
    second = StatusPublisher(connect(etcd), prefix, interval=0.3)
    second.update(step=50)
    second.close()
    status = read_status(reader, prefix)["training"]
    assert status["step"] == 50 and len(status["events"]) == MAX_EVENTS
    reader.close()


def test_the_publisher_writes_no_urls_credentials_into_etcd_whatever_a_field_holds(etcd, run_id):
    # A user's own loop may publish what it likes (StatusPublisher is public): the document in etcd,
    # which `status` shows and every node with the run's credentials reads, holds no userinfo.
    prefix = run_prefix(None, run_id)
    pub = StatusPublisher(connect(etcd), prefix, interval=0.3)
    pub.update(checkpoint={"step": 1, "time": time.time(), "url": "s3://AKIA:s3cr3t/x@bucket/ck"})
    pub.event({"time": time.time(), "event": "note", "message": "copied from memory://user:pw0rd@store/run"})
    pub.close()
    reader = connect(etcd)
    try:
        value, _ = reader.client.get(prefix + "status")
    finally:
        reader.close()
    assert b"s3cr3t" not in value and b"pw0rd" not in value and b"s3://***@bucket/ck" in value


def test_status_text_shows_a_redacted_checkpoint_url_without_its_password():
    """The trainer publishes the URL through storage.redact; the text a person reads keeps it so."""
    from elastic_trainer import storage

    status = {"round": None, "complete": None, "closed": None, "live": None, "nodes": [], "waiting": [],
              "training": {"state": "training", "step": 3, "epoch": 0, "world_size": 1, "loss": 0.5,
                           "samples_per_s": 10.0, "node": "n", "age_s": 0.5, "events": [],
                           "checkpoint": {"step": 2, "time": time.time(),
                                          "url": storage.redact("s3://AKIA:s3cr3t@bucket/ck")}}}
    text = format_status("r", "127.0.0.1:1", status)
    assert "s3cr3t" not in text and "checkpoint: step-2" in text and "s3://***@bucket/ck" in text


def test_status_text_lists_a_refused_node_with_its_line_and_its_next_check():
    now = 1_000_000.0
    status = {"round": None, "complete": None, "closed": None, "live": None, "nodes": [], "waiting": [],
              "refused": [{"node": "host-b-42", "time": now - 12, "retry_at": now + 5,
                           "line": "node check failed: device: cpu ran a 1024x1024 matmul at 3.0 GFLOP/s"}],
              "training": None}
    [line] = [t for t in format_status("r", "127.0.0.1:1", status, now=now).splitlines() if "refused" in t]
    assert line == ("  refused: host-b-42 since 12s ago, next check in 5s: node check failed: device: cpu ran a "
                    "1024x1024 matmul at 3.0 GFLOP/s")


def test_status_without_a_run_says_what_to_give_in_one_line(tmp_path):
    proc = subprocess.run(cli_cmd("status"), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "elastic-train: error: no run with an embedded etcd under ./runs; give --rdzv-endpoint HOST:PORT and --run-id"]


def test_status_of_an_endpoint_that_does_not_answer_is_one_line(tmp_path):
    port = free_port()
    proc = subprocess.run(cli_cmd("status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-id", "x"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"cannot read run x from etcd 127.0.0.1:{port}" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_status_shows_a_live_two_node_job_and_docs_architecture_names_every_thread_it_runs(tmp_path, procs):
    """`elastic-train status` of a live 2-node job, found through its embedded etcd; and every thread
    rank 0's worker ran while we looked (the status's ``threads``: its ``threading.enumerate()``) is
    in docs/architecture.md's thread table."""
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--run-id", "job", "--rdzv-conf", "last_call_timeout=1"]
    trainer = ["--", *TINY, "--global-batch-size", "8", "--no-wandb", "--no-progress", "--max-steps", "100000",
               "--sleep-per-step", "0.05", "--checkpoint-every", "10"]
    # node A: the embedded etcd, logs in the default runs/job; node B joins it (same checkpoint dir)
    procs.start(cli_cmd(*common, *trainer), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint_file = tmp_path / "runs" / "job" / "etcd-endpoint"
    wait_until(endpoint_file.exists, 60, "the embedded etcd's endpoint file")
    endpoint = endpoint_file.read_text().strip()
    # as the join line A prints: the embedded etcd has authentication on, its password in A's log dir
    auth = f"last_call_timeout=1,user=root,password_file={tmp_path / 'runs' / 'job' / 'etcd-password'}"
    b_args = [a if a != "last_call_timeout=1" else auth for a in common]

    threads: set[str] = set()  # every thread name rank 0 published, over the whole run

    def status_json() -> dict:
        proc = subprocess.run(cli_cmd("status", "--json"), cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        doc = json.loads(proc.stdout)
        threads.update((doc["training"] or {}).get("threads") or [])
        return doc

    # B joins a world of 1 that trains (started together, a slow machine may form one world of 2 at once,
    # and there is then no change of world size to show)
    wait_until(status_json, 120, "node A training alone", interval=2.0,
               until=lambda d: d["training"] and d["training"].get("world_size") == 1 and d["training"]["step"] > 0)
    procs.start(cli_cmd(*b_args, "--rdzv-endpoint", endpoint, "--log-dir", str(tmp_path / "logs-b"), *trainer),
                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    doc = wait_until(status_json, 180, "a world of 2 with a committed checkpoint", interval=2.0,
                     until=lambda d: d["training"] and d["training"].get("world_size") == 2
                     and d["training"].get("checkpoint") and d["live"] and d["live"]["world_size"] == 2)
    assert doc["run_id"] == "job" and doc["endpoint"] == endpoint
    assert len(doc["nodes"]) == 2 and sorted(r for n in doc["nodes"] for r in n["ranks"]) == [0, 1]
    assert all(0 < n["lease_left_s"] <= n["lease_ttl_s"] and n["since"] <= time.time() for n in doc["nodes"])
    t = doc["training"]
    assert t["step"] > 0 and math.isfinite(t["loss"]) and t["samples_per_s"] > 0 and t["age_s"] < 10
    assert t["checkpoint"]["step"] % 10 == 0 and t["checkpoint"]["url"] == "checkpoints/job"
    assert {"start", "world_size_changed"} <= {e["event"] for e in t["events"]}

    # the same from another directory, by endpoint and run id, for people
    proc = subprocess.run(cli_cmd("status", "--rdzv-endpoint", endpoint, "--run-id", "job", "--rdzv-conf",
                                  auth.split(",", 1)[1]), cwd="/", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "world size 2" in out and "checkpoint: step-" in out and "events:" in out
    assert all(n["name"] in out for n in doc["nodes"])
    assert "threads (rank 0): " in out and "MainThread" in threads and "live-watch" in threads
    assert unnamed(sorted(threads)) == [], (f"threads a live worker runs that docs/architecture.md's thread table "
                                            f"does not name (it ran {sorted(threads)})")
