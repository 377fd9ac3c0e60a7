"""How ``elastic-train``'s commands report bad input: one line on stderr, exit status 2.

A command raises :class:`UsageError` (or its parser does, being a :class:`Parser`), and
``cli.main`` prints ``elastic-train: error: <message>`` and returns ``env.EXIT_USAGE``: no usage
block, no traceback, nothing started.
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """Bad input: printed as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, raised as :class:`UsageError` instead of printed."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


class TrainerParser(Parser):
    """The built-in trainer's generated parser as the launcher uses it: errors say whose flag it was."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"trainer: {message}")
