"""The README and docs say what the code does and where each number comes from.

- The flag tables in README.md and docs/*.md are the parsers' own (``python -m elastic_trainer.flag_tables
  --update FILE`` rewrites them); every flag of the smaller commands is named in docs/usage.md.
- A number quoted from a benchmark is the text of a link to its file in benchmarks/results/; the
  file exists and holds that number (rounded as quoted). In the README's "Numbers" every number of
  a result column is such a link. A run whose files were replaced is named as ``git show C:path``.
- The README stays a first page (under 250 lines) whose module tree names every module; relative
  links and their anchors exist; the launcher command lines in code blocks parse.

Nothing here runs training or a benchmark.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from elastic_trainer import flag_tables, flags
from elastic_trainer.cli import launch
from tests.helpers.common import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "k8s" / "README.md",
        REPO / "benchmarks" / "README.md", REPO / "benchmarks" / "results" / "README.md"]
RESULTS = REPO / "benchmarks" / "results"
LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def _outside_code(text: str) -> str:
    """The text with fenced code blocks blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in NUMBER.findall(text)]


def _holds(cited: str, found: set[str]) -> bool:
    """A quoted number is in the file as written, or a number of the file rounds to it."""
    if cited in found:
        return True
    decimals = len(cited.split(".")[1]) if "." in cited else 0
    return any(round(float(f), decimals) == float(cited) for f in found)


def _results_links(path: Path) -> list[tuple[str, Path]]:
    """(link text, target file) of every link from ``path`` into benchmarks/results/."""
    found = []
    for text, target in LINK.findall(_outside_code(path.read_text())):
        file = (path.parent / target.split("#")[0]).resolve()
        if file.is_relative_to(RESULTS) and file != RESULTS and file.suffix in (".txt", ".json"):
            found.append((text, file))
    return found


# ------------------------------------------------------------------------------- flag tables

@pytest.mark.parametrize("path", DOCS, ids=_doc_id)
def test_every_flag_table_is_what_the_parser_says(path):
    for spec, written, now in flag_tables.generated_tables(path.read_text()):
        assert written == now, (f"{_doc_id(path)}: the '{spec}' flag table differs from the parser; run "
                                f"python -m elastic_trainer.flag_tables --update {_doc_id(path)}")


def test_the_launcher_trainer_and_drill_tables_are_there():
    specs = {doc.name: [spec for spec, _, _ in flag_tables.generated_tables(doc.read_text())] for doc in DOCS}
    assert specs["usage.md"] == ["launcher"] and specs["trainer.md"] == ["trainer"] and specs["drills.md"] == ["drill"]


def test_a_stale_table_is_found_and_rewritten():
    text = (REPO / "docs" / "usage.md").read_text()
    stale = text.replace("| `--min-nodes N` | 1 |", "| `--min-nodes N` | 2 |")
    assert stale != text
    assert any(written != now for _, written, now in flag_tables.generated_tables(stale))
    assert flag_tables.update_tables(stale) == text


def test_the_table_takes_the_default_from_the_help():
    assert flag_tables.split_default("workers (default 1)") == ("workers", "1")
    assert flag_tables.split_default("address (default: looked up (by name))") == ("address", "looked up (by name)")
    assert flag_tables.split_default("options (see docs)") == ("options (see docs)", None)


def _help_flags(capsys, *argv: str) -> set[str]:
    from elastic_trainer import cli

    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    return set(re.findall(r"--[a-z][a-z0-9-]*", usage)) - {"--help"}


@pytest.mark.parametrize("command", [("etcd",), ("etcd", "certs"), ("status",), ("export",)], ids=" ".join)
def test_every_flag_of_the_other_commands_is_in_the_usage_doc(capsys, command):
    usage = (REPO / "docs" / "usage.md").read_text()
    named = _help_flags(capsys, *command)
    assert named, command
    missing = sorted(f for f in named if f not in usage)
    assert missing == [], f"docs/usage.md does not name {missing} of elastic-train {' '.join(command)}"


# ------------------------------------------------------------------------------ numbers

