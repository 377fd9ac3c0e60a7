"""Offline validators for the custom resources in k8s/ (no cluster, no network).

Built-in kinds are checked with kubernetes-validate; the custom resources with the JSON schemas in
k8s/schemas/, written from each project's published CRD (see each schema's ``description``), whose
``$ref``s to Kubernetes types (pod templates, env vars, object metadata) resolve against the
definitions kubernetes-validate bundles for the pinned Kubernetes version::

    check = validator_for(obj, "1.31")      # None: a built-in kind, for kubernetes-validate
    errors = [e.message for e in check.iter_errors(obj)] if check else []
    problems = errors_of(obj, "1.31")       # either way: "path: message" of each error
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parents[2] / "k8s" / "schemas"

# (apiVersion, kind) -> the schema file that validates it.
CUSTOM_KINDS: dict[tuple[str, str], str] = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-kubeflow-v1.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob-trainer-v1alpha1.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): "trainingruntime-trainer-v1alpha1.json",
    ("chaos-mesh.org/v1alpha1", "PodChaos"): "podchaos-chaos-mesh-v1alpha1.json",
    ("chaos-mesh.org/v1alpha1", "NetworkChaos"): "networkchaos-chaos-mesh-v1alpha1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
}
CUSTOM_GROUPS = {api.split("/")[0] for api, _ in CUSTOM_KINDS}


@functools.cache
def _kubernetes_definitions(version: str) -> dict:
    from kubernetes_validate import utils

    bundled = [v for v in utils.all_versions() if utils.major_minor(v) == version]
    if not bundled:
        raise ValueError(f"kubernetes-validate bundles no Kubernetes {version}")
    path = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{bundled[0]}-local-strict/_definitions.json")
    return json.loads(path.read_text())


@functools.cache
def validator(schema_file: str, version: str):
    """A jsonschema validator for ``k8s/schemas/<schema_file>`` whose Kubernetes refs resolve offline."""
    import jsonschema
    from referencing import Registry, Resource

    defs = _kubernetes_definitions(version)
    schema = json.loads((SCHEMAS / schema_file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    registry = Registry().with_resources([(defs["$id"], Resource.from_contents(defs)),
                                          (schema["$id"], Resource.from_contents(schema))])
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validator_for(obj: dict, version: str):
    """The validator of a custom resource we have a schema for; None for a built-in kind.

    A kind of a custom API group we have no schema for raises ``KeyError`` (a new kind in k8s/ needs
    its schema), rather than falling through to kubernetes-validate's "no schema" message.
    """
    api, kind = obj["apiVersion"], obj["kind"]
    if (api, kind) in CUSTOM_KINDS:
        return validator(CUSTOM_KINDS[api, kind], version)
    if api.split("/")[0] in CUSTOM_GROUPS:
        raise KeyError(f"no schema in k8s/schemas/ for {kind} ({api}): write one from the published CRD")
    return None


def errors_of(obj: dict, version: str) -> list[str]:
    """``path: message`` of each error of ``obj``: against our schema for a custom resource,
    kubernetes-validate (strict: unknown fields fail) for a built-in kind."""
    import kubernetes_validate

    crd = validator_for(obj, version)
    if crd is not None:
        return [f"{'.'.join(map(str, e.path))}: {e.message[:200]}" for e in crd.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []
