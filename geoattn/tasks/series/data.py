"""The ``series`` task's data: where a set comes from (a classification set bundled with sktime or aeon,
a UEA/UCR ``.ts`` pair, a long table), observations dropped at random per series, and the packed
``(time, mask, values)`` batches every model reads.

Sources (:data:`FORMATS`, chosen by :func:`load_data`):

* ``task.dataset``: a classification set shipped as ``NAME/NAME_TRAIN.ts`` and ``NAME_TEST.ts`` inside
  sktime's (or aeon's, when installed) package data (:func:`bundled_sets` lists them; no download).
  Cached as ``.npz`` under ``cache_dir()/series`` (keyed by the package's version).
* ``--data X_TRAIN.ts`` (or a folder with one ``*_TRAIN.ts``): the pair ``X_TRAIN.ts`` / ``X_TEST.ts``,
  read by sktime's own ``.ts`` reader. Unequal lengths and missing values (``?``) are kept: a missing
  value is a channel not observed at that time.
* ``--data table.csv`` / ``.parquet``: a long table, one observation a row, columns ``id, time,
  channel, value``; the label per series as a column ``label`` or in ``task.labels`` (a table ``id,
  label``); the split as a column ``split`` (``train`` / ``test``) or as a pair ``X_TRAIN.csv`` /
  ``X_TEST.csv``. Times are kept as given (no resampling), measured from each series' first
  observation; each channel is observed at its own times.

Times: for ``.ts`` files and bundled sets a sample's time is its index (0, 1, …, L − 1, in units of
the set's sampling interval; :attr:`Dataset.sample_times`); for a table, the table's times.

Irregular sampling (the Neural CDE paper's protocol, Kidger et al. 2020, §4.2): from every series of
``L`` time points (train, validation and test alike) ``int(drop · L)`` are removed, all channels at
once, chosen at random per series from ``(seed, split, index)`` alone, so a series loses the same
points whatever else is loaded. Kept observations keep their times, so the gaps carry what dropping
removed.

Packed layout (:func:`pack`): a batch of series is ``x (B, N, 2 + C)`` float32 with, per row ``j``
(the j-th observed time, in time order), ``x[..., 0]`` its time, ``x[..., 1]`` 1 (observed) or 0
(padding) and ``x[..., 2:]`` its ``C`` normalised channel values, **NaN for a channel not observed at
that time**; padding rows (after a series' last observation, up to the batch's longest series) are all
zero. :func:`unpack` gives the values with NaN as 0 and the per-channel mask.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geoattn.core.cache import cache_dir
from geoattn.core.errors import ConfigError, DataError
from geoattn.core.extras import check_installed, require

EXTRA = "series"
SPLITS = ("train", "test")
CACHE_VERSION = 2
# packages whose data folder ships classification sets as NAME/NAME_TRAIN.ts, NAME_TEST.ts
BUNDLING_PACKAGES = ("sktime", "aeon")
COLUMNS = ("id", "time", "channel", "value")


# --------------------------------------------------------------------------------------------------
# The loaded set


@dataclass
class RawSet:
    """One split as loaded: ``series[i]`` ``(L_i, C)`` float64 (NaN: channel not observed then), its
    times ``times[i]`` ``(L_i,)`` increasing, and its class label ``labels[i]`` (an index into the
    set's ``classes``)."""

    series: list[np.ndarray]
    labels: np.ndarray  # (n,) int64
    times: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.series)


@dataclass
class Dataset:
    """A set: its ``train`` and ``test`` splits, the class names (label ``k`` is ``classes[k]``), the
    channel names, where it came from and whether its times are sample indices."""

    name: str
    train: RawSet
    test: RawSet
    classes: list[str]
    channel_names: list[str]
    sample_times: bool = True

    @property
    def channels(self) -> int:
        """Channels ``C`` per time point."""
        return len(self.channel_names)

    @property
    def partial(self) -> bool:
        """Whether some time point has some but not all channels observed (the models then read a
        per-channel mask)."""
        return any(np.isnan(s).any() for raw in (self.train, self.test) for s in raw.series)

    @property
    def time_scale(self) -> float:
        """The time unit the models normalise t by: the longest series (in samples, for sample
        times) or the longest span of times (tables)."""
        if self.sample_times:
            return float(max(len(s) for raw in (self.train, self.test) for s in raw.series))
        return float(max(t[-1] - t[0] for raw in (self.train, self.test) for t in raw.times)) or 1.0


