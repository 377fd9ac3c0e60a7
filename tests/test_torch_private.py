"""torch's private rendezvous API that the etcd-v3 handler relies on is still what we expect.

A torch upgrade that renames or re-signs any of it fails here, by name, instead of deep in a
recovery (``elastic_trainer/torch_private.py``). The handler's subclasses touch torch's
private names by overriding and reading them, which no import shows; the second test reads
``handler.py`` and ``state.py`` and fails when one of those names is not in ``torch_private``'s
lists, and the third makes, from torch's own source, a torch that renamed each listed name and
checks that ``check_compatible()`` notices.
"""

import ast
import inspect
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from elastic_trainer import torch_private

# (handler.py's operation loop moved to admission.py and its watchdog to watchdog.py: both subclass torch's classes.)
SUBCLASS_FILES = [Path(torch_private.__file__).parent / "rendezvous" / name
                  for name in ("handler.py", "admission.py", "watchdog.py", "state.py")]


def test_torch_private_api_matches_what_the_handler_relies_on():
    assert torch_private.check_compatible() == []


def test_installed_torch_is_a_tested_version():
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert minor in torch_private.TESTED_TORCH, (
        f"torch {torch.__version__} is not among the versions torch_private.py was checked against "
        f"{torch_private.TESTED_TORCH}; check it and widen the bound in pyproject.toml")


def test_a_missing_method_is_reported(monkeypatch):
    monkeypatch.delattr(torch_private.DistributedOpExecutor, "_mark_rendezvous_complete")
    assert any("_mark_rendezvous_complete" in p for p in torch_private.check_compatible())


# -- every torch name the subclasses touch is listed ---------------------------------------------

def _torch_members(cls: type) -> set[str]:
    return set(dir(cls)) | torch_private.instance_attributes(cls)


def torch_names_touched(path: Path) -> dict[str, set[str]]:
    """Per torch class (``torch_private.torch_classes()``'s labels): the names of it that ``path``'s
    subclasses override, call or read on ``self`` (or ``super()``), and the private names read on
    any other object that one of the file's torch classes has (``obj._settings``)."""
    classes = torch_private.torch_classes()
    tree = ast.parse(path.read_text(), str(path))
    subclasses = {node: [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
                  for node in tree.body if isinstance(node, ast.ClassDef)}
    in_file = {label for labels in subclasses.values() for label in labels}
    touched: dict[str, set[str]] = {label: set() for label in in_file}
    on_self: set[int] = set()
    for node, labels in subclasses.items():
        for label in labels:
            members = _torch_members(classes[label])
            for item in node.body:
                own_init = classes[label].__init__ is not object.__init__
                if isinstance(item, ast.FunctionDef) and item.name in members and \
                        ((item.name == "__init__" and own_init) or not item.name.startswith("__")):
                    touched[label].add(item.name)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and (
                        (isinstance(sub.value, ast.Name) and sub.value.id == "self")
                        or (isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Name)
                            and sub.value.func.id == "super")):
                    on_self.add(id(sub))
                    if sub.attr.startswith("_") and not sub.attr.startswith("__") and sub.attr in members:
                        touched[label].add(sub.attr)
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Attribute) and id(sub) not in on_self and sub.attr.startswith("_") \
                and not sub.attr.startswith("__"):
            for label in in_file:
                if sub.attr in _torch_members(classes[label]):
                    touched[label].add(sub.attr)
    return touched


def test_every_torch_name_the_subclasses_touch_is_checked():
    found = {}
    for path in SUBCLASS_FILES:
        for label, names in torch_names_touched(path).items():
            found.setdefault(label, set()).update(names)
    assert set(found) == {"DynamicRendezvousHandler", "DistributedOpExecutor", "StateHolder"}
    listed = {label: set(torch_private.METHODS.get(label, ())) | set(torch_private.ATTRIBUTES.get(label, ()))
              for label in found}
    missing = {label: sorted(names - listed[label]) for label, names in found.items() if names - listed[label]}
    assert missing == {}, f"add these to torch_private.METHODS or ATTRIBUTES: {missing}"
    # the ones that issue 26 found unchecked
    assert {"_start_heartbeats", "_stop_heartbeats", "_this_node", "_store", "_settings", "_state_holder"} \
        <= found["DynamicRendezvousHandler"]


def test_the_scan_sees_an_unlisted_override_and_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class H(DynamicRendezvousHandler):\n"
                     "    def _wrap_store(self, store):\n"
                     "        return self._heartbeat_lock\n")
    assert torch_names_touched(probe) == {"DynamicRendezvousHandler": {"_wrap_store", "_heartbeat_lock"}}


# -- a torch that renamed any listed name fails the check -----------------------------------------

def renamed_in_torch(cls: type, tmp_path: Path, monkeypatch, old: str = "", new: str = "") -> type:
    """``cls`` as a torch would define it that renamed ``old`` to ``new`` (neither given: a plain copy):
    torch's own source of the class with the name replaced, compiled in a module file of its own (so
    that its source can be read, as ``instance_attributes`` does)."""
    source = textwrap.dedent(inspect.getsource(cls))
    changed = re.sub(rf"\b{re.escape(old)}\b", new, source) if old else source
    assert changed != source or not old, f"{old} is not in torch's source of {cls.__name__}"
    path = tmp_path / f"newer_torch_{cls.__name__}.py"
    path.write_text(changed)
    module = types.ModuleType(path.stem)
    module.__dict__.update({k: v for k, v in vars(sys.modules[cls.__module__]).items() if not k.startswith("__")})
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, path.stem, module)
    exec(compile(changed, str(path), "exec"), module.__dict__)
    return module.__dict__[cls.__name__]


# The private names (public ones, ``run`` or ``shutdown``, are also declared by torch's abstract bases).
LISTED = sorted({(label, name) for table in (torch_private.METHODS, torch_private.ATTRIBUTES)
                 for label, names in table.items() for name in names
                 if name.startswith("_") and not name.startswith("__")})


@pytest.mark.parametrize("label, name", LISTED, ids=[f"{label}.{name}" for label, name in LISTED])
def test_a_torch_that_renamed_a_listed_name_fails_the_check(label, name, tmp_path, monkeypatch):
    real = torch_private.torch_classes()[label]
    fake = renamed_in_torch(real, tmp_path, monkeypatch, name, f"{name}_v2")
    monkeypatch.setattr(torch_private, label, fake)
    assert torch_private.torch_classes()[label] is fake
    problems = torch_private.check_compatible()
    assert any(re.search(rf"\b{label}\b.*[ .]{re.escape(name)}\b", p) for p in problems), problems


def test_an_unchanged_copy_of_torchs_handler_passes(tmp_path, monkeypatch):
    """(The renaming above is what fails the check, not the copying.)"""
    for label, real in torch_private.torch_classes().items():
        monkeypatch.setattr(torch_private, label, renamed_in_torch(real, tmp_path, monkeypatch))
    assert torch_private.check_compatible() == []
