"""One PNG per benchmark, drawn from the results in ``benchmarks/results/`` into ``docs/``.

    .venv/bin/python benchmarks/plots.py                     # reads benchmarks/results/, writes docs/*.png
    .venv/bin/python benchmarks/plots.py --results /tmp/out --out /tmp/out
    .venv/bin/python benchmarks/plots.py --docs /tmp/out     # the same: reads and writes one folder

``benchmarks/run_all`` writes the results and then runs this script; the PNGs go to ``docs/``
because the prose there shows them.

Inputs (a benchmark whose result is missing is skipped with a message):

- ``overhead.json`` (``benchmarks/overhead.py --out``) -> ``overhead.png``
- ``overhead_breakdown.json`` (``overhead.py --sides elastic,plain,trainer,trainer-nockpt --out``) ->
  ``overhead_breakdown.png``
- ``checkpoint_bench.json`` (``benchmarks/checkpoint_bench.py --json``) if present, else
  ``checkpoint_bench.txt`` (its printed `` | `` table) -> ``checkpoint_bench.png``
- ``recovery.json`` (``benchmarks/recovery.py --json``) -> ``recovery.png``
- ``rdzv_scale.json`` (``benchmarks/rdzv_scale.py --json``) if present, else ``rdzv_scale.txt``
  (its printed table) -> ``rdzv_scale.png``

``run_all`` has every script write JSON; the printed tables are still read so that results saved
before the scripts wrote JSON (a ``.txt`` without its ``.json``) still plot.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"  # what run_all writes: <name>.json and the printed <name>.txt
DOCS = REPO / "docs"  # the PNGs, beside the prose that shows them

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def number(text: str) -> float | None:
    """The first number in a table cell ('12.5%' -> 12.5, '3.1x' -> 3.1, '-' -> None)."""
    m = _NUMBER.search(text)
    return float(m.group()) if m else None


def parse_pipe_table(text: str) -> list[dict[str, str]]:
    """Rows of the first `` | ``-separated table in ``text`` (header line, then rows of as many cells)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if " | " not in line:
            continue
        head = [c.strip() for c in line.split("|")]
        rows = []
        for row in lines[i + 1:]:
            cells = [c.strip() for c in row.split("|")]
            if len(cells) != len(head):
                break
            if all(re.fullmatch(r":?-+:?", c) for c in cells if c):  # a markdown separator row
                continue
            rows.append(dict(zip(head, cells)))
        if rows:
            return rows
    return []


def _column(row: dict[str, str], *names: str) -> float | None:
    for name in names:
        for key, value in row.items():
            if key.lower() == name.lower():
                return number(value)
    return None


# ---------------------------------------------------------------------------- per benchmark

def plot_overhead(results: Path, out: Path | None = None) -> Path | None:
    src = results / "overhead.json"
    if not src.exists():
        return None
    r = json.loads(src.read_text())
    runs = r["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    every = r["settings"].get("checkpoint_every", 50)
    labels = {"elastic": f"elastic-train (etcd, async ckpt/{every})", "plain": "torchrun + DDP (plain)",
              "trainer": f"our trainer under torchrun (ckpt/{every})", "trainer-nockpt": "our trainer under torchrun, no ckpt"}
    colors = {"elastic": "tab:blue", "plain": "tab:orange", "trainer": "tab:green", "trainer-nockpt": "tab:purple"}
    for kind in r["settings"].get("sides", ["elastic", "plain"]):
        xs = [x["repeat"] for x in runs if x["kind"] == kind]
        ys = [x["samples_per_s"] for x in runs if x["kind"] == kind]
        med = r["sides"][kind]["samples_per_s"]["median"] if "sides" in r else r[kind]["median"]
        ax1.plot(xs, ys, "o-", color=colors.get(kind), label=f"{labels.get(kind, kind)}: median {med:.0f}")
        ax1.axhline(med, color=colors.get(kind), ls=":", lw=1)
    ax1.set_xticks(sorted({x["repeat"] for x in runs}))
    ax1.set_xlabel("repeat (A and B alternated)")
    ax1.set_ylabel("samples/s (after warm-up)")
    ax1.set_title("Throughput per run")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8, loc="lower left")
    pairs = list(zip([x for x in runs if x["kind"] == "elastic"], [x for x in runs if x["kind"] == "plain"]))
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
    cpu = [b["cpu_ms_per_sample"] / a["cpu_ms_per_sample"] if a.get("cpu_ms_per_sample") and b.get("cpu_ms_per_sample")
           else 0.0 for a, b in pairs]
    ax2.bar([i - 0.2 for i in range(len(ratios))], ratios, 0.4, color="tab:blue", alpha=0.8,
            label="samples/s elastic / plain")
    if any(cpu):
        ax2.bar([i + 0.2 for i in range(len(cpu))], cpu, 0.4, color="tab:gray", alpha=0.8,
                label="CPU per sample plain / elastic")
    ratios = ratios + [c for c in cpu if c]
    ax2.axhline(1.0, color="black", lw=1)
    ax2.axhline(0.98, color="tab:red", ls="--", lw=1, label="target 0.98 (2% overhead)")
    ax2.set_xlabel("repeat")
    ax2.set_ylabel("ratio (1 = no overhead)")
    ax2.set_title(f"Paired ratio; ratio of medians {r['ratio_of_medians']:.3f}")
    ax2.set_ylim(min(0.8, min(ratios) - 0.05), max(1.1, max(ratios) + 0.05))
    ax2.legend(fontsize=8)
    fig.suptitle(f"Steady-state overhead ({r.get('cpus')} CPUs, {r['settings']['nproc_per_node']} workers, "
                 f"{r['settings']['max_steps']} steps, warm-up {r['settings']['warmup_steps']})", fontsize=10)
    return _save(fig, (out or results) / "overhead.png")


