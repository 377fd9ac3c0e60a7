"""`elastic-train drill`: scenario parsing, the exactly-once judge and the report on synthetic
logs (fast), and real drills on the default path (etcd-v3 rendezvous, built-in trainer; slow)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import etcd3
import pytest

from elastic_trainer import records
from elastic_trainer.drill import command as drill, report as drill_report
from elastic_trainer.records import LedgerRecord, StepRecord
from elastic_trainer.drill.scenario import ScenarioError, Trigger, parse_args, parse_fault
from tests.helpers.common import REPO, wait_until


# ----------------------------------------------------------------------------- scenarios


def test_fault_flags_keep_command_line_order_and_targets():
    args = parse_args(["--kill", "node:1@step:20", "--add-node", "@after:5", "--kill-rank0", "@step:40",
                       "--stop", "node:2@step:30,for:9", "--term", "random@time:30"])
    assert [(f.kind, f.target, f.trigger, f.duration) for f in args.faults] == [
        ("kill", "node:1", Trigger("step", 20), None),
        ("add-node", None, Trigger("after", 5), None),
        ("kill-rank0", None, Trigger("step", 40), None),
        ("stop", "node:2", Trigger("step", 30), 9.0),
        ("term", "random", Trigger("time", 30), None),
    ]
    assert args.nodes == 3 and args.rdzv_backend == "etcd-v3"


def test_durations_default_per_fault_and_corrupt_targets_a_random_node():
    [stop] = parse_fault("stop", "node:0@step:5")
    [etcd] = parse_fault("restart-etcd", "@step:5")
    [corrupt] = parse_fault("corrupt-checkpoint", "@after:2")
    assert stop.duration == 8.0 and etcd.duration == 1.0
    assert corrupt.target == "random" and corrupt.duration is None


def test_random_kills_expand_to_kill_then_add_pairs():
    faults = parse_fault("random-kills", "3,every:4")
    assert [(f.kind, f.target, f.trigger) for f in faults] == [
        ("kill", "random", Trigger("after", 4)), ("add-node", None, Trigger("after", 1))] * 3


@pytest.mark.parametrize("kind, spec, words", [
    ("kill", "@step:5", "needs a target"),
    ("kill", "node:1", "say when"),
    ("kill", "node:x@step:5", "not node:N"),
    ("add-node", "node:1@step:5", "takes no target"),
    ("kill", "node:1@steps:5", "WHEN must be"),
    ("kill", "node:1@step:5,for:3", "takes no for"),
    ("stop", "node:1@step:5,for:abc", "takes seconds"),
    ("explode", "@step:1", "unknown fault"),
    ("random-kills", "zero", "count"),
])
def test_bad_fault_specs_are_refused_with_a_sentence(kind, spec, words):
    with pytest.raises(ScenarioError, match=words):
        parse_fault(kind, spec)


def test_scenario_file_gives_settings_and_faults_and_flags_win(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[drill]\nnodes = 4\ntail_steps = 7\ntrainer_args = ["--sleep-per-step", "0.1"]\n'
                    'faults = ["kill node:1@step:10", "add-node @after:3", "random-kills 1"]\n')
    args = parse_args(["--scenario", str(path), "--nodes", "2", "--term", "node:0@after:2"])
    assert args.nodes == 2 and args.tail_steps == 7 and args.trainer_args == "--sleep-per-step 0.1"
    assert [f.kind for f in args.faults] == ["kill", "add-node", "kill", "add-node", "term"]


def test_default_catalogue_parses_and_covers_every_fault():
    args = parse_args(["--scenario", str(REPO / "drills" / "default.toml")])
    kinds = {f.kind for f in args.faults}
    assert kinds == set(drill.FAULTS), sorted(set(drill.FAULTS) - kinds)
    assert args.netns


@pytest.mark.parametrize("argv, words", [
    (["--cut", "node:1@step:5,for:3"], "needs --netns"),
    (["--fill-disk", "@step:5", "--trainer-args=--checkpoint-dir /tmp/x"], "tmpfs"),
    (["--restart-etcd", "@step:5", "--rdzv-endpoint", "127.0.0.1:1"], "own etcd"),
])
def test_faults_that_need_the_drills_own_resources_say_so(argv, words):
    with pytest.raises(ScenarioError, match=words):
        parse_args(argv)


def test_main_reports_a_bad_scenario_in_one_line(capsys):
    assert drill.main(["--cut", "node:1@step:5"]) == 2
    assert "needs --netns" in capsys.readouterr().err


def test_an_out_folder_with_an_earlier_drills_results_is_refused_in_one_line(tmp_path, capsys):
    """Its step lines would be read with the new drill's (seen: 792 samples 'repeated' and two
    worlds 'overlapping' for 2.5 hours, a drill of the morning counted again)."""
    out = tmp_path / "drill"
    (out / "nodes" / "node-0").mkdir(parents=True)
    assert drill.main(["--out", str(out), "--nodes", "2", "--kill", "node:1@step:5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"elastic-train drill: error: --out {out} holds an earlier drill's results (nodes); "
                   "give a new folder or remove it"]
    assert sorted(p.name for p in out.iterdir()) == ["nodes"]  # nothing started, nothing written


def test_help_documents_the_grammar_with_examples():
    text = drill.build_parser().format_help()
    for needle in ("[TARGET]@WHEN", "node:N", "after:K", "--random-kills", "--trainer-args=--no-resume"):
        assert needle in text


def test_hang_needs_a_target_and_takes_no_duration():
    [hang] = parse_fault("hang", "random@after:3")
    assert (hang.kind, hang.target, hang.trigger, hang.duration) == ("hang", "random", Trigger("after", 3), None)
    with pytest.raises(ScenarioError, match="needs a target"):
        parse_fault("hang", "@step:5")
    with pytest.raises(ScenarioError, match="takes no for"):
        parse_fault("hang", "node:1@step:5,for:3")


def test_the_lease_comes_from_rdzv_conf_or_the_rendezvous_default():
    assert parse_args(["--stop", "node:1@step:5"]).lease_ttl == 3.0
    assert parse_args(["--rdzv-conf", "keep_alive_interval=1,lease_ttl=5", "--stop", "node:1@step:5"]).lease_ttl == 5.0
    with pytest.raises(ScenarioError, match="lease_ttl='x'"):
        parse_args(["--rdzv-conf", "lease_ttl=x"])


class FakeCluster:
    """What the kinds' fire functions use of a Cluster, without processes."""

    def __init__(self, nodes: int = 3) -> None:
        import random
        self.nodes = [SimpleNamespace(name=f"node-{i}", proc=SimpleNamespace(pid=1000 + i), state="running",
                                      net=None, paused_pgids=set(), signal=lambda sig: {4242})
                      for i in range(nodes)]
        self.max_nodes, self.rng, self.notes = nodes, random.Random(0), []
        self.network = SimpleNamespace(cut=lambda net: None)

    def node(self, name):
        return next((n for n in self.nodes if n.name == name), None)

    def note(self, node, what, **extra):
        self.notes.append((node, what, extra))


