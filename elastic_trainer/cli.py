"""``elastic-train``: run one node of an elastic training job on torchrun's elastic agent.

Examples::

    # One machine, embedded etcd, the built-in example task, 1 to 4 nodes of 2 workers:
    elastic-train --min-nodes 1 --max-nodes 4 --nproc-per-node 2

    # Flags for the built-in trainer come after `--`:
    elastic-train --nnodes 1:2 --nproc-per-node 2 -- --max-steps 200 --checkpoint-every 20

    # A second node joins the same run (the first one prints its endpoint):
    elastic-train --nnodes 1:4 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:PORT

    # Your own script, torchrun style:
    elastic-train --nnodes 2:4 --rdzv-endpoint etcd:2379 my_train.py --lr 3e-4

    # A standalone etcd for several machines, TLS with client certificates (docs/security.md):
    elastic-train etcd certs --out etcd-tls --host 10.0.0.5      # prints the flags each side needs
    elastic-train etcd --host 0.0.0.0 --port 2379 --data-dir /var/lib/elastic-etcd --tls-dir etcd-tls

    # Kill-node recovery drills (see docs/drills.md):
    elastic-train drill --help

    # A checkpoint's model weights as safetensors, and a new run from them:
    elastic-train export checkpoints/elastic-run --to model.safetensors
    elastic-train --nnodes 1:4 -- --init-from model.safetensors

The launcher parses and checks its flags and those of the built-in trainer after ``--`` (with
the trainer's own parser, generated from ``TrainConfig``; a bad one ends it with one line and
status 2),
starts the embedded etcd when no endpoint is given, and hands a ``LaunchConfig`` to
``torch.distributed.launcher.api.elastic_launch``: the agents, their restarts and their
workers are torchrun's own.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from elastic_trainer import config as cfg
from elastic_trainer import cpus
from elastic_trainer.config import RunConfig

logger = logging.getLogger("elastic_trainer")

USAGE_ERROR = 2
BUILTIN_TRAINER = ["-m", "elastic_trainer.train"]
# Trainer flags the launcher needs too: it checks the checkpoint dir and keeps its own logs in the log dir.
SHARED_TRAINER_FLAGS = ("checkpoint_dir", "log_dir")


class UsageError(Exception):
    """Bad input: printed as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, raised instead of printed."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


