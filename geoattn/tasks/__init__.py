"""Tasks: data, models and metrics behind one contract (:class:`geoattn.tasks.base.Task`).

``TASKS`` maps each ``--task`` name to the class that implements it (imported on use, so ``lm``
works without the simulators' imports). Adding a task: one module with a ``Task`` subclass and
one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from geoattn.core.errors import ConfigError
from geoattn.tasks.base import EvalRow, Task

TASKS = {
    "lm": "geoattn.tasks.lm.task:LMTask",
    "filter": "geoattn.tasks.filter.task:FilterTask",
    "nbody": "geoattn.tasks.nbody.task:NBodyTask",
    "molecule": "geoattn.tasks.molecule.task:MoleculeTask",
    "pointcloud": "geoattn.tasks.pointcloud.task:PointCloudTask",
    "series": "geoattn.tasks.series.task:SeriesTask",
}


def task_class(name: str) -> type[Task]:
    """The :class:`Task` subclass registered as ``name``; ConfigError listing the valid names."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_task(
    name: str,
    options: dict[str, Any] | None = None,
    *,
    data: str | None = None,
    block_size: int,
    meta: dict[str, Any] | None = None,
    load_data: bool = True,
) -> Task:
    """The task ``name`` with its ``task.*`` ``options`` (see :meth:`Task.from_options`)."""
    return task_class(name).from_options(
        options, data=data, block_size=block_size, meta=meta, load_data=load_data
    )


__all__ = ["TASKS", "Task", "EvalRow", "task_class", "get_task"]
