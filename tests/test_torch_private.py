"""torch's private rendezvous API that the etcd-v3 handler relies on is still what we expect.

A torch upgrade that renames or re-signs any of it fails here, by name, instead of deep in a
recovery (``elastic_trainer/rendezvous/torch_private.py``).
"""

import torch

from elastic_trainer.rendezvous import torch_private


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