class _TrainerParser(_Parser):
    """The built-in trainer's generated parser as the launcher uses it: errors say whose flag it was."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"trainer: {message}")


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be at least 1, got {value}")
        return value
    return parse


def _nproc(text: str) -> int:
    if text in ("auto", "gpu", "cpu"):
        from elastic_trainer import devices

        try:
            return devices.nproc_per_node(text, devices.CudaView.probe())
        except devices.DeviceError as exc:  # `gpu` without a GPU: an error, as torchrun's
            raise argparse.ArgumentTypeError(str(exc)) from None
    return _positive_int("--nproc-per-node")(text)


def _nnodes(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--nnodes takes N or MIN:MAX (for example 1:4), got {text!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise argparse.ArgumentTypeError(f"--nnodes minimum must be at least 1, got {low}")
    return low, high


def _umask(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--umask takes an octal mask such as 077 or 027, got {text!r}") from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"--umask must be from 000 to 777, got {text!r}")
    return value


def _rdzv_conf(text: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--rdzv-conf takes key=value[,key=value...], got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser (also used by tests and the k8s manifest checks)."""
    p = _Parser(prog="elastic-train", description=__doc__.split("\n\n")[0],
                epilog="Flags of the built-in trainer go after `--`; see `python -m elastic_trainer.train --help`.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    nodes = p.add_argument_group("nodes")
    nodes.add_argument("--min-nodes", type=_positive_int("--min-nodes"), default=None,
                       help="fewest nodes to train on (default 1)")
    nodes.add_argument("--max-nodes", type=_positive_int("--max-nodes"), default=None,
                       help="most nodes in a round (default: --min-nodes)")
    nodes.add_argument("--nnodes", type=_nnodes, default=None, metavar="MIN:MAX",
                       help="torchrun's spelling of --min-nodes/--max-nodes: N or MIN:MAX")
    nodes.add_argument("--nproc-per-node", "--nproc_per_node", type=_nproc, default=1, metavar="N",
                       help="workers on this node: a number, 'auto' (one per GPU, else 1), 'gpu' (one per GPU; an "
                            "error without one) or 'cpu' (1) (default 1)")
    rdzv = p.add_argument_group("rendezvous")
    rdzv.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT[,HOST:PORT]",
                      help="etcd to meet through; leave out to start the embedded etcd on this machine")
    rdzv.add_argument("--rdzv-backend", "--rdzv_backend", default="etcd-v3",
                      help="torchrun rendezvous backend (default etcd-v3, ours; c10d for comparisons)")
    rdzv.add_argument("--rdzv-conf", "--rdzv_conf", type=_rdzv_conf, default={}, metavar="K=V,...",
                      help="rendezvous options, e.g. last_call_timeout=1,lease_ttl=3 (see README)")
    rdzv.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", default=cfg.DEFAULT_RUN_ID,
                      help=f"the run's name; nodes with the same run id and endpoint train together (default {cfg.DEFAULT_RUN_ID})")
    rdzv.add_argument("--local-addr", "--local_addr", default=None,
                      help="address other nodes reach this one at (default: looked up from the host name)")
    agent = p.add_argument_group("agent")
    agent.add_argument("--max-restarts", "--max_restarts", type=int, default=100,
                       help="restarts of the worker group after failures, a lost peer included (default 100)")
    agent.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1,
                       help="seconds between the agent's checks of its workers (default 0.1)")
    agent.add_argument("--recovery", choices=("live", "restart"), default=None,
                       help="live (the default for the built-in trainer with DDP and for scripts that use "
                            "elastic_trainer.Manager): survivors keep their processes and state when a node is "
                            "lost or added; restart (the default for other scripts, --fsdp and --scale-lr): every "
                            "fault restarts the workers, which resume from the newest checkpoint")
    io = p.add_argument_group("storage (the trainer's own flags: give each here or after `--`, not both)")
    for name in SHARED_TRAINER_FLAGS:  # declared once, in TrainConfig; None here means "not given"
        cfg.add_train_flag(io, name, default=None)
    io.add_argument("--umask", type=_umask, default=0o077, metavar="OCTAL",
                    help="file-mode mask of this node's launcher and workers (default 077: checkpoints, logs "
                         "and the embedded etcd's data readable by this user only; 027: also its group; "
                         "022: everyone)")
    prog = p.add_argument_group("program")
    prog.add_argument("-m", "--module", action="store_true",
                      help="run the program as a Python module (python -m), like torchrun")
    prog.add_argument("training_script", nargs="?", default=None,
                      help="script to run on every worker (default: the built-in trainer)")
    prog.add_argument("training_script_args", nargs=argparse.REMAINDER,
                      help="arguments of the script")
    return p


