"""The one trainer for every task and model: config, loop, run directory, DDP, plots, evaluation.

config.py       TrainConfig (typed; TOML, --set overrides, one command-line flag per field)
trainer.py      Trainer, evaluate_model, scheduled_lr, run_task / run_model (a config's task and network)
run_dir.py      RunDirectory: the run's files (checkpoint, metrics, summary, plots) and report
distributed.py  torchrun / DDP set-up and deterministic teardown
evaluate.py     load_run, evaluation_rows (geoattn eval / sample)
plots.py        loss curves, attention map, RT precision (PNG)
"""

from geoattn.training.config import TrainConfig
from geoattn.training.run_dir import RunDirectory
from geoattn.training.trainer import Trainer, evaluate_model, run_model, run_task, scheduled_lr

__all__ = [
    "TrainConfig",
    "Trainer",
    "RunDirectory",
    "scheduled_lr",
    "evaluate_model",
    "run_task",
    "run_model",
]