def fire(kind: str, duration: float | None, argv=(), **rec_extra) -> dict:
    """Fire ``kind`` on node-1 of a 3-node FakeCluster; return its record."""
    from elastic_trainer.drill.kinds import FAULTS
    args = parse_args(list(argv) + ["--netns", "--kill", "node:1@step:5"])
    driver = SimpleNamespace(cluster=FakeCluster(), args=args)
    rec = {"duration": duration, "node": "node-1", "notes": [], "final_world": 3, "expected_world": 3, **rec_extra}
    kind_ = FAULTS[kind]
    if kind_.prepare is not None:
        assert kind_.prepare(driver, rec) is None
    kind_.fire(driver, rec, driver.cluster.nodes[1], 3, 0.0)
    return rec


@pytest.mark.parametrize("kind", ["stop", "cut"])
def test_a_node_away_longer_than_its_lease_is_expected_at_n_minus_1_then_back_at_n(kind):
    rec = fire(kind, 30.0)
    assert rec["expect_dip"] and (rec["away_world"], rec["expected_world"], rec["final_world"]) == (2, 2, 3)
    rec = fire(kind, 2.0)  # under the 3 s lease: N throughout
    assert not rec["expect_dip"] and (rec["expected_world"], rec["final_world"]) == (3, 3)
    rec = fire(kind, 6.0, ["--rdzv-conf", "lease_ttl=6"])  # a longer lease: 6 s is not past it
    assert not rec["expect_dip"]