@pytest.mark.parametrize("path", DOCS, ids=_doc_id)
def test_every_cited_results_file_exists_and_holds_the_cited_numbers(path):
    for text, file in _results_links(path):
        assert file.exists(), f"{_doc_id(path)} cites {file.relative_to(REPO)}, which does not exist"
        found = set(_numbers(file.read_text()))
        wrong = [n for n in _numbers(text) if not _holds(n, found)]
        assert wrong == [], f"{_doc_id(path)}: [{text}] cites {file.name}, which does not hold {wrong}"


def test_the_check_catches_a_number_its_file_does_not_hold():
    found = set(_numbers((RESULTS / "live_recovery.txt").read_text()))
    assert _holds("0.088", found) and _holds("0.09", found) and not _holds("0.777", found)


def test_every_number_in_the_readme_results_names_its_file():
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Numbers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    assert len(rows) >= 10
    for row in rows:
        results = "|".join(row.split("|")[2:])  # the first cell says what was measured, and how
        bare = LINK.sub("", results)
        assert _numbers(bare) == [], f"README.md Numbers: {_numbers(bare)} without a results file in {row[:80]}"
        assert _results_links(REPO / "README.md")  # and the links resolve (checked above)


@pytest.mark.parametrize("path", DOCS, ids=_doc_id)
def test_every_run_named_by_git_show_is_in_the_history(path):
    refs = re.findall(r"git show ([0-9a-f]{7,40}):(\S+?)`", path.read_text())
    if not refs:
        return
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for commit, file in refs:
        assert subprocess.run(["git", "cat-file", "-e", f"{commit}:{file}"], cwd=REPO,
                              capture_output=True).returncode == 0, f"{_doc_id(path)}: git show {commit}:{file}"


# --------------------------------------------------------------------------- README, links

def test_the_readme_is_a_first_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 250
    heads = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert heads[:3] == ["Two commands", "How recovery works", "Numbers"]
    assert "bash launch/quickstart" in text and "bash launch/test" in text


def test_the_readme_module_tree_names_every_module():
    tree = (REPO / "README.md").read_text().split("\nelastic_trainer/\n", 1)[1].split("```", 1)[0]
    modules = {p.stem for p in (REPO / "elastic_trainer").rglob("*.py") if p.stem not in ("__init__", "__main__")}
    missing = sorted(m for m in modules if not re.search(rf"\b{m}\b", tree))
    assert missing == [], f"README.md's module tree does not name {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=_doc_id)
def test_relative_links_and_their_anchors_exist(path):
    for _, target in LINK.findall(_outside_code(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{_doc_id(path)} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            heads = {_slug(h) for h in re.findall(r"^#+ (.+)$", _outside_code(dest.read_text()), flags=re.M)}
            assert anchor in heads, f"{_doc_id(path)} links to {target}: no such heading"


def _launcher_lines(path: Path) -> list[str]:
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith("elastic-train -") and "..." not in line and "[" not in line:
            lines.append(line.split("#")[0].rstrip(" \\"))
    return lines


@pytest.mark.parametrize("path", [REPO / "README.md", REPO / "docs" / "usage.md", REPO / "docs" / "trainer.md"],
                         ids=_doc_id)
def test_the_launcher_command_lines_in_the_docs_parse(path):
    for line in _launcher_lines(path):
        argv = shlex.split(line)[1:]
        ours = argv[:argv.index("--")] if "--" in argv else argv
        launch.build_parser().parse_args(ours)
        if "--" in argv:  # the launcher hands its workers a checkpoint dir
            parser = flags.build_train_parser(environ={"ELASTIC_TRAINER_CHECKPOINT_DIR": "checkpoints/x"})
            flags.parse_train_config(argv[argv.index("--") + 1:], parser)


def test_no_doc_offers_a_standalone_etcd_on_the_network_without_tls_or_insecure():
    for path in DOCS:
        for line in path.read_text().splitlines():
            m = re.search(r"elastic-train etcd --host (\S+)(.*)", line)
            if m and m[1] not in ("127.0.0.1", "localhost", "H"):
                assert "--tls-dir" in m[2] or "--insecure" in m[2], f"{_doc_id(path)}: {line.strip()}"
