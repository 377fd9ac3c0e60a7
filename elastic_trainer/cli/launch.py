"""``elastic-train``: run one node of an elastic training job on torchrun's elastic agent.

The node command: flags -> a checked ``RunConfig`` -> torch's ``LaunchConfig`` ->
``torch.distributed.launcher.api.elastic_launch``; the agents, their restarts and their workers
are torchrun's own. In order:

1. :func:`parse_run_config`: the launcher's flags (generated from ``RunConfig``'s fields by
   ``flags.add_run_flags``, plus ``--nnodes``, ``-m`` and the program), and the built-in trainer's
   flags after ``--``, parsed once with the trainer's own generated parser, as every worker will
   (a bad one ends the launcher with one line and status 2); for the built-in trainer the fork
   server its workers come from starts first, and imports torch while the rest goes on
   (``preload.py``). The recovery mode is chosen here:
   ``--recovery`` when given, else live for the built-in trainer and for a script that uses the
   Manager (``training/uses_manager.py``), restart for any other.
2. :func:`check_devices` and :func:`check_environment`: what this node can run (``--device``,
   ``--amp``, GPUs per worker), the etcd binary or endpoint, a writable checkpoint dir.
3. :func:`run_node`: the embedded etcd when no endpoint is given (:func:`embedded_etcd`: kept by
   ``etcd_keeper`` for as long as any node of the run uses it) and the join command
   (``cli/join.py``), the workers' environment (``OMP_NUM_THREADS``, the run's folders, secrets
   moved out by ``cli.secrets``, NCCL's error handling in live mode, what this node runs for the
   joiner check), then torch's ``elastic_launch``: the built-in trainer's workers forked from the
   fork server (``preload.train_worker``), a user's script in a new interpreter through
   ``elastic_trainer.script`` (:func:`worker_command`): its workers die with this node, and under
   live recovery one that forms its group without the Manager stops the node with one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_trainer import cpus, flags, preload
from elastic_trainer.cli import secrets
from elastic_trainer.cli.usage import Parser, TrainerParser, UsageError
from elastic_trainer.config import RunConfig, TrainConfig, flag_name, run_flag_fields
from elastic_trainer.env import (
    ENV_AGENT_PID,
    ENV_CHECKPOINT_DIR,
    ENV_LOG_DIR,
    ENV_NCCL_ERROR_HANDLING,
    ENV_OMP_NUM_THREADS,
    ENV_PROGRAM,
    ENV_PROGRESS_DIR,
    ENV_RDZV_ENDPOINT,
    ENV_REFUSAL_FILE,
    ENV_RUN_ID,
    ENV_STRAGGLERS,
    EXIT_CRASH_LOOP,
    EXIT_EVICTED,
    EXIT_USAGE,
    NCCL_CLEAN_UP_ONLY,
)

if TYPE_CHECKING:
    from elastic_trainer.etcd.client import EtcdOptions
    from elastic_trainer.observability.check_board import CheckBoard

logger = logging.getLogger("elastic_trainer")

BUILTIN_TRAINER = ["-m", "elastic_trainer.train"]
SCRIPT_ENTRY = ["-u", "-m", "elastic_trainer.script"]
"""How a worker runs a user's script or module: ``elastic_trainer/script.py`` around it."""
SHARED_TRAINER_FLAGS = tuple(f.name for f in run_flag_fields() if f.metadata["trainer"])
"""Trainer flags the launcher takes too: it checks the checkpoint dir and keeps its own logs in the log dir."""


