"""Offline checks of ``k8s/components/monitoring``: the PodMonitor, the alerts (PrometheusRule), the
Grafana dashboard and the NetworkPolicy that lets Prometheus in; no cluster is needed.

The component is built onto each workload flavour with ``kubectl kustomize``; every rendered object
validates (kubernetes-validate, strict, for built-in kinds; the Prometheus Operator's PodMonitor and
PrometheusRule against k8s/schemas/, converted from its v0.93 CRDs); the trainer container of each
flavour gets the named port the PodMonitor scrapes, the launcher's default ``--metrics-port``. Every
PromQL expression of the dashboard and the alerts parses (promql-parser) and selects only series
that ``elastic_trainer/observability/metrics.py`` defines, and the dashboard shows every metric.
Where ``promtool`` is installed (Debian's ``prometheus`` package) the rules pass ``promtool check
rules`` and each alert is run against synthetic series (``promtool test rules``): it fires when it
should and stays quiet when it should.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_k8s_monitoring.py
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from elastic_trainer.observability import metrics
from elastic_trainer.observability.metrics_server import DEFAULT_PORT
from tests.helpers import k8s_pod, k8s_schemas
from tests.helpers.common import REPO
from tests.helpers.k8s_network import DEFAULT_DENY, allowed

K8S = REPO / "k8s"
COMPONENT = K8S / "components" / "monitoring"
FLAVOURS = {"overlays/pvc": "Job", "overlays/pytorchjob": "PyTorchJob", "overlays/trainer-v2": "TrainingRuntime"}
TRAINER_LABELS = {"app.kubernetes.io/component": "trainer", "app.kubernetes.io/part-of": "elastic-trainer"}
K8S_VERSION = "1.31"  # as tests/test_k8s.py
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$namespace": "elastic-trainer"}

kubectl = shutil.which("kubectl")
promtool = shutil.which("promtool")
needs_kubectl = pytest.mark.skipif(kubectl is None, reason="kubectl is not installed: cannot run `kubectl kustomize`")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool is not installed (apt-get install prometheus)")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each flavour with the monitoring component, built once."""
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot run `kubectl kustomize`")
    out = {}
    for flavour in FLAVOURS:
        folder = tmp_path_factory.mktemp("kustomize")
        rel = lambda p: os.path.relpath(p, folder)  # noqa: E731 - kustomize refuses absolute paths
        (folder / "kustomization.yaml").write_text(yaml.safe_dump(
            {"resources": [rel(K8S / flavour)], "components": [rel(COMPONENT)]}))
        out[flavour] = k8s_pod.kustomize(folder)
    return out


def _one(objs: list[dict], kind: str) -> dict:
    [obj] = [o for o in objs if o["kind"] == kind]
    return obj


def _trainer_pod(objs: list[dict], kind: str) -> dict:
    workload = _one(objs, kind)
    if kind == "PyTorchJob":
        return workload["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    if kind == "TrainingRuntime":
        [job] = [j for j in workload["spec"]["template"]["spec"]["replicatedJobs"]
                 if j["template"]["metadata"]["labels"].get("trainer.kubeflow.org/trainjob-ancestor-step") == "trainer"]
        return job["template"]["spec"]["template"]
    return workload["spec"]["template"]


def _rules() -> list[dict]:
    rule = yaml.safe_load((COMPONENT / "prometheusrule.yaml").read_text())
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def _dashboard() -> dict:
    return json.loads((COMPONENT / "dashboard.json").read_text())


def _dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]
    for name, value in GRAFANA_VARIABLES.items():  # what Grafana puts in before Prometheus sees them
        exprs = [e.replace(name, value) for e in exprs]
    return exprs


def _selected_series(expr: str) -> set[str]:
    import promql_parser

    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


# ---------------------------------------------------------------------------------------- manifests

@needs_kubectl
@pytest.mark.parametrize("version", [K8S_VERSION, "latest"])
def test_every_object_with_the_component_validates_offline(rendered, version):
    from kubernetes_validate import utils

    version = utils.major_minor(utils.latest_version()) if version == "latest" else version
    failures = []
    for flavour, objs in rendered.items():
        assert {"PodMonitor", "PrometheusRule"} <= {o["kind"] for o in objs}
        failures += [f"{flavour} {o['kind']}/{o['metadata']['name']}: {e}" for o in objs
                     for e in k8s_schemas.errors_of(o, version)]
    assert not failures, "\n".join(failures)