@pytest.mark.parametrize("recovery, sig, dip", [("live", signal.SIGUSR2, True), ("restart", signal.SIGSTOP, False)])
def test_hang_signals_one_worker_of_the_node_and_expects_n_minus_1_on_the_live_path(monkeypatch, recovery, sig, dip):
    from elastic_trainer.drill import kinds
    sent = []
    monkeypatch.setattr(kinds, "workers", lambda pid: [pid + 7] if pid == 1001 else [])
    monkeypatch.setattr(kinds.os, "kill", lambda pid, s: sent.append((pid, s)))
    rec = fire("hang", None, ["--recovery", recovery])
    assert sent == [(1008, sig)] and rec["worker_pid"] == 1008
    assert rec["expect_dip"] is dip and rec["away_world"] == 2 and rec["final_world"] == 3


def test_every_node_of_a_drill_with_a_hang_or_a_slow_node_gets_the_debug_hook():
    from elastic_trainer.drill.kinds import FAULTS, SLOW_FACTOR, SLOW_NODE_ARGS
    from elastic_trainer.env import ENV_DEBUG_HANG, ENV_DEBUG_SLOW
    assert dict(FAULTS["hang"].node_env) == {ENV_DEBUG_HANG: "1"}
    assert dict(FAULTS["slow"].node_env) == {ENV_DEBUG_SLOW: str(SLOW_FACTOR)}
    assert FAULTS["slow"].node_args == SLOW_NODE_ARGS and "--straggler-hold-out" in SLOW_NODE_ARGS
    assert not any(k.node_env or k.node_args for name, k in FAULTS.items() if name not in ("hang", "slow"))


# ----------------------------------------------------------------------------- synthetic logs

GBS = 4


def write_attempt(root: Path, node_ranks: dict[str, list[int]], rnd: int, steps: range, t0: float,
                  offset_of=lambda step: step * GBS, indices_of=None, pid_base: int = 1000) -> None:
    """Step logs + ledger of one world: ranks split each global batch of GBS indices."""
    world = sum(len(r) for r in node_ranks.values())
    for node, ranks in node_ranks.items():
        for rank in ranks:
            pid = pid_base + rnd * 100 + rank
            s, led = records.JsonLines(records.steps_path(root / node, rank, pid)), \
                records.JsonLines(records.ledger_path(root / node, rank, pid))
            for k, step in enumerate(steps):
                batch = indices_of(step) if indices_of else list(range((step - 1) * GBS, step * GBS))
                s.write(StepRecord(time=t0 + k, step=step, epoch=0, offset=offset_of(step), world_size=world,
                                   rank=rank, round=rnd, loss=1.0 / step, node="vm"))
                led.write(LedgerRecord(step=step, epoch=0, round=rnd, indices=batch[rank::world]))
            s.close()
            led.close()


def kill_record(fired_at: float, expected: int = 1, survivors=("node-0",)) -> dict:
    return {"index": 1, "label": "kill node:1@step:12", "kind": "kill", "fired_at": fired_at, "end_at": None,
            "fired_step": 12, "world_before": 2, "expected_world": expected, "final_world": expected,
            "survivors": list(survivors), "notes": [], "corrupted_steps": [], "status": "recovered"}


def two_attempts(root: Path, resume_from: int, **second) -> dict[str, Path]:
    """World 0 (2 nodes) trains steps 1..12 at t=100.., node-1 dies at t=112; world 1 resumes."""
    write_attempt(root, {"node-0": [0], "node-1": [1]}, 0, range(1, 13), 100.0)
    write_attempt(root, {"node-0": [0]}, 1, range(resume_from + 1, 31), 130.0, **second)
    return {"node-0": root / "node-0", "node-1": root / "node-1"}


TIMELINE = [{"time": 113.0, "node": "node-0", "what": "workers_gone"},
            {"time": 115.0, "node": "node-0", "what": "workers_started"}]
COMMITS = {5: 105.5, 10: 110.5}


def test_resume_from_the_last_checkpoint_is_exactly_once_and_measured(tmp_path):
    dirs = two_attempts(tmp_path, resume_from=10)
    report = drill_report.build_report({}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0, COMMITS)
    [fault] = report["faults"]
    assert report["ok"], report["failures"]
    assert report["ledger"]["final_step"] == 30 and report["ledger"]["samples_checked"] == 30 * GBS
    assert (fault["detect_s"], fault["rendezvous_s"], fault["first_step_s"]) == (1.5, 3.5, 18.5)
    assert (fault["last_step_before"], fault["resumed_from"], fault["steps_lost"], fault["samples_lost"]) == \
           (12, 10, 2, 2 * GBS)
    assert fault["committed_lost"] == 0