def _natural(label: str) -> tuple:
    """Sort key: numeric labels by value ('2' before '10'), then the others by text."""
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def _assemble(
    name: str,
    where: dict[str, str],
    splits: dict[str, tuple[list[np.ndarray], list[np.ndarray], np.ndarray]],
    channel_names: list[str],
    *,
    sample_times: bool,
) -> Dataset:
    """The :class:`Dataset` ``name`` from each split's ``(times, series, string labels)``, checked: no
    empty split, no series without an observation, every test class seen in training (``where``:
    split → the file its errors name)."""
    for split, (_, series, _) in splits.items():
        if not series:
            raise DataError(f"{where[split]}: the {split} split has no series")
        for i, s in enumerate(series):
            if not (~np.isnan(s)).any():
                raise DataError(f"{where[split]}: {split} series {i} has no observed value")
    train_classes = set(splits["train"][2])
    unseen = sorted(set(splits["test"][2]) - train_classes, key=_natural)
    if unseen:
        raise DataError(
            f"{where['test']}: class(es) {', '.join(unseen)} of the test split have no training example"
        )
    classes = sorted(train_classes, key=_natural)
    index = {c: k for k, c in enumerate(classes)}
    raw = {
        split: RawSet(series, np.array([index[c] for c in labels], dtype=np.int64), times)
        for split, (times, series, labels) in splits.items()
    }
    return Dataset(name, raw["train"], raw["test"], classes, channel_names, sample_times)


# --------------------------------------------------------------------------------------------------
# Bundled sets and .ts files


def _package_data(package: str) -> Path | None:
    """The ``datasets/data`` folder of an installed ``package`` (found without importing it)."""
    try:
        spec = util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    return folder if folder.is_dir() else None


def _is_classification(train: Path) -> bool:
    """Whether a ``.ts`` file's header declares class labels (``@classlabel true``), not a regression
    target."""
    with train.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            words = line.strip().lower().split()
            if words[:1] == ["@classlabel"]:
                return words[1:2] == ["true"]
            if words[:1] == ["@data"]:
                return False
    return False


def bundled_sets() -> dict[str, tuple[str, Path]]:
    """Set name → ``(package, folder)`` of every classification set bundled with sktime or aeon (the
    installed ones): a folder ``NAME`` of the package's ``datasets/data`` holding ``NAME_TRAIN.ts``
    and ``NAME_TEST.ts`` whose header declares class labels. sktime's copy wins a name both ship."""
    found: dict[str, tuple[str, Path]] = {}
    for package in BUNDLING_PACKAGES:
        root = _package_data(package)
        if root is None:
            continue
        for folder in sorted(root.iterdir()):
            train = folder / f"{folder.name}_TRAIN.ts"
            if folder.name in found or not (
                train.is_file() and (folder / f"{folder.name}_TEST.ts").is_file()
            ):
                continue
            if _is_classification(train):
                found[folder.name] = (package, folder)
    return found


def dataset_name(name: str) -> str:
    """The bundled set called ``name`` (case ignored); ConfigError naming ``task.dataset`` and the
    sets the installed packages bundle."""
    check_installed("sktime", extra=EXTRA, purpose="the series task")
    sets = bundled_sets()
    for key in sets:
        if key.lower() == str(name).strip().lower():
            return key
    raise ConfigError(
        f"task.dataset: unknown set {name!r}; bundled with {', '.join(_installed())}: {', '.join(sets)}"
    )


def _installed() -> list[str]:
    return [p for p in BUNDLING_PACKAGES if _package_data(p) is not None]


def load_dataset(name: str, *, cache: bool = True) -> Dataset:
    """The bundled set ``name`` (see :func:`bundled_sets`), through the disk cache.

    Raises a one-line ConfigError when sktime is not installed (``pip install 'geoattn[series]'``).
    """
    name = dataset_name(name)
    package, folder = bundled_sets()[name]
    version = metadata.version(package)
    path = cache_dir() / "series" / f"{name}-{package}{version}-v{CACHE_VERSION}.npz"
    if cache and path.is_file():
        return _read_cache(path, name)
    data = read_ts_pair(folder / f"{name}_TRAIN.ts", folder / f"{name}_TEST.ts")
    data.name = name
    if cache:
        _write_cache(path, data)
    return data


def ts_pair(path: Path) -> tuple[Path, Path]:
    """The ``(X_TRAIN.ts, X_TEST.ts)`` pair of ``path`` (the train file or a folder holding one);
    DataError naming what is missing."""
    return _pair(path, ".ts")