def plot_overhead_breakdown(results: Path, out: Path | None = None) -> Path | None:
    """CPU per sample by process for each side of ``overhead.py --sides ...`` (overhead_breakdown.json)."""
    src = results / "overhead_breakdown.json"
    if not src.exists():
        return None
    r = json.loads(src.read_text())
    sides = r["settings"]["sides"]
    roles = sorted({role for k in sides for role in r["sides"][k].get("cpu_ms_per_sample_by_role", {})} - {"total"})
    if not roles:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(sides)
    for j, role in enumerate(roles):
        vals = [r["sides"][k]["cpu_ms_per_sample_by_role"].get(role, 0.0) for k in sides]
        ax1.bar(range(len(sides)), vals, 0.6, bottom=bottom, label=role, color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        ax1.annotate(f"{total:.2f}", (i, total), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(sides)), sides, fontsize=8)
    ax1.set_ylabel("CPU ms per sample (median of repeats)")
    ax1.set_title("Where the CPU goes, per process")
    ax1.set_ylim(0, max(bottom) * 1.3)
    ax1.legend(fontsize=8, loc="upper center", ncol=len(roles))
    meds = [r["sides"][k]["samples_per_s"]["median"] for k in sides]
    lows = [m - r["sides"][k]["samples_per_s"]["min"] for m, k in zip(meds, sides)]
    highs = [r["sides"][k]["samples_per_s"]["max"] - m for m, k in zip(meds, sides)]
    ax2.bar(range(len(sides)), meds, 0.6, yerr=[lows, highs], capsize=4, color="tab:gray")
    ax2.set_xticks(range(len(sides)), sides, fontsize=8)
    ax2.set_ylabel("samples/s (median, min..max)")
    ax2.set_title("Throughput (moved by other load on the machine)")
    fig.suptitle(f"Overhead split: {r['settings']['repeats']} alternated repeats of each side", fontsize=10)
    return _save(fig, (out or results) / "overhead_breakdown.png")


# checkpoint_bench.txt's table columns -> the JSON row keys of ``checkpoint_bench.py --json``, with the
# factor that turns the printed unit into the JSON's (ms -> s, % -> fraction)
_CKPT_COLUMNS = {"step ms": ("step_s", 1e-3), "async blocked ms": ("blocked_s", 1e-3), "sync save s": ("sync_s", 1),
                 "save MB/s": ("save_mbps", 1), "plain copy MB/s": ("plain_mbps", 1), "save/plain": ("ratio", 1e-2),
                 "plain+fsync MB/s": ("durable_mbps", 1), "save/(plain+fsync)": ("durable_ratio", 1e-2)}
# the line checkpoint_bench.py prints below its table for the copy through the save's own write path
_STREAMED = re.compile(r"^(\S+) d_model=(\d+): plain copy through the save's write path.*? ([\d.]+) MB/s, "
                       r"save/that ([\d.]+)%", re.M)


