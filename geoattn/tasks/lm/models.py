"""The lm task's model table: every language model of ``geoattn.models.lm.LM_TABLE`` as a row,
with the lm task's recipe for it."""

from __future__ import annotations

from functools import partial
from typing import Any

from geoattn.models.base import ModelSizes, TaskModel
from geoattn.models.lm import LM_TABLE
from geoattn.tasks.base import ModelRow, Recipe

FIXED = ("vocab_size", "block_size")  # the task's: its vocabulary and its training context


def build(name: str, task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    """The language model ``name`` in its own config class, with the run's ``sizes``, ``model.*``
    ``options`` and the task's vocabulary and context (``task``: an ``LMTask``)."""
    row = LM_TABLE[name]
    fixed = dict(vocab_size=task.vocab_size, block_size=task.block_size)
    return row.lm(row.config.from_sizes(sizes, options, **fixed))


def lm_row(name: str, recipe: Recipe, *, compiles: bool = False) -> ModelRow:
    """The row of ``LM_TABLE[name]`` in the lm task, with the task's ``recipe``."""
    model = LM_TABLE[name]
    return ModelRow(model.config, partial(build, name), model.description, recipe, compiles, FIXED)


# Recipes: the learning rates chosen on the selection split by experiments/lm-lr.toml (the same grid
# 5e-4 … 8e-3 for every model, one seed; results/lm-lr.md); ALiBi (a transformer option) chose the
# transformer's 1e-3; rt and nGPT chose the grid's top rate.
# compiles: the models whose compiled step is faster than their eager one at the recipe
# (`geoattn bench lm --compile both`); rfa and the rotor LM are not. The transformer's eager step is as
# fast as its compiled one inside a whole run, so a fresh process does not pay the compile
# (`geoattn bench train --peer nanogpt --cache cold`, BENCHMARKS.md).
LM_TASK_TABLE: dict[str, ModelRow] = {
    "transformer": lm_row("transformer", Recipe({"lr": 1e-3})),
    "rt": lm_row("rt", Recipe({"lr": 8e-3}), compiles=True),
    "rfa": lm_row("rfa", Recipe({"lr": 2e-3})),
    "ngpt": lm_row("ngpt", Recipe({"lr": 8e-3}), compiles=True),
    "rotor": lm_row("rotor", Recipe({"lr": 4e-3})),
}
