"""The documentation build's generators (docs/site_builder.py); `make test` runs the full strict build.

Checked here: the CLI reference covers every command and flag of the parser, the docstring audit
finds what it should and nothing else, maths becomes MathML outside code only, Sphinx roles become
cross-references (required for full geoattn paths), and the README sections the site pulls exist.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import site_builder as sb  # noqa: E402

from geoattn.cli import build_parser  # noqa: E402


def _walk(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _walk(child)


def test_cli_reference_lists_every_command_and_flag():
    parser = build_parser()
    page = sb.cli_reference(parser)
    parsers = list(_walk(parser))
    assert len(parsers) > 10
    for p in parsers:
        assert f"`{p.prog}`" in page, p.prog
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in page, (p.prog, flag)


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package with documented, undocumented, overriding and imported names."""
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A fake package."""\n')
    (pkg / "mod.py").write_text(
        textwrap.dedent(
            '''
            """A module."""
            from json import dumps  # imported: not this module's name

            class Base:
                """Documented base."""

                def run(self):
                    """Run."""

            class Child(Base):
                """Documented child."""

                def run(self):  # an override: documented at Base.run
                    pass

                def extra(self):
                    pass

                @property
                def size(self):
                    return 1

                def _private(self):
                    pass

            def documented():
                """Yes."""

            def bare():
                pass

            def _hidden():
                pass
            '''
        )
    )
    (pkg / "listed.py").write_text(
        '__all__ = ["shown"]\n\ndef shown():\n    pass\n\ndef unlisted():\n    pass\n'
    )
    (pkg / "nodoc.py").write_text("def f():\n    '''F.'''\n")
    (pkg / "_private.py").write_text("def g():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakepkg"
    for name in [m for m in sys.modules if m.startswith("fakepkg")]:
        del sys.modules[name]


def test_docstring_audit(fake_package):
    modules = sb.public_modules(fake_package)
    assert modules == ["fakepkg", "fakepkg.listed", "fakepkg.mod", "fakepkg.nodoc"]
    missing = sb.missing_docstrings(modules)
    assert sorted(missing) == [
        "fakepkg.listed",
        "fakepkg.listed.shown",  # __all__ decides what is public
        "fakepkg.mod.Child.extra",
        "fakepkg.mod.Child.size",
        "fakepkg.mod.bare",
        "fakepkg.nodoc",
    ]


def test_maths_become_mathml_outside_code():
    text = "Energy $E = mc^2$ costs $5 and $6.\n\n`$x$` stays\n\n"
    text += "```bash\necho $HOME $x$\n```\n\n$$\\kappa_{ij}$$\n"
    html = sb.latex_to_mathml(text)
    assert html.count("<math") == 2
    assert '<span class="math"><math' in html and '<div class="math"><math' in html
    assert "costs $5 and $6." in html
    assert "`$x$` stays" in html and "echo $HOME $x$" in html


def test_sphinx_roles_become_references():
    html = "see :class:<code>~geoattn.models.base.TaskModel</code> and :meth:<code>RunDirectory.plot</code>"
    out = sb.sphinx_roles_to_autorefs(html)
    assert '<autoref identifier="geoattn.models.base.TaskModel"><code>TaskModel</code></autoref>' in out
    assert '<autoref identifier="RunDirectory.plot" optional><code>RunDirectory.plot</code></autoref>' in out


def test_readme_sections_the_site_pulls_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    extras = "Hugging Face, TensorBoard, a documentation site (optional extras)"
    headings = (
        "Set-up: two commands",
        "Use the layers",
        "Train, evaluate, sample, measure",
        extras,
        "Results",
    )
    for heading in headings:
        section = sb.markdown_section(readme, heading)
        assert section.startswith(f"## {heading}\n") and "\n## " not in section
    with pytest.raises(ValueError, match="no section"):
        sb.markdown_section(readme, "No such heading")


def test_site_output_is_ignored_by_git():
    assert "site/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "site_dir: site" in (ROOT / "mkdocs.yml").read_text()


def test_make_builds_the_docs_strictly_in_make_test():
    """`--quiet` would drop the warnings that `--strict` counts, so the build must not pass it."""
    makefile = (ROOT / "Makefile").read_text()
    (line,) = [x for x in makefile.splitlines() if x.startswith("MKDOCS :=")]
    assert "mkdocs build --strict" in line and "--quiet" not in line and " -q" not in line
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "$(MKDOCS)" in test_recipe


def test_readmes_result_links_resolve_on_the_results_page():
    """README links reports as results/NAME.md; on the site's results page (results/index.md) they
    must become experiments/NAME.md, each an existing report (a broken link fails the strict build)."""
    import re

    section = sb.markdown_section((ROOT / "README.md").read_text(encoding="utf-8"), "Results")
    reports = sorted(p.name for p in (ROOT / "results").glob("*.md"))
    page = sb.rewrite_links(section, sb.results_page_links(reports))
    targets = re.findall(r"\]\(([^)#]+)", page)
    assert targets and not [t for t in targets if t.startswith("results/")]
    for target in targets:
        if target.startswith("experiments/"):
            assert target.removeprefix("experiments/") in reports, target


def test_rewrite_links_keeps_anchors():
    text = "see [a](docs/tasks.md#series) and [b](docs/tasks.md)"
    out = sb.rewrite_links(text, {"docs/tasks.md": "tasks.md"})
    assert out == "see [a](tasks.md#series) and [b](tasks.md)"


_ITEM = re.compile(r"(?:[*-]|\d+\.) ")


def lists_read_as_paragraphs(text: str, where: str) -> list[str]:
    """Each list item that starts directly under a paragraph line: Markdown (Python-Markdown, the
    site's) needs a blank line before a list, or the items join the paragraph as plain text. A list
    lasts across blank lines while what follows is indented (an item's continuation) or display maths."""
    found, fenced, in_list, previous = [], False, False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced, in_list, previous = not fenced, False, line
            continue
        if fenced:
            continue
        if _ITEM.match(line):
            paragraph = previous.strip() and not previous.startswith((" ", "#", "|", "<"))
            if paragraph and not in_list:
                found.append(f"{where}:{number}: a list item directly under a paragraph: {line[:40]!r}")
            in_list = True
        elif line.strip() and not previous.strip() and not line.startswith((" ", "$$")):
            in_list = False
        previous = line
    return found


def test_no_list_reads_as_a_paragraph():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        found += lists_read_as_paragraphs(page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix())
    assert found == []


def test_a_list_under_a_paragraph_is_caught():
    text = "In short:\n* one\n* two\n\nSteps:\n\n1. first\n   still first\n2. second\n\n## Heading\n- fine\n"
    text += "```\nIn code:\n* not a list\n```\nAnd\n1. numbered\n"
    assert lists_read_as_paragraphs(text, "x.md") == [
        "x.md:2: a list item directly under a paragraph: '* one'",
        "x.md:18: a list item directly under a paragraph: '1. numbered'",
    ]
