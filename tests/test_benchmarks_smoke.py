"""Smoke tests of benchmarks/: every script runs at its smallest size, exits 0 and prints numbers.

These keep the benchmark scripts working; they assert nothing about speed (the numbers of a
2-core machine shared with other work say nothing in a test). A script that has not landed in
the repository yet is skipped with the reason; one that exists and fails is a failure.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_benchmarks_smoke.py
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import provenance
from tests.helpers.common import REPO

BENCH = REPO / "benchmarks"
FLOAT = re.compile(r"\d+\.\d+")


def run_script(procs, name: str, *args: str, timeout: float = 240) -> str:
    """Run ``benchmarks/<name> args...`` from the repository root; return its output (exit 0 asserted)."""
    script = BENCH / name
    if not script.exists():
        pytest.skip(f"benchmarks/{name} has not landed yet")
    proc = procs.start([sys.executable, str(script), *args], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.kill_all()
        out, _ = proc.communicate()
        pytest.fail(f"benchmarks/{name} {' '.join(args)} ran over {timeout}s; output:\n{out[-3000:]}")
    assert proc.returncode == 0, f"benchmarks/{name} {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}"
    assert "command:" in out, f"benchmarks/{name} did not print the command that produced its numbers"
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overhead_quick_measures_both_launchers_and_writes_json(procs, tmp_path):
    out = run_script(procs, "overhead.py", "--quick", "--out", str(tmp_path / "overhead.json"))
    result = json.loads((tmp_path / "overhead.json").read_text())
    assert result["elastic"]["median"] > 0 and result["plain"]["median"] > 0
    assert result["ratio_of_medians"] > 0
    assert re.search(r"ratio of medians elastic/plain: \d+\.\d+", out)
    assert "plain_ddp.py" in result["plain_command"] and "elastic_trainer.cli" in result["elastic_command"]
    assert [r["kind"] for r in result["runs"]] == ["elastic", "plain"]  # alternated, A first
    assert result["runs"][0]["checkpoints"] >= 1  # the elastic side saved inside the measured window


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_bench_quick_prints_a_row_per_store(procs):
    out = run_script(procs, "checkpoint_bench.py", "--quick")
    rows = [line for line in out.splitlines() if line.startswith(("file |", "s3 |"))]
    assert rows, f"no result rows in:\n{out[-2000:]}"
    assert all(FLOAT.search(r) for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sharded_bench_small_measures_full_and_sharded_saves_and_loads(procs, tmp_path):
    out = run_script(procs, "sharded_bench.py", "--ranks", "2", "--widths", "128", "--steps", "2", "--repeats", "1",
                     "--json", str(tmp_path / "s.json"), timeout=380)
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert sorted({(r["mode"], r["world"]) for r in rows}) == [
        ("full", 2), ("load-full", 1), ("load-full", 2), ("load-sharded", 1), ("load-sharded", 2), ("sharded", 2)]
    assert all(r["peak"] > 0 and r["rss_before"] > 0 for r in rows)
    saves = [r for r in rows if not r["mode"].startswith("load")]
    assert all(r["save_s"][0] > 0 and r["copy_s"][0] > 0 and r["blocked_s"][0] > 0 and r["bytes"] > 0 for r in saves)
    assert all(r["seconds"] > 0 for r in rows if r["mode"].startswith("load"))
    assert len([line for line in out.splitlines() if line.startswith("  128 |")]) == 6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stream_read_small_reads_both_formats_and_repositions(procs, tmp_path):
    out = run_script(procs, "stream_read.py", "--gb", "0.01", "--seq-len", "256", "--paced-steps", "5",
                     "--repositions", "1", "--step-seconds", "0.05", "--json", str(tmp_path / "s.json"), timeout=280)
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert sorted((r["format"], r["workers"]) for r in rows) == [("parquet", 0), ("parquet", 2), ("tokens", 0), ("tokens", 2)]
    assert all(r["read"]["rows"] == r["rows_in_all"] // 16 * 16 and r["read"]["mb_per_s"] > 0 for r in rows)
    assert all(v["n"] == 2 and v["max_ms"] > 0 for r in rows for v in r["reposition"].values())
    data = re.search(r" under (\S+) in ", out)
    assert "worst reposition" in out and data and not Path(data[1]).exists(), "the data it wrote stays behind"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_recovery_one_trial_of_etcd_v3_measures_each_scenario(procs, tmp_path):
    out = run_script(procs, "recovery.py", "--trials", "1", "--backends", "etcd-v3", "--json",
                     str(tmp_path / "recovery.json"), timeout=360)
    results = json.loads((tmp_path / "recovery.json").read_text())["results"]["etcd-v3"]
    assert len(results) == 1 and set(results[0]) >= {"kill-other", "kill-rank0", "join"}
    assert any(isinstance(v, float) for v in results[0].values()), f"no recovery was measured: {results}"
    assert "median s" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_live_recovery_one_trial_recovers_each_fault_and_measures_goodput(procs, tmp_path):
    """One live trial (kill a node, add one, kill rank 0) and an 8 s goodput run with a fault at 4 s
    (each goodput run, clean and with faults, lasts that long: 8 s instead of 12 s saves 8 s of the
    suite; the fault is still recovered from in ~0.1-0.3 s, well inside the window)."""
    out = run_script(procs, "live_recovery.py", "--systems", "live", "--trials", "1", "--goodput-seconds", "8",
                     "--fault-every", "4", "--scenarios", "kill-other,join,kill-rank0", "--json",
                     str(tmp_path / "live.json"), timeout=270)
    result = json.loads((tmp_path / "live.json").read_text())
    trial = result["results"]["live"][0]
    for scenario in ("kill-other", "join", "kill-rank0"):
        assert isinstance(trial[scenario], dict), f"live did not recover from {scenario}: {trial[scenario]}"
        assert trial[scenario]["s"] > 0 and trial[scenario]["redone"] is not None
    assert trial["join"]["pause"] > 0 and trial["join"]["hwm_extra_mib"]["survivors"] == 2
    goodput = result["goodput"]["live"]
    assert goodput["clean"]["steps"] > 0 and goodput["faults"]["steps"] > 0 and goodput["ratio"] > 0
    assert 0 < goodput["time_ratio"] <= 1
    assert len(goodput["faults"]["faults"]) == 1  # one fault at 4 s (the next would be at 8 s, the end)
    assert "targets (issue 17):" in out and "median s" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_live_recovery_one_frozen_node_goes_to_n_minus_1_and_back_and_writes_commit_and_date(procs, tmp_path):
    """One live trial of stop-node (issue 27): a world without the frozen node, then N again.

    It runs after kill-rank0 in the same job, as in the full benchmark: the job gets its killed
    node back before the node is frozen. (Before, the freeze came on the world of N-1 the kill
    left, whose earlier steps at N passed for a steady world of N: the frozen node took the world
    to N-2 and "no step at world size N" was reported as a failure to recover.)"""
    out = run_script(procs, "live_recovery.py", "--systems", "live", "--trials", "1", "--scenarios",
                     "kill-rank0,stop-node", "--goodput-seconds", "0", "--json", str(tmp_path / "s.json"),
                     "--txt", str(tmp_path / "s.txt"), timeout=150)
    result = json.loads((tmp_path / "s.json").read_text())
    assert isinstance(result["results"]["live"][0]["kill-rank0"], dict)
    stop = result["results"]["live"][0]["stop-node"]
    assert isinstance(stop, dict), f"live did not recover from a frozen node: {stop}"
    assert 0 < stop["s"] < stop["back"] and stop["away_s"] >= 5
    assert list(result)[:4] == list(provenance.JSON_KEYS)
    head = (tmp_path / "s.txt").read_text().splitlines()[0]
    assert provenance.HEADER_RE.match(head) and "live_recovery.py --systems live" in head, head
    assert "targets (issue 27):" in out and "live stop-node: to N-1 median" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rdzv_scale_eight_agents_all_get_a_rank(procs):
    out = run_script(procs, "rdzv_scale.py", "--sizes", "8")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["8"]]
    assert rows, f"no row for 8 agents in:\n{out[-2000:]}"
    assert FLOAT.fullmatch(rows[0][1]), f"8 agents did not all get a rank: {rows[0]}"


def test_plots_draw_one_png_per_benchmark_from_results(tmp_path):
    """plots.py reads each benchmark's result format (JSON or printed table) and writes its PNG."""
    (tmp_path / "overhead.json").write_text(json.dumps({
        "runs": [{"kind": k, "repeat": i, "samples_per_s": v} for i in range(2)
                 for k, v in (("elastic", 100.0 + i), ("plain", 102.0))],
        "elastic": {"median": 100.5}, "plain": {"median": 102.0}, "ratio_of_medians": 0.985, "cpus": 2,
        "settings": {"nproc_per_node": 2, "max_steps": 110, "warmup_steps": 10}}))
    (tmp_path / "checkpoint_bench.txt").write_text(
        "command: python benchmarks/checkpoint_bench.py\n"
        "store | d_model | step ms | async blocked ms | sync save s | save MB/s | plain copy MB/s\n"
        "file | 128 | 40 | 2.0 | 0.30 | 80 | 100\n"
        "s3 | 512 | 300 | 9.0 | 2.10 | 50 | 70\n")
    (tmp_path / "recovery.json").write_text(json.dumps({"results": {
        "etcd-v3": [{"kill-other": 3.0, "join": 2.0, "kill-rank0": 4.0}],
        "c10d": [{"kill-other": 40.0, "join": "timeout", "kill-rank0": "died"}]}}))
    (tmp_path / "rdzv_scale.txt").write_text(
        " agents  all ranked s  first s  req/agent  lost CAS/agent  notes\n"
        "      8          0.21     0.20       12.0             0.5\n"
        "   1000          >120        -       12.0             0.5  only 3/1000 ranked\n")
    out = subprocess.run([sys.executable, str(BENCH / "plots.py"), "--docs", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("overhead", "checkpoint_bench", "recovery", "rdzv_scale"):
        png = tmp_path / f"{name}.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name}.png not written"


def test_plots_read_the_results_folder_and_write_the_pngs_elsewhere(tmp_path):
    """By default results come from benchmarks/results/ and PNGs go to docs/; --results and --out move each."""
    plots = _load_plots()
    assert plots.RESULTS == BENCH / "results" and plots.DOCS == REPO / "docs"
    results, pngs = tmp_path / "results", tmp_path / "pngs"
    results.mkdir()
    (results / "recovery.json").write_text(json.dumps({"results": {
        "etcd-v3": [{"kill-other": 3.0, "join": 2.0, "kill-rank0": 4.0}]}}))
    out = subprocess.run([sys.executable, str(BENCH / "plots.py"), "--results", str(results), "--out", str(pngs),
                          "--only", "recovery"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (pngs / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (results / "recovery.png").exists()


def _load_plots():
    spec = importlib.util.spec_from_file_location("bench_plots", BENCH / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CKPT_TABLE = (
    "command: python benchmarks/checkpoint_bench.py\n"
    "store | d_model | step ms | async blocked ms | sync save s | save MB/s | plain copy MB/s | save/plain | "
    "plain+fsync MB/s | save/(plain+fsync)\n"
    "--- | --- | --- | --- | --- | --- | --- | --- | --- | ---\n"
    "file | 128 | 40 | 2.0 | 0.30 | 80 | 100 | 75% | 90 | 88%\n"
    "s3 | 128 | 300 | 9.0 | 2.10 | 50 | 70 | 70% | n/a | n/a\n"
    "file d_model=128: plain copy through the save's write path (early writeback + fsync) 120 MB/s, save/that 66%\n")
CKPT_JSON_ROWS = [
    {"store": "file", "d_model": 128, "step_s": 0.040, "blocked_s": 0.002, "sync_s": 0.30, "save_mbps": 80.0,
     "plain_mbps": 100.0, "ratio": 0.75, "durable_mbps": 90.0, "durable_ratio": 0.88, "streamed_mbps": 120.0,
     "streamed_ratio": 0.66},
    {"store": "s3", "d_model": 128, "step_s": 0.300, "blocked_s": 0.009, "sync_s": 2.10, "save_mbps": 50.0,
     "plain_mbps": 70.0, "ratio": 0.70, "durable_mbps": None, "durable_ratio": None, "streamed_mbps": None,
     "streamed_ratio": None}]


def test_plots_read_checkpoint_json_and_printed_table_alike(tmp_path):
    """The JSON of checkpoint_bench.py and its printed table give the same rows, durable copies included."""
    plots = _load_plots()
    (tmp_path / "checkpoint_bench.txt").write_text(CKPT_TABLE)
    from_table = plots._checkpoint_rows(tmp_path)
    (tmp_path / "checkpoint_bench.json").write_text(json.dumps({"command": "x", "rows": CKPT_JSON_ROWS}))
    from_json = plots._checkpoint_rows(tmp_path)
    assert from_json[0]["d_model"] == 128, "the JSON (d_model an int) is read before the table when both are there"
    assert [(r["store"], str(r["d_model"])) for r in from_table] == [(r["store"], str(r["d_model"])) for r in from_json]
    for t, j in zip(from_table, from_json):
        for key, value in j.items():
            if key in ("store", "d_model"):
                continue
            assert (t[key] is None) == (value is None), key
            if value is not None:
                assert t[key] == pytest.approx(value), key
    assert plots.plot_checkpoint(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_plots_read_rdzv_scale_json_with_its_timeout(tmp_path):
    """A size whose agents were not all ranked is drawn at the join timeout the JSON records."""
    plots = _load_plots()
    (tmp_path / "rdzv_scale.json").write_text(json.dumps({"timeout_s": 120.0, "results": [
        {"agents": 8, "all_ranked_s": 0.2, "requests_per_agent": 13},
        {"agents": 1000, "all_ranked_s": None, "requests_per_agent": 28}]}))
    rows = plots._rdzv_rows(tmp_path)
    assert [(r["agents"], r["all_ranked_s"], r["timeout_s"]) for r in rows] == [(8, 0.2, 120.0), (1000, None, 120.0)]
    assert plots.plot_rdzv_scale(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_run_all_is_valid_bash_and_calls_every_benchmark():
    script = BENCH / "run_all"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for name in ("overhead.py", "checkpoint_bench.py", "recovery.py", "live_recovery.py", "rdzv_scale.py",
                 "plots.py"):
        assert f"benchmarks/{name}" in text
    for name in ("checkpoint_bench", "live_recovery", "rdzv_scale"):  # results as JSON (plots.py prefers it)
        assert re.search(rf'benchmarks/{name}\.py .*--json "\$OUT/{name}\.json"', text), name
