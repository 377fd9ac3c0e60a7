"""Command-line flags generated from the configs: the trainer's parser from ``TrainConfig``, the
launcher's flags from ``RunConfig``.

Each flag is declared once, as a field of its config (``config.flag`` / ``config.run_flag`` hold
its section, help and details; the field holds its default). This module turns the fields into
``argparse`` arguments, so that a flag's spelling, type, default and help cannot drift between
the trainer, the launcher, the drill and the docs::

    parser = build_train_parser()                       # python -m elastic_trainer.train's parser
    config = parse_train_config(["--max-steps", "5"])   # -> a checked TrainConfig

    groups = add_run_flags(parser)                      # elastic-train's flags; defaults None = "not given"

The launcher reads the trainer's flags after ``--`` with :func:`build_train_parser` too (with a
parser class whose errors are exceptions, and the env-var defaults its workers will get), and so
does the drill for its ``--trainer-args``.

This module sits below the commands (``cli/``, ``drill/``, ``train.py``): they import it, never the
reverse. The docs' flag tables, which read the commands' parsers, are generated above them, by
``flag_tables.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field
from typing import Any

from elastic_trainer.config import (
    RUN_SECTIONS,
    SECTIONS,
    RunConfig,
    TrainConfig,
    flag_name,
    run_flag_fields,
    train_field,
    train_flag_fields,
)


@functools.cache
def _types(config: type) -> dict[str, Any]:
    return typing.get_type_hints(config)


def _value_type(config: type, name: str) -> tuple[type, bool]:
    """A field's type without ``None``, and whether it may be None."""
    kind = _types(config)[name]
    optional = type(None) in typing.get_args(kind)
    if optional:
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    return kind, optional


class _Switch(argparse.Action):
    """A bool field's flag: ``--name`` sets it, ``--no-name`` (and the field's ``off`` spellings) clears it."""

    def __init__(self, option_strings: list[str], dest: str, off: tuple[str, ...] = (), **kwargs: Any) -> None:
        self.off = ("--no-" + option_strings[0][2:], *off)
        super().__init__([*option_strings, *self.off], dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string not in self.off)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings[:2])


def _converter(kind: type, optional: bool) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if optional and text.lower() in ("none", ""):
            return None
        return kind(text)
    convert.__name__ = kind.__name__  # argparse says "invalid int value: 'x'"
    return convert


def _help(text: str, default_text: str | None) -> str:
    return (text + (f" (default: {default_text})" if default_text else "")).replace("%", "%%")


# ------------------------------------------------------------------------------- the trainer's

def _default_text(f: Field) -> str | None:
    if f.metadata["env"]:
        return f"${f.metadata['env']}, else {'none' if f.default is None else f.default}"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return None if f.default is None else str(f.default)


def add_train_flag(container: Any, name: str, *, default: Any, default_text: str | None = None) -> argparse.Action:
    """Add the flag of ``TrainConfig.<name>`` to ``container`` (a parser or an argument group).

    Its type, choices, metavar and help come from the field; ``default`` is the caller's (the
    trainer's is the field's default or its env var; the launcher's is None, "not given here").
    """
    meta = train_field(name).metadata
    kind, optional = _value_type(TrainConfig, name)
    text = _help(meta["help"], default_text)
    if kind is bool:
        return container.add_argument(flag_name(name), action=_Switch, off=meta["off"], default=default, help=text)
    metavar = meta["metavar"] or {int: "N", float: "X"}.get(kind)
    return container.add_argument(flag_name(name), type=None if kind is str else _converter(kind, optional),
                                  choices=meta["choices"], metavar=metavar, default=default, help=text)


def add_train_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add every ``TrainConfig`` flag to ``parser``, one argument group per section of ``config.SECTIONS``.

    A default is the field's, or the value of the field's env var in ``environ`` (``os.environ``
    unless given) when that is set and not empty.
    """
    environ = os.environ if environ is None else environ
    groups = {section: parser.add_argument_group(title) for section, title in SECTIONS.items()}
    for f in train_flag_fields():
        env = f.metadata["env"]
        default = (environ.get(env) if env else None) or f.default
        add_train_flag(groups[f.metadata["section"]], f.name, default=default, default_text=_default_text(f))


def build_train_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                       environ: Mapping[str, str] | None = None, doc: str | None = None) -> argparse.ArgumentParser:
    """The trainer's parser (``python -m elastic_trainer.train``): every ``TrainConfig`` field's flag
    (:func:`add_train_flags`), then the example task's flags (``tasks.add_example_arguments``).

    ``parser_class`` lets the launcher and the drill get errors as exceptions; ``environ`` replaces
    ``os.environ`` as the source of the env-var defaults (the launcher passes what its workers will get);
    ``doc``: the entry's docstring, whose first paragraph is ``--help``'s description and the rest its
    epilog (``train.py`` passes its own: this module does not import the command it serves).
    """
    from elastic_trainer.tasks import add_example_arguments

    description, _, epilog = (doc or "").partition("\n\n")
    p = parser_class(prog="python -m elastic_trainer.train", description=description or None,
                     epilog=epilog or None, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(p, environ)
    add_example_arguments(p)
    return p


def parse_train_config(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> TrainConfig:
    """Parse flags into a checked ``TrainConfig`` (unknown flags go to the task as ``args.task_argv``).

    Bad input goes to ``parser.error`` (argparse's: usage, message and exit status 2).
    """
    parser = parser or build_train_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.task is None and unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.task_argv = unknown
    names = {f.name for f in train_flag_fields()}
    try:
        if args.task is None:  # the built-in example: its flags must fit the --example chosen
            from elastic_trainer.tasks import check_example_args

            check_example_args(args)
        return TrainConfig(**{k: v for k, v in vars(args).items() if k in names}, task_args=args)
    except ValueError as exc:
        parser.error(str(exc))


# ------------------------------------------------------------------------------ the launcher's

def add_run_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Add every ``RunConfig`` flag to ``parser``, one argument group per section of
    ``config.RUN_SECTIONS``; return the groups by section (the launcher adds its other flags to them).

    Every default is None, "not given": the run's defaults are ``RunConfig``'s, which the help shows.
    A flag marked ``trainer`` is the built-in trainer's own declaration (:func:`add_train_flag`).
    """
    groups = {section: parser.add_argument_group(title) for section, title in RUN_SECTIONS.items()}
    for f in run_flag_fields():
        meta, group = f.metadata, groups[f.metadata["section"]]
        if meta["trainer"]:
            add_train_flag(group, f.name, default=None, default_text=meta["default_text"])
            continue
        kind, optional = _value_type(RunConfig, f.name)
        default_text = meta["default_text"] or (None if f.default in (None, MISSING) else str(f.default))
        parse = meta["parse"] or (None if kind is str else _converter(kind, optional))
        metavar = meta["metavar"] or {int: "N", float: "X"}.get(kind)
        group.add_argument(flag_name(f.name), *meta["aliases"], dest=f.name, type=parse, choices=meta["choices"],
                           metavar=metavar, default=None, help=_help(meta["help"], default_text))
    return groups


def given_run_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RunConfig`` flags given on the command line (not None), as ``RunConfig`` keyword arguments."""
    return {f.name: getattr(args, f.name) for f in run_flag_fields() if getattr(args, f.name) is not None}
