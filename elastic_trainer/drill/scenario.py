"""What a drill does: the fault grammar, the ``elastic-train drill`` flags and the scenario file.

Fault grammar: ``--FAULT [TARGET]@WHEN[,for:SECONDS]``.
  TARGET  node:N (node N; nodes are numbered 0.. in start order, added ones after),
          rank0 (the node hosting global rank 0 now), random (a random live node).
  WHEN    step:S (the run reached global step S), time:T (T seconds after the first step),
          after:K (K steps after the previous fault recovered).
Faults fire in the order given; one fires only once the previous one has recovered.

A scenario file (``--scenario``) is TOML: a ``[drill]`` table with any of the flags (dashes or
underscores) and a ``faults`` list of ``"KIND SPEC"`` lines (``drills/default.toml``). Flags given on
the command line win over the file, the file over :data:`DEFAULTS`; faults from the file fire
before those from flags. The kinds of fault, their help, target rules and durations are
``kinds.FAULTS``. :func:`parse_args` returns the merged settings with ``faults``, a list of
:class:`Fault`, and refuses combinations the drill cannot run.

The drill declares no trainer flag: its trainer flags are :data:`DEFAULT_TRAINER_ARGS` followed
by ``--trainer-args``, read with the trainer's own generated parser, which also checks them before
any node starts. ``--trainer-args='--checkpoint-dir URL'`` puts the checkpoints at URL instead of
``<out>/checkpoints``; ``--log-dir`` is the drill's to set (one per node).
"""

from __future__ import annotations

import argparse
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from elastic_trainer.drill.kinds import FAULTS, Target

DESCRIPTION = "``elastic-train drill``: break a training run on purpose and prove that it recovers."

# A model small enough that a step is dominated by --sleep-per-step on a 2-core machine.
DEFAULT_TRAINER_ARGS = [
    "--d-model", "16", "--nhead", "2", "--layers", "1", "--dim-feedforward", "32", "--src-len", "4",
    "--tgt-len", "4", "--dataset-size", "100000", "--global-batch-size", "12",
    "--sleep-per-step", "0.25", "--checkpoint-every", "5", "--sample-ledger", "--no-wandb",
]
class ScenarioError(ValueError):
    """A fault spec or scenario file that cannot be understood; the message says how to fix it."""


@dataclass(frozen=True)
class Trigger:
    """When a fault fires: ``step:S``, ``time:T`` (s after the first step) or ``after:K`` steps."""

    kind: str
    value: float

    def __str__(self) -> str:
        return f"{self.kind}:{self.value:g}"


@dataclass
class Fault:
    """One fault of a scenario: its kind (a key of ``FAULTS``), target, trigger and duration."""

    kind: str
    target: str | None
    trigger: Trigger
    duration: float | None = None

    @property
    def label(self) -> str:
        extra = f",for:{self.duration:g}" if self.duration is not None else ""
        return f"{self.kind} {self.target or ''}@{self.trigger}{extra}"


def _parse_target(kind: str, text: str) -> str | None:
    text = text.strip()
    rule = FAULTS[kind].target
    if not text:
        if rule is Target.REQUIRED:
            raise ScenarioError(f"--{kind} needs a target before '@': node:N, rank0 or random "
                                f"(for example --{kind} node:1@step:20)")
        return FAULTS[kind].default_target
    if rule is Target.NONE:
        raise ScenarioError(f"--{kind} takes no target, got {text!r} (write --{kind} @step:20)")
    if text in ("rank0", "random"):
        return text
    if text.startswith("node:") and text[5:].isdigit():
        return text
    raise ScenarioError(f"--{kind}: target {text!r} is not node:N, rank0 or random")


