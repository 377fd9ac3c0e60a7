"""A node's ``/metrics``, scraped over real HTTP and read back as samples (tests of live runs)."""

from __future__ import annotations

import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.common import REPO, cli_cmd
from tests.helpers.runs import CONF, SEEDS_MSE


def scrape(port: int, scheme: str = "http", context: ssl.SSLContext | None = None) -> dict[str, list]:
    """Sample name -> its samples, from one real HTTP scrape."""
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", timeout=10, context=context) as answer:
        text = answer.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def node_metrics(port: int) -> dict[str, list]:
    """A scrape of a running node (empty while its endpoint is not up yet)."""
    try:
        return scrape(port)
    except (urllib.error.URLError, ConnectionError, OSError):
        return {}


def figure(samples: dict[str, list], name: str, **labels: str) -> float:
    """The largest value of ``name`` with ``labels`` (0 when there is none)."""
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    return max(found) if found else 0.0


def live_node(procs, log: Path, *, endpoint: str, run_id: str, nnodes: str, port: int, run_dir: Path,
              launcher: tuple[str, ...] = (), trainer: tuple[str, ...] = ()) -> subprocess.Popen:
    """One ``elastic-train`` node of the built-in trainer (``SEEDS_MSE``) under live recovery, serving
    its ``/metrics`` on ``port`` of loopback, its output appended to ``log``; checkpoints and logs
    under ``run_dir``. ``launcher``: more launcher flags; ``trainer``: more trainer flags."""
    with open(log, "a") as out:
        return procs.start(cli_cmd("--nnodes", nnodes, "--rdzv-endpoint", endpoint, "--run-id", run_id,
                                   "--rdzv-conf", CONF, "--recovery", "live", "--metrics-port", str(port),
                                   "--metrics-addr", "127.0.0.1", "--checkpoint-dir", str(run_dir / "ck"),
                                   "--log-dir", str(run_dir / "logs"), *launcher, "--", *SEEDS_MSE,
                                   "--max-steps", "100000", *trainer),
                           cwd=REPO, stdout=out, stderr=out)