def test_resume_from_scratch_loses_committed_work_and_fails(tmp_path):
    dirs = two_attempts(tmp_path, resume_from=0)
    report = drill_report.build_report({}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0, COMMITS)
    [fault] = report["faults"]
    assert not report["ok"]
    assert fault["committed_lost"] == 10 and fault["resumed_from"] == 0
    assert any("committed steps lost" in f for f in report["failures"])


def test_a_rewound_sampler_repeats_samples_and_fails(tmp_path):
    def rewound(step):  # the resumed world replays the indices of steps 9 and 10 at 11 and 12
        return list(range((step - 3) * GBS, (step - 2) * GBS))
    dirs = two_attempts(tmp_path, resume_from=10, indices_of=rewound)
    ledger = drill_report.build_report({}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0, COMMITS)["ledger"]
    assert not ledger["ok"] and ledger["repeated"] == 2 * GBS
    assert ledger["repeated_examples"][0]["times"] == 2


def test_a_sampler_that_jumps_ahead_skips_samples_and_fails(tmp_path):
    dirs = two_attempts(tmp_path, resume_from=10, offset_of=lambda step: (step + 2) * GBS,
                        indices_of=lambda step: list(range((step + 1) * GBS, (step + 2) * GBS)))
    ledger = drill_report.build_report({}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0, COMMITS)["ledger"]
    assert not ledger["ok"] and ledger["skipped"] == 2 * GBS and ledger["offset_gaps"][0]["step"] == 11


def in_order(step, world_size=None):
    return list(range((step - 1) * GBS, step * GBS))


def test_the_sampler_order_check_passes_a_faithful_resume(tmp_path):
    dirs = two_attempts(tmp_path, resume_from=10)
    ledger = drill_report.build_report({}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0, COMMITS,
                                       expected=in_order)["ledger"]
    assert ledger["ok"] and ledger["order_checked"] and ledger["skipped"] == 0


def test_the_sampler_order_check_catches_substituted_samples(tmp_path):
    # Same offsets, no repeats, full batches: only the expected order shows that 11..12 took other data.
    dirs = two_attempts(tmp_path, resume_from=10,
                        indices_of=lambda step: in_order(step) if step > 12 else [1000 + i for i in in_order(step)])
    ledger = drill_report.build_report({}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0, COMMITS,
                                       expected=in_order)["ledger"]
    assert not ledger["ok"] and ledger["order_mismatch_steps"] == [11, 12] and ledger["skipped"] == 2 * GBS


def test_sampler_order_is_the_built_in_samplers_permutation():
    from elastic_trainer.sampler import epoch_permutation
    expected = drill_report.sampler_order(dataset_len=50, global_batch=12, seed=3)
    assert expected(1) == epoch_permutation(50, 3, 0)[:12].tolist()
    assert expected(5) == epoch_permutation(50, 3, 1)[:12].tolist()  # 4 steps per epoch, 2 samples dropped


def test_no_step_at_the_expected_world_is_not_recovered(tmp_path):
    dirs = two_attempts(tmp_path, resume_from=10)
    report = drill_report.build_report({}, [kill_record(111.5, expected=2)], TIMELINE, dirs, GBS, 60.0, COMMITS)
    assert not report["ok"] and not report["faults"][0]["recovered"]


def stop_record(fired_at: float, end_at: float, expect_dip: bool = True) -> dict:
    return {"index": 1, "label": "stop node:2@step:12,for:30", "kind": "stop", "fired_at": fired_at,
            "end_at": end_at, "duration": end_at - fired_at, "fired_step": 12, "world_before": 3, "round_before": 0,
            "away_world": 2, "expect_dip": expect_dip, "expected_world": 2 if expect_dip else 3, "final_world": 3,
            "survivors": ["node-0", "node-1"], "notes": [], "corrupted_steps": [], "status": "recovered"}


def three_nodes(root: Path) -> dict[str, Path]:
    return {f"node-{i}": root / f"node-{i}" for i in range(3)}


