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

    base = recipe(named("task"), named("model"))
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