def parse_run_config(argv: list[str]) -> RunConfig:
    """Parse launcher flags into a checked ``RunConfig``; raise ``UsageError`` on bad input."""
    from elastic_trainer.checkpoint.storage import has_credentials, redact

    leaked = next((a for a in argv if has_credentials(a)), None)
    if leaked is not None:
        raise UsageError(f"{redact(leaked)!r} holds credentials, which every user of this machine can read on a "
                         f"command line; give the keys in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or the whole "
                         f"checkpoint URL in the launcher's env var {cfg.ENV_CHECKPOINT_DIR}")
    trainer_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, trainer_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    min_nodes, max_nodes = args.min_nodes, args.max_nodes
    if args.nnodes is not None:
        if min_nodes is not None or max_nodes is not None:
            raise UsageError("give either --nnodes or --min-nodes/--max-nodes, not both")
        min_nodes, max_nodes = args.nnodes
    min_nodes = min_nodes or 1
    max_nodes = max_nodes or min_nodes
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
    rdzv_conf = dict(args.rdzv_conf)
    if rdzv_conf.get("password"):
        raise UsageError("--rdzv-conf password=... would put the etcd password on the command line, which every "
                         "user of this machine can read; give password_file=PATH (a file only you can read) or "
                         "set ELASTIC_TRAINER_RDZV_PASSWORD instead")
    recovery = args.recovery or rdzv_conf.get("recovery")
    # Live recovery: the built-in trainer, or a script that uses elastic_trainer.Manager (its text
    # says so: training/manager.py's script_uses_manager); any other script gets torchrun's restarts.
    from elastic_trainer.training.manager import script_uses_manager

    builtin = args.training_script is None
    managed = builtin or script_uses_manager(args.training_script, module=args.module)
    live_ok = managed and args.rdzv_backend == "etcd-v3" and not {"--fsdp", "--scale-lr"} & set(trainer_args)
    if recovery == "live" and not live_ok:
        raise UsageError("--recovery live needs the built-in trainer with DDP and a constant global batch, or a "
                         "script that uses elastic_trainer.Manager (see examples/own_loop.py; a script without it "
                         "would get a process group of its own node only), on the etcd-v3 rendezvous (not "
                         "--fsdp, --scale-lr or c10d); use --recovery restart")
    if args.rdzv_backend == "etcd-v3":
        rdzv_conf["recovery"] = recovery or ("live" if live_ok else "restart")
    try:
        run = RunConfig(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=args.nproc_per_node,
                        rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend,
                        rdzv_conf=rdzv_conf, run_id=args.run_id, max_restarts=args.max_restarts,
                        monitor_interval=args.monitor_interval,
                        # The launcher's env var: where a URL with keys may come from (never a command line).
                        checkpoint_dir=args.checkpoint_dir or os.environ.get(cfg.ENV_CHECKPOINT_DIR) or None,
                        log_dir=args.log_dir, local_addr=args.local_addr, umask=args.umask, program=program)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if program[:2] == BUILTIN_TRAINER:
        check_trainer_flags(run, given_here={name: getattr(args, name) for name in SHARED_TRAINER_FLAGS})
    return run


def check_trainer_flags(run: RunConfig, given_here: dict[str, str | None]) -> None:
    """Parse the built-in trainer's flags (``run.program[2:]``) with its generated parser, as each
    worker will, and check them as ``TrainConfig`` does: a bad one ends the launcher now, with one
    line, instead of every worker after the start. A shared flag (``--checkpoint-dir``, ``--log-dir``)
    given there becomes the run's; given both here and there with different values, it is an error.
    """
    from elastic_trainer import train

    # What the workers get: the launcher hands its checkpoint and log folders over in these env vars.
    environ = {cfg.ENV_CHECKPOINT_DIR: run.checkpoint_dir or "", cfg.ENV_LOG_DIR: run.log_dir or ""}
    trainer = train.parse_config(run.program[2:], train.build_parser(_TrainerParser, environ))
    for name in SHARED_TRAINER_FLAGS:
        here, there = getattr(run, name) or "", getattr(trainer, name) or ""
        if there == here:
            continue
        if given_here[name] is not None:
            raise UsageError(f"{cfg.flag_name(name)} is given twice, {here!r} before `--` and {there!r} "
                             "after it; give it once")
        setattr(run, name, there)


def check_devices(run: RunConfig) -> None:
    """The built-in trainer's ``--device`` and ``--amp`` against the GPUs this node shows (its
    workers see the same ones): ``--device auto`` on a node whose GPUs torch cannot use, ``cuda``
    without CUDA, more workers than GPUs, ``--amp fp16`` on the CPU end the launcher now with one
    line, instead of training on the CPU by accident or failing in every worker later. (Whether a
    GPU has bf16 is left to the workers: asking would make a CUDA context in the launcher.)"""
    from elastic_trainer import devices, train

    if run.program[:2] != BUILTIN_TRAINER:
        return
    environ = {cfg.ENV_CHECKPOINT_DIR: run.checkpoint_dir or "", cfg.ENV_LOG_DIR: run.log_dir or ""}
    trainer = train.parse_config(run.program[2:], train.build_parser(_TrainerParser, environ))
    view = devices.CudaView.probe()
    try:
        device = devices.pick_device(trainer.device, 0, view)
        if device.type == "cuda":
            devices.check_local_ranks(run.nproc_per_node, view.device_count)
        devices.amp_plan(trainer.amp, device)
    except devices.DeviceError as exc:
        raise UsageError(str(exc)) from exc


def rendezvous_etcd_options(run: RunConfig):
    """How the etcd-v3 rendezvous will reach etcd (``EtcdOptions``), from ``--rdzv-conf`` as its
    handler parses it; a bad option is a ``UsageError`` now rather than in every agent later."""
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastic_trainer.rendezvous.options import RendezvousOptions

    try:
        params = RendezvousParameters("etcd-v3", run.rdzv_endpoint or "", run.run_id, run.min_nodes,
                                      run.max_nodes, **run.rdzv_conf)
        return RendezvousOptions(params).etcd
    except ValueError as exc:
        raise UsageError(f"--rdzv-conf: {exc}") from exc


def check_environment(run: RunConfig) -> None:
    """Checks that need the outside world: the etcd binary or endpoint, the checkpoint dir."""
    from elastic_trainer import etcd_server
    from elastic_trainer.checkpoint import storage

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


def hand_over_storage_keys(url: str, secrets_dir: str) -> tuple[str, dict[str, str]]:
    """What the workers get for S3 keys: the checkpoint URL without ``KEY:SECRET@``, and the keys
    (from the URL, else ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``) in a
    0600 AWS credentials file named by ``AWS_SHARED_CREDENTIALS_FILE``, never in their environment
    (from where they would reach every DataLoader worker and subprocess). Returns the URL for them
    and the variables it took out of ``os.environ`` (to put back when the run ends)."""
    from elastic_trainer.checkpoint.storage import split_credentials

    if not url.startswith(("s3://", "s3a://")):
        return url, {}
    clean, keys = split_credentials(url)
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SHARED_CREDENTIALS_FILE")
    taken = {name: os.environ[name] for name in names if name in os.environ}
    from_env = [os.environ.pop(name, None) for name in names[:3]]
    if keys is None and from_env[0] and from_env[1]:
        keys = (from_env[0], from_env[1])
    if keys is None:
        os.environ.update(taken)  # keys from a credentials file or an instance role: nothing to move
        return clean, {}
    lines = [f"[{os.environ.get('AWS_PROFILE', 'default')}]", f"aws_access_key_id = {keys[0]}",
             f"aws_secret_access_key = {keys[1]}"]
    if from_env[2] and keys == (from_env[0], from_env[1]):
        lines.append(f"aws_session_token = {from_env[2]}")
    path = os.path.join(secrets_dir, "aws-credentials")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = path
    return clean, taken


