"""The package's layering (docs/layout.md): imports point one way, down, and no two top-level parts of
the package import each other.

Read from the source with ``ast`` (module-level and function-level imports alike, relative ones
resolved), so an import inside a function that only runs on a rare path counts as much as one at the
top of a file.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "geoattn"

# Each top-level module or subpackage of geoattn and its layer, lowest first; an import may point to
# its own layer or below. docs/layout.md draws the same table.
LAYERS: dict[str, int] = {
    # 0: helpers with no geoattn imports above core.errors, shared by every layer: errors, settings,
    # extras, formatting, compile, subnormals, cache
    "core": 0,
    # 1: the C++ CPU kernels, their build and their gradients' torch forms
    "native": 1,
    # 2: pure maths
    "algebra": 2,
    # 3: functional kernels
    "rt": 3,
    "attention": 3,
    # 4-5: modules, whole networks
    "layers": 4,
    "models": 5,
    # 6-7: data and metrics per task, the one trainer and the recipes under its configs
    "tasks": 6,
    "training": 7,
    # 8: what builds on a trained run: measurements, export
    "bench": 8,
    "hf": 8,
    # 9: resumable grids of runs and their reports
    "experiments": 9,
    # 10: the command and the quickstart
    "cli": 10,
    "__main__": 10,
}

# Arrows up that exist today, each to be removed by its file's owner; the list may only shrink.
KNOWN_UP: set[tuple[str, str]] = set()


def _module_name(path: Path, root: Path) -> list[str]:
    parts = [p.removesuffix(".py") for p in path.relative_to(root.parent).parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(root: Path) -> list[tuple[str, int, str]]:
    """Every import of a geoattn module inside the package at ``root``: (file relative to root's parent,
    line, imported dotted name), ``from a import b`` giving ``a.b`` (``b`` may be a module)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        here = _module_name(path, root)
        package = here if path.name == "__init__.py" else here[:-1]
        rel = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            found += [(rel, node.lineno, name) for name in names if name.split(".")[0] == root.name]
    return found


def _top(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else None


def _imported_module(dotted: str) -> str:
    """``a.b.c`` of ``from a.b import c`` where ``c`` is a name in ``a.b``: the known-arrow key is the
    module, so drop a trailing name that is not a module or package of the tree."""
    parts = dotted.split(".")
    path = PACKAGE.parent.joinpath(*parts)
    return dotted if path.with_suffix(".py").is_file() or path.is_dir() else ".".join(parts[:-1])


def arrows_up(
    found: list[tuple[str, int, str]], layers: dict[str, int], known: set[tuple[str, str]]
) -> list[str]:
    """Each import from a lower layer to a higher one that ``known`` does not list, as "file:line → name"."""
    bad = []
    for rel, line, name in found:
        source, target = Path(rel).parts[1].removesuffix(".py"), _top(name)
        if target is None or target == source:
            continue
        if layers[target] > layers[source] and (rel, _imported_module(name)) not in known:
            levels = f"{source}, layer {layers[source]} → {target}, layer {layers[target]}"
            bad.append(f"{rel}:{line} → {name} ({levels})")
    return bad


def cycles(found: list[tuple[str, int, str]], known: set[tuple[str, str]]) -> list[list[str]]:
    """The groups of top-level parts that import one another (strongly connected, more than one)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for rel, _, name in found:
        source, target = Path(rel).parts[1].removesuffix(".py"), _top(name)
        if target and target != source and (rel, _imported_module(name)) not in known:
            graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in list(graph):
        if node not in index:
            visit(node)
    return groups


FOUND = imports(PACKAGE)


def test_every_top_level_part_has_a_layer():
    parts = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    }
    parts.discard("__init__")
    assert parts - set(LAYERS) == set(), "give each a row of LAYERS (and of docs/layout.md)"
    assert set(LAYERS) - parts == set(), "LAYERS names a part the package no longer has"


def layout_table(text: str) -> dict[str, int]:
    """Part → layer as docs/layout.md's table draws them (`cli/` and `cli` alike)."""
    drawn: dict[str, int] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for part in re.findall(r"`([^`]+)`", cells[1]):
                drawn[part.removesuffix("/").removesuffix(".py")] = int(cells[0])
    return drawn


def test_the_layout_page_draws_the_layers_as_the_code_has_them():
    assert layout_table((ROOT / "docs" / "layout.md").read_text()) == LAYERS


def test_the_layout_check_catches_a_part_on_the_wrong_layer():
    text = "| layer | parts |\n| --- | --- |\n| 3 | `rt/`, `attention/` |\n| 2 | `algebra/` |\n"
    assert layout_table(text) == {"rt": 3, "attention": 3, "algebra": 2}
    assert layout_table(text.replace("| 2 |", "| 4 |"))["algebra"] == 4


def test_no_loose_modules_at_the_top():
    """The package's top level holds folders only, beside its entry points."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_imports_point_down():
    assert len(FOUND) > 200  # the walk sees the package's imports, function-level ones included
    assert arrows_up(FOUND, LAYERS, KNOWN_UP) == []


def test_no_cycle_between_top_level_parts():
    assert cycles(FOUND, KNOWN_UP) == []


def test_known_arrows_up_only_shrink():
    assert len(KNOWN_UP) <= 1


def test_the_checks_catch_a_planted_arrow_up_and_a_cycle(tmp_path):
    """A fake package: a function-level relative import up from ``low`` and a module-level one back."""
    pkg = tmp_path / "geoattn"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("def f():\n    from ..high import thing\n    return thing\n")
    (pkg / "high" / "__init__.py").write_text("from geoattn.low import f\nthing = 1\n")
    found = imports(pkg)
    assert ("geoattn/low/__init__.py", 2, "geoattn.high.thing") in found
    layers = {"low": 0, "high": 1}
    (line,) = arrows_up(found, layers, set())
    assert line.startswith("geoattn/low/__init__.py:2 → geoattn.high.thing")
    assert cycles(found, set()) == [["high", "low"]]


@pytest.mark.parametrize("variable", ["GEOATTN_CACHE", "XDG_CACHE_HOME", None])
def test_one_cache_folder_for_the_native_builds_and_the_tasks(monkeypatch, tmp_path, variable):
    """The native builds and the tasks' files resolve the cache folder through one function."""
    from geoattn import native
    from geoattn.core.cache import cache_dir
    from geoattn.tasks.lm import datasets

    monkeypatch.delenv("GEOATTN_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if variable:
        monkeypatch.setenv(variable, str(tmp_path / "set"))
    expected = {
        "GEOATTN_CACHE": tmp_path / "set",
        "XDG_CACHE_HOME": tmp_path / "set" / "geoattn",
        None: tmp_path / "home" / ".cache" / "geoattn",
    }[variable]
    assert cache_dir() == expected
    assert native.cache_root() == expected / "native"
    assert datasets.cache_dir is cache_dir