def _checkpoint_rows(results: Path) -> list[dict]:
    """Rows of ``checkpoint_bench.json`` if present, else of the table in ``checkpoint_bench.txt``, in the JSON's keys.

    Each row has ``store``, ``d_model`` and the numbers (None where missing): ``step_s``, ``blocked_s``,
    ``sync_s``, ``save_mbps``, ``plain_mbps``, ``ratio``, ``durable_mbps``, ``durable_ratio``,
    ``streamed_mbps``, ``streamed_ratio``.
    """
    keys = [key for key, _ in _CKPT_COLUMNS.values()] + ["streamed_mbps", "streamed_ratio"]
    if (results / "checkpoint_bench.json").exists():
        data = json.loads((results / "checkpoint_bench.json").read_text())
        rows = data["rows"] if isinstance(data, dict) else data
        return [{"store": r.get("store", "?"), "d_model": r.get("d_model", "?"), **{k: r.get(k) for k in keys}}
                for r in rows]
    if not (results / "checkpoint_bench.txt").exists():
        return []
    text = (results / "checkpoint_bench.txt").read_text()
    rows = []
    for cells in parse_pipe_table(text):
        row = {"store": cells.get("store", "?"), "d_model": cells.get("d_model", "?"), **dict.fromkeys(keys)}
        for column, (key, scale) in _CKPT_COLUMNS.items():
            value = _column(cells, column)
            row[key] = value * scale if value is not None else None
        rows.append(row)
    for store, d_model, mbps, ratio in _STREAMED.findall(text):
        for row in rows:
            if row["store"] == store and str(row["d_model"]) == d_model:
                row["streamed_mbps"], row["streamed_ratio"] = float(mbps), float(ratio) / 100
    return rows


def plot_checkpoint(results: Path, out: Path | None = None) -> Path | None:
    rows = _checkpoint_rows(results)
    if not rows:
        return None
    labels = [f"{row['store']}\nd={row['d_model']}" for row in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(rows))
    w = 0.27
    for offset, key, label in ((-w, "step_s", "training step"), (0, "blocked_s", "step blocked by async save"),
                               (w, "sync_s", "synchronous save")):
        ax1.bar([i + offset for i in x], [(row[key] or 0) * 1e3 for row in rows], w, label=label)
    ax1.set_yscale("log")
    ax1.set_ylabel("ms (log scale)")
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set_title("Blocked time per checkpoint (target: async < 5% of a step)")
    ax1.legend(fontsize=8)
    # the save, then each copy of the same bytes it is compared with; the durable copies (fsync) only
    # exist on local disks, so their bars are drawn only when some row has them
    series = [("save_mbps", None, "checkpoint save"), ("plain_mbps", "ratio", "plain copy of the same bytes"),
              ("durable_mbps", "durable_ratio", "plain copy + fsync"),
              ("streamed_mbps", "streamed_ratio", "plain copy through the save's write path (fsync)")]
    series = [s for s in series if any(row[s[0]] for row in rows)]
    bw = 0.8 / len(series)
    for j, (key, ratio_key, label) in enumerate(series):
        xs = [i - 0.4 + bw * (j + 0.5) for i in x]
        ax2.bar(xs, [row[key] or 0 for row in rows], bw, label=label, color=f"C{j}")
        if ratio_key is None:
            continue
        for xpos, row in zip(xs, rows):  # save / this copy: the script's own (pairwise median) ratio
            if row[key] and row[ratio_key] is not None:
                ax2.annotate(f"{row[ratio_key]:.0%}", (xpos, row[key]), ha="center", va="bottom", fontsize=7)
    ax2.set_ylabel("MB/s (label: save / that copy)")
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_title("Save throughput (target: >= 80% of a plain copy)")
    ax2.legend(fontsize=7)
    fig.suptitle("Checkpoint cost (benchmarks/checkpoint_bench.py)", fontsize=10)
    return _save(fig, (out or results) / "checkpoint_bench.png")


