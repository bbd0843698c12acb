"""The training configuration: one typed dataclass, read from TOML and overridden from the command line.

Precedence, lowest first: the defaults below, a checkpoint's saved config (``--resume``), a TOML
file (``--config``), ``--set key=value`` overrides, explicit command-line flags.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OPTION_TABLES = ("model_options", "task_options")


@dataclass
class TrainConfig:
    """Everything a run needs, saved as ``config.json`` next to every checkpoint.

    The defaults are nanoGPT's CPU shakespeare_char recipe (SPEC §3): 4 layers × 4 heads × 128,
    context 64, batch 12, 2000 iterations, lr 1e-3. ``model_options`` and ``task_options`` are
    passed through to the model config (e.g. ``mlp="gelu"``) and the task (e.g. filter simulator
    parameters); the task validates them.
    """

    task: str = "lm"
    model: str = "transformer"
    data: str | None = None  # lm: a text file or a dataset name; nbody: a GATr-format directory
    out: str | None = None
    # model size (every task maps these onto its model config)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64  # lm context / sequence length
    dropout: float = 0.0
    model_options: dict[str, Any] = field(default_factory=dict)
    task_options: dict[str, Any] = field(default_factory=dict)
    # optimisation: AdamW, linear warmup then cosine decay to min_lr at lr_decay_iters
    max_iters: int = 2000
    batch_size: int = 12  # global: split across DDP ranks
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int | None = None  # None: max_iters
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    # evaluation, logging, checkpoints
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 1  # a metrics.jsonl line every this many iterations (and at every evaluation)
    plots: bool = True
    # runtime
    seed: int = 1337
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 (autocast; bf16 keeps fp32's range, so no loss scaling)

    def __post_init__(self) -> None:
        positive = ("n_layer", "n_head", "n_embd", "block_size", "max_iters", "batch_size")
        positive += ("eval_interval", "eval_iters", "log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {self.warmup_iters}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.max_iters

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} cannot be empty")
    origin = typing.get_origin(kind) or kind
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a table of options, got {value!r}")
        return dict(value)
    if origin is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if origin is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return origin(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {origin.__name__}, got {value!r}") from None


def unknown_key_error(key: str, where: str) -> ValueError:
    valid = ", ".join(sorted([*FIELDS, *(f"{t}.KEY" for t in ("model", "task"))]))
    return ValueError(f"unknown config key {key!r} in {where}; valid keys: {valid}")


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
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"config file {path} is not valid TOML: {err}") from None
    return flatten_toml(document, str(path))


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set key=value`` overrides; ``model.X=...`` / ``task.X=...`` go to the option tables.

    Values are read as TOML literals (``0.1``, ``true``, ``"gelu"``), and as plain strings otherwise.
    """
    flat: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
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


def merge(base: dict[str, Any], *layers: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from ``base`` (field values) updated by each layer in turn (option tables merge)."""
    values = dict(base)
    for layer in layers:
        for key, value in layer.items():
            if key not in FIELDS:
                raise unknown_key_error(key, "config")
            if key in OPTION_TABLES:
                values[key] = {**values.get(key, {}), **value}
            else:
                values[key] = value
    return TrainConfig(**{k: coerce(k, v) for k, v in values.items()})
