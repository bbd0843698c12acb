"""Every model of a task is a row of its task's table: no branch on a model's name outside a table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from geoattn.tasks import TASKS, task_class
from geoattn.tasks.base import ModelRow

PACKAGE = Path(__file__).resolve().parents[1] / "geoattn"


def model_branches(source: str) -> list[int]:
    """Line numbers of comparisons of a name ``model`` (or ``*.model``) with ``==``, ``!=`` or ``in``
    a literal: the if-chain a table row replaces."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        named = (isinstance(left, ast.Name) and left.id == "model") or (
            isinstance(left, ast.Attribute) and left.attr == "model"
        )
        literal = all(isinstance(c, ast.Constant | ast.Tuple | ast.List | ast.Set) for c in node.comparators)
        branching = all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops)
        if named and literal and branching:
            lines.append(node.lineno)
    return lines


def test_the_checker_finds_a_planted_branch():
    assert model_branches('if model == "rotor":\n    pass\n') == [1]
    assert model_branches('x = config.model in ("a", "b")\n') == [1]
    assert model_branches("if model in TABLE:\n    pass\n") == []


@pytest.mark.parametrize("folder", ["tasks", "models"])
def test_no_model_branch(folder):
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for line in model_branches(path.read_text())
    ]
    assert not found, f"a model's name branched on outside its task's table: {found}"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_derives_its_models_from_one_table(name):
    cls = task_class(name)
    assert cls.table, f"the {name} task has no model table"
    assert all(isinstance(row, ModelRow) for row in cls.table.values())
    assert list(cls.models) == list(cls.table)
    assert set(cls.recipes) <= set(cls.table)
    assert cls.compile_wins == {m for m, row in cls.table.items() if row.compiles}
    for model, row in cls.table.items():
        assert cls.model_settings(model) == (row.config, row.fixed)


@pytest.mark.parametrize("name", list(TASKS))
def test_a_run_that_names_no_model_gets_its_tasks_first_row(name):
    """``geoattn train --task T`` without ``--model`` runs a model the task has (molecule: rotor,
    series: rt), and its recipe; a named model still wins."""
    from geoattn.training.recipes import build_config

    cls = task_class(name)
    assert cls.default_model == next(iter(cls.table))
    config = build_config({"task": name})
    assert config.model == cls.default_model and config.model in cls.models
    assert config.lr == cls.recipes.get(cls.default_model, {}).get("lr", config.lr)
    other = list(cls.models)[-1]
    assert build_config({"task": name}, {"model": other}).model == other
