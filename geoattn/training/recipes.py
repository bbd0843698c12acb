"""A run's config with its model's recipe below it: the defaults of ``geoattn train --task T --model M``.

Each task keeps the best settings measured for its models (``Task.recipes``: model name → config
fields); this module layers them between :class:`~geoattn.training.config.TrainConfig`'s defaults
and everything the user sets. It sits in ``training``, above ``tasks``, below the command line, the
experiments and the benches that build their configs with it.
"""

from __future__ import annotations

from typing import Any

from geoattn.tasks import task_class
from geoattn.training.config import TrainConfig, merge


def recipe(task: str, model: str) -> dict[str, Any]:
    """The config fields of ``model``'s recipe on ``task`` (empty when it has none); ConfigError on
    an unknown task."""
    return dict(task_class(task).recipes.get(model, {}))


Layers = tuple[dict[str, Any], ...]

# a recipe key's spelling (``model.KEY``, ``task.KEY`` or a run field) -> (option table or None, key)
_TABLES = {"model": "model_options", "task": "task_options"}


def _split(key: str) -> tuple[str | None, str]:
    head, _, rest = key.partition(".")
    return (_TABLES[head], rest) if rest and head in _TABLES else (None, key)


def _given(layers: Layers, key: str) -> list[Any]:
    """The values the layers give ``key`` (``model.KEY`` / ``task.KEY`` / a run field), lowest first."""
    table, name = _split(key)
    if table is None:
        return [layer[name] for layer in layers if name in layer]
    return [layer[table][name] for layer in layers if name in layer.get(table, {})]


def _followed(task: str, model: str, base: dict[str, Any], layers: Layers) -> dict[str, Any]:
    """``base`` with the recipe's defaults that follow an explicit choice of the layers: for each
    :class:`~geoattn.tasks.base.Follow` whose option the layers set to its value, its ``then`` values
    for the keys no layer sets (a key the user set stays theirs, and the model's own check speaks)."""
    cls = task_class(task)
    if model not in cls.table:
        return base
    out = {**base, **{t: dict(base.get(t, {})) for t in _TABLES.values()}}
    for follow in cls.table[model].recipe.follows:
        given = _given(layers, follow.option)
        if not given or given[-1] != follow.value:
            continue
        for key, value in follow.then.items():
            if _given(layers, key):
                continue
            table, name = _split(key)
            if table is None:
                out[name] = value
            else:
                out[table][name] = value
    return {k: v for k, v in out.items() if v or k not in _TABLES.values() or k in base}


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """The TrainConfig of a run: the task's recipe for the model, then ``layers`` (lowest first: a
    saved config, TOML, ``--set``, flags). The task and model are those the layers name.

    A recipe with a held rate (``hold_iters``) is a schedule of its own run length: in a run of another
    length the recipe's ``warmup_iters`` and ``hold_iters`` (each one a layer does not set) scale with
    it, so the warmup, the hold and the decay keep their shares of the run.
    """

    # the task and model only (a layer's settings may be valid only on top of the recipe, e.g. a
    # hold for the recipe's run length): the last layer that names each, else TrainConfig's default
    def named(key: str) -> str:
        given = [layer[key] for layer in layers if key in layer]
        return given[-1] if given else TrainConfig.__dataclass_fields__[key].default

    if not any("model" in layer for layer in layers):  # no --model: the task's own first choice
        layers = ({"model": task_class(named("task")).default_model}, *layers)

    base = _followed(named("task"), named("model"), recipe(named("task"), named("model")), layers)
    scaled = [k for k in ("warmup_iters", "hold_iters") if not any(k in layer for layer in layers)]
    if base.get("hold_iters") and scaled:
        length = base.get("lr_decay_iters") or base.get("max_iters") or named("max_iters")
        lengths = (lay[k] for lay in reversed(layers) for k in ("lr_decay_iters", "max_iters") if lay.get(k))
        run = int(next(lengths, length))
        if run != length:
            base = {**base, **{k: round(base.get(k, 0) * run / length) for k in scaled}}
            if "hold_iters" in scaled:  # rounding can leave no step to decay in a very short run
                given = [layer["warmup_iters"] for layer in layers if "warmup_iters" in layer]
                warmup = int(given[-1]) if given else base.get("warmup_iters", 0)
                base["hold_iters"] = max(0, min(base["hold_iters"], run - 1 - warmup))
    return merge(base, *layers)
