"""The one trainer for every task and model: config, loop, checkpoints, DDP, plots, evaluation.

config.py       TrainConfig (typed; TOML and --set overrides)
trainer.py      Trainer, evaluate_model, cosine_lr
checkpoint.py   model.safetensors + trainer_state.pt + config.json, atomic, checked on load
distributed.py  torchrun / DDP set-up and deterministic teardown
evaluate.py     load_run, length_extrapolation (geoattn eval / sample)
plots.py        loss curves, attention map, RT precision (PNG)
"""

from geoattn.training.config import TrainConfig
from geoattn.training.trainer import Trainer, cosine_lr, evaluate_model

__all__ = ["TrainConfig", "Trainer", "cosine_lr", "evaluate_model"]
