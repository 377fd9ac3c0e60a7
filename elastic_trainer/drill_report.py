"""What a drill measured: read the trainer's logs, judge each fault, write the report.

A drill (``elastic_trainer.drill``) leaves one log folder per node (``<out>/nodes/node-<i>/``,
the node's ``--log-dir``) holding the trainer's step logs, sample ledger and events, plus its
own record of what it did and saw (faults fired, worker processes started and gone). This
module turns them into numbers:

* An **attempt** is one world: the workers of one rendezvous round (the step logs' ``round``;
  without rounds, the workers whose steps overlap a rank-0 worker's). Attempts are ordered by
  their first step.
* The **final lineage** says, for every optimizer step ``1..final``, which attempt's work the
  final model contains: the last attempt's steps, then the steps up to the one it resumed from
  taken from the latest earlier attempt that reached that step, and so on back to step 1.
  Exactly-once is judged over it: no dataset index twice in one epoch, every step present with
  a full global batch, and the sampler offset never jumping forward.
* Per fault (times from the fault): **detection** (a surviving node's workers stopped),
  **rendezvous** (new workers started for the next round), **first step** at the expected world
  size; **steps/samples lost** (last step before the fault minus the step resumed from); and
  **committed work lost** (a checkpoint committed before the resume that was newer than the
  step resumed from: that is a bug, the rest is the price of the checkpoint interval).

``build_report`` returns a JSON-able dict; ``write_report`` writes ``report.json`` and the PNG
timeline; ``summary_table`` formats one screen of text.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# The trainer's events.jsonl entry written when a checkpoint save starts (an async save logs
# "checkpoint_saved" when its upload begins; the commit itself is seen in the checkpoint dir).
CKPT_START_EVENTS = ("checkpoint_saved", "checkpoint_save_start")
WORLD_CHANGING = ("kill", "kill-rank0", "kill-during-checkpoint", "term", "add-node", "corrupt-checkpoint")
_FILE_RE = re.compile(r"rank-(\d+)-(\d+)\.jsonl$")
# Agent log lines: python logging "[2026-11-23 07:38:53,081] ..." and torch's "W1123 07:38:53.109000 pid file] ...".
_PY_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] (.*)$")
_TORCH_LINE = re.compile(r"^\[?[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ (.*)$")
# What an agent writes when it notices a lost or new peer and stops its workers.
DETECT_RE = re.compile(r"stopping its workers|lost their etcd lease|round \d+ is over|closing signal|"
                       r"Detected \d+ new nodes|Worker group FAILED|will restart worker group", re.I)
JOINED_RE = re.compile(r"joined round (\d+) of rendezvous")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; a torn last line (writer killed mid-write) is skipped."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


@dataclass
class Worker:
    """One worker process: its step-log lines and its ledger lines."""

    node: str
    rank: int
    pid: int
    steps: list[dict] = field(default_factory=list)
    ledger: list[dict] = field(default_factory=list)


@dataclass
class Attempt:
    """One world: the workers of one rendezvous round."""

    key: str
    workers: list[Worker] = field(default_factory=list)

    @property
    def lines(self) -> list[dict]:
        return sorted((s for w in self.workers for s in w.steps), key=lambda s: s["time"])

    @property
    def rank0(self) -> list[dict]:
        return [s for s in self.lines if s.get("rank") == 0]

    @property
    def start(self) -> float:
        return min(s["time"] for w in self.workers for s in w.steps)

    @property
    def end(self) -> float:
        return max(s["time"] for w in self.workers for s in w.steps)

    @property
    def first_step(self) -> int:
        return min(s["step"] for w in self.workers for s in w.steps)

    @property
    def last_step(self) -> int:
        return max(s["step"] for w in self.workers for s in w.steps)

    @property
    def world_size(self) -> int:
        return Counter(s.get("world_size") for w in self.workers for s in w.steps).most_common(1)[0][0]

    @property
    def nodes(self) -> list[str]:
        return sorted({w.node for w in self.workers})

    def complete_last_step(self) -> int:
        """The newest step every rank of this world logged (the killed end may be torn)."""
        ranks: dict[int, int] = {}
        for w in self.workers:
            if w.steps:
                ranks[w.rank] = max(ranks.get(w.rank, 0), max(s["step"] for s in w.steps))
        return min(ranks.values()) if ranks else 0


def read_agent_log(path: Path) -> list[dict]:
    """Timestamped lines of a node's agent log: ``{"time", "text"}`` (local-time stamps)."""
    out = []
    try:
        text = path.read_text(errors="replace")
        year = time.localtime(path.stat().st_mtime).tm_year
    except FileNotFoundError:
        return out
    for raw in text.replace("\r", "\n").splitlines():
        line = raw.strip()
        m = _PY_LINE.match(line)
        try:
            if m:
                stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
                out.append({"time": stamp, "text": m.group(3)})
                continue
            m = _TORCH_LINE.match(line)
            if m:
                hms, frac = m.group(3).split(".")
                stamp = datetime.strptime(f"{year}-{m.group(1)}-{m.group(2)} {hms}", "%Y-%m-%d %H:%M:%S").timestamp()
                out.append({"time": stamp + float("0." + frac), "text": m.group(4)})
        except ValueError:
            continue
    return out


