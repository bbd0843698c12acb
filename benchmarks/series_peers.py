"""The series task's peers run from their authors' code: PyPOTS's GRU-D, BRITS and Raindrop classifiers
(each trained by PyPOTS's own ``fit``) and a Neural CDE on torchcde, on the identical splits
``geoattn train --task series`` reads. One model, one seed, one ``OUT/metrics.json``.

Run with the peers' venv (``benchmarks/setup_series_peers.sh``), from the repository root::

    ../peers/pypots-venv/bin/python benchmarks/series_peers.py --model grud --python .venv/bin/python \\
        --task-options '{"dataset": "JapaneseVowels", "drop": 0.5}' --seed 1 --out /tmp/grud --threads 1

The splits. The peers' venv has no geoattn: this file, run by geoattn's interpreter (``--python``) as
``export``, builds the series task (``geoattn.tasks.get_task("series", task_options, data=...)``, the
same call the experiment runner makes) and writes its packed ``train``, ``val`` and (when readable)
``test`` splits, ``x (n, N, 2 + C)`` = [time, mask, normalised values with NaN where a channel was not
observed] and ``y (n,)``: the same series, dropped points, validation split and normalisation as every
geoattn model. The test split is exported only with ``--read-test`` (or ``GEOATTN_READ_TEST=1``): an
exploratory run never reads it.

The grid. PyPOTS's classifiers read ``X (n, T, C)`` on a regular grid, NaN where missing, and count
time in grid steps (GRU-D's decays, BRITS's deltas, Raindrop's timestamps ``0 … T − 1``). For a set
whose times are sample indices (bundled sets, ``.ts`` files) the grid is the set's native one: row
``t`` of a series is its sample ``t``, so a dropped point is a NaN row and the gaps are the real gaps;
``T`` is the longest series of the set (train and test). For a long table with real times the grid is
each series' own observation times in order (row ``j`` = its ``j``-th observation, ``T`` the most
observations of a series), as geoattn's ``grud`` and ``ncde`` do on ``model.grid=rows``; the real
times then reach only the Neural CDE (its time channel). Rows after a series' last observation are
NaN (PyPOTS's padding).

The models (:data:`MODELS`):

* ``grud``, ``brits``, ``raindrop``: ``pypots.classification``'s classes at the sizes PyPOTS's own
  tests build them with (GRU-D 256 hidden, BRITS 32 hidden, Raindrop 2 layers of ``d_model = 4 C``,
  2 heads, FFN 256, dropout 0.3; ``--width`` sets the first number; Adam with weight decay 1e-5),
  batch 32, trained by PyPOTS's ``fit`` on our training split with our validation split as its
  validation set: PyPOTS keeps the epoch of the lowest validation cross-entropy and stops after
  ``--patience`` epochs without a better one. Raindrop's graph layers import ``torch_scatter`` and
  ``torch_sparse``, which have no build for this torch: :func:`_scatter_shims` maps them onto
  torch_geometric's own ``scatter`` (the same reductions; ``SparseTensor`` is only ever tested with
  ``isinstance`` on these dense inputs).
* ``ncde``: torchcde's recipe for irregular data (its ``example/irregular_data.py``): Hermite cubic
  coefficients with backward differences of ``[time, values, cumulative observed count per channel]``,
  NaN where missing, series filled forward after their last observation; the Neural CDE paper's UEA
  model and loop (Kidger et al. 2020, its ``experiments/uea.py`` and ``common.py``): 32 hidden
  channels (``--width``), a vector field of 3 layers 32 wide with a final tanh, ``z0`` from the first
  observation, RK4 at one step per grid point, Adam at lr 1e-3, batch 32, scored every 10 epochs, the
  model of the best validation accuracy kept, ReduceLROnPlateau (patience 1) on it, and training
  stopped when the training loss or the training accuracy has not improved for 50 epochs.

``metrics.json``: ``val_acc_full``, ``val_loss_full`` (every validation series), ``test_acc`` (only
when the test split is readable), ``params``, ``epochs`` (trained), ``best_epoch``, ``lr``,
``width``, ``wall_s`` (training and scoring) and ``export_s``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SPLITS = ("train", "val", "test")
READ_TEST_ENV = "GEOATTN_READ_TEST"


# --------------------------------------------------------------------------------------------------
# The splits, exported by geoattn's own interpreter


def export(options: dict, data: str | None, read_test: bool, path: Path) -> None:
    """Write the series task's packed splits to ``path`` (``.npz``); run by geoattn's interpreter."""
    from geoattn.tasks import get_task
    from geoattn.training.config import TrainConfig

    task = get_task("series", options, data=data, block_size=TrainConfig.block_size)
    if not read_test:
        task.sealed = frozenset(task.test_sets)
    arrays = {
        "grid": np.array(task.grid),
        # the grid's length: the set's longest series (sample times) or most observations (rows)
        "steps": np.array(int(task.time_scale) if task.grid == "unit" else task.longest),
        "n_classes": np.array(len(task.classes)),
    }
    for name in filter(task.readable, SPLITS):
        split = task.split(name)
        arrays[f"{name}_x"] = split.x.numpy()
        arrays[f"{name}_y"] = split.y.numpy()
        arrays[f"{name}_lengths"] = split.lengths.numpy()
    np.savez(path, **arrays)


@dataclass
class Splits:
    """The task's splits on the peers' grid: per split ``X (n, T, C)`` float32 (NaN: not observed),
    its row times ``t (n, T)`` (NaN after the last observation), the last observed row ``last (n,)``
    and the labels ``y (n,)``."""

    X: dict[str, np.ndarray]
    t: dict[str, np.ndarray]
    last: dict[str, np.ndarray]
    y: dict[str, np.ndarray]
    n_classes: int

    @property
    def steps(self) -> int:
        return self.X["train"].shape[1]

    @property
    def channels(self) -> int:
        return self.X["train"].shape[2]


def load_splits(path: Path) -> Splits:
    """The exported ``.npz`` on the grid of the module docstring (``unit``: row = sample time;
    ``rows``: row = observation)."""
    with np.load(path) as f:
        grid, steps, n_classes = str(f["grid"]), int(f["steps"]), int(f["n_classes"])
        names = [s for s in SPLITS if f"{s}_x" in f.files]
        out = Splits({}, {}, {}, {}, n_classes)
        for name in names:
            X, t, last = on_grid(f[f"{name}_x"], f[f"{name}_lengths"], grid, steps)
            out.X[name], out.t[name], out.last[name], out.y[name] = X, t, last, f[f"{name}_y"]
    return out


def on_grid(x: np.ndarray, lengths: np.ndarray, grid: str, steps: int) -> tuple[np.ndarray, ...]:
    """Packed ``x (n, N, 2 + C)`` with ``lengths (n,)`` → ``X (n, steps, C)`` (NaN where missing), row
    times ``t (n, steps)`` and last observed row ``last (n,)``; ValueError naming a time off the grid."""
    n, _, width = x.shape
    X = np.full((n, steps, width - 2), np.nan, dtype=np.float32)
    t = np.full((n, steps), np.nan, dtype=np.float32)
    last = np.zeros(n, dtype=np.int64)
    for i, k in enumerate(lengths):
        times, values = x[i, :k, 0], x[i, :k, 2:]
        rows = _ROWS[grid](times)
        if rows[-1] >= steps or (np.diff(rows) <= 0).any() or (grid == "unit" and (rows != times).any()):
            raise ValueError(f"series {i}: times {times.tolist()} do not fit a {grid} grid of {steps} rows")
        X[i, rows], last[i] = values, rows[-1]
        t[i, : rows[-1] + 1] = np.arange(rows[-1] + 1) if grid == "unit" else times
    return X, t, last


# the row of each observation: its sample index on the set's native grid, its rank on a table's own
_ROWS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "unit": lambda times: np.rint(times).astype(np.int64),
    "rows": lambda times: np.arange(len(times)),
}


# --------------------------------------------------------------------------------------------------
# PyPOTS's classifiers


@dataclass
class Trained:
    """A trained peer: ``proba(split) -> (n, K)`` class probabilities, its size and epochs."""

    proba: Callable[[str], np.ndarray]
    params: int
    epochs: int
    best_epoch: int


def _scatter_shims() -> None:
    """``torch_scatter.scatter`` and ``torch_sparse.SparseTensor`` from torch_geometric, for
    Raindrop's layers (module docstring)."""
    from torch_geometric import typing as pyg_typing
    from torch_geometric.utils import scatter

    for name, attrs in (
        ("torch_scatter", {"scatter": scatter}),
        ("torch_sparse", {"SparseTensor": pyg_typing.SparseTensor}),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module


def _grud(data: Splits, width: int, common: dict):
    from pypots.classification import GRUD

    return GRUD(data.steps, data.channels, data.n_classes, rnn_hidden_size=width, **common)


def _brits(data: Splits, width: int, common: dict):
    from pypots.classification import BRITS

    return BRITS(data.steps, data.channels, data.n_classes, rnn_hidden_size=width, **common)


def _raindrop(data: Splits, width: int, common: dict):
    _scatter_shims()
    from pypots.classification import Raindrop

    return Raindrop(
        data.steps, data.channels, data.n_classes, n_layers=2, d_model=width * data.channels, n_heads=2,
        d_ffn=256, dropout=0.3, d_static=0, aggregation="mean", sensor_wise_mask=False, static=False,
        **common,
    )  # fmt: skip


def train_pypots(build: Callable, data: Splits, args: argparse.Namespace) -> Trained:
    """A PyPOTS classifier built by ``build(data, args.width, common_kwargs)``, trained by its own
    ``fit`` with our validation split as its validation set (early stopping on validation
    cross-entropy)."""
    from pypots.optim import Adam

    common = dict(
        batch_size=args.batch_size, epochs=args.epochs, patience=min(args.patience, args.epochs),
        optimizer=Adam(lr=args.lr, weight_decay=1e-5), num_workers=0, device="cpu",
        saving_path=None, model_saving_strategy=None, verbose=False,
    )  # fmt: skip
    model = build(data, args.width, common)
    sets = {name: {"X": data.X[name], "y": data.y[name]} for name in data.X}
    model.fit(sets["train"], sets["val"])

    def proba(split: str) -> np.ndarray:
        return np.asarray(model.predict({"X": data.X[split]})["classification_proba"], dtype=np.float64)

    # PyPOTS counts down its patience; the epochs it ran are the best one plus what it waited
    ran = min(args.epochs, model.best_epoch + args.patience)
    params = sum(p.numel() for p in model.model.parameters())
    return Trained(proba, params, ran, model.best_epoch)


# --------------------------------------------------------------------------------------------------
# The Neural CDE (torchcde)

NCDE_WIDTH = 32  # the paper's UEA sizes: z of --width (32), a vector field of 3 layers 32 wide
NCDE_LAYERS = 3
NCDE_EVERY = 10  # the paper scores every 10 epochs ...
NCDE_PLATEAU = 50  # ... and stops after 50 epochs without a better training loss or accuracy


def ncde_path(data: Splits, split: str):
    """``[time, values (C), cumulative observed count (C)]`` ``(n, T, 1 + 2C)`` float32 (NaN: not
    observed), each series filled forward after its last observation (so its path is constant there)."""
    import torch

    X, t, last = data.X[split], data.t[split], data.last[split]
    count = np.cumsum(~np.isnan(X), axis=1, dtype=np.float32)
    path = np.concatenate([t[..., None], X, count], axis=-1)
    for i, end in enumerate(last):
        path[i, end + 1 :] = path[i, end]
    return torch.from_numpy(path)


def train_ncde(data: Splits, args: argparse.Namespace) -> Trained:
    """A Neural CDE (module docstring) by the Neural CDE paper's loop on torchcde's splines."""
    import torch
    import torchcde
    from torch import nn

    class VectorField(nn.Module):
        """``f(z) (B, hidden, channels)`` of ``z (B, hidden)``: the paper's ``FinalTanh``."""

        def __init__(self, hidden: int, channels: int):
            super().__init__()
            sizes = [hidden] + [NCDE_WIDTH] * NCDE_LAYERS
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
            self.out = nn.Linear(NCDE_WIDTH, hidden * channels)
            self.hidden, self.channels = hidden, channels

        def forward(self, t, z):
            out = z
            for layer in self.layers:
                out = layer(out).relu()
            return self.out(out).view(*z.shape[:-1], self.hidden, self.channels).tanh()

    class NeuralCDE(nn.Module):
        def __init__(self, hidden: int, channels: int, outputs: int):
            super().__init__()
            self.initial = nn.Linear(channels, hidden)
            self.func = VectorField(hidden, channels)
            self.readout = nn.Linear(hidden, outputs)

        def forward(self, coeffs):  # (B, T - 1, 4 (1 + 2C)) -> (B, outputs)
            X = torchcde.CubicSpline(coeffs)
            z0 = self.initial(X.evaluate(X.interval[0]))
            z = torchcde.cdeint(
                X, self.func, z0, X.interval, adjoint=False, method="rk4", options={"step_size": 1.0}
            )
            return self.readout(z[:, -1])

    coeffs = {
        s: torchcde.hermite_cubic_coefficients_with_backward_differences(ncde_path(data, s)) for s in data.X
    }
    labels = {s: torch.from_numpy(np.asarray(data.y[s], dtype=np.int64)) for s in data.X}
    binary = data.n_classes == 2  # the paper: one logit and binary cross-entropy for two classes
    model = NeuralCDE(args.width, coeffs["train"].shape[-1] // 4, 1 if binary else data.n_classes)

    def loss_fn(logits, y):
        if binary:
            return nn.functional.binary_cross_entropy_with_logits(logits[:, 0], y.float())
        return nn.functional.cross_entropy(logits, y)

    @torch.no_grad()
    def proba(split: str) -> np.ndarray:
        model.eval()
        logits = torch.cat([model(c) for c in coeffs[split].split(256)])
        model.train()
        if binary:
            p = torch.sigmoid(logits[:, 0])
            return torch.stack([1 - p, p], 1).double().numpy()
        return torch.softmax(logits, -1).double().numpy()

    def scores(split: str) -> tuple[float, float]:
        return _accuracy_and_loss(proba(split), data.y[split])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1, mode="max")
    best = {
        "val_acc": -1.0,
        "train_loss": math.inf,
        "train_acc": 0.0,
        "epoch": 0,
        "loss_epoch": 0,
        "acc_epoch": 0,
    }
    best_state = copy.deepcopy(model.state_dict())
    n = len(labels["train"])
    epoch = 0
    for epoch in range(args.epochs):
        for index in torch.randperm(n).split(args.batch_size):
            loss = loss_fn(model(coeffs["train"][index]), labels["train"][index])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if epoch % NCDE_EVERY and epoch != args.epochs - 1:
            continue
        train_acc, train_loss = scores("train")
        val_acc, _ = scores("val")
        if train_loss * 1.0001 < best["train_loss"]:
            best.update(train_loss=train_loss, loss_epoch=epoch)
        if train_acc > best["train_acc"] * 1.001:
            best.update(train_acc=train_acc, acc_epoch=epoch)
        if val_acc > best["val_acc"]:
            best.update(val_acc=val_acc, epoch=epoch)
            best_state = copy.deepcopy(model.state_dict())
        scheduler.step(val_acc)
        if epoch > min(best["loss_epoch"], best["acc_epoch"]) + NCDE_PLATEAU:
            break
    model.load_state_dict(best_state)
    params = sum(p.numel() for p in model.parameters())
    return Trained(proba, params, epoch + 1, best["epoch"] + 1)


# --------------------------------------------------------------------------------------------------
# The table and the run


@dataclass(frozen=True)
class Peer:
    """A peer: what it is, how it trains on :class:`Splits`, and its ``--width`` default (the
    description's parenthesis says what the width sizes)."""

    description: str
    train: Callable[[Splits, argparse.Namespace], Trained]
    width: int


MODELS: dict[str, Peer] = {
    "grud": Peer("GRU-D, pypots.classification.GRUD (hidden state)", partial(train_pypots, _grud), width=256),
    "brits": Peer(
        "BRITS, pypots.classification.BRITS (hidden state)", partial(train_pypots, _brits), width=32
    ),
    "raindrop": Peer(
        "Raindrop, pypots.classification.Raindrop (d_model per channel)",
        partial(train_pypots, _raindrop),
        width=4,
    ),
    "ncde": Peer("Neural CDE on torchcde, the paper's UEA recipe (z's channels)", train_ncde, width=32),
}


def _accuracy_and_loss(proba: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of class probabilities ``proba (n, K)`` against ``y (n,)``."""
    y = np.asarray(y, dtype=np.int64)
    picked = np.clip(proba[np.arange(len(y)), y], 1e-12, 1.0)
    return float((proba.argmax(1) == y).mean()), float(-np.log(picked).mean())


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(args: argparse.Namespace) -> dict[str, float]:
    """Export the splits, train ``args.model`` and score it; the metrics written to ``metrics.json``."""
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "splits.npz"
        script = str(Path(__file__).resolve())
        command = [args.python, script, "export", "--task-options", args.task_options, "--out", str(path)]
        command += ["--data", args.data] if args.data else []
        command += ["--read-test"] if args.read_test else []
        subprocess.run(command, check=True)  # in our working directory: --data means what it says here
        data = load_splits(path)
    export_s = time.perf_counter() - start
    seed_everything(args.seed)
    start = time.perf_counter()
    trained = MODELS[args.model].train(data, args)
    metrics = {}
    for split in ("val", "test"):
        if split in data.X:
            acc, loss = _accuracy_and_loss(trained.proba(split), data.y[split])
            metrics[f"{split}_acc_full" if split == "val" else "test_acc"] = acc
            if split == "val":
                metrics["val_loss_full"] = loss
    metrics.update(
        params=trained.params, epochs=trained.epochs, best_epoch=trained.best_epoch, lr=args.lr,
        width=args.width, wall_s=time.perf_counter() - start, export_s=export_s,
    )  # fmt: skip
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _default_python() -> str:
    """geoattn's interpreter: the repository's ``.venv`` when there is one."""
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else "python3"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("train", "export"), default="train",
                        help="export: write the task's splits (run by geoattn's interpreter)")  # fmt: skip
    parser.add_argument("--model", choices=sorted(MODELS), default="grud")
    parser.add_argument("--task-options", default="{}", help="the series task's task.* options, as JSON")
    parser.add_argument("--data", default="", help="the series task's --data (empty: task.dataset)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--patience", type=int, default=20, help="PyPOTS's early-stopping patience (epochs)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, help="the model's size (MODELS; default: its row's)")
    parser.add_argument(
        "--python", default=_default_python(), help="geoattn's interpreter (exports the splits)"
    )
    parser.add_argument("--read-test", action="store_true", default=os.environ.get(READ_TEST_ENV) == "1",
                        help=f"read the test split (default: sealed; or {READ_TEST_ENV}=1)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.options = json.loads(args.task_options)
    except ValueError as err:
        parser.error(f"--task-options is not JSON ({err})")
    if not isinstance(args.options, dict):
        parser.error("--task-options must be a JSON object of task.* options")
    args.width = args.width or MODELS[args.model].width
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.mode == "export":
        export(args.options, args.data or None, args.read_test, Path(args.out))
        return
    metrics = run(args)
    print(json.dumps(metrics))


if __name__ == "__main__":
    sys.exit(main())
