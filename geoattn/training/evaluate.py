"""Loading a finished run for ``geoattn eval`` / ``geoattn sample``, and the length-extrapolation test."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from geoattn.tasks import get_task
from geoattn.tasks.base import Task
from geoattn.training import checkpoint as ckpt
from geoattn.training.config import TrainConfig, merge
from geoattn.training.trainer import evaluate_model

CONTEXT_MULTIPLES = (1, 2, 4, 8)


@dataclass
class Run:
    """A trained run: its config, task and model (weights loaded, eval mode)."""

    out: Path
    config: TrainConfig
    task: Task
    model: nn.Module
    device: torch.device
    saved: dict[str, Any]  # config.json as written


def load_run(
    out: Path,
    *,
    device: str | None = None,
    data: str | None = None,
    batch_size: int | None = None,
    eval_iters: int | None = None,
    need_data: bool = True,
) -> Run:
    """Rebuild the model of the run in ``out`` from its config.json and load its weights.

    Raises CheckpointError (a ValueError) when the files are missing, corrupt, or do not match.
    """
    saved = ckpt.read_config(out)
    overrides = {
        k: v
        for k, v in {"device": device, "batch_size": batch_size, "eval_iters": eval_iters}.items()
        if v is not None
    }
    try:
        config = merge(saved["train"], overrides)
    except TypeError as err:
        raise ckpt.CheckpointError(
            f"{out / ckpt.CONFIG_FILE} does not hold a valid TrainConfig ({err})"
        ) from None
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if config.task == "lm":
        text = (data or config.data) if need_data else None
        task = get_task("lm", data=text, block_size=config.block_size, meta=saved["task"])
    else:
        task = get_task(config.task, data=data or config.data, options=config.task_options)
    dev = torch.device(config.device)
    model = task.build_model(config.model, config).to(dev)
    ckpt.load_weights(out, model, dev)
    model.eval()
    return Run(out, config, task, model, dev, saved)


def evaluate_run(run: Run) -> dict[str, float]:
    """Losses and task metrics on the run's evaluation batches, the task's baselines, extra sets."""
    results = evaluate_model(run.model, run.task, run.config, device=run.device)
    results.update({f"baseline_{k}": v for k, v in run.task.baselines("val").items()})
    if hasattr(run.task, "evaluate_sets"):
        results.update(run.task.evaluate_sets(run.model))
    return results


@torch.no_grad()
def length_extrapolation(run: Run, multiples: tuple[int, ...] = CONTEXT_MULTIPLES) -> list[list[Any]]:
    """Rows ``[context, "k×", val loss or the reason it cannot be computed]`` for an lm run.

    Every row uses ``eval_iters`` batches of ``batch_size`` windows from the val split, drawn from
    the same seed. A model that cannot run past its training context (learned absolute positions)
    raises ValueError in forward; that message is the row's value.
    """
    rows = []
    for k in multiples:
        T = k * run.config.block_size
        generator = torch.Generator().manual_seed(run.config.seed + 2)
        try:
            total = 0.0
            for _ in range(run.config.eval_iters):
                x, y = run.task.get_batch("val", run.config.batch_size, generator, run.device, block_size=T)
                total += float(run.model(x, y)[1])
            value: Any = round(total / run.config.eval_iters, 4)
        except ValueError as err:
            value = f"n/a: {err}"
        rows.append([T, f"{k}×", value])
    return rows
