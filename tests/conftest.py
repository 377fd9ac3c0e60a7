"""Shared fixtures: a real etcd server, a real S3 HTTP endpoint, and process clean-up.

Every fixture starts what it needs on a free loopback port and stops it afterwards,
also when the test fails. Helpers that are not fixtures are in ``tests/helpers/`` (``common.py``,
``Processes`` among them, and ``runs.py``: the tiny model's flags and the trainer runs the
end-to-end tests compare).
"""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import HealthCheck, settings

from elastic_trainer.etcd.server import EtcdServer, free_port
from tests.helpers.common import DIST_ENV, Processes

# Property tests run on 2 shared cores beside multi-process tests: a case's wall time says nothing about
# the property, so no deadline and no too-slow health check (a test's own @settings still applies).
settings.register_profile("shared-cores", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-cores")


_HANDLER_EXPORTS = "ELASTIC_TRAINER_RDZV_"


def pytest_addoption(parser):
    parser.addoption("--trials", action="store_true",
                     help="also run the long end-to-end trials (tests marked `trial`; about 25 more minutes "
                          "on 2 cores): `bash launch/test --trials`")


def _named(item, args: list[str]) -> bool:
    """Whether the command line names this test itself (``file.py::test``, a parametrised id or its
    prefix), not only its file or folder."""
    return any("::" in a and (item.nodeid == a or item.nodeid.startswith(a.rstrip("/") + "[")
                              or item.nodeid.startswith(a + "::")) for a in args)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``trial`` (long runs of several nodes, each repeating at a larger size what a
    shorter test of the default suite covers) run with ``--trials``, ``-m trial`` or when named on
    the command line; else they are skipped, saying how to run them. Tests marked ``gpu`` need CUDA: where torch
    sees none they are skipped, saying why."""
    if not config.getoption("--trials") and "trial" not in (config.getoption("markexpr") or ""):
        args = [str(a) for a in config.args]
        skip_trial = pytest.mark.skip(reason="a long end-to-end trial: run with `bash launch/test --trials`")
        for item in items:
            if item.get_closest_marker("trial") and not _named(item, args):
                item.add_marker(skip_trial)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    why = ("CPU-only torch build" if torch.version.cuda is None
           else f"torch built for CUDA {torch.version.cuda} sees no GPU")
    skip = pytest.mark.skip(reason=f"needs CUDA ({why}); run `pytest -m gpu` on a GPU machine")
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_rendezvous_exports():
    """Undo what a rendezvous handler run in-process exports after every test.

    The etcd-v3 handler puts its round, prefix and node into ``os.environ`` for the workers it
    starts; left there, they would reach the trainers that later tests start, which would then be
    fenced by a round of an etcd that is gone. (Only these keys: session fixtures such as
    ``s3_endpoint`` set environment variables of their own during a test's setup.)"""
    saved = {k: v for k, v in os.environ.items() if k.startswith(_HANDLER_EXPORTS)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_HANDLER_EXPORTS)]:
            del os.environ[key]
        os.environ.update(saved)


@pytest.fixture
def single_process_env(monkeypatch) -> None:
    """No torchrun or rendezvous variables (``DIST_ENV``) in the environment during the test, so a
    ``Trainer`` built in it runs as one process. A module opts in with
    ``pytestmark = [..., pytest.mark.usefixtures("single_process_env")]``."""
    for name in DIST_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real etcd 3.4 on loopback for the tests of one module: yields the ``EtcdServer``."""
    data = tmp_path_factory.mktemp("etcd") / "data"
    server = EtcdServer(data_dir=data, log_path=data.with_suffix(".log"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def run_id() -> str:
    """A run id no other test uses, so tests can share one etcd."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 HTTP endpoint (moto's ThreadedMotoServer) with credentials in the environment."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    url = f"http://127.0.0.1:{port}"
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                          "ELASTIC_TRAINER_S3_ENDPOINT_URL")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", ELASTIC_TRAINER_S3_ENDPOINT_URL=url)
    try:
        yield url
    finally:
        server.stop()
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_url(s3_endpoint) -> str:
    """``s3://<new bucket>/run`` on the real S3 endpoint, the bucket created."""
    from elastic_trainer import storage

    bucket = f"t-{uuid.uuid4().hex[:12]}"
    fs, _ = storage.get_fs(f"s3://{bucket}")
    fs.mkdir(bucket)
    return f"s3://{bucket}/run"


@pytest.fixture(params=["file", "memory", "s3"])
def any_url(request, tmp_path) -> str:
    """A fresh storage URL on each store: a local path, ``memory://`` and ``s3://`` (real endpoint)."""
    if request.param == "file":
        return str(tmp_path / "store")
    if request.param == "memory":
        return f"memory://store-{uuid.uuid4().hex[:8]}"
    return request.getfixturevalue("s3_url")


@pytest.fixture
def procs():
    """Start processes with ``procs.start([...])``; all are killed (by process group) after the test."""
    started = Processes()
    try:
        yield started
    finally:
        started.kill_all()
