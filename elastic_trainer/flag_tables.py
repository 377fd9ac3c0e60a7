"""The docs' flag tables, generated from the commands' own parsers.

A markdown file holds a generated table between ``TABLE_START`` and ``TABLE_END``; the table is
what the parser's ``--help`` says, flag by flag (spelling, default, meaning), so that the docs
cannot drift from the code. tests/test_docs.py checks that every table is fresh; rewrite them with::

    python -m elastic_trainer.flag_tables --update docs/usage.md docs/trainer.md docs/drills.md
    python -m elastic_trainer.flag_tables --markdown "trainer max_steps lr"   # print one table

This module reads the commands' parsers (``cli/launch.py``'s and ``drill/scenario.py``'s
``build_parser``, and the trainer's, ``flags.build_train_parser``), so it sits above the commands:
no command, and nothing below them (``flags.py``, ``config.py``), imports it.
"""

from __future__ import annotations

import argparse
import re

from elastic_trainer.flags import build_train_parser

TABLE_START = "<!-- flags: {spec} -->"
TABLE_END = "<!-- end of flags -->"
"""A generated table sits between these two lines in a markdown file: ``<!-- flags: launcher -->``,
``<!-- flags: trainer -->``, ``<!-- flags: trainer task lr ... -->`` (those flags, by field name) or
``<!-- flags: drill -->``; ``python -m elastic_trainer.flag_tables --update FILE...`` rewrites them."""


def split_default(help_text: str) -> tuple[str, str | None]:
    """A help text without its closing ``(default: X)`` (or ``(default X)``), and X (None when it has none)."""
    text = help_text.rstrip()
    if not text.endswith(")"):
        return text, None
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            inner = text[i + 1:-1]
            if inner.startswith("default: ") or inner.startswith("default "):
                return text[:i].rstrip(), inner.split(" ", 1)[1]
            return text, None
    return text, None


def _cell(text: str) -> str:
    """One table cell: on one line, ``|`` escaped, and ``<`` escaped outside code spans (``<run-id>``
    would be read as an HTML tag)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "\\<") for i, p in enumerate(parts))


def _spelling(action: argparse.Action) -> str:
    """A flag as the tables show it: its spellings (torchrun's underscore ones left out) and metavar."""
    names = [s for s in action.option_strings if "_" not in s]
    if action.nargs == 0:  # a switch, a store_true
        return ", ".join(f"`{n}`" for n in names)
    if action.choices is not None:
        value = "|".join(str(c) for c in action.choices)
    else:
        value = action.metavar or action.dest.upper()
    return ", ".join([f"`{names[0]} {value}`", *(f"`{n}`" for n in names[1:])]).replace("|", "\\|")


def _rows(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """(section, action) of every optional flag of ``parser`` but ``-h``, in the help's order.

    argparse has no public list of a parser's arguments by group; what ``--help`` prints is what
    the tables show, so they are gathered the way ``--help`` is made: by a help formatter, which
    ``format_help`` hands each group's title (``start_section``) and then its flags (``add_argument``).
    """
    rows: list[tuple[str, argparse.Action]] = []

    class Gather(argparse.HelpFormatter):
        section = ""

        def start_section(self, heading: str | None) -> None:
            self.section = heading.split(":")[0].split(" (")[0] if heading else ""
            super().start_section(heading)

        def add_argument(self, action: argparse.Action) -> None:
            if action.option_strings and action.help != argparse.SUPPRESS and "--help" not in action.option_strings:
                rows.append((self.section, action))

    kept = parser.formatter_class
    parser.formatter_class = Gather
    try:
        parser.format_help()
    finally:
        parser.formatter_class = kept
    return rows


def markdown_table(parser: argparse.ArgumentParser, *, names: list[str] | None = None, sections: bool = False) -> str:
    """The parser's flags as a markdown table: flag, default, meaning (and the section with ``sections``),
    the default taken from the help's ``(default: X)``; ``names``: only these flags (field names), in that order."""
    rows = _rows(parser)
    if names is not None:
        by_name = {a.dest: (s, a) for s, a in rows}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ValueError(f"no flag for {', '.join(missing)} in {parser.prog}")
        rows = [by_name[n] for n in names]
    head = ["section"] * sections + ["flag", "default", "meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for section, action in rows:
        meaning, default = split_default(action.help or "")
        cells = [section] * sections + [_spelling(action), _cell(default or "–"), _cell(meaning.replace("%%", "%"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table_for(spec: str) -> str:
    """The table a ``<!-- flags: SPEC -->`` line asks for: ``launcher``, ``trainer [NAME...]`` or ``drill``."""
    kind, *names = spec.split()
    if kind == "launcher":
        from elastic_trainer.cli.launch import build_parser

        return markdown_table(build_parser(), names=names or None)
    if kind == "trainer":
        return markdown_table(build_train_parser(environ={}), names=names or None, sections=not names)
    if kind == "drill":
        from elastic_trainer.drill.scenario import build_parser as build_drill_parser

        return markdown_table(build_drill_parser(), names=names or None)
    raise ValueError(f"unknown flag table {spec!r}: launcher, trainer [NAME...] or drill")


def generated_tables(text: str) -> list[tuple[str, str, str]]:
    """Each generated table of a markdown text: (spec, the table as written, the table as generated now)."""
    found = re.finditer(re.escape(TABLE_START).replace(r"\{spec\}", "(.+?)") + "\n(.*?)" + re.escape(TABLE_END),
                        text, flags=re.S)
    return [(m.group(1), m.group(2), table_for(m.group(1))) for m in found]


def update_tables(text: str) -> str:
    """``text`` with every generated table written anew."""
    for spec, written, now in generated_tables(text):
        start = TABLE_START.format(spec=spec) + "\n"
        text = text.replace(start + written + TABLE_END, start + now + TABLE_END)
    return text


def main(argv: list[str] | None = None) -> int:
    """``python -m elastic_trainer.flag_tables --markdown SPEC`` prints a table; ``--update FILE...`` rewrites
    the tables in those files; ``--check FILE...`` exits 1 when one differs from the parsers."""
    p = argparse.ArgumentParser(prog="python -m elastic_trainer.flag_tables", description=main.__doc__)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", metavar="SPEC", help="launcher, trainer [NAME...] or drill")
    what.add_argument("--update", nargs="+", metavar="FILE")
    what.add_argument("--check", nargs="+", metavar="FILE")
    args = p.parse_args(argv)
    if args.markdown:
        print(table_for(args.markdown), end="")
        return 0
    stale = []
    for path in args.update or args.check:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = update_tables(text)
        if new != text:
            stale.append(path)
            if args.update:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    if stale:
        print(("rewrote " if args.update else "stale flag tables (python -m elastic_trainer.flag_tables --update "
               + " ".join(args.check) + "): ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
