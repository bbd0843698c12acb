"""MkDocs hooks of the geoattn site: LaTeX maths as MathML, Sphinx roles in docstrings as links."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from site_builder import latex_to_mathml, sphinx_roles_to_autorefs  # noqa: E402


def on_page_markdown(markdown: str, **kwargs) -> str:
    """``$…$`` and ``$$…$$`` become MathML before Markdown runs (code spans and fences untouched)."""
    return latex_to_mathml(markdown)


def on_page_content(html: str, **kwargs) -> str:
    """``:class:`~geoattn.x.Y``` in rendered docstrings becomes a cross-reference (resolved by autorefs)."""
    return sphinx_roles_to_autorefs(html)


def on_files(files, **kwargs):
    """The generated navigation file (literate-nav reads it) is not a page of its own."""
    from mkdocs.structure.files import InclusionLevel

    summary = files.get_file_from_path("SUMMARY.md")
    if summary is not None:
        summary.inclusion = InclusionLevel.EXCLUDED
    return files
