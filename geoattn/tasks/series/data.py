"""The ``series`` task's data: classification sets bundled inside sktime (no download), observations
dropped at random per series, and the packed ``(time, mask, values)`` batches every model reads.

Sets (:data:`DATASETS`): sktime ships a few UCR/UEA classification problems as files inside the
package; they are read with its bundled-data loaders (``load_japanese_vowels`` and the like), which
never touch the network. A loaded set is cached as ``.npz`` under ``cache_dir()/series`` (keyed by the
sktime version), so a run after the first needs neither the files' parser nor sktime's import.

Irregular sampling (the Neural CDE paper's protocol, Kidger et al. 2020, §4.2): from every series of
length ``L`` (train, validation and test alike) ``int(drop · L)`` time points are removed, all channels
at once, chosen at random per series from ``(seed, split, index)`` alone, so a series loses the same
points whatever else is loaded. Each kept observation keeps its **time = its original sample index**
(0, 1, …, L − 1, in units of the set's sampling interval; not rescaled), so the gaps between kept
observations carry the information that dropping removed.

Packed layout (:func:`pack`): a batch of series is ``x (B, N, 2 + C)`` float32 with, per row ``j``
(the j-th kept observation, in time order), ``x[..., 0]`` its time, ``x[..., 1]`` 1 (observed) or 0
(padding) and ``x[..., 2:]`` its ``C`` normalised channel values; padding rows (after a series' last
observation, up to the batch's longest series) are all zero.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geoattn.errors import ConfigError, DataError
from geoattn.extras import check_installed, require
from geoattn.tasks.cache import cache_dir

EXTRA = "series"
# set name -> sktime's loader of its bundled files (sktime.datasets; each reads only the package's data
# directory). JapaneseVowels and BasicMotions are multivariate, PLAID and JapaneseVowels vary in length.
DATASETS = {
    "JapaneseVowels": "load_japanese_vowels",
    "BasicMotions": "load_basic_motions",
    "ItalyPowerDemand": "load_italy_power_demand",
    "GunPoint": "load_gunpoint",
    "ArrowHead": "load_arrow_head",
    "OSULeaf": "load_osuleaf",
    "PLAID": "load_plaid",
    "ACSF1": "load_acsf1",
}
SPLITS = ("train", "test")
CACHE_VERSION = 1


def dataset_name(name: str) -> str:
    """The key of ``name`` in :data:`DATASETS` (case ignored); ConfigError naming ``task.dataset``."""
    for key in DATASETS:
        if key.lower() == str(name).strip().lower():
            return key
    raise ConfigError(f"task.dataset: unknown set {name!r}; bundled sets: {', '.join(DATASETS)}")


@dataclass
class RawSet:
    """One split of a set as loaded: ``series[i]`` ``(L_i, C)`` float64 (lengths may differ) and its
    class label ``labels[i]`` (an index into the set's ``classes``)."""

    series: list[np.ndarray]
    labels: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.series)


@dataclass
class Dataset:
    """A bundled set: its ``train`` and ``test`` splits, the class names (label ``k`` is ``classes[k]``)
    and the number of channels."""

    name: str
    train: RawSet
    test: RawSet
    classes: list[str]

    @property
    def channels(self) -> int:
        """Channels ``C`` per time point."""
        return self.train.series[0].shape[1]


def load_dataset(name: str, *, cache: bool = True) -> Dataset:
    """The set ``name`` (see :data:`DATASETS`) from sktime's bundled files, through the disk cache.

    Raises a one-line ConfigError when sktime is not installed (``pip install 'geoattn[series]'``).
    """
    name = dataset_name(name)
    check_installed("sktime", extra=EXTRA, purpose="the series task")  # importing it takes seconds
    path = cache_dir() / "series" / f"{name}-sktime{metadata.version('sktime')}-v{CACHE_VERSION}.npz"
    if cache and path.is_file():
        return _read_cache(path, name)
    loader = getattr(require("sktime.datasets", extra=EXTRA, purpose="the series task"), DATASETS[name])
    splits = {}
    for split in SPLITS:
        frame, labels = loader(split=split, return_X_y=True)
        series = [
            np.stack([np.asarray(frame.iloc[i, c], dtype=np.float64) for c in range(frame.shape[1])], -1)
            for i in range(len(frame))
        ]
        splits[split] = (series, np.asarray(labels).astype(str))
    classes = sorted(set(splits["train"][1]) | set(splits["test"][1]), key=_natural)
    index = {c: k for k, c in enumerate(classes)}
    data = Dataset(
        name,
        *(RawSet(s, np.array([index[c] for c in y], dtype=np.int64)) for s, y in splits.values()),
        classes=classes,
    )
    for split in SPLITS:
        if any(not np.isfinite(s).all() for s in getattr(data, split).series):
            raise DataError(f"{name} {split}: missing values in the files; the series task expects none")
    if cache:
        _write_cache(path, data)
    return data


