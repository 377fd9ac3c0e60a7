"""What a drill measured: judge each fault, and write the report.

From a drill's logs (``drill_logs``) and its own record of what it did and saw (faults fired,
worker processes started and gone, checkpoint commits), :func:`build_report` measures every fault
and the whole run:

* Per fault (times from the fault): **detection** (a surviving node's workers stopped),
  **rendezvous** (new workers started for the next round), for a silent fault (stop, cut, hang)
  the **first step at N-1** (the world without the node), **first step** at the expected world
  size (after a silent fault: back at N); **steps/samples lost** (last step before the fault minus the step resumed from); and
  **committed work lost** (a checkpoint committed before the resume that was newer than the
  step resumed from: that is a bug, the rest is the price of the checkpoint interval).
* For the run: exactly-once over the final lineage (``drill_ledger``) and no two worlds
  training at once.

``build_report`` returns a JSON-able dict; ``write_report`` writes ``report.json`` and the PNG
timeline; ``summary_table`` formats one screen of text. The names of ``drill_logs`` and
``drill_ledger`` stay importable from here (``load_logs``, ``check_exactly_once``, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from elastic_trainer.drill.kinds import FAULTS
from elastic_trainer.drill.ledger import check_exactly_once, find_overlapping_worlds, sampler_order, stream_order
from elastic_trainer.drill.logs import (Attempt, RunLogs, Worker, final_lineage, group_attempts, load_logs,
                                        read_agent_log)
from elastic_trainer.records import CHECKPOINT_START_EVENTS, Event

__all__ = ["CKPT_START_EVENTS", "DETECT_RE", "JOINED_RE", "WORLD_CHANGING", "Attempt", "RunLogs", "Worker",
           "build_report", "check_exactly_once", "final_lineage", "find_overlapping_worlds", "group_attempts",
           "load_logs", "measure_fault", "plot_timeline", "read_agent_log", "sampler_order", "stream_order",
           "summary_table", "write_report"]


# The trainer's event written when a checkpoint save starts (an async save logs "checkpoint_saved"
# when its upload begins; the commit itself is seen in the checkpoint dir).
CKPT_START_EVENTS = CHECKPOINT_START_EVENTS
# The faults after which the run goes on at another world size, in a new round.
WORLD_CHANGING = tuple(name for name, kind in FAULTS.items() if kind.changes_world)
# What an agent writes when it notices a lost or new peer and stops its workers.
DETECT_RE = re.compile(r"stopping its workers|lost their etcd lease|round \d+ is over|closing signal|"
                       r"Detected \d+ new nodes|Worker group FAILED|will restart worker group", re.I)
# A completed round: the agents' rendezvous (restart path), or a live quorum the workers re-formed
# in place ("live: rank 1 -> 0 of 2 in quorum 5 (...)") or admitted a newcomer to (live recovery).
JOINED_RE = re.compile(r"joined round (\d+) of rendezvous|-> \d+ of \d+ in quorum (\d+)|admitted to quorum (\d+)")


def _steps_redone(logs: RunLogs, last_step: int, first: Attempt | None, final: Attempt) -> int:
    """Steps redone from the last step before a fault through every world up to ``final``: at
    each change of world, the previous world's last step minus the step the next one resumed from."""
    chain = [a for a in logs.attempts if first is not None and first.start <= a.start <= final.start]
    lost, top = 0, last_step
    for attempt in chain or [final]:
        lost += max(0, top - (attempt.first_step - 1))
        top = attempt.last_step
    return lost


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(sum(values) / len(values), 5) if values else None


def _first(items, pred):
    return next((x for x in items if pred(x)), None)