@dataclass
class RunLogs:
    workers: list[Worker]
    events: list[dict]
    attempts: list[Attempt]
    agent: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def rank0_lines(self) -> list[dict]:
        return sorted((s for w in self.workers if w.rank == 0 for s in w.steps), key=lambda s: s["time"])

    def attempt_of(self, line: dict) -> Attempt | None:
        if not hasattr(self, "_index"):
            self._index = {id(s): a for a in self.attempts for w in a.workers for s in w.steps}
        return self._index.get(id(line))


def load_logs(node_dirs: dict[str, Path]) -> RunLogs:
    """Read every node's step logs, ledger and events (``{node name: its log dir}``)."""
    workers: dict[tuple[str, int, int], Worker] = {}
    events: list[dict] = []
    for node, root in sorted(node_dirs.items()):
        root = Path(root)
        for sub, attr in (("steps", "steps"), ("ledger", "ledger")):
            for path in sorted((root / sub).glob("rank-*.jsonl")):
                match = _FILE_RE.search(path.name)
                if not match:
                    continue
                key = (node, int(match.group(1)), int(match.group(2)))
                worker = workers.setdefault(key, Worker(node, key[1], key[2]))
                lines = read_jsonl(path)
                if attr == "steps":
                    lines = [s for s in lines if isinstance(s.get("time"), (int, float)) and "step" in s]
                    for s in lines:
                        s["_node"] = node
                getattr(worker, attr).extend(lines)
        for ev in read_jsonl(root / "events.jsonl"):
            if isinstance(ev.get("time"), (int, float)):
                ev["_node"] = node
                events.append(ev)
    events.sort(key=lambda e: e["time"])
    agent = {node: read_agent_log(Path(root) / "agent.log") for node, root in node_dirs.items()}
    return RunLogs(list(workers.values()), events, group_attempts(list(workers.values())), agent)


def group_attempts(workers: list[Worker]) -> list[Attempt]:
    """Group worker processes into worlds: by round when logged, else by overlap with rank 0."""
    attempts: dict[str, Attempt] = {}
    loose = []
    for w in workers:
        if not w.steps:
            continue
        rnd = w.steps[0].get("round")
        if rnd not in (None, ""):
            attempts.setdefault(f"round-{rnd}", Attempt(f"round-{rnd}")).workers.append(w)
        elif w.rank == 0:
            attempts.setdefault(f"{w.node}:{w.pid}", Attempt(f"{w.node}:{w.pid}")).workers.append(w)
        else:
            loose.append(w)
    for w in loose:  # no round logged: join the rank-0 world that overlaps this worker most
        start, end = min(s["time"] for s in w.steps), max(s["time"] for s in w.steps)
        best, best_overlap = None, -1.0
        for a in attempts.values():
            overlap = min(end, a.end) - max(start, a.start)
            if a.world_size == w.steps[0].get("world_size") and overlap > best_overlap:
                best, best_overlap = a, overlap
        if best is not None:
            best.workers.append(w)
    return sorted(attempts.values(), key=lambda a: a.start)


