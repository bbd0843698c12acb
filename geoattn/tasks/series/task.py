"""The ``series`` task: classify irregularly sampled real time series (sets bundled inside sktime,
:mod:`.data`) with models that all receive the observation times (:mod:`.models`).

Protocol: the set's own train/test split; a stratified validation split (``task.val_fraction`` of the
training series, seeded by ``task.seed``) for model selection; ``int(task.drop · L)`` time points of
every series removed at random (the Neural CDE paper's 30 / 50 / 70 %, deterministic per ``task.seed``
and series); per-channel normalisation with the statistics of the training series (validation
excluded). Training draws batches from the training series; the trainer's estimates read the
validation split; at the end ``final_metrics`` scores every validation series (``val_acc_full``,
``val_loss_full``) and, once, every test series (``test_acc``).

A batch: ``x (B, N, 2 + C)`` float32 = [time (original sample index), mask, normalised values], N the
longest series in the batch, padding rows zero; ``y (B,)`` long class indices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.errors import ConfigError
from geoattn.models.base import ModelSizes, TaskModel
from geoattn.tasks.base import Task
from geoattn.tasks.series.data import (
    channel_statistics,
    dataset_name,
    irregular,
    load_dataset,
    pack,
    stratified_split,
)
from geoattn.tasks.series.models import (
    RT_FIXED,
    GRUDConfig,
    MTANConfig,
    NCDEConfig,
    SeriesGRUD,
    SeriesMTAN,
    SeriesNCDE,
    SeriesRT,
    SeriesRTConfig,
)

SPLITS = ("train", "val", "test")
# the training budget every model's recipe shares: evaluation only at the end (the splits are small)
_BUDGET = {
    "max_iters": 400,
    "batch_size": 32,
    "warmup_iters": 20,
    "weight_decay": 0.01,
    "eval_interval": 400,
    "eval_iters": 4,
}


@dataclass
class SeriesConfig:
    """The series task.

    Fields:
        dataset: a set bundled inside sktime (``geoattn.tasks.series.data.DATASETS``): JapaneseVowels
            (12 channels, 9 classes, lengths 7–29, 270 / 370 series), BasicMotions, ItalyPowerDemand, ….
        drop: fraction of each series' time points removed at random, in [0, 1) (the NCDE paper: 0.3,
            0.5, 0.7).
        seed: seeds which points are dropped (per series) and which training series validate.
        val_fraction: share of the training series held out for validation (stratified by class).
    """

    dataset: str = "JapaneseVowels"
    drop: float = 0.5
    seed: int = 0
    val_fraction: float = 0.2

    def __post_init__(self) -> None:
        self.dataset = dataset_name(self.dataset)
        if isinstance(self.drop, bool) or not isinstance(self.drop, (int, float)) or not 0 <= self.drop < 1:
            raise ConfigError(f"task.drop must be a fraction in [0, 1), got {self.drop!r}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"task.val_fraction must be in (0, 1), got {self.val_fraction!r}")


@dataclass
class SeriesSplit:
    """A split ready for batches: ``x (n, N_max, 2 + C)`` packed, ``y (n,)``, observations per series
    ``lengths (n,)``."""

    x: Tensor
    y: Tensor
    lengths: Tensor

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Series ``index`` trimmed to the longest of them: ``(x (B, N, 2 + C), y (B,))``."""
        n = int(self.lengths[index].max())
        return self.x[index, :n], self.y[index]


