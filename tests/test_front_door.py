"""The front door stays one: README is a user's guide of at most 300 lines, with no dates, clock times or
issue numbers (history lives in git and in the reports), the package's comments and docstrings carry
no dates or clock times, and no relative link of README or a docs page points at a missing file.

Each check is a function over text, run here on the repository and on planted violations.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import site_builder as sb  # noqa: E402

README_MAX_LINES = 300

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
# what each finding is called → its pattern
DATED: dict[str, re.Pattern[str]] = {
    "date": re.compile(
        rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b{_MONTH}\.? \d{{1,2}}(?:st|nd|rd|th)?\b|\b\d{{1,2}} {_MONTH}\b"
    ),
    "clock time": re.compile(r"(?<![\d:.[])\b(?:[01]?\d|2[0-3]):[0-5]\d\b(?![:\d\]])"),  # not a slice [1:20]
}
ISSUE = re.compile(r"(?<![\w&/])#\d+\b|\bissues? #?\d+\b", re.I)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def dated(text: str, where: str, patterns: dict[str, re.Pattern[str]] = DATED) -> list[str]:
    """Each date or clock time in ``text`` as "where:line: kind 'match'"."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in patterns.items():
            found += [f"{where}:{number}: {kind} {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def issue_numbers(text: str, where: str) -> list[str]:
    """Each issue number (``#56``, ``issue 56``) in ``text`` as "where:line: issue number 'match'"."""
    return dated(text, where, {"issue number": ISSUE})


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment and every docstring of a Python module's ``source``."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    found.append((body[0].lineno, body[0].value.value))
    return sorted(found)


def dated_python(source: str, where: str) -> list[str]:
    """Each date or clock time in a comment or docstring of ``source``, with its file line."""
    found = []
    for first, text in comments_and_docstrings(source):
        for finding in dated(text, where):
            place, rest = finding.split(": ", 1)
            line = first + int(place.rsplit(":", 1)[1]) - 1
            found.append(f"{where}:{line}: {rest}")
    return found


def broken_links(text: str, path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of the markdown file ``path`` (its ``text``) to a file that does not exist;
    a docs page may link a page the site build generates (``site_builder.is_generated``)."""
    docs = root / "docs"
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in LINK.finditer(line):
            target = match.group(1).split("#", 1)[0]
            if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, a URL, mailto:
                continue
            resolved = (path.parent / target).resolve()
            if resolved.exists():
                continue
            if resolved.is_relative_to(docs) and sb.is_generated(resolved.relative_to(docs).as_posix()):
                continue
            found.append(f"{path.relative_to(root)}:{number}: link to a missing file {match.group(1)!r}")
    return found


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the story into docs/ or a report"


def test_readme_has_no_dates_clock_times_or_issue_numbers():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert dated(text, "README.md") + issue_numbers(text, "README.md") == []


def test_package_comments_and_docstrings_have_no_dates_or_clock_times():
    found = []
    for path in sorted((ROOT / "geoattn").rglob("*.py")):
        found += dated_python(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    assert found == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_relative_links_point_at_files(path):
    assert broken_links(path.read_text(encoding="utf-8"), path) == []


def test_the_checks_report_planted_violations(tmp_path):
    text = (
        "Measured on 2026-12-05 and on Dec 5, from 12:28–12:55 UTC, see #56 and issue 56.\n"
        "[a report](results/missing.md) beside [one that exists](real.md), [a site](https://example.org)\n"
        "and [an anchor](#set-up).\n"
    )
    (tmp_path / "real.md").write_text("# real\n")
    page = tmp_path / "README.md"
    found = dated(text, "README.md") + issue_numbers(text, "README.md") + broken_links(text, page, tmp_path)
    assert found == [
        "README.md:1: date '2026-12-05'",
        "README.md:1: date 'Dec 5'",
        "README.md:1: clock time '12:28'",
        "README.md:1: clock time '12:55'",
        "README.md:1: issue number '#56'",
        "README.md:1: issue number 'issue 56'",
        "README.md:2: link to a missing file 'results/missing.md'",
    ]
    clean = "Ratios 1.05x at 2,048 tokens, lr 8e-3, p = 0.037, [x](real.md#part), a slice x[1:20], 3 Decks."
    assert dated(clean, "x") + issue_numbers(clean, "x") + broken_links(clean, page, tmp_path) == []
    source = '"""Module, written 2026-12-05."""\n\nx = 1  # timed at 09:51\ny = "2026-12-05 is data"\n'
    assert dated_python(source, "m.py") == ["m.py:1: date '2026-12-05'", "m.py:3: clock time '09:51'"]


def results_rows(text: str) -> list[list[str]]:
    """The rows of README's "Confirmed results" table, each a list of its cells."""
    section = text.split("### Confirmed results", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def unconfirmed_rows(text: str, results: Path) -> list[str]:
    """README's results rows whose report is not a confirmatory one: each row links ``results/NAME.md``
    whose ``NAME.json`` (a confirmation's summary, with its claim) exists and whose ledger entry is
    there (:func:`geoattn.experiments.report.check_confirmations`)."""
    from geoattn.experiments.report import check_confirmations

    problems = check_confirmations(results)
    for row in results_rows(text):
        links = re.findall(r"\]\((results/[^)]+\.md)\)", row[-1])
        summary = (results.parent / links[0]).with_suffix(".json") if links else None
        if summary is None or not summary.is_file() or "claim" not in summary.read_text():
            problems.append(f"README results row {row[0]!r} links no confirmatory report")
    return problems


def test_readme_results_come_from_confirmations():
    assert unconfirmed_rows((ROOT / "README.md").read_text(), ROOT / "results") == []


def test_a_results_row_without_a_confirmation_is_reported(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "explore.md").write_text("# an exploratory report\n")
    text = (
        "### Confirmed results\n\n| claim | data | effect | p | verdict | report |\n"
        "| --- | --- | --- | --- | --- | --- |\n"
        "| rt wins | x | 1 | 0.01 | confirmed | [explore](results/explore.md) |\n"
    )
    expected = ["README results row 'rt wins' links no confirmatory report"]
    assert unconfirmed_rows(text, tmp_path / "results") == expected