def plot_recovery(results: Path, out: Path | None = None) -> Path | None:
    src = results / "recovery.json"
    if not src.exists():
        return None
    results: dict[str, list[dict]] = json.loads(src.read_text())["results"]
    scenarios = []  # "X rdzv" keys are the rendezvous part of scenario X, drawn inside its bar
    for trials in results.values():
        for t in trials:
            scenarios.extend(k for k in t if k not in scenarios and not k.endswith(" rdzv"))
    backends = list(results)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(backends))
    drawn_rdzv = False
    for j, backend in enumerate(backends):
        for i, scenario in enumerate(scenarios):
            values = [t.get(scenario) for t in results[backend]]
            ok = [v for v in values if isinstance(v, (int, float))]
            xpos = i - 0.4 + width * (j + 0.5)
            if not ok:
                ax.annotate(f"{backend}:\nno success\n0/{len(values)}", (xpos, 0.5), ha="center", va="bottom",
                            fontsize=7, color="tab:red")
                continue
            med, worst = statistics.median(ok), max(ok)
            ax.bar(xpos, med, width, color=f"C{j}", label=backend if i == 0 else None)
            rdzv = [t.get(f"{scenario} rdzv") for t in results[backend]]
            rdzv = [v for v in rdzv if isinstance(v, (int, float))]
            if rdzv:
                ax.bar(xpos, statistics.median(rdzv), width * 0.5, color="white", alpha=0.6, hatch="//",
                       edgecolor="black", lw=0.5, label="of which rendezvous (median)" if not drawn_rdzv else None)
                drawn_rdzv = True
            ax.errorbar(xpos, med, yerr=[[0], [worst - med]], color="black", capsize=3, lw=1)
            ax.annotate(f"{med:.1f}\n{len(ok)}/{len(values)}", (xpos, worst), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_xlim(-0.6, len(scenarios) - 0.4)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the labels above the whiskers
    ax.set_ylabel("seconds to the first step at the new world size")
    ax.set_title("Recovery: bar = median, whisker = worst, n = successful/trials", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, (out or results) / "recovery.png")


def _rdzv_rows(results: Path) -> list[dict]:
    """Rows of ``rdzv_scale.json`` if present, else of the table in ``rdzv_scale.txt``.

    Each row has ``agents``, ``all_ranked_s`` (None when not every agent got a rank in time),
    ``timeout_s`` (the join timeout, where known) and ``requests_per_agent``.
    """
    if (results / "rdzv_scale.json").exists():
        data = json.loads((results / "rdzv_scale.json").read_text())
        if not isinstance(data, dict):
            return data
        return [{"timeout_s": data.get("timeout_s"), **row} for row in data["results"]]
    if not (results / "rdzv_scale.txt").exists():
        return []
    rows = []
    for line in (results / "rdzv_scale.txt").read_text().splitlines():
        cells = line.split()
        if len(cells) >= 5 and cells[0].isdigit():
            rows.append({"agents": int(cells[0]), "all_ranked_s": number(cells[1]) if not cells[1].startswith(">")
                         else None, "timeout_s": number(cells[1]) if cells[1].startswith(">") else None,
                         "requests_per_agent": number(cells[3])})
    return rows


def plot_rdzv_scale(results: Path, out: Path | None = None) -> Path | None:
    rows = _rdzv_rows(results)
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ok = [r for r in rows if r.get("all_ranked_s") is not None]
    ax1.plot([r["agents"] for r in ok], [r["all_ranked_s"] for r in ok], "o-", label="every agent ranked")
    for r in rows:
        if r.get("all_ranked_s") is None:
            y = r.get("timeout_s") or 30
            ax1.plot([r["agents"]], [y], "x", color="tab:red", ms=10)
            ax1.annotate(f"{r['agents']} agents: not all\nranked within {y:.0f} s", (r["agents"], y),
                         color="tab:red", fontsize=8, ha="right", va="top")
    ax1.axhline(30, color="tab:red", ls="--", lw=1, label="target: 1,000 agents < 30 s")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("simulated agents")
    ax1.set_ylabel("seconds")
    ax1.set_title("Time until every agent has its rank")
    ax1.legend(fontsize=8)
    ax2.plot([r["agents"] for r in rows], [r.get("requests_per_agent") or 0 for r in rows], "s-", color="tab:green")
    ax2.set_xscale("log")
    ax2.set_xlabel("simulated agents")
    ax2.set_ylabel("etcd requests per agent")
    ax2.set_title("etcd requests per agent")
    ax2.set_ylim(bottom=0)
    fig.suptitle("Rendezvous scale on one etcd (benchmarks/rdzv_scale.py)", fontsize=10)
    return _save(fig, (out or results) / "rdzv_scale.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTS = {"overhead": plot_overhead, "overhead_breakdown": plot_overhead_breakdown, "checkpoint_bench": plot_checkpoint, "recovery": plot_recovery,
         "rdzv_scale": plot_rdzv_scale}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=None, metavar="DIR",
                   help=f"folder with the results (default {RESULTS.relative_to(REPO)}/)")
    p.add_argument("--out", default=None, metavar="DIR", help=f"folder for the PNGs (default {DOCS.relative_to(REPO)}/)")
    p.add_argument("--docs", default=None, metavar="DIR",
                   help="one folder for both: read the results in DIR and write the PNGs there "
                        "(--results or --out, when given, win)")
    p.add_argument("--only", default=None, help="comma list of " + ", ".join(PLOTS))
    args = p.parse_args(argv)
    results = Path(args.results or args.docs or RESULTS)
    out = Path(args.out or args.docs or DOCS)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(PLOTS)
    for name in names:
        png = PLOTS[name](results, out)
        print(f"{name}: {'wrote ' + str(png) if png else 'no results in ' + str(results) + ', skipped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