def final_lineage(attempts: list[Attempt]) -> tuple[dict[int, Attempt], list[int], int]:
    """Map each step of the final model's history to the attempt that did it.

    Returns ``(step -> attempt, steps no attempt covers, final step)``.
    """
    if not attempts:
        return {}, [], 0
    lineage: dict[int, Attempt] = {}
    missing: list[int] = []
    current = attempts[-1]
    final = current.complete_last_step()
    top = final
    while True:
        first = current.first_step
        for step in range(max(first, 1), top + 1):
            lineage[step] = current
        resumed = first - 1
        if resumed <= 0:
            break
        earlier = [a for a in attempts if a.start < current.start and a.first_step <= resumed <= a.last_step]
        if not earlier:
            missing.extend(range(1, resumed + 1))
            break
        current, top = earlier[-1], resumed
    return lineage, sorted(missing), final


def check_exactly_once(logs: RunLogs, global_batch: int | None = None, expected=None) -> dict:
    """Judge exactly-once sample consumption over the final lineage (see module docstring).

    ``expected(step) -> list[int]``, when given, is the global batch the sampler must yield at
    that step (the drill builds it from the trainer's dataset size and seed); every index it
    lists that the step did not consume counts as skipped.
    """
    lineage, missing, final = final_lineage(logs.attempts)
    have_ledger = any(w.ledger for w in logs.workers)
    result = {"final_step": final, "order_checked": expected is not None, "steps_checked": 0, "samples_checked": 0, "repeated": 0,
              "skipped": 0, "missing_steps": missing[:20], "missing_step_count": len(missing),
              "bad_batch_steps": [], "offset_gaps": [], "repeated_examples": [], "ledger": have_ledger}
    if not have_ledger:
        result["ok"] = False
        result["problem"] = "no sample ledger was written (run the trainer with --sample-ledger)"
        return result
    sizes: dict[int, int] = {}
    per_epoch: dict[int, Counter] = {}
    for step in range(1, final + 1):
        attempt = lineage.get(step)
        if attempt is None:
            continue
        rows = [row for w in attempt.workers for row in w.ledger if row.get("step") == step]
        if not rows:
            missing.append(step)
            continue
        indices = [i for row in rows for i in row.get("indices", [])]
        sizes[step] = len(indices)
        if expected is not None:
            missed = set(expected(step)) - set(indices)
            if missed:
                result.setdefault("order_mismatch_steps", []).append(step)
                result["skipped"] += len(missed)
        per_epoch.setdefault(int(rows[0].get("epoch", 0)), Counter()).update(indices)
        result["steps_checked"] += 1
        result["samples_checked"] += len(indices)
    batch = global_batch or (Counter(sizes.values()).most_common(1)[0][0] if sizes else 0)
    result["global_batch"] = batch
    for step, size in sizes.items():
        if size != batch:
            result["bad_batch_steps"].append({"step": step, "samples": size})
            if size < batch:
                result["skipped"] += batch - size
    for epoch, counts in sorted(per_epoch.items()):
        for index, count in counts.items():
            if count > 1:
                result["repeated"] += count - 1
                if len(result["repeated_examples"]) < 10:
                    result["repeated_examples"].append({"epoch": epoch, "index": index, "times": count})
    # The sampler offset (samples of the epoch committed) must grow by exactly one batch a step.
    offsets = {}
    for step, attempt in lineage.items():
        rows = [s for s in attempt.rank0 if s["step"] == step]
        if rows and "offset" in rows[0]:
            offsets[step] = (rows[0].get("epoch", 0), rows[0]["offset"])
    for step in sorted(offsets):
        if step - 1 in offsets:
            (e0, o0), (e1, o1) = offsets[step - 1], offsets[step]
            gap = (o1 - o0 - batch) if e1 == e0 else (o1 - batch if e1 == e0 + 1 else 0)
            if gap > 0:
                result["offset_gaps"].append({"step": step, "skipped": gap})
                result["skipped"] += gap
    result["missing_steps"] = sorted(set(missing))[:20]
    result["missing_step_count"] = len(set(missing))
    result["skipped"] += len(set(missing)) * batch
    result["ok"] = result["repeated"] == 0 and result["skipped"] == 0 and not result["bad_batch_steps"]
    return result


