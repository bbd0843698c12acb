"""The series task's data in: bundled sets (sktime's own list), UEA/UCR ``.ts`` pairs written by
sktime's ``.ts`` writer, long tables (CSV by pandas, Parquet by pyarrow) with each channel at its own
times; every model on such irregular batches; sealed test sets; the model table; every bad input a
one-line DataError; ``geoattn train`` and ``geoattn experiment`` end to end on each format."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from geoattn.cli import main
from geoattn.core.errors import ConfigError, DataError
from geoattn.models.base import ModelSizes
from geoattn.training.recipes import build_config

pytest.importorskip("sktime", reason="the 'series' extra (sktime, torchcde) is not installed")
pd = pytest.importorskip("pandas")

from sktime.datasets import write_dataframe_to_tsfile, write_ndarray_to_tsfile  # noqa: E402

from geoattn.tasks.series.data import bundled_sets, read_data  # noqa: E402
from geoattn.tasks.series.models import TABLE, fill_linear, to_grid  # noqa: E402
from geoattn.tasks.series.task import SeriesConfig, SeriesTask  # noqa: E402

SIZES = ModelSizes(n_layer=1, n_head=2, n_embd=16)
TINY = ["--max-iters", "3", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--batch-size", "4"]
TINY += ["--eval-interval", "3", "--eval-iters", "1", "--device", "cpu", "--no-plots"]


# ----------------------------------------------------------------------------- fixtures ------------
def write_ts(folder: Path, name: str, fold: str, X: np.ndarray, y: list[str], labels=("a", "b")) -> Path:
    """``X (n, C, L)`` (NaN: missing) and labels ``y`` as ``folder/name/name{fold}.ts`` by sktime."""
    write_ndarray_to_tsfile(
        X,
        str(folder),
        problem_name=name,
        class_label=list(labels),
        class_value_list=np.array(y),
        equal_length=True,
        series_length=X.shape[2],
        fold=fold,
    )
    return folder / name / f"{name}{fold}.ts"


def toy_arrays(seed: int, n: int, channels: int = 2, length: int = 6) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    y = ["a", "b"] * (n // 2)
    X = (
        rng.normal(size=(n, channels, length))
        + np.array([0.0 if c == "a" else 3.0 for c in y])[:, None, None]
    )
    return X, y


@pytest.fixture
def ts_pair(tmp_path) -> Path:
    """Toy_TRAIN.ts (8 series, 2 channels, one missing value) and Toy_TEST.ts (4 series)."""
    X, y = toy_arrays(0, 8)
    X[1, 1, 2] = np.nan  # channel 1 of series 1 not observed at time 2
    train = write_ts(tmp_path, "Toy", "_TRAIN", X, y)
    write_ts(tmp_path, "Toy", "_TEST", *toy_arrays(1, 4))
    return train


def unequal_pair(tmp_path) -> Path:
    """Une_TRAIN.ts / Une_TEST.ts of unequal lengths (3 to 6 points), written by sktime."""
    for fold, lengths, labels in (("_TRAIN", (3, 5, 4, 6), "abab"), ("_TEST", (4, 3), "ab")):
        cells = [
            pd.Series(np.arange(n, dtype=float) * (1 if c == "a" else -1)) for n, c in zip(lengths, labels)
        ]
        frame = pd.DataFrame({"dim_0": cells})
        write_dataframe_to_tsfile(
            frame,
            str(tmp_path),
            problem_name="Une",
            class_label=["a", "b"],
            class_value_list=np.array(list(labels)),
            equal_length=False,
            fold=fold,
        )
    return tmp_path / "Une" / "Une_TRAIN.ts"


def long_rows(n: int, split: str | None, seed: int) -> list[dict]:
    """An irregular long table: series ``n`` ids, channel 'hr' at its own random times and channel
    'bp' at others (never the same set of times), label by mean level."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = "low" if i % 2 == 0 else "high"
        level = 0.0 if label == "low" else 2.0
        for channel, count in (("hr", 5), ("bp", 3)):
            for t in np.sort(rng.uniform(0, 10, count)).round(3) + 100.0:
                row = {
                    "id": f"{split or 's'}{i}",
                    "time": t,
                    "channel": channel,
                    "value": level + rng.normal(),
                }
                rows.append({**row, "label": label, **({"split": split} if split else {})})
    return rows


@pytest.fixture
def parquet(tmp_path) -> Path:
    """The table of :func:`table` as Parquet (written by pandas through pyarrow)."""
    pytest.importorskip("pyarrow")
    path = tmp_path / "obs.parquet"
    pd.DataFrame(long_rows(10, "train", 0) + long_rows(4, "test", 1)).to_parquet(path)
    return path


