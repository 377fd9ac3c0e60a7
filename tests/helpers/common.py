"""Helpers the test modules share: the repository and the CLI, polling, the distributed
environment, exact state equality, a tiny tmpfs, an etcd connection, the processes a test starts.

    from tests.helpers.common import REPO, assert_same_state, cli_cmd, mounted_tmpfs, wait_until

    steps = wait_until(lambda: records.read_steps(logs), 90, "3 steps", until=lambda s: len(s) >= 3)
    assert holds_within(lambda: watch.established.is_set(), 5), "the watch must be re-established"
    assert_same_state(resumed.state_dict(), uninterrupted.state_dict(), "model")
    with mounted_tmpfs(tmp_path / "tiny", size="1m"):   # skips the test when not root
        ...

Fixtures stay in ``tests/conftest.py`` (``single_process_env`` clears ``DIST_ENV``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from elastic_trainer.env import ENV_CHECKPOINT_DIR, ENV_LOG_DIR, ENV_RDZV_ROUND
from elastic_trainer.etcd.server import EtcdServer
from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions, parse_endpoints

REPO = Path(__file__).resolve().parent.parent.parent

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            ENV_CHECKPOINT_DIR, ENV_LOG_DIR, ENV_RDZV_ROUND)
"""What torchrun and the etcd-v3 handler give a worker: a trainer that sees none of these runs as a
single process, with the folders its flags name."""

T = TypeVar("T")


def cli_cmd(*args: str) -> list[str]:
    """The command line of ``elastic-train`` in this interpreter."""
    return [sys.executable, "-m", "elastic_trainer.cli", *args]


def wait_until(poll: Callable[[], T], timeout: float, what: str, *, until: Callable[[T], object] = bool,
               interval: float = 0.2, details: Callable[[], str] | None = None) -> T:
    """Call ``poll()`` every ``interval`` seconds until ``until(value)`` holds, and return that value.

    ``until`` defaults to the value's truth, so ``wait_until(lambda: path.exists(), 30, "the marker")``
    waits for a condition, and ``until=lambda steps: len(steps) >= 3`` returns what ``poll`` read.
    ``poll`` may itself assert (that a process is still running, say). After ``timeout`` seconds this
    raises ``AssertionError`` "timed out after <timeout> s waiting for <what>", followed by ``details()``
    when given (what was seen so far, the tails of the logs).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = poll()
        if until(value):
            return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g} s waiting for {what}"
            raise AssertionError(f"{message}; {details()}" if details is not None else message)
        time.sleep(interval)


def holds_within(check: Callable[[], object], timeout: float, interval: float = 0.02) -> bool:
    """Whether ``check()`` holds within ``timeout`` seconds, polled every ``interval`` (finely: the
    watch and lease tests time what they wait for): ``assert holds_within(...), "why"``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def etcd_conn(etcd: EtcdServer | str, retry_timeout: float = 10) -> EtcdConnection:
    """A client connection to a test's etcd (the server, or its endpoint ``host:port[,...]``)."""
    endpoint = etcd if isinstance(etcd, str) else etcd.endpoint
    return EtcdConnection(EtcdOptions(endpoints=parse_endpoints(endpoint), retry_timeout=retry_timeout))


class Processes:
    """OS processes a test starts, each in its own session, all killed (by process group) at the end
    (conftest's ``procs`` fixture; the k8s test's pods). Not a torch process group: what it holds
    are ``subprocess.Popen`` objects."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(cmd, **kwargs)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


def assert_same_state(a: Any, b: Any, where: str = "state") -> None:
    """Exact equality of two nested states (state dicts, checkpoints: dicts, lists and tuples of
    tensors and plain values): the same keys and lengths, tensors of the same dtype bit for bit.
    ``where`` names the part that differs in the failure (``state['model']['w'] differs``)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where} keys differ: {set(a) ^ set(b)}"
        for k in a:
            assert_same_state(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str = "1m", read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (created) for the ``with`` block, unmounted after it.

    Mounting needs root: where it fails, the test is skipped."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"ro,size={size}" if read_only else f"size={size}"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
