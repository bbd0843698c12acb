"""The generated pages of the site (run by the mkdocs-gen-files plugin at every ``mkdocs build``).

Writes, into the build only (nothing is committed): the home and usage pages from README.md, the
CLI reference from the argparse definitions, one API page per public module, the results pages from
README.md, ``results/`` and BENCHMARKS.md, the concept figures, and the navigation (SUMMARY.md).
A public name without a docstring is logged as a warning, which ``--strict`` turns into a failure;
``docs/undocumented.txt`` lists the ones that predate the check (it may only shrink).
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import site_builder as sb  # noqa: E402

from geoattn.cli import build_parser  # noqa: E402

log = logging.getLogger("mkdocs.plugins.geoattn")
README = (ROOT / "README.md").read_text(encoding="utf-8")
# README links the docs pages as docs/PAGE.md; on the site they sit at the docs root.
DOCS_LINKS = {f"docs/{p.relative_to(ROOT / 'docs').as_posix()}": p.relative_to(ROOT / "docs").as_posix()
              for p in (ROOT / "docs").rglob("*.md")}
LINKS = {"BENCHMARKS.md": "results/benchmarks.md", **DOCS_LINKS}


def write(path: str, text: str) -> None:
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(text)


def write_bytes(path: str, data: bytes) -> None:
    with mkdocs_gen_files.open(path, "wb") as f:
        f.write(data)


# ------------------------------------------------------------------ home, usage, CLI --------------
home = sb.markdown_intro(README) + "\n" + sb.markdown_section(README, "Set-up: two commands")
write("index.md", sb.rewrite_links(home, LINKS))
usage = ["# Usage", ""]
extras = "Hugging Face, TensorBoard, a documentation site (optional extras)"
usage_sections = (
    "Use the layers",
    "What runs where",
    "The native build",
    "Bring your data",
    "Train, evaluate, sample, measure",
)
for heading in (*usage_sections, extras):
    usage.append(sb.markdown_section(README, heading))
write("usage.md", sb.rewrite_links("\n".join(usage), LINKS))
write("cli.md", sb.cli_reference(build_parser()))

# ------------------------------------------------------------------ API reference ----------------
modules = sb.public_modules("geoattn")
nav_api = []
for dotted in modules:
    parts = dotted.split(".")
    is_package = (ROOT / Path(*parts) / "__init__.py").exists()
    page = "reference/" + "/".join(parts) + ("/index.md" if is_package else ".md")
    write(page, f"::: {dotted}\n")
    nav_api.append(f"{'    ' * len(parts)}* [{parts[-1]}]({page})")

known = sb.read_name_list(ROOT / "docs/undocumented.txt")
missing = sb.missing_docstrings(modules)
for name in missing:
    if name not in known:
        log.warning(f"public name without a docstring: {name} (write one; see docs/about.md)")
for name in sorted(known - set(missing)):
    log.info(f"docs/undocumented.txt lists {name}, which is documented or gone: remove the line")

# ------------------------------------------------------------------ results and benchmarks -------
# The experiments a user reruns are results/NAME.md (site: results/experiments/), the probes
# results/probes/NAME.md (site: results/probes/, reached from the one index page docs/results/probes.md).
section = sb.markdown_section(README, "Results").split("\n", 1)[1]  # without its "## Results" line
reports = sorted((ROOT / "results").glob("*.md"))
probes = sorted((ROOT / "results" / "probes").glob("*.md"))
links = sb.results_page_links((p.name for p in reports), (p.name for p in probes))
section = sb.rewrite_links(section, links)
section = sb.rewrite_links(section, {old: f"../{new}" for old, new in DOCS_LINKS.items()})
write("results/index.md", "\n".join(["# Results", "", section]) + "\n")
for folder, pages in (("experiments", reports), ("probes", probes)):
    for report in pages:
        write(f"results/{folder}/{report.name}", report.read_text(encoding="utf-8"))
    for image in sorted(pages[0].parent.glob("*.png")) if pages else ():
        write_bytes(f"results/{folder}/{image.name}", image.read_bytes())
write("results/benchmarks.md", (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))

# ------------------------------------------------------------------ figures ----------------------
with tempfile.TemporaryDirectory() as tmp:
    for name, draw in sb.FIGURES.items():
        write_bytes(f"concepts/figures/{name}", draw(Path(tmp) / name).read_bytes())

# ------------------------------------------------------------------ navigation -------------------
nav = [
    "* [Home](index.md)",
    "* [Usage](usage.md)",
    "* [Bring your data](your-data.md)",
    "* Concepts",
    "    * [RT-Filter attention](concepts/rt-filter.md)",
    "    * [Rotors](concepts/rotors.md)",
    "    * [Rotor head types](concepts/head-types.md)",
    "* [Native CPU kernels](native.md)",
    "* [Hugging Face](hf.md)",
    "* [Tasks](tasks.md)",
    "* [Package layout](layout.md)",
    "* [Command line](cli.md)",
    "* API reference",
    *nav_api,
    "* [Results](results/index.md)",
    *[f"    * [{p.stem}](results/experiments/{p.name})" for p in reports],
    "    * [Exploratory findings](results/findings.md)",
    "    * [Probes](results/probes.md)",
    "    * [Benchmarks](results/benchmarks.md)",
    "* [About these docs](about.md)",
]
write("SUMMARY.md", "\n".join(nav) + "\n")