def _nnodes(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--nnodes takes N or MIN:MAX (for example 1:4), got {text!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise argparse.ArgumentTypeError(f"--nnodes minimum must be at least 1, got {low}")
    return low, high


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser (also used by tests and the k8s manifest checks): ``RunConfig``'s flags,
    generated, and those that are not a field: ``--nnodes``, ``-m`` and the program."""
    p = Parser(prog="elastic-train", description=__doc__.split("\n\n")[0],
               epilog="Commands: elastic-train etcd|status|export|drill --help. Flags of the built-in trainer go "
                      "after `--`; see `python -m elastic_trainer.train --help`.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = flags.add_run_flags(p)
    groups["nodes"].add_argument("--nnodes", type=_nnodes, default=None, metavar="MIN:MAX",
                                 help="torchrun's spelling of --min-nodes/--max-nodes: N or MIN:MAX")
    prog = p.add_argument_group("program")
    prog.add_argument("-m", "--module", action="store_true",
                      help="run the program as a Python module (python -m), like torchrun")
    prog.add_argument("training_script", nargs="?", default=None,
                      help="script to run on every worker (default: the built-in trainer)")
    prog.add_argument("training_script_args", nargs=argparse.REMAINDER,
                      help="arguments of the script")
    return p


def parse_run_config(argv: list[str], start_workers_server: bool = False) -> RunConfig:
    """Parse launcher flags into a checked ``RunConfig``; raise ``UsageError`` on bad input.
    ``start_workers_server``: for the built-in trainer, start the fork server its workers come from
    (``preload.py``) as soon as the program is known, before the trainer's flags import torch."""
    secrets.refuse_command_line_secrets(argv)
    trainer_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, trainer_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    given = flags.given_run_flags(args)
    if args.nnodes is not None:
        if "min_nodes" in given or "max_nodes" in given:
            raise UsageError("give either --nnodes or --min-nodes/--max-nodes, not both")
        given["min_nodes"], given["max_nodes"] = args.nnodes
    if args.training_script is None:
        if args.module:
            raise UsageError("-m/--module needs a module name after the flags")
        program = [*BUILTIN_TRAINER, *trainer_args]
    elif args.module:
        program = ["-m", args.training_script, *args.training_script_args, *trainer_args]
    else:
        if not Path(args.training_script).is_file():
            raise UsageError(f"the training script {args.training_script!r} does not exist; "
                             "give a path to a .py file, or nothing for the built-in trainer")
        program = ["-u", args.training_script, *args.training_script_args, *trainer_args]
    rdzv_conf = given["rdzv_conf"] = dict(given.get("rdzv_conf", {}))
    secrets.refuse_rdzv_password(rdzv_conf)
    backend = given.get("rdzv_backend", RunConfig.rdzv_backend)
    recovery = given.pop("recovery", None) or rdzv_conf.get("recovery")
    builtin = program[:2] == BUILTIN_TRAINER
    if recovery == "live":
        if backend != "etcd-v3":
            raise UsageError(f"--recovery live needs the etcd-v3 rendezvous (--rdzv-backend {backend} has no live "
                             "quorum); leave --rdzv-backend out, or use --recovery restart")
        if builtin and "--scale-lr" in program[2:]:
            raise UsageError("--recovery live keeps the global batch of the built-in trainer across world sizes, and "
                             "--scale-lr changes it with the world; leave --scale-lr out, or use --recovery restart")
    if backend == "etcd-v3":
        rdzv_conf["recovery"] = recovery or default_recovery(program)
    if "checkpoint_dir" not in given:  # "" given: no checkpoints
        # The launcher's env var: where a URL with keys may come from (never a command line).
        given["checkpoint_dir"] = os.environ.get(ENV_CHECKPOINT_DIR) or None
    try:
        run = RunConfig(**given, recovery=rdzv_conf.get("recovery"), program=program)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if program[:2] == BUILTIN_TRAINER:  # `-m elastic_trainer.train` too
        if start_workers_server:
            run.fork_server_error = preload.start_server(secrets.without_secrets(os.environ))
            run.forked_workers = run.fork_server_error is None
        run.trainer = trainer_config(run, given_here={name: getattr(args, name) for name in SHARED_TRAINER_FLAGS})
    return run


def default_recovery(program: list[str]) -> str:
    """The recovery mode when ``--recovery`` is not given: live for the built-in trainer (unless
    ``--scale-lr``) and for a script or module that uses elastic_trainer.Manager, in its own text or
    in a module of its own that it imports (``training/uses_manager.py``); restart for any other."""
    from elastic_trainer.training.uses_manager import script_uses_manager

    if program[:2] == BUILTIN_TRAINER:
        return "restart" if "--scale-lr" in program[2:] else "live"
    return "live" if script_uses_manager(program[1], module=program[0] == "-m") else "restart"


def trainer_config(run: RunConfig, given_here: dict[str, str | None]) -> TrainConfig:
    """Parse the built-in trainer's flags (``run.program[2:]``) with its generated parser, as each
    worker will, and check them as ``TrainConfig`` does: a bad one ends the launcher now, with one
    line, instead of every worker after the start. A shared flag (``--checkpoint-dir``, ``--log-dir``)
    given there becomes the run's; given both here and there with different values, it is an error.
    """
    # What the workers get: the launcher hands its checkpoint and log folders over in these env vars.
    environ = {ENV_CHECKPOINT_DIR: run.checkpoint_dir or "", ENV_LOG_DIR: run.log_dir or ""}
    trainer = flags.parse_train_config(run.program[2:], flags.build_train_parser(TrainerParser, environ))
    for name in SHARED_TRAINER_FLAGS:
        here, there = getattr(run, name) or "", getattr(trainer, name) or ""
        if there == here:
            continue
        if given_here[name] is not None:
            raise UsageError(f"{flag_name(name)} is given twice, {here!r} before `--` and {there!r} "
                             "after it; give it once")
        setattr(run, name, there)
    return trainer


def check_devices(run: RunConfig) -> None:
    """The built-in trainer's ``--device`` and ``--amp`` against the GPUs this node shows (its
    workers see the same ones): ``--device auto`` on a node whose GPUs torch cannot use, ``cuda``
    without CUDA, more workers than GPUs, ``--amp fp16`` on the CPU end the launcher now with one
    line, instead of training on the CPU by accident or failing in every worker later. (Whether a
    GPU has bf16 is left to the workers: asking would make a CUDA context in the launcher.)"""
    from elastic_trainer import devices

    if run.trainer is None:
        return
    view = devices.CudaView.probe()
    try:
        device = devices.pick_device(run.trainer.device, 0, view)
        if device.type == "cuda":
            devices.check_local_ranks(run.nproc_per_node, view.device_count)
        devices.amp_plan(run.trainer.amp, device)
    except devices.DeviceError as exc:
        raise UsageError(str(exc)) from exc


def rendezvous_etcd_options(run: RunConfig, endpoint: str | None = None) -> EtcdOptions:
    """How the etcd-v3 rendezvous will reach etcd (``EtcdOptions``), from ``--rdzv-conf`` as its
    handler parses it; a bad option is a ``UsageError`` now rather than in every agent later.
    ``endpoint``: the etcd found since (the embedded one), over ``--rdzv-endpoint``."""
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastic_trainer.rendezvous.options import RendezvousOptions

    try:
        params = RendezvousParameters("etcd-v3", endpoint or run.rdzv_endpoint or "", run.run_id, run.min_nodes,
                                      run.max_nodes, **run.rdzv_conf)
        return RendezvousOptions(params).etcd
    except ValueError as exc:
        raise UsageError(f"--rdzv-conf: {exc}") from exc


def check_environment(run: RunConfig) -> None:
    """Checks that need the outside world: the etcd binary or endpoint, the checkpoint dir."""
    from elastic_trainer.etcd import server as etcd_server
    from elastic_trainer import storage

    if run.embedded_etcd:
        try:
            etcd_server.find_etcd_binary()
        except etcd_server.EtcdError as exc:
            raise UsageError(str(exc)) from exc
    elif run.rdzv_backend == "etcd-v3":
        try:
            etcd_server.parse_endpoints(run.rdzv_endpoint or "")
        except ValueError as exc:
            raise UsageError(f"--rdzv-endpoint: {exc}") from exc
        etcd = rendezvous_etcd_options(run)
        try:
            # With the rendezvous's own TLS and auth options: a check in plain http would fail
            # against an etcd that serves TLS although the rendezvous would reach it.
            etcd_server.probe_endpoint(run.rdzv_endpoint or "", timeout=3.0, options=etcd)
        except etcd_server.EtcdError as exc:
            raise UsageError(f"--rdzv-endpoint: {exc}") from exc
    if not run.checkpoint_dir:
        return  # an empty --checkpoint-dir: no checkpoints
    try:
        storage.check_writable(run.checkpoint_dir)
    except storage.StorageError as exc:
        raise UsageError(f"--checkpoint-dir: {exc}") from exc


def keep_nccl_errors_in_process(run: RunConfig) -> str | None:
    """In live mode, NCCL's clean-up-only error handling for every worker: set in this (the agent's)
    environment, before torch's agent builds the workers' (which would otherwise put ``1`` there,
    ending a worker on any NCCL error, so that live recovery became a restart). A value the user set
    is kept, with a warning. Returns the variable's earlier value (None: it was not set)."""
    before = os.environ.get(ENV_NCCL_ERROR_HANDLING)
    if run.recovery != "live":
        return before
    if before is None:
        os.environ[ENV_NCCL_ERROR_HANDLING] = NCCL_CLEAN_UP_ONLY
    elif before != NCCL_CLEAN_UP_ONLY:
        logger.warning("%s=%s ends a worker on an NCCL error or timeout, which turns live recovery into restarts; "
                       "unset it (or set %s) to keep live recovery on GPUs", ENV_NCCL_ERROR_HANDLING, before,
                       NCCL_CLEAN_UP_ONLY)
    return before


def embedded_etcd(run: RunConfig, log_dir: Path) -> tuple[str, subprocess.Popen | None]:
    """The run's embedded etcd: the one a keeper of this log dir runs already (this first node started
    again while the others train on: its endpoint file names an etcd that answers), else a new one
    under a keeper of its own (``etcd/keeper.py``), which stops it once no node of the run is left.
    Returns its endpoint and the keeper this node started (None: it reuses one).

    Authentication is on: any other user of this machine reaches the loopback port too, and could
    otherwise register a node or rewrite the run's state. The password is in a 0600 file of the
    log dir, so the join command works for this user only."""
    from elastic_trainer.etcd.keeper import KeeperError, running_etcd, start_keeper
    from elastic_trainer.rendezvous.etcd_backend import DEFAULT_KEY_PREFIX, run_prefix

    root = (run.rdzv_conf.get("key_prefix") or DEFAULT_KEY_PREFIX).rstrip("/") + "/"
    endpoint = running_etcd(log_dir, run_prefix(root, run.run_id))
    if endpoint is not None:
        logger.info("using the embedded etcd at %s that a keeper of run %s runs already", endpoint, run.run_id)
        return endpoint, None
    try:
        keeper, endpoint = start_keeper(log_dir, root)
    except KeeperError as exc:
        raise UsageError(str(exc)) from exc
    return endpoint, keeper


def worker_entrypoint(run: RunConfig):
    """What torch's agent starts for each worker: the built-in trainer forked from the fork server
    that imported torch while this launcher started (``preload.train_worker``), or a new interpreter:
    for a user's script (its ``__main__`` is the script), or the built-in trainer when the server
    could not start (``preload.start_server``)."""
    return preload.train_worker if run.forked_workers else sys.executable


def worker_command(run: RunConfig) -> list:
    """The arguments of :func:`worker_entrypoint`: for the built-in trainer the agent's environment
    when it starts the worker (``preload.AgentEnviron``) and the trainer's flags, or in a new
    interpreter the trainer's module and flags (either way it dies with its agent and uses the
    Manager by itself); a user's script or module runs through ``elastic_trainer.script``."""
    if run.forked_workers:
        return [preload.AgentEnviron(), *run.program[2:]]
    if run.trainer is not None:
        return run.program
    return [*SCRIPT_ENTRY, *(run.program[1:] if run.program[0] == "-u" else run.program)]


def serve_metrics(run: RunConfig):
    """This node's ``/metrics`` (``observability/metrics_server.py``), before any worker starts: the
    server, or None when off (``--metrics-port 0``) or the default port is taken."""
    from elastic_trainer.observability import metrics
    from elastic_trainer.observability.metrics_server import DEFAULT_PORT, MetricsConfig, MetricsError, serve

    try:
        served = serve(MetricsConfig(
            port=DEFAULT_PORT if run.metrics_port is None else run.metrics_port, addr=run.metrics_addr,
            certfile=run.metrics_certfile, keyfile=run.metrics_keyfile, client_cafile=run.metrics_client_cafile,
            port_given=run.metrics_port is not None))
    except (MetricsError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    metrics.node_started(run.min_nodes)
    return served


def evicted_reason(refusal: Path) -> str | None:
    """Why this node's workers were evicted as stragglers (their refusal file, ``EXIT_EVICTED``), or None."""
    if not refusal.exists():
        return None
    reason, _, code = refusal.read_text().strip().partition("\n")
    return reason if code.strip() == str(EXIT_EVICTED) else None


def hold_out(run: RunConfig, reason: str, seconds: float, endpoint: str, board: CheckBoard | None) -> None:
    """An evicted straggler's node: wait ``seconds`` (shown in ``elastic-train status`` meanwhile),
    then pass the checks before a join (``checked``), before its agent runs again and joins the run
    live as a newcomer. A signal meanwhile ends it as usual."""
    import threading

    line = f"this node was left out ({reason}); it rejoins in {seconds:.0f} s if its checks pass"
    print(f"elastic-train: {line}", file=sys.stderr, flush=True)
    if board is not None:
        board.refused(line, seconds)
    threading.Event().wait(seconds)
    checked(run, endpoint, rejoin=True, board=board)


def check_board(run: RunConfig, endpoint: str) -> CheckBoard | None:
    """Where this node reports its checks and reads its peers' speeds (``observability/check_board.py``):
    the run's etcd; None on another rendezvous backend."""
    import dataclasses

    from elastic_trainer.observability.check_board import CheckBoard
    from elastic_trainer.rendezvous.etcd_backend import run_prefix

    if run.rdzv_backend != "etcd-v3":
        return None
    options = dataclasses.replace(rendezvous_etcd_options(run, endpoint), connect_timeout=3.0, retry_timeout=3.0)
    return CheckBoard(options, run_prefix(run.rdzv_conf.get("key_prefix"), run.run_id))


def checked(run: RunConfig, endpoint: str, *, rejoin: bool, board: CheckBoard | None) -> None:
    """The checks before a join (``observability/health.py``), retried after a back-off (5 s doubling
    to 5 min) until they pass, each failure one line here and in ``elastic-train status`` (``board``).
    Before a rejoin: the checkpoint storage, etcd and the device; before the first join the start-up
    checks (``check_environment``) did storage and etcd, so the device alone. The device's matmul
    speed is held against the median its peers on other hosts reported for the same device, and
    reported in turn once it passes. On GPUs the matmul runs in a process of its own (a CUDA
    context in the launcher would stay on GPU 0 for the whole run) and NVML is asked too."""
    import threading

    import torch

    from elastic_trainer.observability import health, metrics
    from elastic_trainer.observability.backoff import BackOff
    from elastic_trainer.observability.check_board import device_label

    gpus = torch.cuda.is_available()
    etcd = rendezvous_etcd_options(run, endpoint) if rejoin and run.rdzv_backend == "etcd-v3" else None
    retry = BackOff(initial=5.0, maximum=300.0)

    def reference(label: str) -> float | None:
        return board.reference(label) if board is not None else None

    def check() -> tuple[health.HealthReport, str | None]:
        cpu = None if gpus else torch.device("cpu")
        label = None if gpus else device_label(cpu)
        report = health.check_node(checkpoint_url=(run.checkpoint_dir or None) if rejoin else None,
                                   etcd_endpoints=endpoint if rejoin else None, etcd_options=etcd,
                                   device=cpu, reference_gflops=reference(label) if label else None)
        if not gpus:
            return report, label
        count = min(run.nproc_per_node, torch.cuda.device_count())
        device = health.check_devices_apart([f"cuda:{i}" for i in range(count)], reference)
        nvml = health.check_nvml()
        for failed in (device, nvml):
            if not failed.ok:
                metrics.health_check_failed(failed.check)
        return health.HealthReport((*report.results, device, nvml)), device.label

    while not (outcome := check())[0].ok:
        report = outcome[0]
        delay = retry.next_delay() or 300.0
        print(f"elastic-train: {report.summary()}; next check in {delay:.0f} s", file=sys.stderr, flush=True)
        if board is not None:
            board.refused(f"{report.summary()}; next check in {delay:.0f} s", delay)
        threading.Event().wait(delay)
    report, label = outcome
    speed = next((r.value for r in report.results if r.check == "device"), None)
    if board is not None:
        board.passed(speed, label)
    if rejoin:
        print(f"elastic-train: {report.summary()}; rejoining", file=sys.stderr, flush=True)
    else:
        logger.info("%s", report.summary())


def run_node(run: RunConfig) -> int:
    """Reach the embedded etcd if needed, run torchrun's agent, let etcd go. Return an exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from elastic_trainer.cli.join import join_command, program_of
    from elastic_trainer.observability.backoff import BackOff
    from elastic_trainer.etcd.keeper import release_keeper
    from elastic_trainer.etcd.server import PASSWORD_FILE, ROOT_USER
    from elastic_trainer.rendezvous.program import ProgramMismatch

    log_dir = Path(run.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    keeper = None
    endpoint = run.rdzv_endpoint
    if run.embedded_etcd:
        endpoint, keeper = embedded_etcd(run, log_dir)
        conf = {"user": ROOT_USER, "password_file": str(log_dir / PASSWORD_FILE)}
        run.rdzv_conf.update(conf)
        print(f"elastic-train: embedded etcd at {endpoint} (run {run.run_id}); join from another terminal with: "
              f"{join_command(run, endpoint, conf)}", file=sys.stderr, flush=True)
    elif endpoint is None:
        endpoint = "127.0.0.1:29400"  # torch's c10d default, for side-by-side runs
    if ENV_OMP_NUM_THREADS not in os.environ:
        # torchrun sets 1 for several workers; we give each worker its share of the CPUs this node
        # may use (the affinity mask capped by the cgroup's CPU quota: a pod's limits.cpu), so that
        # N workers do not each start a thread per core (measured: 30x slower on 2 cores).
        threads = cpus.threads_per_worker(run.nproc_per_node)
        os.environ[ENV_OMP_NUM_THREADS] = str(threads)
        logger.info("OMP_NUM_THREADS=%d for each of %d worker(s) (set it to override)", threads, run.nproc_per_node)
    nccl_before = keep_nccl_errors_in_process(run)
    # A worker that cannot run as launched says why here and stops this node (elastic_trainer/script.py).
    refusal = log_dir / f"refusal-{os.getpid()}"
    refusal.unlink(missing_ok=True)
    # What this node's workers leave for the crash-loop policy of the next ones (observability/crash_loop.py).
    progress = log_dir / f"progress-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(progress, ignore_errors=True)
    progress.mkdir(mode=0o700)
    ours = {ENV_REFUSAL_FILE: str(refusal), ENV_PROGRESS_DIR: str(progress), ENV_AGENT_PID: str(os.getpid())}
    ours[ENV_STRAGGLERS] = run.stragglers.to_json()
    if run.rdzv_backend == "etcd-v3":
        ours[ENV_PROGRAM] = program_of(run).to_json()  # the joiner check (rendezvous/program.py)
    served = board = None
    try:
        served = serve_metrics(run)
        with secrets.handed_over(run.checkpoint_dir or "") as workers_url:
            os.environ.update({ENV_RDZV_ENDPOINT: endpoint, ENV_RUN_ID: run.run_id,
                               ENV_CHECKPOINT_DIR: workers_url, ENV_LOG_DIR: str(log_dir), **ours})
            config = LaunchConfig(
                min_nodes=run.min_nodes, max_nodes=run.max_nodes, nproc_per_node=run.nproc_per_node,
                run_id=run.run_id, rdzv_backend=run.rdzv_backend, rdzv_endpoint=endpoint,
                rdzv_configs=dict(run.rdzv_conf), max_restarts=run.max_restarts,
                monitor_interval=run.monitor_interval, local_addr=run.local_addr,
                start_method="forkserver" if run.forked_workers else "spawn",  # (unused for a program)
                logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "torchelastic")),
            )
            held_out = BackOff(initial=run.stragglers.hold_out_s, maximum=8 * run.stragglers.hold_out_s)
            board = check_board(run, endpoint)
            checked(run, endpoint, rejoin=False, board=board)
            if run.fork_server_error is not None:
                logger.warning("the workers start as new interpreters: their fork server could not start (%s)",
                               run.fork_server_error)
            while True:
                try:
                    elastic_launch(config, worker_entrypoint(run))(*worker_command(run))
                    return 0
                except SignalException:
                    reason = evicted_reason(refusal)
                    if reason is None:
                        raise
                refusal.unlink(missing_ok=True)
                hold_out(run, reason, held_out.next_delay() or run.stragglers.hold_out_s, endpoint, board)
    except ProgramMismatch as exc:
        raise UsageError(str(exc)) from exc
    except ChildFailedError as exc:
        first = next(iter(exc.failures.values()), None)
        print(f"elastic-train: training failed: {exc.name} "
              f"(exit code {getattr(first, 'exitcode', '?')}; see the worker output above)", file=sys.stderr)
        return 1
    except RendezvousClosedError as exc:
        # A spare beyond --max-nodes, or a node that came after the end: the run is over, and this
        # node has nothing to do. Success, so that a Job does not recreate the pod (which, alone in
        # etcd later, could start the finished run over).
        print(f"elastic-train: nothing to do: {exc}", file=sys.stderr)
        return 0
    except SignalException as exc:
        if refusal.exists():  # a worker stopped this node: it cannot run as launched, or it is in a crash loop
            reason, _, code = refusal.read_text().strip().partition("\n")
            if code.strip() == str(EXIT_CRASH_LOOP):
                print(reason, file=sys.stderr)  # the policy's line: "elastic-train: stopped: ..."
                return EXIT_CRASH_LOOP
            print(f"elastic-train: error: {reason}", file=sys.stderr)
            return EXIT_USAGE
        print(f"elastic-train: stopped by {signal.Signals(exc.sigval).name}; workers ended", file=sys.stderr)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    finally:
        refusal.unlink(missing_ok=True)
        shutil.rmtree(progress, ignore_errors=True)
        if served is not None:
            served.close()
        if board is not None:
            board.close()
        for name in ours:  # for callers that run main() in-process
            os.environ.pop(name, None)
        if keeper is not None:
            release_keeper(keeper)  # etcd stops now if no other node uses it, else when the last one left
        if nccl_before is None:
            os.environ.pop(ENV_NCCL_ERROR_HANDLING, None)


def main(argv: list[str]) -> int:
    """``elastic-train [flags] [script [args]] [-- trainer flags]``: check everything, then run this
    node (:func:`run_node`). Bad input: ``UsageError``, before anything starts."""
    run = parse_run_config(argv, start_workers_server=True)
    # Before anything is created (the checkpoint dir's probe, the log dir, etcd's data); the
    # agent and its workers inherit it. Restored after, for callers that run main() in-process.
    old_umask = os.umask(run.umask)
    try:
        check_devices(run)  # first: on a node whose GPUs cannot be used, that is the error to see
        check_environment(run)
        return run_node(run)
    finally:
        os.umask(old_umask)