def parse_fault(kind: str, spec: str) -> list[Fault]:
    """Parse one ``--KIND SPEC`` (see the module docstring) into faults."""
    if kind == "random-kills":
        count, _, rest = spec.partition(",")
        every = 5.0
        if rest:
            key, _, val = rest.partition(":")
            if key.strip() != "every" or not val.strip().isdigit():
                raise ScenarioError(f"--random-kills takes N[,every:STEPS], got {spec!r}")
            every = float(val)
        if not count.strip().isdigit() or int(count) < 1:
            raise ScenarioError(f"--random-kills takes a count of at least 1, got {spec!r}")
        out = []
        for _ in range(int(count)):
            out.append(Fault("kill", "random", Trigger("after", every)))
            out.append(Fault("add-node", None, Trigger("after", 1)))
        return out
    if kind not in FAULTS:
        raise ScenarioError(f"unknown fault {kind!r}; known: {', '.join(sorted(FAULTS))}, random-kills")
    target_text, at, rest = spec.partition("@")
    if not at:
        raise ScenarioError(f"--{kind} {spec!r}: say when with '@', e.g. @step:20, @time:30 or @after:5")
    when, *options = [p.strip() for p in rest.split(",")]
    wkind, _, wval = when.partition(":")
    try:
        trigger = Trigger(wkind, float(wval))
    except ValueError:
        raise ScenarioError(f"--{kind} {spec!r}: WHEN must be step:S, time:T or after:K") from None
    if wkind not in ("step", "time", "after") or trigger.value < 0:
        raise ScenarioError(f"--{kind} {spec!r}: WHEN must be step:S, time:T or after:K with a number >= 0")
    duration = FAULTS[kind].duration
    for opt in options:
        key, _, val = opt.partition(":")
        if key != "for":
            raise ScenarioError(f"--{kind} {spec!r}: unknown option {opt!r} (only for:SECONDS)")
        if FAULTS[kind].duration is None:
            raise ScenarioError(f"--{kind} takes no for:SECONDS")
        try:
            duration = float(val)
        except ValueError:
            raise ScenarioError(f"--{kind} {spec!r}: for: takes seconds, got {val!r}") from None
    return [Fault(kind, _parse_target(kind, target_text), trigger, duration)]


def parse_fault_line(line: str) -> list[Fault]:
    """``"kill node:1@step:20"`` (a scenario file's entry) into faults."""
    kind, _, spec = line.strip().lstrip("-").partition(" ")
    return parse_fault(kind, spec.strip())


class _FaultAction(argparse.Action):
    """Appends parsed faults to ``namespace.faults`` in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        kind = self.dest.replace("_", "-")
        try:
            faults = parse_fault(kind, values)
        except ScenarioError as exc:
            parser.error(str(exc))
        namespace.faults = list(getattr(namespace, "faults", None) or []) + faults


def build_parser() -> argparse.ArgumentParser:
    examples = """examples:
  elastic-train drill --nodes 3 --kill node:1@step:20 --add-node @after:5
  elastic-train drill --nodes 3 --kill-rank0 @step:30 --stop node:2@after:5,for:8 --term random@time:60
  elastic-train drill --nodes 2 --restart-etcd @step:15,for:2 --corrupt-checkpoint @after:5 --fill-disk @after:5,for:6
  elastic-train drill --netns --nodes 3 --cut node:1@step:20,for:6
  elastic-train drill --nodes 3 --random-kills 5,every:4
  elastic-train drill --scenario drills/default.toml --out runs/drill-default
  elastic-train drill --nodes 2 --recovery restart --kill node:1@step:12 --trainer-args=--no-resume   # must FAIL
