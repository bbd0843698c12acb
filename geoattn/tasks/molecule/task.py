"""The ``molecule`` task behind the trainer's contract: a molecule file (:mod:`.files`: geoattn's, revised
MD17's, sGDML's or extended XYZ), rMD17's split sizes or its split files, the model table
(:mod:`.models`), batches and energy / force MAE metrics.

A batch is ``x`` ``(B, N, 4)`` = [atomic number, position (Å)] per atom and ``y`` ``(B, N, 4)`` = [energy
(eV, repeated per atom), force (eV/Å)], float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from geoattn.core.errors import ConfigError
from geoattn.models.base import TaskModel
from geoattn.tasks.base import Task
from geoattn.tasks.molecule.data import (
    Trajectory,
    TrajectorySettings,
    make_trajectory,
    molecule_name,
    split_indices,
)
from geoattn.tasks.molecule.files import Keys, index_splits, read_molecule_file
from geoattn.tasks.molecule.models import TABLE

SPLITS = ("train", "val", "test")
MEV = 1000.0  # eV → meV
# split sizes when the user sets none: rMD17's 1000 / 1000 drawn from the file, and with revised MD17's
# index files the 50 validation frames MACE and NequIP take out of the 1000 training ones
DEFAULT_N_TRAIN, DEFAULT_N_VAL, DEFAULT_N_VAL_FROM_INDEX_FILE = 1000, 1000, 50


@dataclass
class MoleculeConfig:
    """The molecule task: which data file, the split, and the energy model's embedding and loss.

    Without ``data`` the task builds (or finds in the cache) the file of the trajectory settings
    (``geoattn data make molecule``). Without ``splits_dir`` the split is random (``split_seed``):
    ``n_train``, ``n_val``, the rest test (rMD17's protocol). With it, test is the test file,
    validation ``n_val`` frames drawn out of the training file and train the rest (or ``n_train`` of it).

    Fields:
        name: the molecule of the built file (aspirin, ethanol, malonaldehyde, uracil, toluene, ...).
        data: the file: geoattn's, revised MD17's or sGDML's .npz, or extended XYZ (.xyz, .extxyz).
        frames, stride, equilibration, temperature, md_seed: the trajectory (TrajectorySettings).
        energy_key: an extended XYZ frame's energy (eV) in its info or calculator (MACE's: REF_energy).
        forces_key: an extended XYZ frame's forces (eV/Å) in its arrays or calculator (REF_forces).
        splits_dir: a directory of revised MD17's index_train_0N.csv / index_test_0N.csv split files.
        split_index: the N of those files (1..5 in revised MD17).
        n_train: training frames (default 1000; with splits_dir, the training file less validation).
        n_val: validation frames (default 1000; with splits_dir, 50 out of the training file).
        split_seed: seed of the split permutation.
        cutoff, n_rbf, interactions, vectors: the radial embedding (MoleculeModelConfig).
        energy_weight, force_weight: loss weights on the energy and force MSE (SchNetPack's MD17 recipe).
    """

    name: str = "aspirin"
    data: str | None = None
    frames: int = 2500
    stride: int = 10
    equilibration: int = 1000
    temperature: float = 500.0
    md_seed: int = 0
    energy_key: str = "energy"
    forces_key: str = "forces"
    splits_dir: str | None = None
    split_index: int = 1
    n_train: int | None = None
    n_val: int | None = None
    split_seed: int = 0
    cutoff: float = 5.0
    n_rbf: int = 8
    interactions: int = 3
    vectors: int = 4
    energy_weight: float = 0.01
    force_weight: float = 0.99

    def __post_init__(self) -> None:
        self.name = molecule_name(self.name)
        for key in ("n_train", "n_val"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"task.{key} must be an integer ≥ 1, got {value!r}")
        if self.split_index != 1 and not self.splits_dir:
            raise ConfigError("task.split_index picks a split file: set task.splits_dir too")

    def trajectory_settings(self) -> TrajectorySettings:
        """The data builder's settings of this task's default file."""
        return TrajectorySettings(
            name=self.name,
            frames=self.frames,
            stride=self.stride,
            equilibration=self.equilibration,
            temperature=self.temperature,
            seed=self.md_seed,
        )


def load_molecule_data(config: MoleculeConfig) -> tuple[Trajectory, dict[str, np.ndarray]]:
    """The frames of ``config``'s file and its train / val / test frame indices: what the task trains
    and measures on, and what the peers' runners (``benchmarks/molecule_peers.py``) read through it.

    A file given (``config.data``) is read by :func:`~geoattn.tasks.molecule.files.read_molecule_file`;
    without one the cached file of ``config.trajectory_settings()`` (built on first use). The split is
    revised MD17's index files when ``config.splits_dir`` is set, else random sizes (``split_seed``).
    """
    c = config
    path = c.data if c.data else make_trajectory(c.trajectory_settings())
    trajectory = read_molecule_file(path, Keys(energy=c.energy_key, forces=c.forces_key))
    default_keys = Keys()
    labelled = (c.energy_key, c.forces_key) != (default_keys.energy, default_keys.forces)
    if labelled and trajectory.settings.get("format") != "extxyz":
        raise ConfigError(
            f"task.energy_key and task.forces_key name an extended XYZ file's labels; {path} is a "
            f"{trajectory.settings.get('format')} .npz (its keys are fixed)"
        )
    return trajectory, splits(config, len(trajectory), path)


def splits(config: MoleculeConfig, frames: int, path: Path | str) -> dict[str, np.ndarray]:
    """The train / val / test frame indices of ``config`` over a file of ``frames`` frames."""
    c = config
    if c.splits_dir:
        n_val = c.n_val or DEFAULT_N_VAL_FROM_INDEX_FILE
        return index_splits(
            Path(c.splits_dir), c.split_index, frames, path, n_train=c.n_train, n_val=n_val, seed=c.split_seed
        )
    return split_indices(frames, c.n_train or DEFAULT_N_TRAIN, c.n_val or DEFAULT_N_VAL, c.split_seed)


class MoleculeTask(Task):
    """MD17-style energies and forces of one molecule (see the module docstring)."""

    name: ClassVar[str] = "molecule"
    table = TABLE
    Settings: ClassVar[type] = MoleculeConfig
    description: ClassVar[str] = "molecular energies (meV) and forces (meV/Å): MD17, rMD17, sGDML, extxyz"

    def __init__(self, config: MoleculeConfig | None = None, trajectory: Trajectory | None = None):
        self.config = config or MoleculeConfig()
        if trajectory is None:
            trajectory, self.indices = load_molecule_data(self.config)
        else:
            self.indices = splits(self.config, len(trajectory), "the given trajectory")
        self.trajectory = trajectory
        self._tensors: dict[str, tuple[Tensor, Tensor]] = {}

    @classmethod
    def settings_defaults(cls, *, data: str | None, block_size: int) -> dict[str, Any]:
        return {"data": data}

    @classmethod
    def from_settings(
        cls,
        settings: MoleculeConfig,
        *,
        data: str | None,
        block_size: int,
        meta: dict[str, Any] | None,
        load_data: bool,
    ) -> MoleculeTask:
        return cls(settings)

    def _split_tensors(self, split: str) -> tuple[Tensor, Tensor]:
        """``x``, ``y`` ``(F, N, 4)`` float64 of ``split``, made on first use (never for a sealed set)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; the molecule task has {', '.join(SPLITS)}")
        if not self.readable(split):
            raise ConfigError(f"the molecule task's {split} set is sealed in this run")
        if split not in self._tensors:
            t, idx = self.trajectory, self.indices[split]
            frames, n = len(idx), len(t.atomic_numbers)
            numbers = np.broadcast_to(t.atomic_numbers.astype(np.float64), (frames, n))[..., None]
            x = np.concatenate((numbers, t.positions[idx]), axis=-1)
            energy = np.broadcast_to(t.energies[idx][:, None, None], (frames, n, 1))
            y = np.concatenate((energy, t.forces[idx]), axis=-1)
            self._tensors[split] = (torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(y)))
        return self._tensors[split]

    def split(self, name: str, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """All of split ``name``: ``x``, ``y`` ``(F, N, 4)`` in ``dtype`` (float64: the file's values)."""
        x, y = self._split_tensors(name)
        return x.to(dtype), y.to(dtype)

    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` random frames of ``split`` (with replacement), float32."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        x, y = self._split_tensors(split)
        pick = torch.randint(x.shape[0], (batch_size,), generator=generator)
        return x[pick].float().to(device), y[pick].float().to(device)

    def energy_statistics(self) -> tuple[float, float]:
        """(mean energy, force RMS) of the training split: the model's energy shift and scale."""
        idx = self.indices["train"]
        t = self.trajectory
        return float(t.energies[idx].mean()), float(np.sqrt((t.forces[idx] ** 2).mean()))

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``energy_mae_mev`` and ``force_mae_mev`` (mean over force components, as MD17 reports)."""
        return mae_metrics(prediction, y)

    def meta(self) -> dict[str, Any]:
        """The settings, the file's record (its format, source units and conversion, sha256) and the
        split's sizes."""
        return {
            "task": self.name,
            "config": dataclasses.asdict(self.config),
            "data": self.trajectory.settings,
            "split": {split: len(idx) for split, idx in self.indices.items()},
        }

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """Energy and force MAE on the whole val and test splits (those this run may read), each beside
        the mean predictor's (``{split}_baseline_energy_mae_mev``, ``{split}_baseline_force_mae_mev``:
        see `baselines`)."""
        out = {}
        for split in filter(self.readable, ("val", "test")):
            for key, value in self.evaluate_split(model, split).items():
                out[f"{split}_{key}"] = value
            for key, value in self.baselines(split).items():
                out[f"{split}_baseline_{key}"] = value
        return out

    def baselines(self, split: str = "val") -> dict[str, float]:
        """The errors of the mean predictor on ``split``: every frame's energy the training split's
        mean and every force zero (``energy_mae_mev``, ``force_mae_mev``). For one molecule this is
        also what per-element reference energies fitted on the training energies predict (every frame
        has the same atoms, so a least-squares fit of ``E ≈ Σ_atoms e_Z`` is the mean): a model's
        energy MAE means something only well below it. Empty for a sealed ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
        if not self.readable(split):
            return {}
        _, y = self.split(split, torch.float64)
        mean_energy, _ = self.energy_statistics()
        prediction = torch.zeros_like(y)
        prediction[..., 0] = mean_energy
        return mae_metrics(prediction, y)

    def evaluate_split(self, model: TaskModel, split: str, *, batch_size: int = 100) -> dict[str, float]:
        """``energy_mae_mev``, ``force_mae_mev`` over every frame of ``split`` (model in eval mode)."""
        parameter = next(model.parameters())
        x_all, y_all = self.split(split, torch.float64)
        was_training = model.training
        model.eval()
        predictions = []
        for start in range(0, x_all.shape[0], batch_size):
            x = x_all[start : start + batch_size].to(parameter.device, parameter.dtype)
            prediction, _ = model(x)
            predictions.append(prediction.detach().double().cpu())
        model.train(was_training)
        return mae_metrics(torch.cat(predictions), y_all)


def mae_metrics(prediction: Tensor, y: Tensor) -> dict[str, float]:
    """Energy MAE (meV) and force MAE (meV/Å, over components) of ``(B, N, 4)`` predictions and targets."""
    energy = (prediction[:, 0, 0].double() - y[:, 0, 0].double()).abs().mean()
    forces = (prediction[..., 1:].double() - y[..., 1:].double()).abs().mean()
    return {"energy_mae_mev": float(energy) * MEV, "force_mae_mev": float(forces) * MEV}
