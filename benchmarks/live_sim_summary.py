"""Several ``live_sim.py`` runs summed up: how soon every survivor knew the next quorum, over all their losses.

    .venv/bin/python benchmarks/live_sim_summary.py benchmarks/results/live_sim_issue42_apart_{3,4,5}.json \
        --txt benchmarks/results/live_sim_issue42_apart_summary.txt

One ``live_sim.py`` run is three losses on a loaded 2-core machine; a claim about the target (the next
quorum known everywhere < 1 s after a lease's expiry) needs many. For each loss, two clocks:

- **from the nominal expiry** (``known_worst_s``: the lost node's last accepted renewal plus the TTL,
  the simulation's t0 under ``--expire``; it includes etcd's own lag in acting on the expiry, its
  lessor checks every 500 ms and later under load);
- **from etcd's deletion** (``known_worst_s - loss_seen_first_s``: from the first survivor seeing the
  lost node's keys go, which is when etcd acted, to the last survivor knowing the next quorum: what
  the product does after etcd has spoken).

Printed: one line per run (its commit, load, and each loss on both clocks), then over every loss:
how many under 1 s, the median and the worst, on each clock. It reads JSON results only; it runs
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import provenance  # noqa: E402

TARGET_S = 1.0


def losses(result: dict) -> list[tuple[float, float, float]]:
    """Each loss of one run: (from the nominal expiry, from etcd's deletion, etcd's lag) in seconds."""
    out = []
    for loss in result.get("losses", []):
        worst, first = float(loss["known_worst_s"]), float(loss["loss_seen_first_s"])
        out.append((worst, round(worst - first, 3), first))
    return out


def summary(paths: list[Path]) -> dict:
    runs, nominal, deletion = [], [], []
    for path in paths:
        result = json.loads(path.read_text())
        got = losses(result)
        runs.append({"file": path.name, "commit": result.get("commit"), "load_end": result["machine"]["load_end"][0],
                     "losses": [{"from_expiry_s": a, "from_deletion_s": b, "etcd_lag_s": c} for a, b, c in got]})
        nominal += [a for a, _, _ in got]
        deletion += [b for _, b, _ in got]
    if not nominal:
        raise ValueError("no losses in these results (runs that failed hold none)")

    def over(values: list[float]) -> dict:
        return {"losses": len(values), "under_target": sum(v < TARGET_S for v in values),
                "median_s": round(statistics.median(values), 3), "worst_s": max(values)}

    return {"runs": runs, "from_expiry": over(nominal), "from_deletion": over(deletion), "target_s": TARGET_S}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="live_sim.py JSON results")
    p.add_argument("--json", default=None, help="also write the summary as JSON")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as record:
        s = summary(args.results)
        for run in s["runs"]:
            each = ", ".join(f"{x['from_expiry_s']:.3f} s ({x['from_deletion_s']:.3f} s after etcd acted "
                             f"{x['etcd_lag_s']:.3f} s late)" for x in run["losses"])
            print(f"{run['file']} (commit {run['commit']}, load {run['load_end']:.1f} at the end): {each}")
        for clock, what in (("from_expiry", "from the nominal expiry"), ("from_deletion", "from etcd's deletion")):
            o = s[clock]
            print(f"{len(s['runs'])} runs, {o['losses']} losses, next quorum known everywhere {what}: "
                  f"{o['under_target']} of {o['losses']} under {TARGET_S:g} s, median {o['median_s']:.3f} s, "
                  f"worst {o['worst_s']:.3f} s")
        provenance.write_json(args.json, s, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
