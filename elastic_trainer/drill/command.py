"""``elastic-train drill``: break a training run on purpose and prove that it recovers.

A drill starts its own etcd and K simulated nodes on this machine (each one an
``elastic-train`` process: a torchrun agent and its workers, in their own sessions), runs the
built-in trainer with a tiny model and the sample ledger on, applies faults one at a time,
and measures each recovery. It ends with ``<out>/report.json``, ``<out>/timeline.png`` and a
summary table, and exits non-zero when a fault was not recovered, a sample was repeated or
skipped, or committed work was lost.

    elastic-train drill --nodes 3 --kill node:1@step:20 --add-node @after:5
    elastic-train drill --scenario drills/default.toml --out runs/drill-default

One module per part; this one runs them (:class:`Drill`) and is the command (:func:`main`):

- ``drill_scenario``: the fault grammar (``--FAULT [TARGET]@WHEN[,for:SECONDS]``), the flags
  and the scenario file;
- ``kinds``: the fault kinds (``FAULTS``): help, target rule, duration, fire and heal of each;
- ``drill_nodes``: a simulated node and the processes under it;
- ``drill_cluster``: the drill's etcd, network, checkpoint folder and nodes, and what they log;
- ``drill_faults``: firing a fault, ending it, and when the run counts as recovered;
- ``drill_report``: the measurements, the exactly-once check, the report and the timeline.

Everything the drill starts (processes, etcd, namespaces, veth pairs, the tmpfs) is removed
when it ends, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import shlex
import signal
import sys
import time

from elastic_trainer.drill import report as drill_report
from elastic_trainer.drill.cluster import POLL, Cluster
from elastic_trainer.drill.faults import SETTLE_STEPS, FaultDriver
from elastic_trainer.drill.kinds import FAULTS, FaultKind, ranks
from elastic_trainer.drill.scenario import (DEFAULT_TRAINER_ARGS, DEFAULTS, Fault, ScenarioError, Trigger,
                                            build_parser, parse_args, parse_fault, parse_fault_line)

# the scenario's names stay importable from here, as they were before the drill was split into modules
__all__ = ["DEFAULT_TRAINER_ARGS", "DEFAULTS", "FAULTS", "Drill", "DrillInterrupted", "Fault", "FaultKind",
           "ScenarioError", "Trigger", "build_parser", "main", "parse_args", "parse_fault", "parse_fault_line"]

logger = logging.getLogger(__name__)


class DrillInterrupted(BaseException):
    """SIGTERM/SIGHUP reached the drill: unwind through the clean-up."""


class Drill:
    """Runs one drill: etcd, nodes, the faults in order, the measurements, the clean-up."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.argv = argv
        self.cluster = Cluster(args)
        self.faults = FaultDriver(self.cluster, args)
        self.out = self.cluster.out
        self.records: list[dict] = []
        self.problems: list[str] = []
        self._cleaned = False
        self.global_batch = _last_int(self.cluster.trainer_args, "--global-batch-size")

    def cleanup(self) -> None:
        """Stop everything this drill started; every step runs even when another fails."""
        if self._cleaned:
            return
        self._cleaned = True
        try:
            self.faults.close_watch()
        except Exception:  # noqa: BLE001 - clean-up goes on; the error is logged with its trace
            logger.exception("drill clean-up of %s failed", "watch")
        self.cluster.cleanup()

    def triggered(self, fault: Fault, settle_step: int) -> bool:
        """Whether ``fault``'s WHEN has come (``settle_step``: the step when the previous one recovered)."""
        latest = self.cluster.latest
        step = latest.step if latest else 0
        if fault.trigger.kind == "step":
            return step >= fault.trigger.value
        if fault.trigger.kind == "after":
            return step >= settle_step + fault.trigger.value
        return time.time() - self.first_step_time >= fault.trigger.value

    def run(self) -> dict:
        self.cluster.setup()
        self.started_at = time.time()
        self.deadline = self.started_at + self.args.timeout
        for _ in range(self.args.nodes):
            self.cluster.start_node()
        self.first_step_time = None
        startup_limit = time.time() + max(self.args.recovery_timeout, 180)
        while self.first_step_time is None:
            self.cluster.poll()
            if self.cluster.latest:
                self.first_step_time = self.cluster.latest.time
            elif time.time() > startup_limit or not any(n.alive for n in self.cluster.nodes):
                self.problems.append("the run made no optimizer step at start (see nodes/*/agent.log)")
                break
            time.sleep(POLL)
        queue = list(self.args.faults) if self.first_step_time else []
        current = None
        settle_step = self.cluster.latest.step if self.cluster.latest else 0
        while self.first_step_time is not None:
            self.cluster.poll()
            if time.time() > self.deadline:
                self.problems.append(f"the drill hit its --timeout of {self.args.timeout:g}s")
                break
            if not any(n.alive for n in self.cluster.nodes):
                if current is not None or queue:
                    self.problems.append("every node exited before the scenario was done")
                break
            if current is not None:
                if self.faults.progress(current):
                    self.cluster.note(current.get("node"), "fault_done", index=current["index"],
                                      status=current["status"])
                    logger.info("fault %d (%s): %s at step %s", current["index"], current["label"],
                                current["status"], self.cluster.latest.step if self.cluster.latest else None)
                    if current["status"] == "timeout":
                        if not self.restart_job(current):
                            break
                    settle_step = self.cluster.latest.step if self.cluster.latest else settle_step
                    current = None
            elif queue:
                if self.triggered(queue[0], settle_step):
                    fault = queue.pop(0)
                    current = self.faults.fire(fault, len(self.records) + 1)
                    self.records.append(current)
                    self.cluster.note(current.get("node"), "fault_fired", index=current["index"],
                                      label=fault.label)
                    logger.info("fault %d %s fired at step %s", current["index"], fault.label, current["fired_step"])
            elif self.cluster.latest and self.cluster.latest.step >= settle_step + self.args.tail_steps:
                break
            time.sleep(POLL)
        for fault in queue:
            self.records.append({"index": len(self.records) + 1, "label": fault.label, "kind": fault.kind,
                                 "fired_at": None, "status": "not fired", "notes": []})
        if current is not None and current["status"] not in ("recovered", "timeout") \
                and not current["status"].startswith("skipped"):
            current["status"] = "unfinished"
        self.cluster.stop_all_nodes()
        self.cluster.scan_commits()
        self.ended_at = time.time()
        return self.report()

    def restart_job(self, rec: dict) -> bool:
        """What an operator does after a failed recovery: kill every node, start fresh ones.

        They resume from the newest checkpoint, so the rest of the scenario still runs (and the
        ledger still judges the whole lineage). Returns False when the job does not come back.
        """
        logger.warning("fault %d (%s) did not recover: restarting the job with %d fresh nodes",
                       rec["index"], rec["label"], self.args.nodes)
        self.problems.append(f"fault {rec['index']} ({rec['label']}) did not recover within "
                             f"{self.args.recovery_timeout:g}s; the drill restarted the job to go on")
        for node in self.cluster.nodes:
            if node.alive:
                self.cluster.kill(node)
        self.cluster.poll()
        self.cluster.note(None, "job_restarted", after_fault=rec["index"])
        marker = time.time()
        for _ in range(self.args.nodes):
            self.cluster.start_node()
        want = ranks(self.args, min(self.args.nodes, self.cluster.max_nodes))
        while time.time() < min(self.deadline, marker + max(self.args.recovery_timeout, 180)):
            self.cluster.poll()
            fresh = [s for s in self.cluster.r0[-SETTLE_STEPS:]
                     if s.time > marker and s.world_size == want]
            if len(fresh) == SETTLE_STEPS:
                return True
            time.sleep(POLL)
        self.problems.append("the job did not come back after the drill restarted it; the rest was not run")
        return False

    def report(self) -> dict:
        for rec in self.records:
            if rec["status"].startswith("skipped"):
                rec["notes"].append(rec["status"])
        meta = {"command": shlex.join(["elastic-train", "drill", *self.argv]), "run_id": self.cluster.run_id,
                "out": str(self.out), "started_at": self.started_at, "ended_at": self.ended_at,
                "config": {"nodes": self.args.nodes, "nproc_per_node": self.args.nproc_per_node,
                           "min_nodes": self.args.min_nodes, "max_nodes": self.cluster.max_nodes,
                           "rdzv_backend": self.args.rdzv_backend, "netns": self.args.netns,
                           "checkpoint_dir": self.cluster.checkpoint_dir,
                           "trainer_args": self.cluster.trainer_args,
                           "recovery_timeout": self.args.recovery_timeout},
                "problems": self.problems}
        node_dirs = {n.name: n.log_dir for n in self.cluster.nodes}
        expected = None
        trainer_args = self.cluster.trainer_args
        size, seed = _last_int(trainer_args, "--dataset-size"), _last_int(trainer_args, "--seed") or 0
        if not self.args.script and "--task" not in trainer_args and self.global_batch:
            source = _example_source(trainer_args)  # a streamed --data (parquet:, tokens:), else None
            if source is not None:  # the stream sampler's order, replayed over the lineage's world sizes
                expected = drill_report.stream_order(source.row_counts(), self.global_batch, seed,
                                                     source.shuffle_buffer, source.shuffle)
            elif size:
                expected = drill_report.sampler_order(size, self.global_batch, seed)  # the built-in task's order
        report = drill_report.build_report(meta, self.records, self.cluster.timeline, node_dirs, self.global_batch,
                                           self.args.recovery_timeout, self.cluster.commits, expected)
        drill_report.write_report(report, self.out)
        return report