@pytest.fixture
def table(tmp_path) -> Path:
    """One CSV with a split column (10 train, 4 test series)."""
    frame = pd.DataFrame(long_rows(10, "train", 0) + long_rows(4, "test", 1))
    path = tmp_path / "obs.csv"
    frame.to_csv(path, index=False)
    return path


# ----------------------------------------------------------------------------- bundled sets ---------
def test_bundled_sets_come_from_the_package_and_exclude_regression():
    sets = bundled_sets()
    assert {"JapaneseVowels", "BasicMotions", "GunPoint", "ArrowHead"} <= set(sets)
    assert not {"Covid3Month", "Tecator"} & set(sets)  # regression targets, not classes
    assert SeriesConfig(dataset="basicmotions").dataset == "BasicMotions"
    with pytest.raises(ConfigError, match="task.dataset: unknown set 'NoSuchSet'.*JapaneseVowels"):
        SeriesConfig(dataset="NoSuchSet")


def plant_aeon(root: Path, name: str = "Toyaeon") -> Path:
    """A package ``aeon`` under ``root`` laid out as aeon ships its sets (``aeon/datasets/data/NAME/``,
    the pair written by sktime's ``.ts`` writer) with its distribution's metadata."""
    data = root / "aeon" / "datasets" / "data"
    data.mkdir(parents=True)
    (root / "aeon" / "__init__.py").write_text("")
    (root / "aeon" / "datasets" / "__init__.py").write_text("")
    dist = root / "aeon-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: aeon\nVersion: 0.0.1\n")
    for fold, seed, n in (("_TRAIN", 0, 8), ("_TEST", 1, 4)):
        write_ts(data, name, fold, *toy_arrays(seed, n))
    return data / name