def _natural(label: str) -> tuple:
    """Sort key: numeric labels by value ('2' before '10'), then the others by text."""
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def _write_cache(path: Path, data: Dataset) -> None:
    arrays = {"classes": np.array(data.classes)}
    for split in SPLITS:
        raw = getattr(data, split)
        arrays[f"{split}_values"] = np.concatenate(raw.series)
        arrays[f"{split}_lengths"] = np.array([len(s) for s in raw.series], dtype=np.int64)
        arrays[f"{split}_labels"] = raw.labels
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)  # atomic: parallel runs never read half a file, nor write into each other's


def _read_cache(path: Path, name: str) -> Dataset:
    with np.load(path, allow_pickle=False) as f:
        splits = []
        for split in SPLITS:
            ends = np.cumsum(f[f"{split}_lengths"])[:-1]
            splits.append(RawSet(np.split(f[f"{split}_values"], ends), f[f"{split}_labels"]))
        return Dataset(name, *splits, classes=[str(c) for c in f["classes"]])


# --------------------------------------------------------------------------------------------------
# Validation split, normalisation, dropping, packing.


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(fit, val)`` of a stratified split: per class ``round(fraction · n_class)`` series go
    to validation (at least one when the class has two or more), chosen with ``seed``."""
    rng = np.random.default_rng([seed, 7])
    fit, val = [], []
    for k in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == k))
        n_val = int(round(fraction * len(members)))
        if fraction > 0 and len(members) > 1:
            n_val = min(max(n_val, 1), len(members) - 1)
        val.extend(members[:n_val])
        fit.extend(members[n_val:])
    return np.sort(np.array(fit, dtype=np.int64)), np.sort(np.array(val, dtype=np.int64))


def channel_statistics(series: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation ``(C,)`` over every time point of ``series`` (a channel
    with no spread gets std 1)."""
    values = np.concatenate(series)
    std = values.std(0)
    return values.mean(0), np.where(std > 0, std, 1.0)


def kept_indices(length: int, drop: float, seed: int, split: str, index: int) -> np.ndarray:
    """The sorted time indices kept of a series of ``length`` points: ``int(drop · length)`` removed at
    random (at most ``length − 1``), drawn from ``(seed, split, index)`` only (``split`` in ``SPLITS``,
    ``index`` the series' position in the set's split)."""
    n_drop = min(int(drop * length), length - 1)
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    return np.sort(rng.permutation(length)[n_drop:])


def irregular(
    raw: RawSet, split: str, drop: float, seed: int, mean: np.ndarray, std: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every series of ``raw`` as ``(times (n_i,), values (n_i, C))``: its kept observations
    (:func:`kept_indices`, indexed by the series' position in the set's ``split``), normalised."""
    out = []
    for i, s in enumerate(raw.series):
        keep = kept_indices(len(s), drop, seed, split, i)
        out.append((keep.astype(np.float64), (s[keep] - mean) / std))
    return out


def pack(observations: list[tuple[np.ndarray, np.ndarray]], length: int | None = None) -> Tensor:
    """``x (B, N, 2 + C)`` float32 of the module docstring's layout; ``N`` = the longest series, or
    ``length`` (≥ it)."""
    longest = max(len(t) for t, _ in observations)
    n = longest if length is None else length
    if n < longest:
        raise ValueError(f"length={n} is shorter than the longest series ({longest} observations)")
    channels = observations[0][1].shape[1]
    x = torch.zeros(len(observations), n, 2 + channels, dtype=torch.float32)
    for i, (times, values) in enumerate(observations):
        k = len(times)
        x[i, :k, 0] = torch.from_numpy(times)
        x[i, :k, 1] = 1.0
        x[i, :k, 2:] = torch.from_numpy(values)
    return x


def unpack(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x (B, N, 2 + C)`` → ``times (B, N)``, ``mask (B, N)`` bool, ``values (B, N, C)``; ValueError
    naming the layout when ``x`` does not have it."""
    if x.dim() != 3 or x.shape[-1] < 3:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, N, 2 + C) = [time, mask, values]")
    return x[..., 0], x[..., 1] > 0.5, x[..., 2:]
