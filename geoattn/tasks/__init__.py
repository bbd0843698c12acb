"""Tasks: data, model construction and metrics behind one contract (``geoattn.tasks.base.Task``).

``get_task(name, ...)`` builds a task from the trainer's settings; ``TASKS`` maps each ``--task``
name to its module (imported on use, so ``lm`` works without the simulators' imports).
"""

from __future__ import annotations

import importlib
from typing import Any

from geoattn.tasks.base import Task

TASKS = {
    "lm": ("geoattn.tasks.lm", "LMTask"),
    "filter": ("geoattn.tasks.filter", "FilterTask"),
    "nbody": ("geoattn.tasks.nbody", "NBodyTask"),
}


def task_class(name: str) -> type[Task]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    module, cls = TASKS[name]
    return getattr(importlib.import_module(module), cls)


def get_task(
    name: str,
    *,
    data: str | None = None,
    block_size: int = 64,
    options: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Task:
    """The task ``name`` for a run.

    Args:
        data: lm: a UTF-8 text file or a registered dataset name; nbody: an optional GATr-format
            directory; filter: unused (generated on the fly).
        block_size: lm context length; filter: the sequence length (``seq_len``) unless given in options.
        options: task-specific settings (``--set task.KEY=VALUE``), validated by the task.
        meta: a checkpoint's task meta data (lm: its vocabulary, so ids keep their meaning).
    """
    cls = task_class(name)
    options = dict(options or {})
    if name == "lm":
        from geoattn.tasks.data import resolve_data

        if options:
            raise ValueError(f"the lm task takes no task options, got {', '.join(sorted(options))}")
        if data is None and meta is None:
            raise ValueError(
                "the lm task needs --data FILE (a UTF-8 text file, or a dataset name: tinyshakespeare)"
            )
        path = None if data is None else resolve_data(data)
        return cls(path, block_size, vocab=None if meta is None else meta["vocab"])
    if name == "filter":
        options.setdefault("seq_len", block_size)
    return _configured(cls, name, data, options)


def _configured(cls: type[Task], name: str, data: str | None, options: dict[str, Any]) -> Task:
    """filter / nbody: ``cls(Config(**options))`` with the task's own config dataclass."""
    import dataclasses

    module = importlib.import_module(cls.__module__)
    config_cls = getattr(module, f"{cls.__name__.removesuffix('Task')}Config")
    valid = {f.name for f in dataclasses.fields(config_cls)}
    if data is not None:
        if "data" not in valid:
            raise ValueError(f"the {name} task generates its data; it takes no --data")
        options = {"data": data, **options}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(
            f"unknown {name} task option(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}"
        )
    return cls(config_cls(**options))