def measure_fault(rec: dict, logs: RunLogs, timeline: list[dict], global_batch: int,
                  deadline: float, commits: dict[int, float]) -> dict:
    """Add the measured numbers and the verdict to one fault record (see module docstring)."""
    out = dict(rec)
    notes = list(rec.get("notes", []))
    if rec.get("fired_at") is None:
        out.update(ok=False, recovered=False, notes=notes + [rec.get("status") or "the fault never fired"])
        return out
    tf = rec["fired_at"]
    t_end = rec.get("end_at") or tf
    kind = rec["kind"]
    # Only what happened before the next fault (and within the deadline) belongs to this one.
    horizon = min(rec.get("window_end") or float("inf"), t_end + deadline)
    r0 = [s for s in logs.rank0_lines if s.time <= horizon]
    before = [s for s in r0 if s.time <= tf]
    last = before[-1] if before else None
    attempt_before = logs.attempt_of(last) if last else None
    out["last_step_before"] = last.step if last else None
    out["world_logged_before"] = last.world_size if last else None

    if kind in WORLD_CHANGING:
        want = rec.get("expected_world")
        rec_line = _first(r0, lambda s: s.time > tf and s.world_size == want
                          and logs.attempt_of(s) is not attempt_before)
        start_from = tf
    else:  # stop/cut/hang: back at full size after the node returns; etcd/disk: steps go on
        want = rec.get("final_world", rec.get("world_before"))
        start_from = t_end
        later = [s for s in r0 if s.time > t_end and s.world_size == want]
        restarted_after = [s for s in later if logs.attempt_of(s) is not attempt_before]
        rec_line = (restarted_after or later or [None])[0]
        if rec.get("end_at"):
            out["steps_during_fault"] = len([s for s in r0 if tf < s.time <= t_end])
    evicted = None
    if "away_world" in rec:  # a silent fault: the first step of the world without the node (N-1)
        evicted = _first(r0, lambda s: tf < s.time and s.world_size == rec["away_world"]
                         and logs.attempt_of(s) is not attempt_before)
        out["evicted_first_step_s"] = round(evicted.time - tf, 3) if evicted else None
        if rec.get("expect_dip") and evicted is None:
            notes.append(f"the others did not train at {rec['away_world']} without "
                         + ("the hung worker" if kind == "hang" else "the node while it was away"))
        elif evicted is not None and not rec.get("expect_dip"):
            notes.append(f"the world went to {rec['away_world']} although the fault was shorter than the lease")
    recovered = rec_line is not None
    out["recovered"] = recovered
    out["first_step_s"] = round(rec_line.time - tf, 3) if rec_line else None
    if rec_line is not None and rec.get("end_at"):
        out["back_after_end_s"] = round(rec_line.time - t_end, 3)
    limit = rec_line.time if rec_line else float("inf")
    survivors = set(rec.get("survivors", []))
    seen = [o["time"] for o in timeline if tf < o["time"] <= limit and o["what"] == "workers_gone"
            and o["node"] in survivors]
    seen += [e["time"] for node in survivors for e in logs.agent.get(node, [])
             if tf < e["time"] <= limit and DETECT_RE.search(e["text"])]
    seen += [e.failed_at for e in logs.events  # live recovery: when a survivor caught the failure
             if e.event == Event.LIVE_REFORM and e.failed_at is not None and tf < e.failed_at <= limit]
    out["detect_s"] = round(min(seen) - tf, 3) if seen else None
    new_attempt = logs.attempt_of(rec_line) if rec_line else None
    restarted = new_attempt is not None and new_attempt is not attempt_before
    out["rendezvous_s"] = None
    if restarted:  # the round's completion in the agents' logs, else new workers after the detection
        key = new_attempt.key
        new_round = int(key[6:]) if key.startswith("round-") and key[6:].isdigit() else None
        joined = [e["time"] for lines in logs.agent.values() for e in lines if tf < e["time"] <= limit
                  and (m := JOINED_RE.search(e["text"])) and int(m.group(m.lastindex)) == new_round]
        if not joined:
            after = tf + (out["detect_s"] or 0.0)
            joined = [o["time"] for o in timeline if o["what"] == "workers_started" and after < o["time"] <= limit]
        out["rendezvous_s"] = round(min(joined) - tf, 3) if joined else None
    out["restarted"] = restarted
    ok = recovered and not (rec.get("expect_dip") and evicted is None)
    if restarted:
        resumed = new_attempt.first_step - 1
        out["resumed_from"] = resumed
        lost = max(0, (last.step if last else 0) - resumed)
        if evicted is not None:  # went through N-1: steps redone at each change of world
            lost = _steps_redone(logs, last.step if last else 0, logs.attempt_of(evicted), new_attempt)
        out["steps_lost"], out["samples_lost"] = lost, lost * global_batch
        bad = set(rec.get("corrupted_steps", []))
        committed = max((step for step, t in commits.items() if t < new_attempt.start and step not in bad),
                        default=0)
        out["committed_before_resume"] = committed
        out["committed_lost"] = max(0, committed - resumed)
        if out["committed_lost"]:
            ok = False
            notes.append(f"resumed from step {resumed} although step {committed} was committed: "
                         f"{out['committed_lost']} committed steps lost")
        if bad and resumed in bad:
            ok = False
            notes.append(f"resumed from the corrupted checkpoint of step {resumed}")
        elif bad and resumed > max(bad):
            notes.append("a newer checkpoint was committed before the resume: the corrupt one was not read")
        out["loss_after"] = _mean([s.loss for s in new_attempt.rank0[:5]])
    else:
        out.update(resumed_from=None, steps_lost=0, samples_lost=0, committed_lost=0)
        if kind in WORLD_CHANGING and recovered:
            notes.append("no restart was seen")
        out["loss_after"] = _mean([s.loss for s in r0 if s.time > start_from][:5])
    out["loss_before"] = _mean([s.loss for s in before[-5:]])
    if kind == "fill-disk":
        saved_after = min((t for t in commits.values() if t > t_end), default=None)
        out["checkpoint_after_free_s"] = round(saved_after - t_end, 3) if saved_after else None
        if saved_after is None or saved_after - t_end > deadline:
            ok = False
            notes.append("no checkpoint was committed after the disk was freed")
        if out.get("steps_during_fault") == 0 and rec.get("end_at"):
            notes.append("no optimizer step while the disk was full")
    if not recovered:
        notes.append(f"no step at world size {want} within {deadline:g}s")
        # What the run did instead, to start the diagnosis from the report.
        ends = [f"rank 0 on {e.origin} logged '{e.event}' ({e.reason or '?'}) at +{e.time - tf:.1f}s"
                for e in logs.events if tf < e.time <= horizon and e.event in (Event.STOPPED, Event.FINISHED)]
        exits = [f"{o['node']} exited with {o.get('code')} at +{o['time'] - tf:.1f}s"
                 for o in timeline if tf < o["time"] <= horizon and o["what"] == "node_exited"]
        if ends or exits:
            notes.append("after the fault: " + "; ".join(ends[:3] + exits[:4]))
    out["ok"] = bool(ok)
    out["notes"] = notes
    return out