def test_sets_bundled_with_aeon_are_found_by_name_and_train(monkeypatch, tmp_path):
    monkeypatch.setenv("GEOATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    folder = plant_aeon(tmp_path / "site")
    sets = bundled_sets()
    assert sets["Toyaeon"] == ("aeon", folder)
    assert sets["JapaneseVowels"][0] == "sktime"  # sktime's copy wins a name both ship
    assert SeriesConfig(dataset="toyaeon").dataset == "Toyaeon"
    out = tmp_path / "run"
    argv = ["train", "--task", "series", "--model", "rt", "--set", "task.dataset=Toyaeon", *TINY]
    assert main([*argv, "--set", "task.val_fraction=0.25", "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    assert list((tmp_path / "cache" / "series").glob("Toyaeon-aeon0.0.1-*.npz"))


def test_aeons_own_sets_are_listed_from_its_installed_package():
    """The series extra installs aeon: its bundled classification sets (PickupGestureWiimoteZ, which
    sktime does not ship) are reachable by name; its regression sets are not."""
    from importlib import util

    if util.find_spec("aeon") is None:
        pytest.skip("aeon is not installed (pip install 'geoattn[series]')")
    sets = bundled_sets()
    assert sets["PickupGestureWiimoteZ"][0] == "aeon"
    assert "Covid3Month" not in sets


# ----------------------------------------------------------------------------- .ts -------------------
def test_ts_pair_is_read_by_sktime_with_missing_values_masked(ts_pair):
    data = read_data(ts_pair)
    assert data.channels == 2 and (len(data.train), len(data.test)) == (8, 4) and data.classes == ["a", "b"]
    X, _ = toy_arrays(0, 8)
    np.testing.assert_allclose(data.train.series[0], X[0].T)
    assert np.isnan(data.train.series[1][2, 1]) and not np.isnan(data.train.series[1][2, 0])
    assert np.array_equal(data.train.times[0], np.arange(6.0)) and data.partial
    # a folder holding the pair reads the same
    assert read_data(ts_pair.parent).train.labels.tolist() == data.train.labels.tolist()
    task = SeriesTask.from_options({"val_fraction": 0.25}, data=str(ts_pair), block_size=8)
    assert task.config.drop == 0.0 and task.partial and task.grid == "unit"  # --data: nothing dropped
    x = task.split("train").x
    assert torch.isnan(x[..., 2:]).sum() == (1 if 1 in task_fit(task) else 0)
    assert int(task.split("test").lengths.min()) == 6


def task_fit(task: SeriesTask) -> list[int]:
    from geoattn.tasks.series.data import stratified_split

    labels = np.array([0, 1] * 4)
    return stratified_split(labels, task.config.val_fraction, task.config.seed)[0].tolist()


def test_unequal_lengths_are_kept(tmp_path):
    data = read_data(unequal_pair(tmp_path))
    assert [len(s) for s in data.train.series] == [3, 5, 4, 6]
    assert not data.partial and data.time_scale == 6.0
    task = SeriesTask(SeriesConfig(val_fraction=0.5), data)
    assert sorted(task.split("test").lengths.tolist()) == [3, 4]


# ----------------------------------------------------------------------------- long tables ---------
def test_long_table_keeps_each_channels_own_times(table):
    data = read_data(table)
    assert data.channel_names == ["bp", "hr"] and data.classes == ["high", "low"]
    assert (len(data.train), len(data.test)) == (10, 4) and data.partial and not data.sample_times
    frame = pd.read_csv(table)
    rows = frame[frame["id"] == "train3"].sort_values("time")
    series, times = data.train.series[3], data.train.times[3]  # ids sort: train0, train1, ...
    assert np.allclose(times, rows["time"].unique() - rows["time"].min())  # from the first observation
    hr = rows[rows["channel"] == "hr"]
    at = np.searchsorted(times, hr["time"].to_numpy() - rows["time"].min())
    np.testing.assert_allclose(series[at, 1], hr["value"].to_numpy())
    assert np.isnan(series[at, 0]).all()  # bp was not observed at hr's times
    task = SeriesTask(SeriesConfig(val_fraction=0.2), data)
    assert task.grid == "rows" and task.config.drop == 0.0
    x, _ = task.get_batch("train", 4, torch.Generator().manual_seed(0))
    assert torch.isnan(x[..., 2:]).any() and not torch.equal(x[0, :, 0], x[0, :, 0].round())


def test_labels_table_and_file_pair(tmp_path):
    for split, n, seed in (("TRAIN", 6, 0), ("TEST", 2, 1)):
        frame = pd.DataFrame(long_rows(n, split.lower(), seed)).drop(columns=["label", "split"])
        frame.to_csv(tmp_path / f"icu_{split}.csv", index=False)
    labels = pd.DataFrame(
        [
            {"id": f"{s}{i}", "label": "low" if i % 2 == 0 else "high"}
            for s, n in (("train", 6), ("test", 2))
            for i in range(n)
        ]
    )
    labels.to_csv(tmp_path / "labels.csv", index=False)
    data = read_data(tmp_path / "icu_TRAIN.csv", tmp_path / "labels.csv")
    assert (len(data.train), len(data.test)) == (6, 2)
    assert [data.classes[k] for k in data.train.labels] == ["low", "high"] * 3


def test_parquet_table(parquet, table):
    from_parquet, from_csv = read_data(parquet), read_data(table)
    assert len(from_parquet.train) == 10
    for a, b in zip(from_parquet.train.series, from_csv.train.series):
        np.testing.assert_allclose(a, b, rtol=1e-12)  # CSV parsing may round the last digits


# ----------------------------------------------------------------------------- bad input -------------
def _table(tmp_path, change) -> Path:
    frame = change(pd.DataFrame(long_rows(6, "train", 0) + long_rows(2, "test", 1)))
    path = tmp_path / "bad.csv"
    frame.to_csv(path, index=False)
    return path


TABLE_FAULTS = {
    "missing column": (lambda f: f.drop(columns="value"), r"bad\.csv: no column value"),
    "misnamed column": (lambda f: f.rename(columns={"time": "t"}), r"bad\.csv: no column time"),
    "NaN label": (lambda f: f.assign(label=f["label"].where(f.index != 3)), r"missing label \(NaN\)"),
    "unseen class": (
        lambda f: f.assign(label=np.where(f["id"] == "test1", "mid", f["label"])),
        r"class\(es\) mid of the test split have no training example",
    ),
    "different channels": (
        lambda f: f.assign(
            channel=np.where((f["split"] == "test") & (f["channel"] == "bp"), "spo2", f["channel"])
        ),
        r"train and test have different channels",
    ),
    "empty split": (lambda f: f[f["split"] == "train"], r"the test split has no series"),
    "unknown split": (lambda f: f.assign(split=f["split"].replace("test", "tst")), r"split 'tst'"),
    "two labels": (
        lambda f: f.assign(label=np.where(f.index == 0, "high", f["label"])),
        r"series train0 has more than one label",
    ),
    "text values": (lambda f: f.assign(value="x"), r"column 'value' is not numeric"),
    "duplicate": (lambda f: pd.concat([f, f.iloc[:1]]), r"series train0 has two values of channel"),
}


@pytest.mark.parametrize("fault", TABLE_FAULTS)
def test_bad_tables_are_one_line_data_errors(tmp_path, fault):
    change, message = TABLE_FAULTS[fault]
    with pytest.raises(DataError, match=message) as err:
        read_data(_table(tmp_path, change=change))
    assert "\n" not in str(err.value) and "bad.csv" in str(err.value)


def test_a_label_missing_from_the_labels_table(tmp_path):
    path = _table(tmp_path, change=lambda f: f.drop(columns="label"))
    pd.DataFrame({"id": ["train0"], "label": ["low"]}).to_csv(tmp_path / "labels.csv", index=False)
    with pytest.raises(DataError, match="series train1 has no label in task.labels"):
        read_data(path, tmp_path / "labels.csv")
    pd.DataFrame({"id": ["x"], "lab": ["low"]}).to_csv(tmp_path / "labels.csv", index=False)
    with pytest.raises(DataError, match=r"labels\.csv: no column label"):
        read_data(path, tmp_path / "labels.csv")


def test_bad_ts_files(ts_pair, tmp_path):
    text = ts_pair.read_text()
    ts_pair.write_text(text[: len(text) * 2 // 3])  # cut in the middle of a series
    with pytest.raises(DataError, match=r"Toy_TRAIN\.ts: not a readable \.ts file"):
        read_data(ts_pair)
    ts_pair.write_text("@problemName Toy\n@classLabel true a b\n@data\n1,2,x:a\n")
    with pytest.raises(DataError, match=r"Toy_TRAIN\.ts: not a readable \.ts file"):
        read_data(ts_pair)
    ts_pair.write_text(text)
    (ts_pair.parent / "Toy_TEST.ts").unlink()
    with pytest.raises(DataError, match=r"Toy_TEST\.ts: no such file"):
        read_data(ts_pair)
    # a test file with three channels against the training file's two
    write_ts(tmp_path, "Toy", "_TEST", np.zeros((2, 3, 6)), ["a", "b"])
    with pytest.raises(DataError, match=r"Toy_TEST\.ts: 3 channels, but Toy_TRAIN\.ts has 2"):
        read_data(ts_pair)
    # a test class the training file never shows
    write_ts(tmp_path, "Toy", "_TEST", np.zeros((2, 2, 6)), ["a", "c"], labels=("a", "b", "c"))
    with pytest.raises(DataError, match="class\\(es\\) c of the test split have no training example"):
        read_data(ts_pair)
    with pytest.raises(DataError, match="expected a NAME_TRAIN.ts"):
        read_data(ts_pair.parent / "Toy_TEST.ts")


def test_no_series_in_a_split(tmp_path, ts_pair):
    header = "@problemName Toy\n@timestamps false\n@univariate false\n@classLabel true a b\n@data\n"
    (ts_pair.parent / "Toy_TEST.ts").write_text(header)
    with pytest.raises(DataError, match=r"Toy_TEST\.ts"):
        read_data(ts_pair)


# ----------------------------------------------------------------------------- models --------------
@pytest.fixture(scope="module")
def irregular_task(tmp_path_factory) -> SeriesTask:
    path = tmp_path_factory.mktemp("irr") / "obs.csv"
    pd.DataFrame(long_rows(10, "train", 0) + long_rows(4, "test", 1)).to_csv(path, index=False)
    return SeriesTask.from_options({}, data=str(path), block_size=8)


MODELS = [("rt", {}), ("rt", {"times": "index"}), ("mtan", {}), ("grud", {}), ("ncde", {})]


@pytest.mark.parametrize("name,options", MODELS)
def test_every_model_reads_an_irregular_batch(irregular_task, name, options):
    torch.manual_seed(0)
    model = irregular_task.build_model(name, SIZES, options).eval()
    x, y = irregular_task.get_batch("train", 5, torch.Generator().manual_seed(3))
    assert torch.isnan(x[..., 2:]).any()
    logits, loss = model(x, y)
    assert logits.shape == (5, 2) and torch.isfinite(logits).all() and torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        padded = torch.cat((x, torch.zeros(5, 4, x.shape[-1])), 1)
        torch.testing.assert_close(model(padded)[0], logits.detach(), rtol=0, atol=2e-5)
        # an unobserved channel is not the same as one observed at 0 (the mask is read)
        zeroed = torch.nan_to_num(x, nan=0.0)
        assert (model(zeroed)[0] - logits).abs().max() > 1e-5


def test_unit_grid_refuses_real_times(irregular_task):
    model = irregular_task.build_model("grud", SIZES, {"grid": "unit"})
    x, y = irregular_task.get_batch("train", 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="model.grid='rows' takes any times"):
        model(x, y)


def test_per_channel_fill_follows_torchcde(irregular_task):
    torchcde = pytest.importorskip("torchcde")
    x, _ = irregular_task.get_batch("test", 4, torch.Generator().manual_seed(0))
    grid = to_grid(x, "rows")
    assert bool(grid.observed.any(1).all())  # every channel seen in every series
    filled = fill_linear(grid)
    for i in range(4):  # torchcde takes one time axis: series by series, each on its own times
        n = int(grid.last[i]) + 1
        expected = torchcde.linear_interpolation_coeffs(grid.values[i, :n], t=grid.times[i, :n])
        torch.testing.assert_close(filled[i, :n], expected, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- the table -----------
def test_the_model_table_is_the_task_s_models():
    assert SeriesTask.table is TABLE and list(SeriesTask.models) == ["rt", "mtan", "grud", "ncde"]
    assert SeriesTask.recipes["rt"]["lr"] == 1e-2 and SeriesTask.recipes["ncde"]["lr"] == 1e-3
    assert SeriesTask.model_settings("rt")[1][-1] == "block_size"
    config = build_config({"task": "series", "model": "grud", "lr": 3e-3})
    assert (config.lr, config.max_iters, config.n_embd) == (3e-3, 400, 64)
    source = "".join(p.read_text() for p in Path("geoattn/tasks/series").glob("*.py"))
    assert not re.search(r"model (==|!=|in \()", source)


# ----------------------------------------------------------------------------- sealed test ---------
def test_a_sealed_test_set_is_never_read(irregular_task, monkeypatch):
    model = irregular_task.build_model("mtan", SIZES)
    irregular_task.sealed = frozenset(irregular_task.test_sets)
    try:

        class Untouchable:
            def __getattr__(self, name):
                raise AssertionError("the sealed test split was read")

        monkeypatch.setitem(irregular_task.splits, "test", Untouchable())
        metrics = irregular_task.final_metrics(model, torch.device("cpu"))
        assert "val_acc_full" in metrics and not any("test" in k for k in metrics)
        with pytest.raises(ValueError, match="sealed"):
            irregular_task.get_batch("test", 2, torch.Generator())
    finally:
        irregular_task.sealed = frozenset()


# ----------------------------------------------------------------------------- end to end ---------
def test_data_and_dataset_together_are_refused(ts_pair):
    with pytest.raises(ConfigError, match="give --data or task.dataset, not both"):
        SeriesTask.from_options({"dataset": "GunPoint"}, data=str(ts_pair), block_size=8)


@pytest.mark.parametrize("kind", ["ts", "csv", "parquet"])
def test_train_reads_data(request, tmp_path, ts_pair, table, kind):
    data = {"ts": ts_pair, "csv": table}.get(kind) or request.getfixturevalue("parquet")
    out = tmp_path / "run"
    argv = ["train", "--task", "series", "--model", "rt", "--data", str(data), *TINY, "--out", str(out)]
    assert main([*argv, "--set", "task.val_fraction=0.25"]) == 0
    assert (out / "model.safetensors").is_file()


def test_train_refuses_a_bad_file_in_one_line(tmp_path, ts_pair, capsys):
    (ts_pair.parent / "Toy_TEST.ts").unlink()
    out = tmp_path / "run"
    code = main(
        ["train", "--task", "series", "--model", "grud", "--data", str(ts_pair), *TINY, "--out", str(out)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Toy_TEST.ts: no such file" in err[0]
    assert not out.exists()


SPEC = """
description = "series on a user's file"
seeds = [1]
metrics = ["val_acc_full"]

[base]
task = "series"
data = "{data}"
max_iters = 3
eval_interval = 3
eval_iters = 1
n_layer = 1
n_head = 2
n_embd = 16
batch_size = 4
plots = false
task_options = {{ val_fraction = 0.25 }}

[[cells]]
name = "rt"
model = "rt"
"""


@pytest.mark.parametrize("kind", ["ts", "csv", "parquet"])
def test_experiment_reads_data(request, tmp_path, ts_pair, table, kind, monkeypatch):
    data = {"ts": ts_pair, "csv": table}.get(kind) or request.getfixturevalue("parquet")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "mine.toml").write_text(SPEC.format(data=data))
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "mine"]) == 0
    report = (tmp_path / "results" / "mine.md").read_text()
    assert "val_acc_full" in report