def find_overlapping_worlds(attempts: list[Attempt], slack: float = 0.0) -> list[dict]:
    """Pairs of worlds of the run that both made optimizer steps at the same time (split brain)."""
    found = []
    for i, a in enumerate(attempts):
        for b in attempts[i + 1:]:
            if a.end > b.start + slack:
                found.append({"world_a": a.key, "world_b": b.key, "overlap_s": round(a.end - b.start, 3)})
    return found


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
    r0 = [s for s in logs.rank0_lines if s["time"] <= horizon]
    before = [s for s in r0 if s["time"] <= tf]
    last = before[-1] if before else None
    attempt_before = logs.attempt_of(last) if last else None
    out["last_step_before"] = last["step"] if last else None
    out["world_logged_before"] = last.get("world_size") if last else None

    if kind in WORLD_CHANGING:
        want = rec.get("expected_world")
        rec_line = _first(r0, lambda s: s["time"] > tf and s.get("world_size") == want
                          and logs.attempt_of(s) is not attempt_before)
        start_from = tf
    else:  # stop/cut: back at full size after the node returns; etcd/disk: steps go on
        want = rec.get("final_world", rec.get("world_before"))
        start_from = t_end
        later = [s for s in r0 if s["time"] > t_end and s.get("world_size") == want]
        restarted_after = [s for s in later if logs.attempt_of(s) is not attempt_before]
        rec_line = (restarted_after or later or [None])[0]
        if kind in ("stop", "cut"):
            evicted = _first(r0, lambda s: tf < s["time"] and s.get("world_size") == rec.get("expected_world")
                             and logs.attempt_of(s) is not attempt_before)
            out["evicted_first_step_s"] = round(evicted["time"] - tf, 3) if evicted else None
            if evicted is None:
                notes.append("the survivors did not train without the node while it was away")
        out["steps_during_fault"] = len([s for s in r0 if tf < s["time"] <= t_end])
    recovered = rec_line is not None
    out["recovered"] = recovered
    out["first_step_s"] = round(rec_line["time"] - tf, 3) if rec_line else None
    limit = rec_line["time"] if rec_line else float("inf")
    survivors = set(rec.get("survivors", []))
    seen = [o["time"] for o in timeline if tf < o["time"] <= limit and o["what"] == "workers_gone"
            and o["node"] in survivors]
    seen += [e["time"] for node in survivors for e in logs.agent.get(node, [])
             if tf < e["time"] <= limit and DETECT_RE.search(e["text"])]
    out["detect_s"] = round(min(seen) - tf, 3) if seen else None
    new_attempt = logs.attempt_of(rec_line) if rec_line else None
    restarted = new_attempt is not None and new_attempt is not attempt_before
    out["rendezvous_s"] = None
    if restarted:  # the round's completion in the agents' logs, else new workers after the detection
        key = new_attempt.key
        new_round = int(key[6:]) if key.startswith("round-") and key[6:].isdigit() else None
        joined = [e["time"] for lines in logs.agent.values() for e in lines if tf < e["time"] <= limit
                  and (m := JOINED_RE.search(e["text"])) and int(m.group(1)) == new_round]
        if not joined:
            after = tf + (out["detect_s"] or 0.0)
            joined = [o["time"] for o in timeline if o["what"] == "workers_started" and after < o["time"] <= limit]
        out["rendezvous_s"] = round(min(joined) - tf, 3) if joined else None
    out["restarted"] = restarted
    ok = recovered
    if restarted:
        resumed = new_attempt.first_step - 1
        out["resumed_from"] = resumed
        lost = max(0, (last["step"] if last else 0) - resumed)
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
        out["loss_after"] = _mean([s.get("loss") for s in new_attempt.rank0[:5]])
    else:
        out.update(resumed_from=None, steps_lost=0, samples_lost=0, committed_lost=0)
        if kind in WORLD_CHANGING and recovered:
            notes.append("no restart was seen")
        out["loss_after"] = _mean([s.get("loss") for s in r0 if s["time"] > start_from][:5])
    out["loss_before"] = _mean([s.get("loss") for s in before[-5:]])
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
        ends = [f"rank 0 on {e['_node']} logged '{e['event']}' ({e.get('reason', '?')}) at +{e['time'] - tf:.1f}s"
                for e in logs.events if tf < e["time"] <= horizon and e.get("event") in ("stopped", "finished")]
        exits = [f"{o['node']} exited with {o.get('code')} at +{o['time'] - tf:.1f}s"
                 for o in timeline if tf < o["time"] <= horizon and o["what"] == "node_exited"]
        if ends or exits:
            notes.append("after the fault: " + "; ".join(ends[:3] + exits[:4]))
    out["ok"] = bool(ok)
    out["notes"] = notes
    return out