def test_a_stop_past_the_lease_is_measured_at_n_minus_1_and_back_at_n(tmp_path):
    """World 0 (3 nodes) steps 1..12 at t=100..111; node-2 stops at 111.5 for 30 s; the others go on
    at 2 from step 13 at t=115 (3.5 s later); node-2 is back at 141.5 and the world of 3 steps from
    step 40 at t=145."""
    write_attempt(tmp_path, {"node-0": [0], "node-1": [1], "node-2": [2]}, 0, range(1, 13), 100.0)
    write_attempt(tmp_path, {"node-0": [0], "node-1": [1]}, 1, range(13, 40), 115.0)
    write_attempt(tmp_path, {"node-0": [0], "node-1": [1], "node-2": [2]}, 2, range(40, 46), 145.0)
    report = drill_report.build_report({}, [stop_record(111.5, 141.5)], [], three_nodes(tmp_path), GBS, 60.0, {})
    [fault] = report["faults"]
    assert report["ok"], report["failures"]
    assert (fault["evicted_first_step_s"], fault["first_step_s"], fault["back_after_end_s"]) == (3.5, 33.5, 3.5)
    assert fault["steps_lost"] == 0 and fault["steps_during_fault"] == 27
    assert report["first_step_at_n_minus_1_s"]["stop"]["median"] == 3.5
    row = next(line for line in drill_report.summary_table(report).splitlines() if "stop node:2" in line)
    assert "3>2>3" in row and "3.5s" in row and "33.5s" in row and row.endswith("yes")


def test_a_stop_past_the_lease_without_a_world_at_n_minus_1_fails(tmp_path):
    """The survivors stall until the node is back (the behaviour before issue 27) and go on at 3."""
    write_attempt(tmp_path, {"node-0": [0], "node-1": [1], "node-2": [2]}, 0, range(1, 13), 100.0)
    write_attempt(tmp_path, {"node-0": [0], "node-1": [1], "node-2": [2]}, 1, range(13, 20), 145.0)
    report = drill_report.build_report({}, [stop_record(111.5, 141.5)], [], three_nodes(tmp_path), GBS, 60.0, {})
    [fault] = report["faults"]
    assert fault["recovered"] and not fault["ok"] and not report["ok"]
    assert fault["evicted_first_step_s"] is None
    assert any("did not train at 2 without the node" in f for f in report["failures"])
    # ... which a stop shorter than the lease may do: N throughout is all it expects
    short = drill_report.build_report({}, [stop_record(111.5, 113.5, expect_dip=False)], [],
                                      three_nodes(tmp_path), GBS, 60.0, {})
    assert short["ok"], short["failures"]
    row = next(line for line in drill_report.summary_table(short).splitlines() if "stop node:2" in line)
    assert " 3>3 " in row


def test_two_worlds_training_at_once_fail(tmp_path):
    write_attempt(tmp_path, {"node-0": [0]}, 0, range(1, 13), 100.0)
    write_attempt(tmp_path, {"node-1": [0]}, 1, range(11, 20), 105.0)
    report = drill_report.build_report({}, [], [], {"node-0": tmp_path / "node-0", "node-1": tmp_path / "node-1"},
                                       GBS, 60.0, {})
    assert report["overlapping_worlds"] and not report["ok"]


