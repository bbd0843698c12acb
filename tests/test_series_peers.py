"""The series task's peers (``benchmarks/series_peers.py``): the splits they train on are the task's own,
every kept observation on the peers' grid at its sample time; the test split leaves geoattn only when
the run may read it; the Neural CDE learns a toy set; one epoch of a PyPOTS classifier in the peers'
venv (skipped where ``benchmarks/setup_series_peers.sh`` has not made it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sktime", reason="the 'series' extra (sktime, torchcde) is not installed")

from sktime.datasets import write_ndarray_to_tsfile  # noqa: E402

from geoattn.tasks.series.data import stratified_split  # noqa: E402

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "series_peers.py"
PEERS_PYTHON = Path(os.environ.get("GEOATTN_PEERS", ROOT.parent / "peers")) / "pypots-venv" / "bin" / "python"
LENGTH = 10

_spec = importlib.util.spec_from_file_location("series_peers", SCRIPT)
peers = sys.modules["series_peers"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(peers)


def _arrays(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``X (n, 2, LENGTH)`` whose class shifts the mean, and labels ``a`` / ``b``."""
    rng = np.random.default_rng(seed)
    y = np.array(["a", "b"] * (n // 2))
    return rng.normal(size=(n, 2, LENGTH)) + 3.0 * (y == "b")[:, None, None], y


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """Toy_TRAIN.ts (20 series, 2 channels, 10 points) and Toy_TEST.ts (10), written by sktime; the
    path of the train file and its arrays."""
    folder = tmp_path_factory.mktemp("toy")
    arrays = {"_TRAIN": _arrays(0, 20), "_TEST": _arrays(1, 10)}
    for fold, (X, y) in arrays.items():
        write_ndarray_to_tsfile(
            X, str(folder), problem_name="Toy", class_label=["a", "b"], class_value_list=y,
            equal_length=True, series_length=LENGTH, fold=fold,
        )  # fmt: skip
    return folder / "Toy" / "Toy_TRAIN.ts", *arrays["_TRAIN"]


def test_every_kept_observation_sits_at_its_sample_time(toy, tmp_path):
    path, X, y = toy
    peers.export({"drop": 0.5}, str(path), False, tmp_path / "splits.npz")
    data = peers.load_splits(tmp_path / "splits.npz")
    assert data.steps == LENGTH and data.channels == 2 and data.n_classes == 2
    labels = (y == "b").astype(np.int64)
    fit, val = stratified_split(labels, 0.2, 0)  # the task's validation split (task.seed 0)
    series = X.transpose(0, 2, 1)  # (n, LENGTH, C)
    mean, std = series[fit].reshape(-1, 2).mean(0), series[fit].reshape(-1, 2).std(0)
    for split, rows in (("train", fit), ("val", val)):
        np.testing.assert_array_equal(data.y[split], labels[rows])
        for k, i in enumerate(rows):
            kept = ~np.isnan(data.X[split][k]).any(1)
            assert kept.sum() == LENGTH - LENGTH // 2  # half of the points dropped, all channels at once
            expected = (series[i] - mean) / std
            np.testing.assert_allclose(data.X[split][k][kept], expected[kept], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(
                data.t[split][k][: data.last[split][k] + 1], np.arange(data.last[split][k] + 1)
            )


def test_the_test_split_leaves_geoattn_only_when_readable(toy, tmp_path):
    path = toy[0]
    peers.export({}, str(path), False, tmp_path / "sealed.npz")
    peers.export({}, str(path), True, tmp_path / "open.npz")
    with np.load(tmp_path / "sealed.npz") as sealed, np.load(tmp_path / "open.npz") as read:
        assert not any(k.startswith("test") for k in sealed.files)
        assert read["test_x"].shape[0] == 10
        np.testing.assert_array_equal(sealed["train_x"], read["train_x"])  # the same training data


def test_a_table_s_rows_keep_their_order_and_times():
    # two series packed as the task packs them: [time, mask, values (C = 1)], the second one shorter
    x = np.zeros((2, 3, 3), dtype=np.float32)
    x[0, :, 0], x[0, :, 2] = [0.0, 0.5, 2.5], [1.0, np.nan, 3.0]
    x[1, :2, 0], x[1, :2, 2] = [0.0, 7.0], [5.0, 6.0]
    X, t, last = peers.on_grid(x, np.array([3, 2]), "rows", 4)
    np.testing.assert_array_equal(last, [2, 1])
    np.testing.assert_array_equal(t[0, :3], [0.0, 0.5, 2.5])
    np.testing.assert_array_equal(X[1, :2, 0], [5.0, 6.0])
    assert np.isnan(X[0, 1, 0]) and np.isnan(X[1, 2:]).all() and np.isnan(t[1, 2:]).all()
    with pytest.raises(ValueError, match="do not fit a unit grid of 2 rows"):
        peers.on_grid(x[1:], np.array([2]), "unit", 2)  # time 7 is past the grid
    with pytest.raises(ValueError, match="do not fit a unit grid of 4 rows"):
        peers.on_grid(x, np.array([3, 2]), "unit", 4)  # time 0.5 is no sample index


def test_the_ncde_path_is_constant_after_the_last_observation():
    x = np.zeros((1, 2, 3), dtype=np.float32)
    x[0, :, 0], x[0, :, 2] = [0.0, 2.0], [1.0, 3.0]
    data = peers.Splits(
        *({"train": a} for a in peers.on_grid(x, np.array([2]), "unit", 5)), {"train": [0]}, 2
    )
    path = peers.ncde_path(data, "train").numpy()[0]  # [time, value, observed count]
    np.testing.assert_array_equal(path[:, 0], [0, 1, 2, 2, 2])
    np.testing.assert_array_equal(path[:, 2], [1, 1, 2, 2, 2])
    assert np.isnan(path[1, 1]) and (path[2:, 1] == 3.0).all()


def test_the_ncde_learns_the_toy_classes(toy, tmp_path):
    pytest.importorskip("torchcde")
    peers.export({"drop": 0.5}, str(toy[0]), False, tmp_path / "splits.npz")
    data = peers.load_splits(tmp_path / "splits.npz")
    peers.seed_everything(0)
    args = peers.parse(
        ["--model", "ncde", "--out", str(tmp_path), "--epochs", "5", "--width", "8", "--lr", "1e-2"]
    )
    trained = peers.train_ncde(data, args)
    accuracy, _ = peers._accuracy_and_loss(trained.proba("train"), data.y["train"])
    assert accuracy >= 0.9  # the classes differ by 3 standard deviations
    assert 1 <= trained.best_epoch <= trained.epochs == 5


@pytest.mark.skipif(
    not PEERS_PYTHON.exists(),
    reason=f"the peers' venv {PEERS_PYTHON} is missing: run bash benchmarks/setup_series_peers.sh",
)
def test_one_epoch_of_a_pypots_classifier(toy, tmp_path):
    command = [str(PEERS_PYTHON), str(SCRIPT), "--model", "grud", "--data", str(toy[0])]
    command += ["--out", str(tmp_path), "--python", sys.executable, "--read-test"]
    command += ["--epochs", "1", "--width", "8", "--seed", "3"]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, timeout=600)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.0 <= metrics["val_acc_full"] <= 1.0 and metrics["val_loss_full"] > 0
    assert 0.0 <= metrics["test_acc"] <= 1.0
    assert metrics["params"] > 0 and metrics["epochs"] == 1 and metrics["width"] == 8
