"""The ``series`` task: classify irregularly sampled real time series (a set bundled with sktime or
aeon, a ``.ts`` pair or a long table; :mod:`.data`) with models that all receive the observation times
(:mod:`.models`, whose ``TABLE`` is the task's model table).

Protocol: the set's own train/test split; a stratified validation split (``task.val_fraction`` of the
training series, seeded by ``task.seed``) for model selection; optionally ``int(task.drop · L)`` time
points of every series removed at random (the Neural CDE paper's 30 / 50 / 70 %, deterministic per
``task.seed`` and series; default 0.5 for the bundled sets, 0 for ``--data``, which is taken as it
is); per-channel normalisation with the statistics of the training series (validation excluded).
Training draws batches from the training series; the trainer's estimates read the validation split;
at the end ``final_metrics`` scores every validation series (``val_acc_full``, ``val_loss_full``) and,
unless the run seals it, every test series (``test_acc``).

A batch: ``x (B, N, 2 + C)`` float32 = [time, mask, normalised values (NaN: channel not observed
then)], N the longest series in the batch, padding rows zero; ``y (B,)`` long class indices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.core.errors import ConfigError
from geoattn.models.base import TaskModel
from geoattn.tasks.base import Task
from geoattn.tasks.series.data import (
    Dataset,
    channel_statistics,
    dataset_name,
    irregular,
    load_dataset,
    pack,
    read_data,
    stratified_split,
)
from geoattn.tasks.series.models import TABLE

SPLITS = ("train", "val", "test")
DEFAULT_DATASET = "JapaneseVowels"
DEFAULT_DROP = 0.5  # for the bundled sets: the NCDE paper's middle rate


@dataclass
class SeriesConfig:
    """The series task.

    Fields:
        dataset: a classification set bundled with sktime or aeon (default JapaneseVowels without --data).
            ``geoattn.tasks.series.data.bundled_sets()`` lists them: JapaneseVowels (12 channels, 9
            classes, lengths 7–29, 270 / 370 series), BasicMotions, ItalyPowerDemand, ….
        drop: fraction of each series' points removed at random, in [0, 1) (default 0.5; 0 with --data).
            The NCDE paper drops 0.3, 0.5, 0.7.
        seed: seeds which points are dropped (per series) and which training series validate.
        val_fraction: share of the training series held out for validation (stratified by class).
        labels: a CSV or Parquet table ``id, label`` of a long table's series (if it has no label column).
    """

    dataset: str | None = None
    drop: float | None = None
    seed: int = 0
    val_fraction: float = 0.2
    labels: str | None = None

    def __post_init__(self) -> None:
        if self.dataset is not None:
            self.dataset = dataset_name(self.dataset)
        drop = self.drop
        if drop is not None and (
            isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop < 1
        ):
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
    table = TABLE
    Settings: ClassVar[type] = SeriesConfig
    description: ClassVar[str] = (
        "classify irregularly sampled time series (bundled sets, .ts pairs, long tables of observations)"
    )

    def __init__(self, config: SeriesConfig | None = None, data: Dataset | None = None):
        c = config or SeriesConfig()
        if data is None:
            c = dataclasses.replace(c, dataset=c.dataset or DEFAULT_DATASET)
            data = load_dataset(c.dataset)
        # nothing dropped from data brought by --data unless asked: it is taken as it is
        self.config = c = dataclasses.replace(
            c, drop=(DEFAULT_DROP if c.dataset else 0.0) if c.drop is None else c.drop
        )
        self.source = data.name
        self.classes, self.channels = data.classes, data.channels
        # the time unit the models normalise t by; whether some rows lack some channels; and the grid
        # grud and ncde step along (sample indices: the unit grid; a table's real times: its rows)
        self.time_scale, self.partial = data.time_scale, data.partial
        self.grid = "unit" if data.sample_times else "rows"
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
        # the most observations of a series: rt's block size
        self.longest = max(int(s.lengths.max()) for s in self.splits.values())

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
        """The set ``--data`` names (a ``.ts`` pair, a long table) or else ``task.dataset``."""
        if data is None:
            if settings.labels is not None:
                raise ConfigError("task.labels labels a long table given by --data; there is none")
            return cls(settings)
        if settings.dataset is not None:
            raise ConfigError(f"give --data or task.dataset, not both (task.dataset={settings.dataset!r})")
        return cls(settings, read_data(data, settings.labels))

    def split(self, name: str) -> SeriesSplit:
        """The packed split ``train`` (training series), ``val`` or ``test``."""
        if name not in self.splits:
            raise ValueError(f"unknown split {name!r}; the series task has {', '.join(SPLITS)}")
        if not self.readable(name):
            raise ValueError(f"the {name} split is sealed in this run")
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
            "source": self.source,
            "classes": self.classes,
            "channels": self.channels,
            "sizes": {name: len(s.y) for name, s in self.splits.items()},
        }

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """Accuracy and mean cross-entropy on every validation series (``val_acc_full``,
        ``val_loss_full``) and the test accuracy on every test series (``test_acc``) unless the run
        seals the test set."""
        val_acc, val_loss = self.score(model, "val")
        out = {"val_acc_full": val_acc, "val_loss_full": val_loss}
        if self.readable("test"):
            out["test_acc"] = self.score(model, "test")[0]
        return out

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