def hand_over_wandb_key(secrets_dir: str) -> dict[str, str]:
    """Move ``WANDB_API_KEY`` out of the environment the workers inherit (and so every DataLoader
    worker and subprocess) into a 0600 file named by ``metrics.WANDB_KEY_FILE``; rank 0 reads it
    when it starts W&B (``metrics.init_wandb``). Returns what it took from ``os.environ``, to put back."""
    from elastic_trainer.training.metrics import WANDB_KEY_FILE

    key = os.environ.pop("WANDB_API_KEY", None)
    if not key:
        return {}
    path = os.path.join(secrets_dir, "wandb-api-key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    taken = {"WANDB_API_KEY": key}
    if WANDB_KEY_FILE in os.environ:
        taken[WANDB_KEY_FILE] = os.environ[WANDB_KEY_FILE]
    os.environ[WANDB_KEY_FILE] = path
    return taken


def _launch(run: RunConfig) -> int:
    """Start the embedded etcd if needed, run torchrun's agent, stop etcd. Return an exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from elastic_trainer import status
    from elastic_trainer.etcd_server import PASSWORD_FILE, ROOT_USER, EtcdError, EtcdServer, enable_auth, run_password

    log_dir = Path(run.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    server = None
    endpoint = run.rdzv_endpoint
    if run.embedded_etcd:
        server = EtcdServer(data_dir=log_dir / "etcd", log_path=log_dir / "etcd.log")
        password_file = log_dir / PASSWORD_FILE
        try:
            server.start()
            # Authentication on: any other user of this machine reaches the loopback port too, and
            # could otherwise register a node or rewrite the run's state. The password is in a
            # 0600 file, so the join command below works for this user only.
            enable_auth(server.endpoint, run_password(password_file))
        except EtcdError as exc:
            server.stop()
            raise UsageError(str(exc)) from exc
        endpoint = server.endpoint
        endpoint_file = log_dir / status.ENDPOINT_FILE  # where `elastic-train status` finds it
        endpoint_file.write_text(endpoint + "\n")
        auth = f"user={ROOT_USER},password_file={password_file}"
        run.rdzv_conf.update(user=ROOT_USER, password_file=str(password_file))
        print(f"elastic-train: embedded etcd at {endpoint} (run {run.run_id}); join from another "
              f"terminal with: elastic-train --nnodes {run.min_nodes}:{run.max_nodes} "
              f"--nproc-per-node {run.nproc_per_node} --run-id {run.run_id} --rdzv-endpoint {endpoint} "
              f"--rdzv-conf {auth}",
              file=sys.stderr, flush=True)
    elif endpoint is None:
        endpoint = "127.0.0.1:29400"  # torch's c10d default, for side-by-side runs
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets 1 for several workers; we give each worker its share of the CPUs this node
        # may use (the affinity mask capped by the cgroup's CPU quota: a pod's limits.cpu), so that
        # N workers do not each start a thread per core (measured: 30x slower on 2 cores).
        threads = cpus.threads_per_worker(run.nproc_per_node)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        logger.info("OMP_NUM_THREADS=%d for each of %d worker(s) (set it to override)", threads, run.nproc_per_node)
    secrets_dir = tempfile.mkdtemp(prefix="elastic-trainer-secrets-")  # 0700; removed when the run ends
    workers_url, taken_keys = hand_over_storage_keys(run.checkpoint_dir or "", secrets_dir)
    taken_wandb = hand_over_wandb_key(secrets_dir)
    os.environ.update({cfg.ENV_RDZV_ENDPOINT: endpoint, cfg.ENV_RUN_ID: run.run_id,
                       cfg.ENV_CHECKPOINT_DIR: workers_url, cfg.ENV_LOG_DIR: str(log_dir)})
    config = LaunchConfig(
        min_nodes=run.min_nodes, max_nodes=run.max_nodes, nproc_per_node=run.nproc_per_node,
        run_id=run.run_id, rdzv_backend=run.rdzv_backend, rdzv_endpoint=endpoint,
        rdzv_configs=dict(run.rdzv_conf), max_restarts=run.max_restarts,
        monitor_interval=run.monitor_interval, local_addr=run.local_addr, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "torchelastic")),
    )
    try:
        elastic_launch(config, sys.executable)(*run.program)
        return 0
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
        print(f"elastic-train: stopped by {signal.Signals(exc.sigval).name}; workers ended", file=sys.stderr)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None:
            (log_dir / status.ENDPOINT_FILE).unlink(missing_ok=True)
            server.stop()
        shutil.rmtree(secrets_dir, ignore_errors=True)
        if taken_keys:  # for callers that run main() in-process
            os.environ.pop("AWS_SHARED_CREDENTIALS_FILE", None)
            os.environ.update(taken_keys)
        if taken_wandb:
            os.environ.pop("ELASTIC_TRAINER_WANDB_KEY_FILE", None)  # metrics.WANDB_KEY_FILE
            os.environ.update(taken_wandb)


def _etcd_certs_main(argv: list[str]) -> int:
    from elastic_trainer.etcd_tls import make_certs

    p = _Parser(prog="elastic-train etcd certs",
                description="Create a CA, etcd's server certificate and the nodes' client certificates, and print "
                            "the flags the etcd server and each node then need.")
    p.add_argument("--out", required=True, help="folder to write the PEM files to (created 0700; keys 0600)")
    p.add_argument("--host", action="append", required=True,
                   help="an address or DNS name the nodes reach etcd at (repeat for several)")
    p.add_argument("--client", action="append", default=None,
                   help="a client certificate to make, by file name (repeat for several; default: client)")
    p.add_argument("--user", default="root", help="the etcd user the client certificates act as when etcd's "
                                                  "authentication is on (their common name; default root)")
    p.add_argument("--days", type=_positive_int("--days"), default=365, help="validity (default 365)")
    args = p.parse_args(argv)
    try:
        files = make_certs(Path(args.out).resolve(), args.host, args.client or ["client"], args.user, args.days)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from exc
    print(f"elastic-train: wrote a CA, a server certificate for {', '.join(args.host)} and client "
          f"certificate(s) {', '.join(args.client or ['client'])} to {files.folder}.\n"
          f"Keep ca-key.pem off the nodes; give each node ca.pem and its own certificate and key.\n"
          f"etcd server: elastic-train etcd --host 0.0.0.0 --tls-dir {files.folder}\n"
          + "".join(f"node ({c}): elastic-train --rdzv-endpoint {args.host[0]}:2379 --rdzv-conf {files.rdzv_conf(c)}\n"
                    for c in args.client or ["client"]), end="", flush=True)
    return 0


def _etcd_main(argv: list[str]) -> int:
    from elastic_trainer.etcd_server import ROOT_USER, EtcdError, EtcdServer, enable_auth
    from elastic_trainer.etcd_tls import TlsFiles
    from elastic_trainer.rendezvous.options import is_loopback, read_password_file

    if argv[:1] == ["certs"]:
        return _etcd_certs_main(argv[1:])
    p = _Parser(prog="elastic-train etcd", description="Run a standalone etcd that several nodes share "
                "(`elastic-train etcd certs --help` makes its TLS certificates).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    p.add_argument("--data-dir", default="etcd-data", help="where etcd keeps its data (default ./etcd-data)")
    p.add_argument("--tls-dir", default=None, help="serve TLS with the certificates in this folder (made by "
                   "`elastic-train etcd certs`) and accept only clients with a certificate from its CA")
    p.add_argument("--password-file", default=None, help="also turn on etcd's user authentication, with user "
                   "root and the password in this file (mode 0600)")
    p.add_argument("--insecure", action="store_true", help="allow plain http on an address other than loopback: "
                   "anyone who reaches the port could join or close a run")
    args = p.parse_args(argv)
    tls = TlsFiles(Path(args.tls_dir).resolve()) if args.tls_dir else None
    if tls is None and not is_loopback(args.host) and not args.insecure:
        raise UsageError(f"--host {args.host} without --tls-dir would let anyone who reaches port {args.port} join "
                         "or close a run; make certificates with `elastic-train etcd certs` and give --tls-dir, "
                         "or add --insecure on a network you trust")
    try:
        if tls is not None:
            tls.check()
        password = read_password_file(args.password_file) if args.password_file else None
    except ValueError as exc:
        raise UsageError(str(exc).replace("the rendezvous option password_file", "--password-file")) from exc
    server = EtcdServer(data_dir=Path(args.data_dir).resolve(), host=args.host, port=args.port,
                        log_path=Path(args.data_dir).resolve().with_suffix(".log"),
                        extra_args=tls.server_flags() if tls else None)
    try:
        server.start()
        if password is not None:
            enable_auth(server.endpoint, password, tls=tls)
    except EtcdError as exc:
        server.stop()
        raise UsageError(str(exc)) from exc
    conf = tls.rdzv_conf("client") if tls else ""
    if password is not None:
        conf += ("," if conf else "") + f"user={ROOT_USER},password_file=PATH"
    print(f"elastic-train: etcd serving at {server.scheme}://{server.endpoint}; use --rdzv-endpoint {server.endpoint}"
          + (f" --rdzv-conf {conf}" if conf else "") + ". Ctrl-C stops it.", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run: a node of a job, ``etcd``, ``export`` or ``drill``. Return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("ELASTIC_TRAINER_LOG_LEVEL", "INFO"),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        if argv[:1] == ["etcd"]:
            return _etcd_main(argv[1:])
        if argv[:1] == ["export"]:
            from elastic_trainer import export
            return export.main(argv[1:])
        if argv[:1] == ["status"]:
            from elastic_trainer import status
            return status.main(argv[1:], _Parser)
        if argv[:1] == ["drill"]:
            from elastic_trainer.drill import command as drill
            return drill.main(argv[1:])
        run = parse_run_config(argv)
        # Before anything is created (the checkpoint dir's probe, the log dir, etcd's data); the
        # agent and its workers inherit it. Restored after, for callers that run main() in-process.
        old_umask = os.umask(run.umask)
        try:
            check_devices(run)  # first: on a node whose GPUs cannot be used, that is the error to see
            check_environment(run)
            return _launch(run)
        finally:
            os.umask(old_umask)
    except UsageError as exc:
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":  # python -m elastic_trainer.cli
    sys.exit(main())