@needs_kubectl
def test_the_schemas_reject_what_the_operator_rejects(rendered):
    objs = rendered["overlays/pvc"]
    monitor, rule = _one(objs, "PodMonitor"), _one(objs, "PrometheusRule")

    def broken(obj, change) -> list[str]:
        bad = copy.deepcopy(obj)
        change(bad)
        return [e.message for e in k8s_schemas.validator_for(bad, K8S_VERSION).iter_errors(bad)]

    assert broken(monitor, lambda m: m["spec"]["podMetricsEndpoints"][0].update(intervall="15s"))  # typo
    assert broken(monitor, lambda m: m["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"))
    assert broken(monitor, lambda m: m["spec"].update(selector="trainer"))
    assert broken(rule, lambda r: r["spec"]["groups"][0]["rules"][0].pop("expr"))
    assert broken(rule, lambda r: r["spec"]["groups"][0]["rules"][0].update(**{"for": "5 minutes"}))


@needs_kubectl
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_podmonitor_scrapes_the_named_metrics_port_of_every_trainer_container(rendered, flavour):
    objs = rendered[flavour]
    pod = _trainer_pod(objs, FLAVOURS[flavour])
    [trainer] = [c for c in pod["spec"]["containers"] if "elastic-train" in c.get("command", [])]
    ports = {p["name"]: p["containerPort"] for p in trainer.get("ports", [])}
    assert ports.get("metrics") == DEFAULT_PORT, f"{flavour}: the trainer container's ports are {ports}"
    monitor = _one(objs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


@needs_kubectl
def test_prometheus_reaches_the_metrics_port_and_nothing_else_of_the_trainers(rendered):
    objs = rendered["overlays/pvc"]
    policies = [copy.deepcopy(DEFAULT_DENY)] + [o for o in objs if o["kind"] == "NetworkPolicy"]
    trainer = {"ns": "elastic-trainer", "labels": _trainer_pod(objs, "Job")["metadata"]["labels"]}
    prometheus = {"ns": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}}
    assert allowed(policies, prometheus, trainer, DEFAULT_PORT)
    assert not allowed(policies, prometheus, trainer, 29500), "Prometheus must not reach rank 0's store"
    for stranger in ({"ns": "other", "labels": {}}, {"ns": "elastic-trainer", "labels": {"app": "debug"}}):
        assert not allowed(policies, stranger, trainer, DEFAULT_PORT)
    assert allowed(policies, trainer, trainer, 45123), "trainers still reach each other on any port"


# ------------------------------------------------------------------------------------ queries

def test_every_query_parses_and_selects_only_metrics_the_module_defines():
    defined = metrics.series_names()
    queries = [("alert " + r["alert"], r["expr"]) for r in _rules()] + [("dashboard", e) for e in _dashboard_exprs()]
    for where, expr in queries:
        selected = _selected_series(expr)
        assert selected, f"{where}: {expr!r} selects no metric"
        assert selected <= defined, f"{where} selects {sorted(selected - defined)}, which metrics.py does not define"


def test_the_dashboard_shows_every_metric():
    shown = set().union(*(_selected_series(e) for e in _dashboard_exprs()))
    missing = [spec.full_name for spec in metrics.SPECS if not spec.series() & shown]
    assert missing == [], f"the dashboard shows nothing of {missing}"


def test_the_alerts_the_issue_asks_for_are_there():
    alerts = {r["alert"]: r for r in _rules()}
    assert {"ElasticTrainerNoCheckpoint", "ElasticTrainerWorldBelowMin", "ElasticTrainerStraggler"} <= set(alerts)
    assert "1800" in alerts["ElasticTrainerNoCheckpoint"]["expr"]
    assert alerts["ElasticTrainerWorldBelowMin"]["for"] == "5m"
    assert all(r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"] for r in alerts.values())


def test_the_dashboard_is_a_grafana_dashboard_with_its_variables():
    dashboard = _dashboard()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "elastic-trainer"
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "namespace"}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and panel["datasource"]["uid"] == "${datasource}"
        assert all('namespace="$namespace"' in t["expr"] for t in panel["targets"]), panel["title"]


# ----------------------------------------------------------------------------------- promtool

def _rules_file(tmp_path: Path, annotations: bool = True) -> Path:
    """The PrometheusRule's groups as a Prometheus rules file (without annotations for the unit tests,
    whose expected alerts would otherwise have to repeat every templated text)."""
    rule = yaml.safe_load((COMPONENT / "prometheusrule.yaml").read_text())
    groups = rule["spec"]["groups"]
    if not annotations:
        for group in groups:
            for r in group["rules"]:
                r.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