def test_a_torn_last_line_is_ignored_and_the_final_step_is_the_last_complete_one(tmp_path):
    dirs = two_attempts(tmp_path, resume_from=10)
    line = json.dumps(StepRecord(time=160.5, step=31, world_size=1, rank=0).to_json())
    path = records.steps_path(tmp_path / "node-0", 0, 1100)
    assert path.exists()
    with open(path, "a") as f:
        f.write(line[:len(line) // 2])
    report = drill_report.build_report({}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0, COMMITS)
    assert report["ok"] and report["ledger"]["final_step"] == 30


def test_report_files_and_summary_table(tmp_path):
    dirs = two_attempts(tmp_path / "logs", resume_from=10)
    report = drill_report.build_report({"started_at": 99.0}, [kill_record(111.5)], TIMELINE, dirs, GBS, 60.0,
                                       COMMITS)
    json_path, png_path = drill_report.write_report(report, tmp_path)
    assert json.loads(json_path.read_text())["faults"][0]["first_step_s"] == 18.5
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = drill_report.summary_table(report)
    assert "kill node:1@step:12" in table and "drill PASSED" in table and "18.5s" in table


# ----------------------------------------------------------------------------- the drill's etcd


@pytest.mark.timeout(60)
@pytest.mark.parametrize("netns", [False, True])
def test_the_drills_own_etcd_admits_only_holders_of_its_password_and_on_the_bridge_its_certificate(tmp_path, netns):
    """Issue 29: as the embedded etcd, the drill's etcd has authentication on (any user of the
    machine reaches its port), the password in a 0600 file the nodes are pointed to; on the netns
    bridge it serves TLS and asks for a client certificate of its own CA as well."""
    import grpc
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastic_trainer.drill.cluster import Cluster
    from elastic_trainer.etcd.client import EtcdConnection
    from elastic_trainer.rendezvous.options import RendezvousOptions

    if netns and (os.geteuid() != 0 or shutil.which("ip") is None):
        pytest.skip("network namespaces need root and iproute2")
    cluster = Cluster(parse_args(["--nodes", "1", "--out", str(tmp_path / "drill"), *(["--netns"] if netns else [])]))
    try:
        cluster.setup()
        conf = dict(item.split("=", 1) for item in cluster.etcd_conf.split(","))
        assert conf["user"] == "root" and Path(conf["password_file"]).stat().st_mode & 0o777 == 0o600
        assert conf.get("protocol") == ("https" if netns else None)
        host, port = cluster.endpoint.rsplit(":", 1)
        refused = (grpc.RpcError, etcd3.exceptions.Etcd3Exception)  # etcd3 wraps a failed connection
        anonymous = etcd3.client(host, int(port), timeout=3)  # no password, no certificate, plain http
        try:
            with pytest.raises(refused):
                anonymous.put("/elastic-trainer/intruder", b"")
        finally:
            anonymous.close()
        if netns:  # the CA, but no client certificate: refused in the TLS handshake
            without_cert = etcd3.client(host, int(port), timeout=3, ca_cert=conf["ca_cert"])
            try:
                with pytest.raises(refused):
                    without_cert.get("/elastic-trainer/x")
            finally:
                without_cert.close()
        # A node's own options (what start_node passes in --rdzv-conf) reach it.
        options = RendezvousOptions(RendezvousParameters("etcd-v3", cluster.endpoint, cluster.run_id, 1, 1, **conf))
        conn = EtcdConnection(options.etcd)
        try:
            conn.call(lambda c: c.put("/elastic-trainer/node-check", b"ok"), "put")
        finally:
            conn.close()
    finally:
        cluster.cleanup()


# ----------------------------------------------------------------------------- real drills


def run_drill(tmp_path: Path, *extra: str, timeout: float = 240) -> tuple[int, dict, str]:
    out = tmp_path / "drill"
    cmd = [sys.executable, "-m", "elastic_trainer.cli", "drill", "--nodes", "2", "--out", str(out),
           "--recovery-timeout", "100", "--timeout", str(timeout), "--tail-steps", "2", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, cwd=REPO,
                          start_new_session=True)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return done.returncode, report, done.stdout + done.stderr


def no_leftovers(report: dict) -> None:
    for rec in report["timeline"]:
        if rec["what"] in ("node_started", "workers_started"):
            for pid in rec.get("pids", [rec.get("pid")]):
                assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_drill_with_a_kill_a_join_a_stop_past_the_lease_and_a_hang_recovers_from_each_with_nothing_lost(tmp_path):
    """One drill of 2 nodes, the faults one after the other (each once the world is back; one
    drill's start and report instead of one per pair: ~15 s of the suite at load 10). A checkpoint
    every 2 steps: the hang often lands while the others gather for a save, which must not hide it
    (it did once: the whole save counted as a slow phase). The stop takes node-0, which the kill and
    the join leave running (node-1 is killed, node-2 joins)."""
    code, report, output = run_drill(tmp_path, "--kill", "node:1@step:8", "--add-node", "@after:2",
                                     "--stop", "node:0@after:3,for:5", "--hang", "random@after:3",
                                     "--trainer-args=--checkpoint-every 2", timeout=360)
    print(output[-3000:])
    assert code == 0, output[-3000:]
    kill, add, stop, hang = report["faults"]
    for fault in (kill, add):
        assert fault["recovered"] and fault["committed_lost"] == 0
        assert fault["first_step_s"] is not None and fault["detect_s"] is not None
    assert (kill["expected_world"], add["expected_world"]) == (1, 2)
    for fault in (stop, hang):  # a node away past its lease, a hung worker: N-1, then N again
        assert fault["expect_dip"] and fault["recovered"] and fault["ok"], fault["notes"]
        assert (fault["world_before"], fault["away_world"], fault["final_world"]) == (2, 1, 2)
        assert 0 < fault["evicted_first_step_s"] < fault["first_step_s"]
    assert stop["evicted_first_step_s"] < 5, "the survivor trained alone while the node was frozen"
    assert hang["signal"] == "SIGUSR2"
    assert report["ledger"]["repeated"] == 0 and report["ledger"]["skipped"] == 0 and not report["overlapping_worlds"]
    rows = [line for line in output.splitlines() if line.lstrip()[:2] in ("3 ", "4 ")]
    assert len(rows) == 2 and all(" 2>1>2 " in row for row in rows), rows
    assert (tmp_path / "drill" / "timeline.png").stat().st_size > 10_000
    no_leftovers(report)


@pytest.mark.slow
@pytest.mark.trial  # about 70 s: the straggler's mechanism is in the suite (tests/test_stragglers_live.py)
@pytest.mark.timeout(450)
def test_drill_slow_fault_leaves_the_slow_node_out_live_and_it_rejoins_with_nothing_lost(tmp_path):
    """The ``slow`` fault (issue 44 point 7): a node's workers five times slower (SIGUSR1 with
    ELASTIC_TRAINER_DEBUG_SLOW) until the others leave it out live (N-1); its launcher holds it out
    (5 s in a drill), checks it and lets it rejoin with new, fast workers (N); no sample repeated or
    skipped."""
    code, report, output = run_drill(tmp_path, "--nodes", "3", "--slow", "node:1@step:20,for:40", timeout=400)
    print(output[-3000:])
    assert code == 0, output[-3000:]
    [slow] = report["faults"]
    assert slow["expect_dip"] and slow["recovered"] and slow["ok"], slow["notes"]
    assert (slow["world_before"], slow["away_world"], slow["final_world"]) == (3, 2, 3)
    assert 0 < slow["evicted_first_step_s"] < slow["first_step_s"]
    assert report["ledger"]["repeated"] == 0 and report["ledger"]["skipped"] == 0 and not report["overlapping_worlds"]
    node = (tmp_path / "drill" / "nodes" / "node-1" / "agent.log").read_text(errors="replace")
    assert "evicted as a straggler" in node and "node check passed" in node, node[-3000:]
    no_leftovers(report)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigterm_to_the_drill_stops_everything_it_started(tmp_path):
    """Processes, etcd, and (as root) namespaces, veths, the bridge and the tmpfs are gone."""
    out = tmp_path / "drill"
    root = os.geteuid() == 0
    cmd = [sys.executable, "-m", "elastic_trainer.cli", "drill", "--nodes", "2", "--out", str(out),
           "--kill", "node:1@step:100000"] + (["--netns", "--fill-disk", "@step:100000"] if root else [])
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def trained() -> bool:
            if any(records.step_files(node, rank=0) for node in out.glob("nodes/*")):
                return True
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            return False

        wait_until(trained, 150, "the drill's first step", interval=0.5)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:
            continue
    assert not left, f"processes left behind: {left}"
    if root:
        names = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout + \
            subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"etd-{proc.pid}-" not in names and f"etb{proc.pid}" not in names
        assert str(out) not in Path("/proc/mounts").read_text()


@pytest.mark.slow
@pytest.mark.timeout(330)
@pytest.mark.trial  # 52 s on CI; the judge's failures on synthetic logs above
def test_drill_against_a_trainer_without_resume_fails(tmp_path):
    # On the restart path a node's loss restarts every worker from storage, so a trainer that
    # ignores its checkpoints starts over and the drill must catch the lost committed work.
    # (Live recovery never reads storage after a loss, so --no-resume changes nothing there.)
    code, report, output = run_drill(tmp_path, "--recovery", "restart", "--kill", "node:1@step:8",
                                     "--trainer-args=--no-resume")
    print(output[-3000:])
    assert code == 1, output[-3000:]
    assert report["faults"][0]["committed_lost"] > 0
    assert "drill FAILED" in output
    no_leftovers(report)
