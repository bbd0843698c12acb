"""The series task: the bundled loader, the dropping protocol, the packed batches, every model's forward,
padding invariance, and that rt reads the times (and rt with index positions does not)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from geoattn.core.errors import ConfigError
from geoattn.models.base import ModelSizes
from geoattn.tasks import get_task, task_class

pytest.importorskip("sktime", reason="the 'series' extra (sktime, torchcde) is not installed")

from geoattn.tasks.series.data import kept_indices, load_dataset, pack, stratified_split  # noqa: E402
from geoattn.tasks.series.models import Grid, fill_linear, to_grid  # noqa: E402
from geoattn.tasks.series.task import SeriesConfig, SeriesTask  # noqa: E402

SIZES = ModelSizes(n_layer=2, n_head=2, n_embd=16)
MODELS = [("rt", {}), ("rt", {"times": "index"}), ("mtan", {}), ("grud", {}), ("ncde", {})]


@pytest.fixture(scope="module")
def task() -> SeriesTask:
    return SeriesTask(SeriesConfig(drop=0.5, seed=3))


def _model(task: SeriesTask, name: str, options: dict):
    torch.manual_seed(0)
    return task.build_model(name, SIZES, options).eval()


def test_japanese_vowels_as_bundled():
    assert task_class("series") is SeriesTask
    data = load_dataset("japanesevowels")  # the name's case is free
    assert (len(data.train), len(data.test), data.channels) == (270, 370, 12)
    assert data.classes == [str(k) for k in range(1, 10)]
    lengths = [len(s) for s in data.train.series + data.test.series]
    assert (min(lengths), max(lengths)) == (7, 29)
    assert set(data.train.labels.tolist()) == set(range(9))
    assert all(s.shape[1] == 12 and s.dtype == np.float64 for s in data.test.series)
    # the validation split: 20 % of each class, disjoint from the rest, the same for the same seed
    fit, val = stratified_split(data.train.labels, 0.2, seed=0)
    assert len(fit) + len(val) == 270 and not set(fit) & set(val) and len(val) == 54
    assert np.array_equal(np.bincount(data.train.labels[val]), np.full(9, 6))
    assert np.array_equal(stratified_split(data.train.labels, 0.2, seed=0)[1], val)


def test_dropping_is_seeded_per_series_and_removes_the_fraction():
    kept = kept_indices(20, 0.3, 0, "train", 5)
    assert np.array_equal(kept, kept_indices(20, 0.3, 0, "train", 5))
    assert len(kept) == 20 - 6 and np.all(np.diff(kept) > 0) and kept.max() < 20
    assert not np.array_equal(kept, kept_indices(20, 0.3, 1, "train", 5))  # another seed
    assert not np.array_equal(kept, kept_indices(20, 0.3, 0, "test", 5))  # another series
    assert len(kept_indices(7, 0.7, 0, "train", 0)) == 7 - 4
    assert np.array_equal(kept_indices(9, 0.0, 0, "train", 0), np.arange(9))


def test_batches_keep_times_aligned_with_their_observations(task):
    data = load_dataset("JapaneseVowels")
    test = task.split("test")
    assert test.x.shape == (370, int(test.lengths.max()), 14) and test.y.dtype == torch.long
    series = data.test.series
    assert [int(n) for n in test.lengths] == [len(s) - int(0.5 * len(s)) for s in series]
    for i in (0, 17, 369):
        n = int(test.lengths[i])
        times = test.x[i, :n, 0].long().numpy()
        assert np.array_equal(times, kept_indices(len(series[i]), 0.5, 3, "test", i))
        assert torch.equal(test.x[i, :n, 1], torch.ones(n)) and not test.x[i, n:].any()
        # each row holds the values observed at its time, normalised with the training statistics
        expected = torch.from_numpy((series[i][times] - task.mean) / task.std).float()
        torch.testing.assert_close(test.x[i, :n, 2:], expected)
    assert np.allclose(task.std, np.concatenate([data.train.series[i] for i in fit_indices(task)]).std(0))
    x, y = task.get_batch("val", 8, torch.Generator().manual_seed(0))
    assert x.shape[0] == 8 and x.shape[1] == int(x[..., 1].sum(1).max()) and y.shape == (8,)


def fit_indices(task: SeriesTask) -> np.ndarray:
    """The training series of ``task`` (its set's train split less the validation series)."""
    labels = load_dataset(task.config.dataset).train.labels
    return stratified_split(labels, task.config.val_fraction, task.config.seed)[0]


def test_bad_settings_name_their_key():
    for options, key in (
        ({"dataset": "NoSuchSet"}, "task.dataset"),
        ({"drop": 1.0}, "task.drop"),
        ({"drop": -0.1}, "task.drop"),
        ({"drop": "half"}, "task.drop"),
    ):
        with pytest.raises(ConfigError, match=key) as err:
            get_task("series", options, block_size=64)
        assert "\n" not in str(err.value)


def test_a_missing_package_is_a_one_line_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchcde", None)  # import torchcde now fails
    with pytest.raises(ConfigError, match="'torchcde': pip install 'geoattn\\[series\\]'"):
        SeriesTask(SeriesConfig()).build_model("ncde", SIZES)
    monkeypatch.setitem(sys.modules, "sktime", None)
    with pytest.raises(ConfigError, match="'sktime': pip install 'geoattn\\[series\\]'"):
        load_dataset("JapaneseVowels")


@pytest.mark.parametrize("name,options", MODELS)
def test_forward_and_padding_invariance(task, name, options):
    model = _model(task, name, options)
    x, y = task.get_batch("train", 6, torch.Generator().manual_seed(1))
    logits, loss = model(x, y)
    assert logits.shape == (6, 9) and torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        padded = torch.cat((x, torch.zeros(6, 7, x.shape[-1])), 1)  # seven more padding rows
        torch.testing.assert_close(model(padded)[0], logits.detach(), rtol=0, atol=2e-6)
        # a series alone (no padding) reads the same as inside the batch
        n = int(x[2, :, 1].sum())
        torch.testing.assert_close(model(x[2:3, :n])[0], logits.detach()[2:3], rtol=0, atol=2e-6)


def test_rt_reads_the_times_and_its_index_ablation_does_not(task):
    x, _ = task.get_batch("train", 6, torch.Generator().manual_seed(2))
    stretched = x.clone()
    stretched[..., 0] = x[..., 0] * 2.0 + 1.0  # the same order, other gaps
    for options, changes in (({}, True), ({"times": "index"}, False)):
        model = _model(task, "rt", options)
        with torch.no_grad():
            difference = (model(stretched)[0] - model(x)[0]).abs().max()
        assert (difference > 1e-3) if changes else (difference == 0), (options, difference)


def test_grid_and_interpolation_follow_torchcde():
    torchcde = pytest.importorskip("torchcde")
    observations = [
        (np.array([1.0, 2.0, 5.0]), np.arange(6.0).reshape(3, 2)),
        (np.array([0.0, 4.0]), np.array([[1.0, -1.0], [3.0, 5.0]])),
    ]
    grid = to_grid(pack(observations, length=4))
    assert grid.values.shape == (2, 6, 2) and grid.last.tolist() == [5, 4]
    assert grid.observed[0].all(-1).tolist() == [False, True, True, False, False, True]  # per channel
    torch.testing.assert_close(grid.values[1, 4], torch.tensor([3.0, 5.0]))
    assert torch.isnan(grid.values[1, 1:4]).all() and torch.isnan(grid.values[1, 5]).all()
    expected = torchcde.linear_interpolation_coeffs(grid.values)
    assert torch.equal(fill_linear(grid), expected)
    # the same on a real batch with many gaps
    task = SeriesTask(SeriesConfig(drop=0.7))
    x, _ = task.get_batch("test", 16, torch.Generator().manual_seed(0))
    batch = to_grid(x)
    assert torch.equal(fill_linear(batch), torchcde.linear_interpolation_coeffs(batch.values))
    with pytest.raises(ValueError, match="integer times"):
        bad = x.clone()
        bad[0, 0, 0] = 0.5
        to_grid(bad)
    assert isinstance(batch, Grid)


def test_rt_fits_a_batch(task):
    """Trainability end to end: 30 AdamW steps on one batch of 32 series bring the loss below 0.5, and
    the trained model still ignores padding (its zero keys stay far below the valid ones)."""
    model = _model(task, "rt", {}).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = task.get_batch("train", 32, torch.Generator().manual_seed(0))
    for _ in range(30):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.normalize_weights()
    assert float(loss.detach()) < 0.5
    with torch.no_grad():
        padded = torch.cat((x, torch.zeros(32, 5, x.shape[-1])), 1)
        torch.testing.assert_close(model(padded)[0], model(x)[0], rtol=0, atol=1e-5)
