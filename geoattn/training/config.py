"""The training configuration: one typed dataclass, read from TOML and overridden from the command line.

Precedence, lowest first: the defaults below, the task's recipe for the model (``Task.recipes``: the
best settings measured for it), a checkpoint's saved config (``--resume``), a TOML file
(``--config``), ``--set key=value`` overrides, explicit command-line flags. This module knows no
task: :func:`geoattn.training.recipes.build_config` layers a task's recipe below the rest.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoattn.core.errors import ConfigError
from geoattn.core.settings import read_toml
from geoattn.models.base import ModelSizes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OPTION_TABLES = ("model_options", "task_options")



def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A TrainConfig field with its command-line help (flags are generated from these)."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Everything a run needs, saved as ``config.json`` next to every checkpoint.

    The defaults are nanoGPT's CPU shakespeare_char recipe (docs/tasks.md#lm): 4 layers × 4 heads × 128,
    context 64, batch 12, 2000 iterations, lr 1e-3. ``model_options`` and ``task_options`` are the
    ``--set model.KEY`` / ``task.KEY`` settings, checked by the model's and the task's own config
    classes (``geoattn train --task T --model M --list-settings`` lists them). Each field's help is
    the command line's: ``geoattn train`` has one flag per field (``--max-iters`` for ``max_iters``).
    """

    task: str = _opt("lm", "the task (see geoattn train --list-settings)")
    model: str = _opt("transformer", "the network (which ones a task supports varies)")
    data: str | None = _opt(
        None,
        "lm: a UTF-8 text file or a dataset name (geoattn data list); nbody: a directory of GATr's "
        "files (train.npz, val.npz, eval.npz, e3_generalization.npz, object_generalization.npz); "
        "filter: none (simulated)",
    )
    out: str | None = _opt(None, "run directory", flag=False)
    # model size (every model maps these onto its own config)
    n_layer: int = _opt(4, "layers (blocks)")
    n_head: int = _opt(4, "attention heads")
    n_embd: int = _opt(
        128,
        "model width; the nbody rotor model reads it as 8 numbers per multivector channel (n_embd/8 "
        "multivector and n_embd/8 scalar channels), the lm rotor model as n_embd/2^n multivector "
        "channels and n_embd scalars (override with --set model.channels / model.scalars)",
    )
    block_size: int = _opt(64, "lm context / filter sequence length")
    dropout: float = _opt(0.0, "dropout probability")
    model_options: dict[str, Any] = _opt({}, "model settings (--set model.KEY=VALUE)", flag=False)
    task_options: dict[str, Any] = _opt({}, "task settings (--set task.KEY=VALUE)", flag=False)
    # optimisation: AdamW, linear warmup then a decay to min_lr at lr_decay_iters
    max_iters: int = _opt(2000, "optimiser steps")
    batch_size: int = _opt(12, "global batch (split across DDP ranks)")
    lr: float = _opt(1e-3, "peak learning rate (default: the model's recipe, see --list-settings; else 1e-3)")
    min_lr: float | None = _opt(
        None, "learning rate at the end of the decay (default: lr/10 for cosine, lr/100 for exponential)"
    )
    lr_schedule: str = _opt(
        "cosine",
        "cosine (nanoGPT: warmup, cosine decay to min_lr) | exponential (GATr: warmup, then "
        "lr·(min_lr/lr)^progress)",
    )
    warmup_iters: int = _opt(100, "linear warmup steps")
    hold_iters: int = _opt(
        0, "steps held at lr after the warmup before the decay starts (warmup-stable-decay; CGENN holds 3/4)"
    )
    lr_decay_iters: int | None = _opt(None, "steps of the decay (default: max_iters)")
    weight_decay: float = _opt(0.1, "AdamW weight decay (matrices only unless the model says otherwise)")
    optimizer: str = _opt(
        "adamw",
        "adamw (decoupled weight decay) | adam (weight_decay as an L2 term in the gradient, as CGENN and "
        "EGNN train; over the same parameter groups)",
    )
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "gradient-norm clipping (0 disables)")
    # evaluation, logging, checkpoints
    eval_interval: int = _opt(250, "evaluate and checkpoint every N steps (and at the last)")
    eval_iters: int = _opt(20, "batches per split per evaluation")
    log_interval: int = _opt(1, "a metrics.jsonl line every N steps (and at every evaluation)")
    keep_best: bool = _opt(
        False,
        "keep the weights of the evaluation with the lowest validation loss (best.safetensors) and "
        "report the final metrics of those, the last model's beside them with the suffix _last "
        "(EGNN's protocol: the test set read at the evaluation validation chose)",
    )
    logger: str = _opt(
        "jsonl",
        "where metrics go: jsonl (metrics.jsonl, always written: resume and the report read it) | "
        "tensorboard (also event files in OUT/tensorboard/: the scalars, and the figures at each "
        "evaluation; needs geoattn[tensorboard]); comma-separated for several: jsonl,tensorboard",
    )
    plots: bool = _opt(True, "write PNG plots at the end", flag=False)
    read_test: bool = _opt(
        True,
        "read the task's test sets (Task.test_sets); an exploratory experiment's runs set it false: "
        "they seal those sets and compute no metric of them (validation only)",
        flag=False,
    )
    # runtime
    seed: int = _opt(1337, "seed for initialisation and data")
    device: str = _opt("cpu", "cpu | cuda")
    dtype: str = _opt("float32", "float32 | bfloat16 (autocast; bf16 keeps fp32's range: no loss scaling)")
    deterministic: bool = _opt(
        True,
        "deterministic algorithms while training (torch.use_deterministic_algorithms, warn-only): "
        "a seed gives the same run in every process; without it compiled rt runs drift apart (a "
        "fused scatter-add with atomic adds); measured at no cost in step time",
    )
    compile: bool | None = _opt(
        None,
        "torch.compile the model's blocks for training (same maths, fused kernels); default: on for "
        "the models whose compiled step measured faster (lm: rt, ngpt) when the run's steps win the "
        "compile back at its measured eager step (config.json's compiled.why), else off",
    )

    def __post_init__(self) -> None:
        positive = ("n_layer", "n_head", "n_embd", "block_size", "max_iters", "batch_size")
        positive += ("eval_interval", "eval_iters", "log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_iters", "hold_iters"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.hold_iters and self.warmup_iters + self.hold_iters >= self.decay_iters:
            raise ConfigError(
                f"warmup_iters + hold_iters ({self.warmup_iters} + {self.hold_iters}) must end before the "
                f"decay does (at {self.decay_iters} steps): set --hold-iters for this run's length"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}"
            )
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"need 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.lr_schedule == "exponential" and self.min_lr == 0:
            raise ConfigError("the exponential schedule needs min_lr > 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        from geoattn.training.loggers import parse_loggers  # the loggers' module owns their names

        parse_loggers(self.logger)

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.max_iters

    @property
    def final_lr(self) -> float:
        """``min_lr``, or its default for the schedule (lr/10 cosine, lr/100 exponential)."""
        if self.min_lr is not None:
            return self.min_lr
        return self.lr / (100.0 if self.lr_schedule == "exponential" else 10.0)

    @property
    def sizes(self) -> ModelSizes:
        """The size settings every model maps onto its own config."""
        return ModelSizes(self.n_layer, self.n_head, self.n_embd, self.block_size, self.dropout)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


LR_SCHEDULES = ("cosine", "exponential")
OPTIMIZERS = ("adamw", "adam")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _field_type(name: str) -> Any:
    hints = typing.get_type_hints(TrainConfig)
    return hints[name]


def coerce(name: str, value: Any) -> Any:
    """``value`` converted to the type of field ``name`` (strings from ``--set`` or JSON numbers)."""
    kind = _field_type(name)
    optional = False
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        optional, kind = len(args) < len(typing.get_args(kind)), args[0]
    if value is None or optional and isinstance(value, str) and value.lower() == "none":
        if optional:  # "none": a field's own default where a recipe set one (TOML has no null)
            return None
        raise ConfigError(f"{name} cannot be empty")
    origin = typing.get_origin(kind) or kind
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a table of options, got {value!r}")
        return dict(value)
    if origin is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if origin is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        return origin(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {origin.__name__}, got {value!r}") from None


def unknown_key_error(key: str, where: str) -> ConfigError:
    valid = ", ".join(sorted([*FIELDS, "model.KEY", "task.KEY"]))
    return ConfigError(
        f"unknown config key {key!r} in {where}; valid keys: {valid}; task and model settings take a "
        f"prefix (task.{key} or model.{key}; geoattn train --task T --model M --list-settings lists them)"
    )


def flatten_toml(table: dict[str, Any], where: str) -> dict[str, Any]:
    """TrainConfig fields from a TOML document; sections (``[optim]``, ``[model_size]``...) only group keys.

    ``[model_options]`` / ``[task_options]`` tables are kept whole. Unknown keys raise ValueError
    listing the valid ones.
    """
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if key in OPTION_TABLES:
            flat[key] = {**flat.get(key, {}), **coerce(key, value)}
        elif key in FIELDS:
            flat[key] = coerce(key, value)
        elif isinstance(value, dict):
            for sub_key, sub_value in flatten_toml(value, where).items():
                flat[sub_key] = (
                    sub_value if sub_key not in OPTION_TABLES else {**flat.get(sub_key, {}), **sub_value}
                )
        else:
            raise unknown_key_error(key, where)
    return flat


def load_toml(path: str | Path) -> dict[str, Any]:
    return flatten_toml(read_toml(path, "config file"), str(path))


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set key=value`` overrides; ``model.X=...`` / ``task.X=...`` go to the option tables.

    Values are read as TOML literals (``0.1``, ``true``, ``"gelu"``), and as plain strings otherwise.
    """
    flat: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        prefix, _, option = key.partition(".")
        if option and prefix in ("model", "task"):
            table = f"{prefix}_options"
            flat.setdefault(table, {})[option] = value
        elif key in FIELDS and key not in OPTION_TABLES:
            flat[key] = coerce(key, value)
        else:
            raise unknown_key_error(key, "--set")
    return flat


# an option table's value that takes the option out: the model's or task's own default applies, not the
# recipe's (TOML has no null; an experiment pins a setting from before a recipe gained the option)
OWN_DEFAULT = "default"


def merge(base: dict[str, Any], *layers: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from ``base`` (field values) updated by each layer in turn (option tables merge; an
    option set to ``"default"`` is dropped, so the model's or task's own default applies)."""
    values = dict(base)
    for layer in layers:
        for key, value in layer.items():
            if key not in FIELDS:
                raise unknown_key_error(key, "config")
            if key in OPTION_TABLES:
                merged = {**values.get(key, {}), **value}
                values[key] = {k: v for k, v in merged.items() if v != OWN_DEFAULT}
            else:
                values[key] = value
    return TrainConfig(**{k: coerce(k, v) for k, v in values.items()})