def _pair(path: Path, suffix: str) -> tuple[Path, Path]:
    if path.is_dir():
        trains = sorted(p for p in path.iterdir() if p.name.upper().endswith(f"_TRAIN{suffix.upper()}"))
        if len(trains) != 1:
            found = ", ".join(p.name for p in trains) or "none"
            raise DataError(f"{path}: expected one *_TRAIN{suffix} file in the folder, found {found}")
        path = trains[0]
    stem = path.name[: -len(suffix)]
    if not stem.upper().endswith("_TRAIN"):
        raise DataError(f"{path}: expected a NAME_TRAIN{suffix} file (its NAME_TEST{suffix} beside it)")
    test = path.with_name(stem[:-5] + ("TEST" if stem[-5:].isupper() else "test") + path.suffix)
    for file in (path, test):
        if not file.is_file():
            raise DataError(
                f"{file}: no such file (the {suffix} pair is NAME_TRAIN{suffix} and NAME_TEST{suffix})"
            )
    return path, test


def read_ts(path: Path) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """One ``.ts`` file by sktime's reader: per series its times ``(L_i,)`` (the sample index, or the
    file's timestamps), values ``(L_i, C)`` (NaN where a channel is missing or shorter) and the string
    labels ``(n,)``; DataError naming the file on anything the reader or these checks refuse."""
    reader = require("sktime.datasets", extra=EXTRA, purpose="reading .ts files").load_from_tsfile
    try:
        frame, labels = reader(str(path), return_data_type="nested_univ")
    except Exception as err:  # the reader's own exceptions: IOError, its parse errors, ValueError...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{path}: not a readable .ts file ({first})") from None
    labels = np.asarray(labels)
    if labels.size == 0 or len(frame) == 0:
        raise DataError(f"{path}: no series")
    if labels.dtype.kind not in "UO" or any(str(v).strip() in ("", "nan", "?") for v in labels):
        raise DataError(f"{path}: a series without a class label (the file must declare @classlabel true)")
    times, series = [], []
    for i in range(len(frame)):
        cells = [frame.iloc[i, c] for c in range(frame.shape[1])]
        try:
            index = np.unique(np.concatenate([np.asarray(cell.index, dtype=np.float64) for cell in cells]))
        except (TypeError, ValueError):
            raise DataError(f"{path}: series {i} has timestamps that are not numbers") from None
        values = np.full((len(index), len(cells)), np.nan)
        for c, cell in enumerate(cells):
            rows = np.searchsorted(index, np.asarray(cell.index, dtype=np.float64))
            values[rows, c] = np.asarray(cell, dtype=np.float64)
        seen = ~np.isnan(values).all(1)  # a time with no channel observed is not an observation
        times.append(index[seen])
        series.append(values[seen])
    return times, series, labels.astype(str)


def read_ts_pair(train: Path, test: Path) -> Dataset:
    """The set of a ``.ts`` pair (see :func:`read_ts`); DataError when the two files' channels differ."""
    splits = {"train": read_ts(train), "test": read_ts(test)}
    channels = {split: s[1][0].shape[1] for split, s in splits.items()}
    if channels["train"] != channels["test"]:
        raise DataError(f"{test}: {channels['test']} channels, but {train.name} has {channels['train']}")
    name = train.name[: -len("_TRAIN.ts")]
    return _assemble(
        name,
        {"train": str(train), "test": str(test)},
        splits,
        [str(c) for c in range(channels["train"])],
        sample_times=True,
    )


def _write_cache(path: Path, data: Dataset) -> None:
    arrays = {"classes": np.array(data.classes), "channel_names": np.array(data.channel_names)}
    for split in SPLITS:
        raw = getattr(data, split)
        arrays[f"{split}_values"] = np.concatenate(raw.series)
        arrays[f"{split}_times"] = np.concatenate(raw.times)
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
            splits.append(
                RawSet(
                    np.split(f[f"{split}_values"], ends),
                    f[f"{split}_labels"],
                    np.split(f[f"{split}_times"], ends),
                )
            )
        return Dataset(
            name,
            *splits,
            classes=[str(c) for c in f["classes"]],
            channel_names=[str(c) for c in f["channel_names"]],
        )


# --------------------------------------------------------------------------------------------------
# Long tables


