"""launch/setup and the Dockerfile: no package index named anywhere, and a second setup run is quiet.

The setup test runs the real script with a virtualenv whose ``bin/python`` is this interpreter
behind a wrapper that records its command lines and stands in for ``python -m pip`` (it must not
install this worktree into the shared test interpreter): what is checked is which steps the script
takes, what it prints, and how long it takes.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.common import REPO

INDEX = re.compile(r"(?i)(--(extra-)?index-url|download\.pytorch\.org|pypi\.org|files\.pythonhosted\.org|/simple\b)")


def test_no_tracked_file_names_a_package_index():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if name == "tests/test_setup.py" or not path.is_file() or path.suffix in (".png", ".jpg"):
            continue
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if INDEX.search(line):
                hits.append(f"{name}:{no}: {line.strip()}")
    assert not hits, "pip must use the machine's own configuration:\n" + "\n".join(hits)


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv, calls = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                       f'if [ "$1" = -m ] && [ "$2" = pip ]; then exit 0; fi\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return venv, calls


def _setup(venv: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "launch/setup"], cwd=REPO, env={**_env(), "VENV": str(venv)},
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - t0


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_setup_installs_the_package_once_and_a_second_run_is_quiet_and_quick(tmp_path):
    venv, calls = _fake_venv(tmp_path)
    first, _ = _setup(venv)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.strip().splitlines()
    assert lines[0] == f"setup: installing elastic-trainer and its test extras into {venv}"
    assert all(line.startswith("setup: ") for line in lines), lines  # one line per step, no pip noise
    assert "-m pip -q --disable-pip-version-check install -e .[test]" in calls.read_text()
    want = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    assert (venv / ".elastic-trainer-setup").read_text().strip() == want

    calls.write_text("")
    second, took = _setup(venv)
    assert second.returncode == 0 and second.stdout == "" and second.stderr == "", (second.stdout, second.stderr)
    assert "pip" not in calls.read_text(), "nothing to install: pip is not even asked"
    assert took < 15, f"a second run took {took:.1f}s"


def test_setup_refuses_an_unknown_torch_build_in_one_line(tmp_path):
    venv, _ = _fake_venv(tmp_path)
    proc = subprocess.run(["bash", "launch/setup"], cwd=REPO, env={**_env(), "VENV": str(venv), "TORCH_BUILD": "rocm"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "setup: TORCH_BUILD=rocm must be auto, cpu or default"