def build_report(meta: dict, faults: list[dict], timeline: list[dict], node_dirs: dict[str, Path],
                 global_batch: int | None, deadline: float, commits: dict[int, float], expected=None) -> dict:
    """Measure every fault and the whole run; the dict is what report.json holds.

    ``commits`` maps each checkpoint step to the time its manifest was committed;
    ``expected`` is passed to ``check_exactly_once``.
    """
    logs = load_logs(node_dirs)
    ledger = check_exactly_once(logs, global_batch, expected)
    batch = ledger.get("global_batch") or global_batch or 0
    fired = sorted(f["fired_at"] for f in faults if f.get("fired_at") is not None)
    for f in faults:  # a fault's window closes when the next one fires
        if f.get("fired_at") is not None:
            f["window_end"] = next((t for t in fired if t > f["fired_at"]), None)
    measured = [measure_fault(f, logs, timeline, batch, deadline, commits) for f in faults]
    overlaps = find_overlapping_worlds(logs.attempts)
    failures = [f"fault {m['index']} ({m['label']}): " + "; ".join(m["notes"] or ["failed"])
                for m in measured if not m["ok"]]
    if not ledger["ok"]:
        failures.append(ledger.get("problem") or f"sample ledger: {ledger['repeated']} repeated, "
                        f"{ledger['skipped']} skipped over steps 1..{ledger['final_step']}")
    if overlaps:
        failures.append(f"two worlds trained at once: {overlaps[:3]}")
    failures.extend(meta.get("problems", []))
    r0 = logs.rank0_lines
    by_kind: dict[str, list[float]] = {}
    to_away: dict[str, list[float]] = {}
    for m in measured:
        if m.get("recovered") and m.get("first_step_s") is not None:
            by_kind.setdefault(m["kind"], []).append(m["first_step_s"])
        if m.get("evicted_first_step_s") is not None:
            to_away.setdefault(m["kind"], []).append(m["evicted_first_step_s"])
    report = {
        **meta,
        "ok": not failures,
        "failures": failures,
        "recovery_first_step_s": {k: {"n": len(v), "median": sorted(v)[len(v) // 2], "max": max(v)}
                                  for k, v in sorted(by_kind.items())},
        "first_step_at_n_minus_1_s": {k: {"n": len(v), "median": sorted(v)[len(v) // 2], "max": max(v)}
                                      for k, v in sorted(to_away.items())},
        "faults": measured,
        "ledger": ledger,
        "worlds": [{"key": a.key, "start": a.start, "end": a.end, "first_step": a.first_step,
                    "last_step": a.last_step, "world_size": a.world_size, "nodes": a.nodes} for a in logs.attempts],
        "overlapping_worlds": overlaps,
        "commits": [{"step": k, "time": v} for k, v in sorted(commits.items())],
        "series": [[round(s.time, 3), s.step, s.world_size, s.loss] for s in r0],
        "events": [e.to_json() | {"node": e.origin} for e in logs.events],
        "timeline": timeline,
    }
    return report


def summary_table(report: dict) -> str:
    """One screen: a row per fault, then the ledger verdict and the overall result."""
    head = f"{'#':>2} {'fault':<34} {'step':>5} {'detect':>7} {'rdzv':>7} {'to N-1':>7} {'1st step':>8} " \
           f"{'world':>7} {'lost':>5} {'samples':>7} {'ok':>3}"
    rows = [head, "-" * len(head)]

    def sec(v):
        return f"{v:.1f}s" if isinstance(v, (int, float)) else "-"

    for f in report["faults"]:
        dipped = f.get("expect_dip") or f.get("evicted_first_step_s") is not None
        world = f"{f.get('world_before', '?')}>" + (f"{f.get('away_world', '?')}>" if dipped else "") + \
            f"{f.get('final_world', f.get('expected_world', '?'))}"
        rows.append(f"{f['index']:>2} {f['label'][:34]:<34} {str(f.get('fired_step', '-')):>5} "
                    f"{sec(f.get('detect_s')):>7} {sec(f.get('rendezvous_s')):>7} "
                    f"{sec(f.get('evicted_first_step_s')):>7} {sec(f.get('first_step_s')):>8} "
                    f"{world:>7} {str(f.get('steps_lost', '-')):>5} {str(f.get('samples_lost', '-')):>7} "
                    f"{'yes' if f['ok'] else 'NO':>3}")
    led = report["ledger"]
    rows.append("-" * len(head))
    rows.append(f"sample ledger over steps 1..{led['final_step']}: {led['samples_checked']} samples, "
                f"{led['repeated']} repeated, {led['skipped']} skipped -> {'ok' if led['ok'] else 'FAILED'}")
    rows.append(f"drill {'PASSED' if report['ok'] else 'FAILED'}" +
                ("" if report["ok"] else ": " + " | ".join(report["failures"])[:600]))
    return "\n".join(rows)


def plot_timeline(report: dict, path: Path) -> None:
    """World size, step and loss over wall time, faults as labelled vertical lines (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = report.get("started_at") or (report["series"][0][0] if report["series"] else 0.0)
    xs = [row[0] - t0 for row in report["series"]]
    fig, axes = plt.subplots(3, 1, figsize=(12, 7.5), sharex=True)
    for world in report.get("worlds", []):  # one bar per world: gaps are time without training
        axes[0].hlines(world["world_size"], world["start"] - t0, world["end"] - t0, color="tab:blue", lw=4)
    sizes = [w["world_size"] for w in report.get("worlds", [])] or [1]
    axes[0].set_ylim(min(sizes) - 0.7, max(sizes) + 0.7)
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("world size")
    for note in report.get("timeline", []):
        if note.get("what") == "job_restarted":
            for ax in axes:
                ax.axvline(note["time"] - t0, color="grey", lw=1.2, ls=":")
            axes[0].annotate("job restarted by the drill", (note["time"] - t0, 0.02), xycoords=("data", "axes fraction"),
                             rotation=90, va="bottom", ha="right", fontsize=7, color="grey")
    axes[1].plot(xs, [row[1] for row in report["series"]], ".", ms=2, color="tab:green")
    axes[1].set_ylabel("global step")
    axes[2].plot(xs, [row[3] for row in report["series"]], ".", ms=2, color="tab:red")
    axes[2].set_ylabel("loss")
    axes[2].set_xlabel("seconds since the drill started")
    for f in report["faults"]:
        if f.get("fired_at") is None:
            continue
        x = f["fired_at"] - t0
        color = "black" if f["ok"] else "red"
        for ax in axes:
            ax.axvline(x, color=color, lw=0.8, ls="--")
            if f.get("end_at"):
                ax.axvspan(x, f["end_at"] - t0, color="orange", alpha=0.15)
        axes[0].annotate(f"{f['index']}:{f['kind']}", (x, 1.0), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=7, color=color)
    fig.suptitle(f"elastic-train drill: {'PASSED' if report['ok'] else 'FAILED'} "
                 f"({len(report['faults'])} faults, samples repeated {report['ledger']['repeated']}, "
                 f"skipped {report['ledger']['skipped']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``timeline.png`` into ``out_dir``; return both paths."""
    out_dir = Path(out_dir)
    json_path, png_path = out_dir / "report.json", out_dir / "timeline.png"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    plot_timeline(report, png_path)
    return json_path, png_path
