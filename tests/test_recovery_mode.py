"""Which recovery mode a script runs under: ``--recovery`` always wins; without it, live when the
script or a module of its own uses the Manager (``training/uses_manager.py``); and a script that
runs live without the Manager stops its node at its first ``init_process_group`` with one line,
instead of training in a world of its own node only (``elastic_trainer/script.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastic_trainer.cli import launch
from elastic_trainer.training.uses_manager import script_sources, script_uses_manager
from tests.helpers.common import REPO, cli_cmd


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_script_uses_the_manager_when_it_imports_it_not_when_it_mentions_it(tmp_path):
    own_loop = REPO / "examples" / "own_loop.py"
    assert script_uses_manager(str(own_loop))
    for use in ("from elastic_trainer import (\n    Manager,\n    records,\n)\n",
                "import elastic_trainer\nm = elastic_trainer.Manager()\n",
                "import elastic_trainer.training.manager as et\nm = et.Manager\n",
                "def main():\n    from elastic_trainer.training.manager import Agreement, Manager\n"):
        _write(tmp_path, {"use.py": use})
        assert script_uses_manager(str(tmp_path / "use.py")), use
    for no_use in ('"""Not elastic_trainer\'s Manager: a CheckpointManager."""\nimport elastic_trainer\n',
                   "# from elastic_trainer import Manager\nimport torch.distributed as dist\n",
                   "from mylib import Manager\n", "import elastic_trainer as et\nx = Manager\n",
                   "this is not python (\n"):
        _write(tmp_path, {"no.py": no_use})
        assert not script_uses_manager(str(tmp_path / "no.py")), no_use
    assert not script_uses_manager(str(tmp_path / "missing.py"))


def test_the_manager_imported_through_the_scripts_own_modules_is_found(tmp_path):
    """Through a helper module beside the script, a package of its own (absolute and relative
    imports), and ``-m`` from the current folder; installed packages are not followed."""
    _write(tmp_path, {
        "train.py": "import torch\nfrom helpers import setup\n",
        "helpers.py": "from mypkg.live import make\n",
        "mypkg/__init__.py": "",
        "mypkg/live.py": "from .core import Group\n",
        "mypkg/core.py": "from elastic_trainer import Manager as Group\n",
        "plain.py": "import torch\nimport json\nfrom helpers2 import x\n",
        "helpers2.py": "import os\n",
    })
    sources = script_sources(str(tmp_path / "train.py"))
    assert sources.uses_manager
    assert [p.relative_to(tmp_path).as_posix() for p in sources.files] == [
        "train.py", "helpers.py", "mypkg/__init__.py", "mypkg/live.py", "mypkg/core.py"]
    plain = script_sources(str(tmp_path / "plain.py"))
    assert not plain.uses_manager and len(plain.files) == 2
    assert launch.parse_run_config([str(tmp_path / "train.py")]).rdzv_conf["recovery"] == "live"
    assert launch.parse_run_config([str(tmp_path / "plain.py")]).rdzv_conf["recovery"] == "restart"


def test_a_module_run_with_dash_m_is_found_from_the_current_folder(tmp_path, monkeypatch):
    _write(tmp_path, {"proj/__init__.py": "", "proj/train.py": "from . import loop\n",
                      "proj/loop.py": "from elastic_trainer import Manager\n"})
    monkeypatch.chdir(tmp_path)
    assert script_uses_manager("proj.train", module=True)
    assert not script_uses_manager("json", module=True)  # the standard library is not followed
    assert not script_uses_manager("no_such_module_here", module=True)
    assert launch.parse_run_config(["-m", "proj.train"]).rdzv_conf["recovery"] == "live"


def test_recovery_given_always_wins_over_the_guess(tmp_path):
    _write(tmp_path, {"plain.py": "import torch.distributed as dist\ndist.init_process_group()\n"})
    plain, own_loop = str(tmp_path / "plain.py"), str(REPO / "examples" / "own_loop.py")
    assert launch.parse_run_config(["--recovery", "live", plain]).rdzv_conf["recovery"] == "live"
    assert launch.parse_run_config(["--recovery", "restart", own_loop]).rdzv_conf["recovery"] == "restart"
    assert launch.parse_run_config(["--rdzv-conf", "recovery=live", plain]).rdzv_conf["recovery"] == "live"
    # What live recovery cannot do at all stays an error, with the reason and the fix:
    with pytest.raises(launch.UsageError, match="--recovery live needs the etcd-v3 rendezvous"):
        launch.parse_run_config(["--recovery", "live", "--rdzv-backend", "c10d", plain])
    with pytest.raises(launch.UsageError, match="--scale-lr"):
        launch.parse_run_config(["--recovery", "live", "--", "--scale-lr"])
    assert launch.parse_run_config(["--", "--scale-lr"]).rdzv_conf["recovery"] == "restart"


