"""Loading a finished run (``geoattn eval`` / ``sample`` / ``export``) and its evaluation table."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from geoattn.core.errors import CheckpointError, ConfigError
from geoattn.models.base import TaskModel
from geoattn.tasks.base import EvalRow, Task
from geoattn.training.config import TrainConfig, merge
from geoattn.training.run_dir import RunDirectory
from geoattn.training.trainer import evaluate_model, run_model, run_task


@dataclass
class Run:
    """A trained run: its directory, config, task and model (weights loaded, eval mode)."""

    directory: RunDirectory
    config: TrainConfig
    task: Task
    model: TaskModel
    device: torch.device
    saved: dict[str, Any]  # config.json as written

    @property
    def out(self) -> Path:
        return self.directory.path


def load_run(
    out: str | Path,
    *,
    device: str | None = None,
    data: str | None = None,
    batch_size: int | None = None,
    eval_iters: int | None = None,
    load_data: bool = True,
    task_options: dict[str, Any] | None = None,
) -> Run:
    """Rebuild the model of the run in ``out`` from its config.json and load its weights.

    ``data`` evaluates on other data than the run's (lm: another text; nbody: another directory of
    GATr's files); ``task_options`` override the run's ``task.*`` settings (another draw of a generated
    task's data, e.g. the pointcloud task's ``seed``). Raises CheckpointError when the files are
    missing, corrupt, or do not match.
    """
    directory = RunDirectory(out)
    saved = directory.read_config()
    overrides = {
        k: v
        for k, v in {
            "device": device,
            "batch_size": batch_size,
            "eval_iters": eval_iters,
            "data": data,
        }.items()
        if v is not None
    }
    try:
        config = merge(saved["train"], overrides, {"task_options": task_options or {}})
    except TypeError as err:
        raise CheckpointError(
            f"{directory.file(RunDirectory.CONFIG)} does not hold a valid TrainConfig ({err})"
        ) from None
    heads = (saved.get("model") or {}).get("head_types")
    if heads is not None and "head_types" not in config.model_options:
        # a rotor run keeps the head types it was trained with, whatever today's default cycle
        config = replace(config, model_options={**config.model_options, "head_types": list(heads)})
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    task = run_task(config, meta=saved["task"], load_data=load_data)
    dev = torch.device(config.device)
    model = run_model(task, config).to(dev)
    directory.load_weights(model, dev)
    model.eval()
    return Run(directory, config, task, model, dev, saved)


def evaluation_rows(run: Run) -> list[EvalRow]:
    """The task's evaluation table of ``run`` (full-set metrics, batch estimates, baselines)."""

    def sampled() -> dict[str, float]:
        return evaluate_model(run.model, run.task, run.config, device=run.device)

    over = f"{run.config.eval_iters} batches of {run.config.batch_size}"
    return run.task.evaluation(run.model, run.device, sampled, over=over)