def _example_source(trainer_args: list[str]):
    """The built-in example's streamed source for these trainer flags (``tasks.example_source``), or None."""
    from elastic_trainer.flags import build_train_parser
    from elastic_trainer.tasks import example_source

    given, _ = build_train_parser().parse_known_args(trainer_args)
    return example_source(given)


def _last_int(args: list[str], flag: str) -> int | None:
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def main(argv: list[str] | None = None) -> int:
    """Run a drill from command-line flags; 0 when everything recovered and nothing was lost."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:  # `python -m elastic_trainer.drill`; the CLI sets this up itself
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        args = parse_args(argv)
    except ScenarioError as exc:
        print(f"elastic-train drill: error: {exc}", file=sys.stderr)
        return 2
    drill = Drill(args, argv)

    def interrupted(signum, frame):
        raise DrillInterrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, interrupted)
        except ValueError:  # not the main thread: the caller handles signals
            break
    atexit.register(drill.cleanup)
    try:
        report = drill.run()
    except ScenarioError as exc:
        print(f"elastic-train drill: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, DrillInterrupted):
        print("elastic-train drill: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    finally:
        drill.cleanup()
        atexit.unregister(drill.cleanup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(drill_report.summary_table(report))
    print(f"report: {drill.out / 'report.json'}  timeline: {drill.out / 'timeline.png'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # python -m elastic_trainer.drill.command
    sys.exit(main())