"""
    p = argparse.ArgumentParser(prog="elastic-train drill", description=DESCRIPTION,
                                epilog=__doc__.split("\n\n")[1] + "\n\n" + examples,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", help="TOML file: a [drill] table of these flags and a faults = [...] list")
    p.add_argument("--nodes", type=int, default=None, help="nodes started at the beginning (default 3)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per node (default 1)")
    p.add_argument("--min-nodes", type=int, default=None, help="the run's --min-nodes (default 1)")
    p.add_argument("--out", default=None, help="folder for logs, checkpoints and the report (default runs/drill-<time>)")
    p.add_argument("--rdzv-endpoint", default=None, help="use this etcd instead of starting one (restart-etcd is then refused)")
    p.add_argument("--rdzv-backend", default=None, help="rendezvous backend (default etcd-v3)")
    p.add_argument("--rdzv-conf", default=None, help="passed to every node's --rdzv-conf")
    p.add_argument("--recovery", choices=("live", "restart"), default=None,
                   help="every node's --recovery (default: the launcher's, live for the built-in trainer)")
    p.add_argument("--disk-size", default=None, help="size of the checkpoint tmpfs for fill-disk (default 48m)")
    p.add_argument("--netns", action="store_true", default=None, help="each node in its own network namespace (root)")
    p.add_argument("--trainer-args", default=None,
                   help="extra trainer flags, one string, appended after the drill's "
                   "(e.g. --trainer-args=--no-resume); '--checkpoint-dir URL' here moves the checkpoints "
                   "from <out>/checkpoints (a tmpfs with fill-disk)")
    p.add_argument("--script", default=None, help="run this training script instead of the built-in trainer "
                   "(it must write the same step log, ledger and events)")
    p.add_argument("--recovery-timeout", type=float, default=None,
                   help="seconds a fault may take to a step at the expected world size (default 120)")
    p.add_argument("--tail-steps", type=int, default=None, help="steps to train after the last fault (default 5)")
    p.add_argument("--timeout", type=float, default=None, help="whole drill limit in seconds (default 1200)")
    p.add_argument("--term-grace", type=float, default=None, help="seconds after SIGTERM before SIGKILL (default 30)")
    p.add_argument("--seed", type=int, default=None, help="seed of random targets (default 0)")
    faults = p.add_argument_group("faults ([TARGET]@WHEN[,for:SECONDS]; fire in the order given)")
    for kind in FAULTS.values():
        faults.add_argument(f"--{kind.name}", dest=kind.name.replace("-", "_"), action=_FaultAction, metavar="SPEC",
                            help=kind.help)
    faults.add_argument("--random-kills", dest="random_kills", action=_FaultAction, metavar="N[,every:K]",
                        help="N times: SIGKILL a random node K steps (default 5) after the last recovery, then add a node")
    return p


DEFAULTS = {"nodes": 3, "nproc_per_node": 1, "min_nodes": 1, "rdzv_backend": "etcd-v3", "disk_size": "48m",
            "netns": False, "recovery_timeout": 120.0, "tail_steps": 5, "timeout": 1200.0, "term_grace": 30.0,
            "seed": 0, "trainer_args": ""}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags, then the scenario file's values for flags not given, then the defaults."""
    args = build_parser().parse_args(argv)
    flag_faults = list(getattr(args, "faults", None) or [])
    file_faults: list[Fault] = []
    if args.scenario:
        try:
            data = tomllib.loads(Path(args.scenario).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ScenarioError(f"cannot read scenario {args.scenario}: {exc}") from exc
        table = dict(data.get("drill", {}))
        for line in table.pop("faults", data.get("faults", [])):
            file_faults.extend(parse_fault_line(line))
        for key, value in table.items():
            key = key.replace("-", "_")
            if key not in DEFAULTS and key not in ("out", "rdzv_endpoint", "rdzv_conf", "script", "recovery"):
                raise ScenarioError(f"{args.scenario}: unknown setting {key!r} in [drill]")
            if key == "trainer_args" and isinstance(value, list):
                value = shlex.join(str(v) for v in value)
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.faults = file_faults + flag_faults
    args.checkpoint_dir = _trainer_checkpoint_dir(DEFAULT_TRAINER_ARGS + shlex.split(args.trainer_args),
                                                  builtin=not args.script)
    if args.nodes < 1 or args.nproc_per_node < 1:
        raise ScenarioError("--nodes and --nproc-per-node must be at least 1")
    kinds = {f.kind for f in args.faults}
    for kind in FAULTS.values():
        problem = kind.refuse(args) if kind.refuse is not None and kind.name in kinds else None
        if problem:
            raise ScenarioError(problem)
    if args.netns and args.rdzv_endpoint:
        raise ScenarioError("--netns starts its own etcd on the drill bridge: leave out --rdzv-endpoint")
    args.lease_ttl = lease_ttl(args.rdzv_conf)
    return args


def lease_ttl(rdzv_conf: str | None) -> float:
    """The nodes' etcd lease in seconds: ``lease_ttl`` in ``--rdzv-conf`` (``k=v,k=v``), else the
    rendezvous default (``LiveSettings.lease_ttl``, 3 s). A frozen or cut-off node is out of the
    world when its lease expires, so this decides what a ``stop`` or ``cut`` is expected to do."""
    from elastic_trainer.env import LiveSettings

    for item in (rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "lease_ttl":
            try:
                return float(value)
            except ValueError:
                raise ScenarioError(f"--rdzv-conf lease_ttl={value!r} is not a number of seconds") from None
    return float(LiveSettings().lease_ttl)


class _TrainerParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ScenarioError(f"--trainer-args: {message}")


def _trainer_checkpoint_dir(trainer_argv: list[str], builtin: bool) -> str | None:
    """Read the trainer flags with the trainer's generated parser; return their ``--checkpoint-dir``
    (None when not given). For the built-in trainer they are also checked as every worker will
    check them (``TrainConfig``, with the folders the drill hands over); a ``--script`` gets them as
    they are.
    """
    from elastic_trainer import config
    from elastic_trainer.flags import build_train_parser, parse_train_config

    unset = "\0unset"  # the env default of --log-dir, to tell whether it was given
    given, _ = build_train_parser(_TrainerParser, {config.ENV_LOG_DIR: unset}).parse_known_args(trainer_argv)
    if given.log_dir != unset:
        raise ScenarioError("--trainer-args: leave --log-dir out; the drill gives each node its own")
    if given.checkpoint_dir == "":
        raise ScenarioError("--trainer-args: an empty --checkpoint-dir turns checkpoints off; a drill needs them")
    if builtin:
        handed_over = {config.ENV_CHECKPOINT_DIR: given.checkpoint_dir or "<out>/checkpoints",
                       config.ENV_LOG_DIR: "<out>/nodes/node-<i>"}
        parse_train_config(trainer_argv, build_train_parser(_TrainerParser, handed_over))
    return given.checkpoint_dir
