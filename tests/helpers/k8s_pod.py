"""What the kubelet would give a rendered container: its environment, its volumes, its command.

No cluster is needed: a test passes the objects a cluster would hold (ConfigMaps from the rendered
manifests, Secrets as the README says to create them, the pod's fields such as its IP and name),
and gets what the container would see, or the error that would keep it from starting.

    env = container_env(container, config_maps, secrets={}, fields={"status.podIP": "10.77.0.3", ...})
    mounts = mount_volumes(pod_spec, container, secrets={}, root=tmp_path / "pod-0", claims={...})
    argv = [localize(expand(t, env), mounts) for t in container["command"] + container["args"]]

Rules followed (Kubernetes documentation, "Define dependent environment variables" and
"Secrets" / "ConfigMaps" as environment variables and volumes):
* ``env`` entries are set in order; ``$(VAR)`` in a ``value`` and in ``command``/``args`` expands to a
  variable defined earlier in the list; ``$$`` is a literal ``$``; an unknown reference stays as written.
* A ``configMapKeyRef``/``secretKeyRef`` to a missing object or key fails the container
  (CreateContainerConfigError) unless ``optional: true``, which leaves the variable unset.
* A ``secret``/``configMap`` volume of a missing object fails the pod unless ``optional: true``,
  which mounts an empty folder; each key becomes a file (``items`` pick and rename keys).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

KUBECTL = shutil.which("kubectl")


def kustomize(folder: str | Path) -> list[dict]:
    """The objects ``kubectl kustomize folder`` renders (the test fails with kubectl's error)."""
    out = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {folder} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


class CreateContainerConfigError(Exception):
    """The kubelet could not build the container: a required ConfigMap, Secret or key is missing."""


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Expand ``$(VAR)`` from ``env`` as the kubelet does (``$$`` escapes, unknown refs stay)."""
    return _REF.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def _key_ref(kind: str, ref: dict, objects: dict[str, dict[str, str]], var: str) -> str | None:
    data = objects.get(ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        what = f"{kind} {ref['name']}" + ("" if data is None else f" has no key {ref['key']}")
        raise CreateContainerConfigError(f"env {var}: {what} (not optional)")
    return data[ref["key"]]


def container_env(container: dict, config_maps: dict[str, dict[str, str]], secrets: dict[str, dict[str, str]],
                  fields: dict[str, str]) -> dict[str, str]:
    """The container's environment; ``fields`` maps fieldRef paths (``status.podIP``) to values."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            value = _key_ref("ConfigMap", source["configMapKeyRef"], config_maps, name)
        elif "secretKeyRef" in source:
            value = _key_ref("Secret", source["secretKeyRef"], secrets, name)
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path not in fields:
                raise KeyError(f"env {name}: the test gives no value for the pod field {path}")
            value = fields[path]
        else:
            raise NotImplementedError(f"env {name}: {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def mount_volumes(pod_spec: dict, container: dict, secrets: dict[str, dict[str, str]], root: Path,
                  claims: dict[str, Path] | None = None,
                  config_maps: dict[str, dict[str, str]] | None = None) -> dict[str, Path]:
    """Make each of the container's volume mounts a local folder under ``root``; ``{mountPath: folder}``.

    emptyDir: a fresh folder; secret/configMap: a folder with one file per key (missing and
    optional: empty); persistentVolumeClaim: ``claims[claimName]``, shared between pods.
    """
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        vol = volumes[mount["name"]]
        folder = root / "volumes" / mount["name"]
        if "persistentVolumeClaim" in vol:
            folder = (claims or {})[vol["persistentVolumeClaim"]["claimName"]]
        elif "emptyDir" in vol:
            folder.mkdir(parents=True, exist_ok=True)
        elif "secret" in vol or "configMap" in vol:
            kind, source = ("Secret", vol["secret"]) if "secret" in vol else ("ConfigMap", vol["configMap"])
            name = source.get("secretName") or source.get("name")
            data = (secrets if kind == "Secret" else config_maps or {}).get(name)
            if data is None and not source.get("optional"):
                raise CreateContainerConfigError(f"volume {mount['name']}: {kind} {name} (not optional)")
            folder.mkdir(parents=True, exist_ok=True)
            items = source.get("items") or [{"key": k, "path": k} for k in (data or {})]
            for item in items:
                if data is not None and item["key"] in data:
                    (folder / item["path"]).write_text(data[item["key"]])
                    (folder / item["path"]).chmod(0o600)
        else:
            raise NotImplementedError(f"volume {mount['name']}: {sorted(vol)}")
        mounts[mount["mountPath"]] = folder
    return mounts


def localize(text: str, mounts: dict[str, Path]) -> str:
    """``text`` with every path under a mount point moved to the mount's local folder."""
    if not mounts:
        return text
    # One pass, longest mount point first, so that a replaced path is not replaced again.
    points = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
    return re.sub(rf"(?<![\w/.-])({points})(?=/|$|,)", lambda m: str(mounts[m[1]]), text)
