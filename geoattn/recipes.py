"""A run's config with its model's recipe below it: the defaults of ``geoattn train --task T --model M``.

Each task keeps the best settings measured for its models (``Task.recipes``: model name → config
fields); this module layers them between :class:`~geoattn.training.config.TrainConfig`'s defaults
and everything the user sets. It sits above both ``tasks`` and ``training``, where the command line,
the experiments and the benches build their configs.
"""

from __future__ import annotations

from typing import Any

from geoattn.tasks import task_class
from geoattn.training.config import TrainConfig, merge


def recipe(task: str, model: str) -> dict[str, Any]:
    """The config fields of ``model``'s recipe on ``task`` (empty when it has none); ConfigError on
    an unknown task."""
    return dict(task_class(task).recipes.get(model, {}))


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """The TrainConfig of a run: the task's recipe for the model, then ``layers`` (lowest first: a
    saved config, TOML, ``--set``, flags). The task and model are those the layers name."""
    probe = merge({}, *layers)
    return merge(recipe(probe.task, probe.model), *layers)