class SeriesTask(Task):
    """Irregularly sampled time-series classification (see the module docstring)."""

    name: ClassVar[str] = "series"
    models: ClassVar[dict[str, str]] = {
        "rt": "RT-Transformer encoder at the observation times (model.times=index: positions 0..n-1)",
        "mtan": "Transformer with mTAN's learned sinusoidal time embedding, masked attention",
        "grud": "GRU-D: input and hidden-state decay by the time since the last observation",
        "ncde": "Neural CDE (torchcde) on the interpolated path of (t, x)",
    }
    Settings: ClassVar[type] = SeriesConfig
    description: ClassVar[str] = (
        "classify irregularly sampled time series (sktime's bundled sets, points dropped at random)"
    )
    # one budget for every model (JapaneseVowels: 216 training series, so ~60 passes); the learning
    # rates chosen on JapaneseVowels' validation split by experiments/series-lr.toml
    recipes: ClassVar[dict[str, dict[str, Any]]] = {
        name: {**_BUDGET, **fields}
        for name, fields in {
            "rt": {"lr": 1e-2, "n_layer": 2, "n_head": 2, "n_embd": 32},
            "mtan": {"lr": 1e-3, "n_layer": 2, "n_head": 2, "n_embd": 32},
            "grud": {"lr": 1e-2, "n_embd": 64},
            "ncde": {"lr": 1e-3, "n_embd": 32},
        }.items()
    }

    def __init__(self, config: SeriesConfig | None = None):
        self.config = config or SeriesConfig()
        c = self.config
        data = load_dataset(c.dataset)
        self.classes, self.channels = data.classes, data.channels
        # the longest series of the set: the time scale the models normalise t by
        self.time_scale = float(max(len(s) for raw in (data.train, data.test) for s in raw.series))
        fit, val = stratified_split(data.train.labels, c.val_fraction, c.seed)
        # per-channel statistics of the training series (validation excluded), (C,) each
        self.mean, self.std = channel_statistics([data.train.series[i] for i in fit])
        train = irregular(data.train, "train", c.drop, c.seed, self.mean, self.std)
        test = irregular(data.test, "test", c.drop, c.seed, self.mean, self.std)
        self.splits = {
            "train": _split([train[i] for i in fit], data.train.labels[fit]),
            "val": _split([train[i] for i in val], data.train.labels[val]),
            "test": _split(test, data.test.labels),
        }

    @classmethod
    def from_settings(
        cls,
        settings: SeriesConfig,
        *,
        data: str | None,
        block_size: int,
        meta: dict[str, Any] | None,
        load_data: bool,
    ) -> SeriesTask:
        """The set named by ``task.dataset``; the series task reads sktime's bundled files (no ``--data``)."""
        if data is not None:
            raise ConfigError("the series task reads sets bundled inside sktime (task.dataset), not --data")
        return cls(settings)

    @classmethod
    def model_settings(cls, model: str) -> tuple[type, tuple[str, ...]]:
        if model == "rt":
            return SeriesRTConfig, (*RT_FIXED, "block_size")
        return {"mtan": MTANConfig, "grud": GRUDConfig, "ncde": NCDEConfig}[model], ()

    def _build(self, model: str, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
        n_classes, channels = len(self.classes), self.channels
        if model == "rt":
            longest = max(int(s.lengths.max()) for s in self.splits.values())
            config = SeriesRTConfig.from_sizes(sizes, options, **RT_FIXED, block_size=longest)
            return SeriesRT(config, channels, n_classes)
        if model == "mtan":
            return SeriesMTAN(MTANConfig.from_sizes(sizes, options), channels, n_classes, self.time_scale)
        if model == "grud":
            return SeriesGRUD(GRUDConfig.from_sizes(sizes, options), channels, n_classes)
        return SeriesNCDE(NCDEConfig.from_sizes(sizes, options), channels, n_classes, self.time_scale)

    def split(self, name: str) -> SeriesSplit:
        """The packed split ``train`` (training series), ``val`` or ``test``."""
        if name not in self.splits:
            raise ValueError(f"unknown split {name!r}; the series task has {', '.join(SPLITS)}")
        return self.splits[name]

    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` series of ``split`` drawn with replacement: ``x (B, N, 2 + C)``, ``y (B,)``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        data = self.split(split)
        x, y = data.batch(torch.randint(len(data.y), (batch_size,), generator=generator))
        return x.to(device), y.to(device)

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``accuracy`` of the logits."""
        return {"accuracy": float((prediction.argmax(-1) == y).float().mean())}

    def meta(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "config": dataclasses.asdict(self.config),
            "classes": self.classes,
            "channels": self.channels,
            "sizes": {name: len(s.y) for name, s in self.splits.items()},
        }

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """Accuracy and mean cross-entropy on every validation series (``val_acc_full``,
        ``val_loss_full``) and the test accuracy on every test series (``test_acc``)."""
        val_acc, val_loss = self.score(model, "val")
        test_acc, _ = self.score(model, "test")
        return {"val_acc_full": val_acc, "val_loss_full": val_loss, "test_acc": test_acc}

    @torch.no_grad()
    def score(self, model: nn.Module, split: str, *, batch_size: int = 128) -> tuple[float, float]:
        """``(accuracy, mean cross-entropy)`` of ``model`` on every series of ``split``, in batches of
        series sorted by length (little padding)."""
        data = self.split(split)
        parameter = next(model.parameters())
        order = torch.argsort(data.lengths, stable=True)
        was_training = model.training
        model.eval()
        correct, loss = 0, 0.0
        for start in range(0, len(order), batch_size):
            x, y = data.batch(order[start : start + batch_size])
            logits, _ = model(x.to(parameter.device, parameter.dtype))
            logits = logits.float().cpu()
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        model.train(was_training)
        return correct / len(order), loss / len(order)


def _split(observations: list[tuple[np.ndarray, np.ndarray]], labels: np.ndarray) -> SeriesSplit:
    lengths = torch.tensor([len(t) for t, _ in observations], dtype=torch.long)
    return SeriesSplit(pack(observations), torch.from_numpy(np.asarray(labels, dtype=np.int64)), lengths)