def _read_frame(path: Path):
    """A CSV or Parquet file as a pandas DataFrame; DataError naming the file when unreadable."""
    pandas = require("pandas", extra=EXTRA, purpose="reading long tables")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    readers: dict[str, Callable] = {".csv": pandas.read_csv, ".parquet": pandas.read_parquet}
    if path.suffix.lower() == ".parquet":
        require("pyarrow", extra=EXTRA, purpose="reading Parquet tables")
    try:
        return readers[path.suffix.lower()](path)
    except Exception as err:  # pandas' and pyarrow's parse errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{path}: not a readable {path.suffix} table ({first})") from None


def _labels_of(frame, where: str, labels: dict[str, str] | None) -> dict[str, str]:
    """Series id → label, from the table's ``label`` column or the ``labels`` table."""
    if labels is None:
        if "label" not in frame.columns:
            raise DataError(
                f"{where}: no 'label' column and no task.labels table "
                f"(columns: {', '.join(map(str, frame.columns))})"
            )
        if frame["label"].isna().any():
            raise DataError(
                f"{where}: a missing label (NaN) for series {frame.loc[frame['label'].isna(), 'id'].iloc[0]}"
            )
        per_id = frame.groupby("id")["label"].nunique()
        if (per_id > 1).any():
            raise DataError(f"{where}: series {per_id.index[per_id > 1][0]} has more than one label")
        return {str(k): str(v) for k, v in frame.groupby("id")["label"].first().items()}
    missing = sorted(set(frame["id"].astype(str)) - set(labels))
    if missing:
        raise DataError(f"{where}: series {missing[0]} has no label in task.labels")
    return labels


def _read_labels(path: Path) -> dict[str, str]:
    frame = _read_frame(path)
    absent = [c for c in ("id", "label") if c not in frame.columns]
    if absent:
        raise DataError(
            f"{path}: no column {', '.join(absent)} (columns: {', '.join(map(str, frame.columns))})"
        )
    if frame["label"].isna().any():
        raise DataError(
            f"{path}: a missing label (NaN) for series {frame.loc[frame['label'].isna(), 'id'].iloc[0]}"
        )
    if frame["id"].duplicated().any():
        raise DataError(
            f"{path}: series {frame.loc[frame['id'].duplicated(), 'id'].iloc[0]} is labelled twice"
        )
    return {str(k): str(v) for k, v in zip(frame["id"], frame["label"])}


def _check_table(frame, where: str) -> None:
    pandas = require("pandas", extra=EXTRA, purpose="reading long tables")
    absent = [c for c in COLUMNS if c not in frame.columns]
    if absent:
        raise DataError(
            f"{where}: no column {', '.join(absent)} (columns: {', '.join(map(str, frame.columns))}; "
            f"expected {', '.join(COLUMNS)})"
        )
    if frame.empty:
        raise DataError(f"{where}: the table has no rows")
    for column in ("time", "value"):
        if not pandas.api.types.is_numeric_dtype(frame[column]):
            raise DataError(f"{where}: column {column!r} is not numeric")
    if frame["time"].isna().any() or not np.isfinite(frame["time"].to_numpy(np.float64)).all():
        raise DataError(f"{where}: a missing or infinite time")
    if np.isinf(frame["value"].to_numpy(np.float64)).any():
        raise DataError(f"{where}: an infinite value")
    if frame["id"].isna().any() or frame["channel"].isna().any():
        raise DataError(f"{where}: a row without an id or channel")
    duplicated = frame.duplicated(["id", "time", "channel"])
    if duplicated.any():
        row = frame[duplicated].iloc[0]
        raise DataError(
            f"{where}: series {row['id']} has two values of channel {row['channel']} at time {row['time']}"
        )


def _table_split(frame, where: str, labels: dict[str, str], channels: list[str]):
    """``(times, series, labels)`` of one split's rows (each series' times from its first observation)."""
    frame = frame.dropna(subset=["value"])  # a missing value: that channel was not observed then
    if frame.empty:
        return [], [], np.array([], dtype=str)
    frame = frame.assign(id=frame["id"].astype(str), channel=frame["channel"].astype(str))
    wide = frame.pivot(index=["id", "time"], columns="channel", values="value").reindex(columns=channels)
    times, series, names = [], [], []
    for key, block in wide.groupby(level=0, sort=True):
        t = block.index.get_level_values(1).to_numpy(np.float64)
        times.append(t - t[0])
        series.append(block.to_numpy(np.float64))
        names.append(labels[str(key)])
    return times, series, np.array(names, dtype=str)