def sampler_order(dataset_len: int, global_batch: int, seed: int):
    """``step -> global batch`` of the built-in ElasticSampler (shuffle on, constant global batch)."""
    from elastic_trainer.sampler import epoch_permutation

    per_epoch = dataset_len // global_batch
    cache: dict[int, list[int]] = {}

    def expected(step: int) -> list[int]:
        epoch, k = divmod(step - 1, per_epoch)
        if epoch not in cache:
            cache.clear()
            cache[epoch] = epoch_permutation(dataset_len, seed, epoch).tolist()
        return cache[epoch][k * global_batch:(k + 1) * global_batch]
    return expected


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
    for m in measured:
        if m.get("recovered") and m.get("first_step_s") is not None:
            by_kind.setdefault(m["kind"], []).append(m["first_step_s"])
    report = {
        **meta,
        "ok": not failures,
        "failures": failures,
        "recovery_first_step_s": {k: {"n": len(v), "median": sorted(v)[len(v) // 2], "max": max(v)}
                                  for k, v in sorted(by_kind.items())},
        "faults": measured,
        "ledger": ledger,
        "worlds": [{"key": a.key, "start": a.start, "end": a.end, "first_step": a.first_step,
                    "last_step": a.last_step, "world_size": a.world_size, "nodes": a.nodes} for a in logs.attempts],
        "overlapping_worlds": overlaps,
        "commits": [{"step": k, "time": v} for k, v in sorted(commits.items())],
        "series": [[round(s["time"], 3), s["step"], s.get("world_size"), s.get("loss")] for s in r0],
        "events": [{k: v for k, v in e.items() if k != "_node"} | {"node": e["_node"]} for e in logs.events],
        "timeline": timeline,
    }
    return report


def summary_table(report: dict) -> str:
    """One screen: a row per fault, then the ledger verdict and the overall result."""
    head = f"{'#':>2} {'fault':<34} {'step':>5} {'detect':>7} {'rdzv':>7} {'1st step':>8} {'world':>6} " \
           f"{'lost':>5} {'samples':>7} {'ok':>3}"
    rows = [head, "-" * len(head)]

    def sec(v):
        return f"{v:.1f}s" if isinstance(v, (int, float)) else "-"

    for f in report["faults"]:
        world = f"{f.get('world_before', '?')}>{f.get('final_world', f.get('expected_world', '?'))}"
        rows.append(f"{f['index']:>2} {f['label'][:34]:<34} {str(f.get('fired_step', '-')):>5} "
                    f"{sec(f.get('detect_s')):>7} {sec(f.get('rendezvous_s')):>7} {sec(f.get('first_step_s')):>8} "
                    f"{world:>6} {str(f.get('steps_lost', '-')):>5} {str(f.get('samples_lost', '-')):>7} "
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
