"""What the documentation build generates, as plain functions (``docs/gen_pages.py`` calls them).

Nothing here is copied into the site by hand: the CLI reference comes from ``geoattn.cli.build_parser``,
the API pages from the package's modules, the set-up and results pages from README.md, BENCHMARKS.md
and ``results/``, the figures from the library's own plotting and kernels. The docstring audit is
what makes ``mkdocs build --strict`` fail on a public name without a docstring.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterable
from pathlib import Path

# ---------------------------------------------------------------------------------------------------
# Markdown taken from the repository's own files


def markdown_section(text: str, heading: str) -> str:
    """The section of ``text`` under the ``## heading`` line, up to the next ``## `` heading
    (subsections included); ValueError naming the heading when there is none."""
    lines = text.splitlines()
    try:
        start = lines.index(f"## {heading}")
    except ValueError:
        raise ValueError(f"no section '## {heading}'") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end]).strip() + "\n"


def markdown_intro(text: str) -> str:
    """Everything before the first ``## `` heading (the title and the opening paragraphs)."""
    head = text.split("\n## ", 1)[0]
    return head.strip() + "\n"


def shift_headings(markdown: str, by: int) -> str:
    """Every ATX heading outside code fences ``by`` levels deeper (``##`` → ``###`` for ``by=1``)."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            line = "#" * by + line
        out.append(line)
    return "\n".join(out) + "\n"


def results_page_links(report_names: Iterable[str], probe_names: Iterable[str] = ()) -> dict[str, str]:
    """Link targets of README's Results section → the results page's (``results/index.md``): the
    reports ``results/NAME.md`` sit beside it under ``experiments/``, the probes' ``results/probes/NAME.md``
    under ``probes/``, the pages ``docs/results/PAGE.md`` beside it, BENCHMARKS.md as ``benchmarks.md``."""
    reports = {f"results/{name}": f"experiments/{name}" for name in report_names}
    probes = {f"results/probes/{name}": f"probes/{name}" for name in probe_names}
    pages = {f"docs/results/{p.name}": p.name for p in (Path(__file__).parent / "results").glob("*.md")}
    return {"BENCHMARKS.md": "benchmarks.md", **reports, **probes, **pages}


# Pages the site build writes (docs/gen_pages.py), relative to docs/: a docs page may link them.
GENERATED = ("index.md", "usage.md", "cli.md", "results/index.md", "results/benchmarks.md")
GENERATED_FOLDERS = ("results/experiments/", "results/probes/", "reference/", "concepts/figures/")


def is_generated(page: str) -> bool:
    """Whether ``page`` (a path relative to docs/) is one the site build writes, not a file in docs/."""
    return page in GENERATED or page.startswith(GENERATED_FOLDERS)


def rewrite_links(markdown: str, targets: dict[str, str]) -> str:
    """Replace link targets ``](old)`` by ``](new)`` (and ``](old#anchor)`` by ``](new#anchor)``) for
    each ``old -> new`` of ``targets``."""
    for old, new in targets.items():
        markdown = markdown.replace(f"]({old})", f"]({new})").replace(f"]({old}#", f"]({new}#")
    return markdown


# ---------------------------------------------------------------------------------------------------
# Maths: LaTeX between dollars becomes MathML, which browsers render without scripts or fonts

_CODE = re.compile(r"(^```.*?^```[ \t]*$|`[^`\n]+`)", re.S | re.M)
_DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE = re.compile(r"(?<![\\$\w])\$(?=\S)([^$\n]+?)(?<=\S)\$(?![\w$])")


def latex_to_mathml(markdown: str) -> str:
    """``$$ … $$`` (display) and ``$ … $`` (inline) LaTeX as MathML; code spans and fences untouched.

    An inline formula starts with a non-space after ``$`` and ends with one before ``$`` (pandoc's
    rule), so prices and shell variables in prose stay text.
    """
    from latex2mathml.converter import convert

    # Python-Markdown takes a line that starts with <math> for a raw HTML block, so formulas go in a
    # <span> (inside a paragraph) or their own <div> block
    def display(match: re.Match) -> str:
        return '\n\n<div class="math">' + convert(match.group(1).strip(), display="block") + "</div>\n\n"

    def inline(match: re.Match) -> str:
        return '<span class="math">' + convert(match.group(1)) + "</span>"

    parts = _CODE.split(markdown)
    for i in range(0, len(parts), 2):  # even parts are outside code
        parts[i] = _INLINE.sub(inline, _DISPLAY.sub(display, parts[i]))
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------
# Sphinx roles in docstrings (:class:`~geoattn.x.Y`) as cross-references

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")


def sphinx_roles_to_autorefs(html: str) -> str:
    """Rendered docstrings write Sphinx roles; turn each into an mkdocs-autorefs reference.

    A full ``geoattn.`` path must resolve (a broken one fails the strict build); a short name
    (``:class:`RunDirectory```) links when autorefs knows it and stays code otherwise. ``~`` shows
    the last component only, as in Sphinx.
    """

    def ref(match: re.Match) -> str:
        tilde, target = match.groups()
        title = target.rsplit(".", 1)[-1] if tilde else target
        optional = "" if target.startswith("geoattn.") else " optional"
        return f'<autoref identifier="{target}"{optional}><code>{title}</code></autoref>'

    return _ROLE.sub(ref, html)


# ---------------------------------------------------------------------------------------------------
# The command-line reference, from the argparse definitions


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        if action.metavar is not None and not action.option_strings:
            name = f"`{action.metavar}`"
        default = "" if action.default in (None, argparse.SUPPRESS, False, []) else f"`{action.default}`"
        if action.required or not action.option_strings:
            default = "(required)"
        rows.append(f"| {name} | {_cell(action.help or '')} | {_cell(default)} |")
    if not rows:
        return []
    return ["| argument | what | default |", "| --- | --- | --- |", *rows, ""]


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """Markdown for every command and subcommand of ``parser``: description, usage, arguments."""
    lines = [
        "# Command line",
        "",
        "Generated from the argparse definitions (`geoattn.cli.build_parser`) at every build;",
        "`geoattn COMMAND --help` prints the same.",
        "",
    ]

    def visit(p: argparse.ArgumentParser, depth: int) -> None:
        lines.extend([f"{'#' * depth} `{p.prog}`", ""])
        if p.description:
            lines.extend([p.description.strip(), ""])
        lines.extend(["```text", p.format_usage().strip(), "```", ""])
        lines.extend(_options_table(p))
        for child in _subcommands(p).values():
            visit(child, min(depth + 1, 4))

    visit(parser, 2)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Public modules and the docstring audit

EXCLUDED_MODULES = ("geoattn.cli", "geoattn.__main__")  # the CLI has its own page


def public_modules(package: str = "geoattn") -> list[str]:
    """Dotted names of the package and every module under it without a ``_``-prefixed part."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        if any(part.startswith("_") for part in info.name.split(".")) or info.name in EXCLUDED_MODULES:
            continue
        names.append(info.name)
    return sorted(names)


def _defined_here(module, name: str, obj: object) -> bool:
    return getattr(obj, "__module__", None) == module.__name__ and (
        inspect.isclass(obj) or inspect.isfunction(obj)
    )


def public_names(module) -> list[tuple[str, object]]:
    """The module's public classes and functions: ``__all__`` where it has one, else every name
    without a leading ``_`` that is defined in the module (not imported)."""
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    return [(n, getattr(module, n)) for n in names if _defined_here(module, n, getattr(module, n, None))]


def _own_doc(obj: object) -> str | None:
    target = obj.fget if isinstance(obj, property) else obj
    return getattr(target, "__doc__", None)


def missing_docstrings(modules: Iterable[str]) -> list[str]:
    """Public names without a docstring: modules, their public classes and functions, and the public
    methods and properties of those classes that do not override a base class's (an override is
    documented where it is declared, e.g. ``nn.Module.forward``)."""
    missing = []
    for dotted in modules:
        module = importlib.import_module(dotted)
        if not (module.__doc__ or "").strip():
            missing.append(dotted)
        for name, obj in public_names(module):
            path = f"{dotted}.{name}"
            if not (obj.__doc__ or "").strip():
                missing.append(path)
            if not inspect.isclass(obj):
                continue
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                    continue
                if any(attr in vars(base) for base in obj.__mro__[1:]):
                    continue
                if not (_own_doc(member) or "").strip():
                    missing.append(f"{path}.{attr}")
    return missing


def read_name_list(path: Path) -> set[str]:
    """Names in a text file, one a line; ``#`` starts a comment."""
    if not path.exists():
        return set()
    return {line.split("#", 1)[0].strip() for line in path.read_text().splitlines()} - {""}


# ---------------------------------------------------------------------------------------------------
# Figures: drawn with the library's own plots and kernels (at build time, never committed)


def figure_rt_precision(path: Path) -> Path:
    """``geoattn.training.plots.rt_precision`` for four heads from "no recency decay" to "fast decay"."""
    import torch

    from geoattn.training import plots

    params = {
        "mu_r": torch.tensor([0.0, 0.01, 0.05, 0.2]),
        "sigma_t2": torch.tensor([0.0, 0.02, 0.05, 0.1]),
        "eta_t2": torch.tensor([0.5, 0.5, 0.5, 0.5]),
    }
    return plots.rt_precision(params, path)


def figure_rt_attention(path: Path) -> Path:
    """``plots.attention_map`` of ``rt_attention``'s weights on a sequence whose key magnitudes vary."""
    import torch

    from geoattn.attention import rt_attention
    from geoattn.training import plots

    g = torch.Generator().manual_seed(0)
    N, D = 48, 16
    direction = torch.randn(D, generator=g)
    q = direction + 0.3 * torch.randn(1, 1, N, D, generator=g)
    k = direction + 0.3 * torch.randn(1, 1, N, D, generator=g)
    k = k * torch.linspace(0.3, 3.0, N).roll(N // 3)[None, None, :, None]  # confident and unsure keys
    v = torch.randn(1, 1, N, D, generator=g)
    one = torch.ones(1)
    _, weights = rt_attention(
        q, k, v, mu_r=0.05 * one, sigma_t2=0.05 * one, eta_t2=one, beta=one,
        backend="reference", return_weights=True,
    )  # fmt: skip
    return plots.attention_map(weights[0, 0], path)


def figure_rt_sde(path: Path) -> Path:
    """Monte Carlo of the RT-SDE (``RTSDE.simulate``) against ``RTSDE.angular_variance`` over Δt."""
    import torch

    from geoattn.algebra import rotate_pairs
    from geoattn.rt import RTSDE
    from geoattn.training.plots import pyplot, save_figure

    dim, paths, m0 = 8, 1500, 2.0
    omega = torch.linspace(0.2, 1.5, dim // 2, dtype=torch.float64)
    sde = RTSDE(dim=dim, mu_r=0.3, mu_t=0.3, sigma_r=0.02, sigma_t=0.05, eta_r=0.05, eta_t=0.05, omega=omega)
    lags = torch.tensor([0.25, 0.5, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64)
    times = torch.cat([torch.zeros(1, dtype=torch.float64), lags])
    sample = sde.simulate(times, paths, m0=m0, generator=torch.Generator().manual_seed(0))
    unit = sample.z[:, 0] / sample.z[:, 0].norm(dim=-1, keepdim=True)
    mc = []
    for i, lag in enumerate(lags.tolist(), start=1):
        predicted = rotate_pairs(unit, omega * lag)
        u = sample.x[:, i] / sample.x[:, i].norm(dim=-1, keepdim=True)
        tangent = predicted - (predicted * u).sum(-1, keepdim=True) * u
        mc.append(float((tangent.square().sum(-1) / (dim - 1)).mean()))
    dense = torch.linspace(0.0, 3.0, 100, dtype=torch.float64)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        dense.numpy(),
        [float(sde.angular_variance(t, m0)) for t in dense.tolist()],
        label="closed form s²(Δt)",
    )
    ax.plot(lags.numpy(), mc, "o", label=f"Monte Carlo of eq. 3 ({paths} paths)")
    ax.set(
        xlabel="Δt", ylabel="angular variance per tangent dimension", title="RT-SDE: transported key noise"
    )
    ax.legend()
    return save_figure(fig, path)


def figure_head_types(path: Path) -> Path:
    """What each rotor head type does to a value vector: ``rotor_attention`` with one key (α = 1)."""
    import torch

    from geoattn.algebra import CliffordAlgebra
    from geoattn.attention import rotor_attention
    from geoattn.training.plots import pyplot, save_figure

    ga = CliffordAlgebra(3)
    a = torch.tensor([1.0, 0.2, 0.1], dtype=torch.float64)  # query direction
    b = torch.tensor([0.2, 1.0, 0.4], dtype=torch.float64)  # key direction
    v = torch.tensor([0.9, 0.1, 0.8], dtype=torch.float64)  # value vector
    heads = ("rotation", "reflection", "projection")
    outputs = {}
    for head in heads:
        out = rotor_attention(
            ga.vector(a)[None, None, None, None], ga.vector(b)[None, None, None, None],
            ga.vector(v)[None, None, None, None], algebra=ga, head_type=head, backend="reference",
        )  # fmt: skip
        outputs[head] = out[0, 0, 0, 0, 1:4]  # the vector part (e1, e2, e3)
    plt = pyplot()
    fig = plt.figure(figsize=(12, 4))
    unit = lambda x: x / x.norm()  # noqa: E731
    for i, head in enumerate(heads):
        ax = fig.add_subplot(1, 3, i + 1, projection="3d")
        for vec, label, color in (
            (unit(a), "query â", "tab:blue"),
            (unit(b), "key b̂", "tab:orange"),
            (v, "value v", "tab:gray"),
            (outputs[head], "output", "tab:red"),
        ):
            ax.quiver(0, 0, 0, *vec.tolist(), color=color, label=label, arrow_length_ratio=0.1)
        ax.set(xlim=(-1, 1), ylim=(-1, 1), zlim=(-1, 1), title=f"head_type={head!r}")
        ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path, dpi=100)


def figure_rotor_positions(path: Path) -> Path:
    """``RotorLM.plots``: what a rotor positional encoding does along a sequence (one layer, at init)."""
    import tempfile

    import torch

    from geoattn.models.rotor_lm import RotorLM, RotorLMConfig

    torch.manual_seed(0)
    config = RotorLMConfig(n_layer=1, channels=4, scalars=16, head_types=("rotation",) * 4, block_size=32)
    model = RotorLM(config)
    with tempfile.TemporaryDirectory() as tmp:
        (written,) = model.plots(Path(tmp))
        path.write_bytes(written.read_bytes())
    return path


FIGURES = {
    "rt_precision.png": figure_rt_precision,
    "rt_attention.png": figure_rt_attention,
    "rt_sde.png": figure_rt_sde,
    "head_types.png": figure_head_types,
    "rotor_positions.png": figure_rotor_positions,
}