def read_table(path: Path, labels: Path | None = None) -> Dataset:
    """A long table (module docstring): ``path`` with a ``split`` column, or ``X_TRAIN.csv`` whose
    ``X_TEST.csv`` lies beside it (or Parquet); labels from its ``label`` column or the ``labels``
    table. DataError naming the file and the fault."""
    label_map = _read_labels(labels) if labels is not None else None
    frame = _read_frame(path) if path.is_file() else None
    if frame is not None and "split" in frame.columns:
        _check_table(frame, str(path))
        unknown = sorted(set(frame["split"].astype(str)) - set(SPLITS))
        if unknown:
            raise DataError(f"{path}: split {unknown[0]!r} is neither 'train' nor 'test'")
        parts = {s: (frame[frame["split"].astype(str) == s], str(path)) for s in SPLITS}
    else:
        train, test = _pair(path, path.suffix if path.is_file() else ".csv")
        parts = {"train": (frame if frame is not None else _read_frame(train), str(train))}
        parts["test"] = (_read_frame(test), str(test))
        for part, where in parts.values():
            _check_table(part, where)
    for split, (part, where) in parts.items():
        if part.empty:
            raise DataError(f"{where}: the {split} split has no series")
    channel_sets = {
        s: sorted(set(part["channel"].astype(str)), key=_natural) for s, (part, _) in parts.items()
    }
    if channel_sets["train"] != channel_sets["test"]:
        extra = sorted(set(channel_sets["test"]) ^ set(channel_sets["train"]))
        raise DataError(
            f"{parts['test'][1]}: train and test have different channels (only in one: {', '.join(extra)})"
        )
    channels = channel_sets["train"]
    splits = {}
    for split, (part, where) in parts.items():
        splits[split] = _table_split(part, where, _labels_of(part, where, label_map), channels)
    where = {split: file for split, (_, file) in parts.items()}
    return _assemble(path.stem, where, splits, channels, sample_times=False)


# the readers of --data, by what the path names: a .ts pair, a long table
FORMATS: dict[str, Callable[[Path, Path | None], Dataset]] = {
    ".ts": lambda path, labels: read_ts_pair(*ts_pair(path)),
    ".csv": read_table,
    ".parquet": read_table,
}


def read_data(path: str | Path, labels: str | Path | None = None) -> Dataset:
    """The set ``--data path`` names (:data:`FORMATS`: a ``.ts`` file, a folder holding a ``.ts`` pair,
    a ``.csv`` or ``.parquet`` table); DataError naming the path when it is none of these."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    suffix = ".ts" if path.is_dir() else path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: the series task reads {', '.join(FORMATS)} files (or a folder with a .ts pair)"
        )
    if labels is not None and suffix == ".ts":
        raise ConfigError("task.labels is for long tables; a .ts file carries its own labels")
    return FORMATS[suffix](path, None if labels is None else Path(labels))


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
    """Per-channel mean and standard deviation ``(C,)`` over every observed value of ``series`` (a
    channel with no spread, or never observed, gets mean 0 and std 1)."""
    values = np.concatenate(series)
    seen = (~np.isnan(values)).sum(0)
    mean = np.where(seen > 0, np.nansum(values, 0) / np.maximum(seen, 1), 0.0)
    std = np.sqrt(np.where(seen > 0, np.nansum((values - mean) ** 2, 0) / np.maximum(seen, 1), 1.0))
    return mean, np.where(std > 0, std, 1.0)


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
    (:func:`kept_indices`, indexed by the series' position in the set's ``split``), normalised (NaN
    stays NaN: not observed)."""
    out = []
    for i, (t, s) in enumerate(zip(raw.times, raw.series)):
        keep = kept_indices(len(s), drop, seed, split, i)
        out.append((t[keep].astype(np.float64), (s[keep] - mean) / std))
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


def unpack(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x (B, N, 2 + C)`` → ``times (B, N)``, row ``mask (B, N)`` bool, ``values (B, N, C)`` (NaN as
    0) and the per-channel mask ``observed (B, N, C)`` bool; ValueError naming the layout when ``x``
    does not have it."""
    if x.dim() != 3 or x.shape[-1] < 3:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, N, 2 + C) = [time, mask, values]")
    mask, values = x[..., 1] > 0.5, x[..., 2:]
    missing = torch.isnan(values)
    return x[..., 0], mask, values.masked_fill(missing, 0.0), mask[..., None] & ~missing
