"""Every results file says where it came from: date, commit, machine and command (``benchmarks/provenance.py``).

Text results start with ``# commit C date D cores N load A/B ... command: ...``; JSON results start
with the keys ``commit``, ``date``, ``machine`` and ``command``. Every benchmark that writes results
writes that header itself, through the one helper. Nothing here runs a benchmark.
"""

from __future__ import annotations

import ast
import json
import sys

import pytest

from benchmarks import provenance
from tests.helpers.common import REPO

RESULTS = REPO / "benchmarks" / "results"
WRITERS = ("overhead", "checkpoint_bench", "sharded_bench", "recovery", "live_recovery", "rdzv_scale",
           "gpu_overhead", "gpu_first_save", "stream_read")
"""The benchmarks that write results files (the others are their workers, their task, and plots.py)."""


def result_files(ext: str) -> list:
    return sorted(RESULTS.rglob(f"*.{ext}"))


def test_there_are_results_to_check():
    assert len(result_files("txt")) >= 8 and len(result_files("json")) >= 8


@pytest.mark.parametrize("path", result_files("txt"), ids=lambda p: p.name)
def test_every_text_result_starts_with_its_header_line(path):
    first = path.read_text().split("\n", 1)[0]
    match = provenance.HEADER_RE.match(first)
    assert match, f"{path.name}: the first line is not a results header: {first[:120]!r}"
    assert match["commit"] != "unknown" and match["date"][:4].isdigit() and "/" in match["load"]
    assert match["command"].startswith("python") and "benchmarks/" in match["command"]


@pytest.mark.parametrize("path", result_files("json"), ids=lambda p: p.name)
def test_every_json_result_starts_with_commit_date_machine_and_command(path):
    data = json.loads(path.read_text())
    assert list(data)[:4] == list(provenance.JSON_KEYS), f"{path.name}: starts with {list(data)[:4]}"
    assert data["commit"] != "unknown" and data["date"][:4].isdigit() and "benchmarks/" in data["command"]
    assert set(data["machine"]) >= {"cores", "load_start", "load_end"}


def test_a_header_added_afterwards_says_so_and_a_text_and_its_json_agree():
    for txt in result_files("txt"):
        js = txt.with_suffix(".json")
        if not js.exists():
            continue
        line = provenance.HEADER_RE.match(txt.read_text().split("\n", 1)[0])
        data = json.loads(js.read_text())
        assert (line["commit"], line["command"]) == (data["commit"], data["command"]), txt.name
        assert bool(line["afterwards"]) == ("header_added_afterwards" in data), txt.name


def test_the_helper_writes_the_header_line_first_then_what_was_printed_and_the_json_keys_first(tmp_path, capsys):
    txt, js = tmp_path / "out" / "bench.txt", tmp_path / "bench.json"
    with provenance.record(txt, argv=["benchmarks/x.py", "--fast"]) as run:
        print("a table")
        provenance.write_json(js, {"rows": [1], "command": "replaced"}, run)
    assert capsys.readouterr().out == "a table\n"  # still printed as before
    first, rest = txt.read_text().split("\n", 1)
    match = provenance.HEADER_RE.match(first)
    assert match and match["command"].endswith("benchmarks/x.py --fast") and not match["afterwards"]
    assert int(match["cores"]) >= 1 and len(match["load"].split("/")) == 2
    assert rest == "a table\n"
    data = json.loads(js.read_text())
    assert list(data) == [*provenance.JSON_KEYS, "rows"] and data["command"] == run.command
    assert data["date"].endswith("Z") and len(data["machine"]["load_start"]) == 3


def test_a_failed_run_still_leaves_its_header_and_says_why(tmp_path):
    txt, before = tmp_path / "bench.txt", sys.stdout
    with pytest.raises(RuntimeError):
        with provenance.record(txt, argv=["benchmarks/x.py"]):
            print("half a table")
            raise RuntimeError("a node did not start")
    lines = txt.read_text().splitlines()
    assert provenance.HEADER_RE.match(lines[0]) and lines[1] == "half a table"
    assert lines[-1] == "# failed: RuntimeError: a node did not start"
    assert sys.stdout is before  # stdout is given back


def test_the_commit_comes_from_git_commit_when_set(monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert provenance.commit() == "abc1234"
    monkeypatch.delenv("GIT_COMMIT")
    assert provenance.commit() != "unknown"  # this checkout's own


@pytest.mark.parametrize("name", WRITERS)
def test_every_benchmark_that_writes_results_writes_them_through_the_helper(name):
    source = (REPO / "benchmarks" / f"{name}.py").read_text()
    tree = ast.parse(source)
    calls = {f"{n.func.value.id}.{n.func.attr}" for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)}
    assert "provenance.record" in calls and "provenance.add_arguments" in calls, name
    assert "json.dump" not in calls, f"{name} writes JSON without the header (use provenance.write_json)"
    writes = {"provenance.write_json", "write_json"} & (calls | {n.func.id for n in ast.walk(tree)
                                                               if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)})
    assert writes, f"{name} writes no JSON through provenance.write_json"


def test_run_all_has_every_benchmark_write_its_own_text_file():
    text = (REPO / "benchmarks" / "run_all").read_text()
    for name in ("overhead", "checkpoint_bench", "recovery", "live_recovery", "rdzv_scale"):
        assert f'--txt "$OUT/{name}.txt"' in text, name
    assert '| tee "$printed"' in text and "printed=$LOGS/" in text  # stdout kept as a log, not as the result