@needs_promtool
def test_promtool_accepts_the_rules_and_their_templates(tmp_path):
    out = subprocess.run([promtool, "check", "rules", str(_rules_file(tmp_path))], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


ALERT_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  # committed once at time 0, never again: quiet at 29 min, firing from 31 min (+ for: 1m)
  - interval: 1m
    input_series:
      - series: 'elastic_trainer_checkpoint_last_commit_timestamp_seconds{namespace="ml", pod="p0"}'
        values: '0x60'
      - series: 'elastic_trainer_started_timestamp_seconds{namespace="ml", pod="p0"}'
        values: '0x60'
    alert_rule_test:
      - {eval_time: 29m, alertname: ElasticTrainerNoCheckpoint, exp_alerts: []}
      - eval_time: 40m
        alertname: ElasticTrainerNoCheckpoint
        exp_alerts: [{exp_labels: {severity: warning, namespace: ml}}]
  # a commit every minute: never
  - interval: 1m
    input_series:
      - series: 'elastic_trainer_checkpoint_last_commit_timestamp_seconds{namespace="ml", pod="p0"}'
        values: '0+60x60'
    alert_rule_test:
      - {eval_time: 59m, alertname: ElasticTrainerNoCheckpoint, exp_alerts: []}
  # never committed since the launcher started at time 0
  - interval: 1m
    input_series:
      - series: 'elastic_trainer_started_timestamp_seconds{namespace="ml", pod="p0"}'
        values: '0x60'
    alert_rule_test:
      - {eval_time: 20m, alertname: ElasticTrainerNoCheckpoint, exp_alerts: []}
      - eval_time: 40m
        alertname: ElasticTrainerNoCheckpoint
        exp_alerts: [{exp_labels: {severity: warning, namespace: ml}}]
  # 3 nodes, one lost at 10 min under --min-nodes 3: quiet within 5 min of it, firing after
  - interval: 1m
    input_series:
      - series: 'elastic_trainer_world_nodes{namespace="ml", pod="p0"}'
        values: '3x9 2x30'
      - series: 'elastic_trainer_min_nodes{namespace="ml", pod="p0"}'
        values: '3x40'
      - series: 'elastic_trainer_min_nodes{namespace="ml", pod="p1"}'
        values: '3x40'
      - series: 'elastic_trainer_min_nodes{namespace="ml", pod="p2"}'
        values: '3x40'
      - series: 'elastic_trainer_steps_total{namespace="ml", pod="p0"}'
        values: '0+10x40'
    alert_rule_test:
      - {eval_time: 9m, alertname: ElasticTrainerWorldBelowMin, exp_alerts: []}
      - {eval_time: 13m, alertname: ElasticTrainerWorldBelowMin, exp_alerts: []}
      - eval_time: 20m
        alertname: ElasticTrainerWorldBelowMin
        exp_alerts: [{exp_labels: {severity: critical, namespace: ml}}]
      - {eval_time: 30m, alertname: ElasticTrainerNoProgress, exp_alerts: []}
  # one launcher of three left (the others' pods gone): fewer than --min-nodes 2 run at all
  - interval: 1m
    input_series:
      - series: 'elastic_trainer_min_nodes{namespace="ml", pod="p0"}'
        values: '2x20'
      - series: 'elastic_trainer_world_nodes{namespace="ml", pod="p0"}'
        values: '2x20'
    alert_rule_test:
      - eval_time: 10m
        alertname: ElasticTrainerWorldBelowMin
        exp_alerts: [{exp_labels: {severity: critical, namespace: ml}}]
  # a pod 5x slower than its peers for 15 min fires; one 1.2x does not
  - interval: 1m
    input_series:
      - series: 'elastic_trainer_straggler_score{namespace="ml", pod="slow", pid="7"}'
        values: '5x20'
      - series: 'elastic_trainer_straggler_score{namespace="ml", pod="fine", pid="8"}'
        values: '1.2x20'
    alert_rule_test:
      - {eval_time: 5m, alertname: ElasticTrainerStraggler, exp_alerts: []}
      - eval_time: 15m
        alertname: ElasticTrainerStraggler
        exp_alerts: [{exp_labels: {severity: warning, namespace: ml, pod: slow}}]
  # launchers up, the step counter flat for 30 min: no progress
  - interval: 1m
    input_series:
      - series: 'elastic_trainer_steps_total{namespace="ml", pod="p0"}'
        values: '100x40'
      - series: 'elastic_trainer_min_nodes{namespace="ml", pod="p0"}'
        values: '1x40'
    alert_rule_test:
      - eval_time: 30m
        alertname: ElasticTrainerNoProgress
        exp_alerts: [{exp_labels: {severity: critical, namespace: ml}}]
"""


@needs_promtool
def test_each_alert_fires_when_it_should_and_stays_quiet_otherwise(tmp_path):
    _rules_file(tmp_path, annotations=False)
    (tmp_path / "tests.yaml").write_text(ALERT_TESTS)
    out = subprocess.run([promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