PLAIN_DDP = """\
import os, sys, time
import torch.distributed as dist
with open(sys.argv[1], "a") as f:          # one line per worker start: a restart would add more
    f.write(f"{os.getpid()}\\n")
dist.init_process_group("gloo")            # env://: under live recovery, this node's world only
with open(sys.argv[1] + ".trained", "a") as f:
    f.write(f"{dist.get_rank()} {dist.get_world_size()}\\n")
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_script_run_live_without_the_manager_stops_its_node_with_one_line_and_no_restart(tmp_path):
    """``--recovery live`` for a plain DDP script: without the check, each of its workers formed a
    group of this node's two workers and trained (``init ok: rank 0 world 2``); now the node ends
    at the first ``init_process_group`` with status 2 and one line that names the fix, and torch's
    agent restarts nothing (it used to restart the workers up to --max-restarts times)."""
    script, starts = tmp_path / "plain_ddp.py", tmp_path / "starts"
    script.write_text(PLAIN_DDP)
    proc = subprocess.run(
        cli_cmd("--nnodes", "1:2", "--nproc-per-node", "2", "--run-id", "guard", "--log-dir", str(tmp_path / "logs"),
                "--checkpoint-dir", "", "--recovery", "live", str(script), str(starts)),
        capture_output=True, text=True, timeout=180, cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elastic-train: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "runs under live recovery but forms its process group with init_process_group" in \
        errors[0] and "elastic_trainer.Manager" in errors[0] and "--recovery restart" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(starts.read_text().split()) <= 2, "the agent restarted the workers"
    assert not (tmp_path / "starts.trained").exists(), "a worker trained in a world of its own node"
    assert not list((tmp_path / "logs").glob("refusal-*"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_runs_through_the_entry_as_python_would_run_it(tmp_path):
    """``python -m elastic_trainer.script PROGRAM ARGS`` outside live recovery: ``__main__``, the
    arguments, the script's folder first on ``sys.path``, its exit status."""
    _write(tmp_path, {"sub/prog.py": "import sys, mod\nif __name__ == '__main__':\n"
                                     "    print(sys.argv, mod.X, sys.path[0]); sys.exit(3)\n",
                      "sub/mod.py": "X = 7\n"})
    proc = subprocess.run([sys.executable, "-m", "elastic_trainer.script", "sub/prog.py", "--a", "1"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == f"['sub/prog.py', '--a', '1'] 7 {(tmp_path / 'sub').resolve()}"


ENDING = '''import atexit, sys, threading, time
class Finalized:
    def __del__(self):
        print("finalized in the teardown", flush=True)
KEPT = Finalized()  # alive until the interpreter's teardown, which the entry skips
atexit.register(print, "the program's atexit callback ran")
def late():
    time.sleep(0.3)
    print("a non-daemon thread finished")
threading.Thread(target=late).start()
print("unflushed output", end="")  # sys.stdout without -u: still written at the end
{end}
'''


@pytest.mark.parametrize("end, status, err", [
    ("", 0, None),
    ("sys.exit(3)", 3, None),
    ("sys.exit('no data')", 1, "no data"),
    ("raise ValueError('bad input')", 1, "ValueError: bad input"),
])
def test_a_script_ends_as_python_ends_it_without_the_interpreters_teardown(tmp_path, end, status, err):
    """The program's threads joined, its atexit callbacks run, its exit status and its last words as
    Python gives them; then the worker exits, skipping the teardown where gloo can abort a finished run
    (``script.py`` 4.): an object left alive is not finalized."""
    (tmp_path / "prog.py").write_text(ENDING.format(end=end))
    proc = subprocess.run([sys.executable, "-m", "elastic_trainer.script", "prog.py"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout.startswith("unflushed output"), proc.stdout
    assert "a non-daemon thread finished" in proc.stdout
    assert "the program's atexit callback ran" in proc.stdout
    assert proc.stdout.index("a non-daemon thread finished") < proc.stdout.index("the program's atexit callback ran")
    assert "finalized in the teardown" not in proc.stdout
    if err:
        assert err in proc.stderr
