"""The ``molecule`` task behind the trainer's contract: an MD17-style file (:mod:`.data`), rMD17's split
sizes, the energy model (:mod:`.models`), batches and energy / force MAE metrics.

A batch is ``x`` ``(B, N, 4)`` = [atomic number, position (Å)] per atom and ``y`` ``(B, N, 4)`` = [energy
(eV, repeated per atom), force (eV/Å)], float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from geoattn.errors import ConfigError
from geoattn.models.base import ModelSizes, TaskModel
from geoattn.models.rotor_transformer import RotorTransformerConfig
from geoattn.tasks.base import Task
from geoattn.tasks.molecule.data import (
    Trajectory,
    TrajectorySettings,
    load_trajectory,
    make_trajectory,
    molecule_name,
    split_indices,
)
from geoattn.tasks.molecule.models import MoleculeModelConfig, MoleculeRotor

SPLITS = ("train", "val", "test")
MEV = 1000.0  # eV → meV
# the rotor model's inputs and outputs besides its width: fixed by the embedding (see MoleculeRotor)
ROTOR_FIXED = ("algebra", "in_channels", "in_scalars", "out_channels", "out_scalars")


@dataclass
class MoleculeConfig:
    """The molecule task: which data file, the split, and the energy model's embedding and loss.

    Fields:
        name: the molecule (aspirin, ethanol, malonaldehyde, uracil, toluene, naphthalene, salicylic_acid).
        data: an .npz file in the molecule format (default: the cached file of the trajectory settings
            below, built on first use; see ``geoattn data make molecule``).
        frames, stride, equilibration, temperature, md_seed: the trajectory (TrajectorySettings).
        n_train, n_val: rMD17's split sizes (random, ``split_seed``); the rest of the frames is test.
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
    n_train: int = 1000
    n_val: int = 1000
    split_seed: int = 0
    cutoff: float = 5.0
    n_rbf: int = 8
    interactions: int = 3
    vectors: int = 4
    energy_weight: float = 0.01
    force_weight: float = 0.99

    def __post_init__(self) -> None:
        self.name = molecule_name(self.name)
        if self.n_train < 1 or self.n_val < 1:
            raise ConfigError(f"task.n_train and task.n_val must be ≥ 1, got {self.n_train}, {self.n_val}")

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


class MoleculeTask(Task):
    """MD17-style energies and forces of one molecule (see the module docstring)."""

    name: ClassVar[str] = "molecule"
    models: ClassVar[dict[str, str]] = {
        "rotor": "radial embedding + RotorTransformer (Cl(3)), energy summed over atoms, forces −∂E/∂x",
    }
    Settings: ClassVar[type] = MoleculeConfig
    description: ClassVar[str] = "MD17-style molecular energies (meV) and forces (meV/Å) from GFN2-xTB MD"
    # chosen on aspirin with `geoattn bench molecule --rotor-set ...` probes (one seed, validation force
    # MAE): 64 environment scalars beat 16 and 128, lr 1e-2 beat 5e-3, and one rotor block learned as
    # fast per epoch as three at a fraction of the cost
    recipes: ClassVar[dict[str, dict[str, Any]]] = {
        "rotor": {
            "lr": 1e-2,
            "n_layer": 1,
            "n_head": 4,
            "n_embd": 128,
            "batch_size": 10,
            "warmup_iters": 50,
            "weight_decay": 0.0,
            "model_options": {"scalars": 64},
        },
    }

    def __init__(self, config: MoleculeConfig | None = None, trajectory: Trajectory | None = None):
        self.config = config or MoleculeConfig()
        if trajectory is None:
            c = self.config
            path = c.data if c.data else make_trajectory(c.trajectory_settings())
            trajectory = load_trajectory(path)
        self.trajectory = trajectory
        self.indices = split_indices(
            len(trajectory), self.config.n_train, self.config.n_val, self.config.split_seed
        )
        self._tensors = self._split_tensors()

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

    @classmethod
    def model_settings(cls, model: str) -> tuple[type, tuple[str, ...]]:
        return RotorTransformerConfig, ROTOR_FIXED

    def _split_tensors(self) -> dict[str, tuple[Tensor, Tensor]]:
        t = self.trajectory
        out = {}
        for split, idx in self.indices.items():
            frames, n = len(idx), len(t.atomic_numbers)
            numbers = np.broadcast_to(t.atomic_numbers.astype(np.float64), (frames, n))[..., None]
            x = np.concatenate((numbers, t.positions[idx]), axis=-1)
            energy = np.broadcast_to(t.energies[idx][:, None, None], (frames, n, 1))
            y = np.concatenate((energy, t.forces[idx]), axis=-1)
            out[split] = (torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(y)))
        return out

    def split(self, name: str, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """All of split ``name``: ``x``, ``y`` ``(F, N, 4)`` in ``dtype`` (float64: the file's values)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; the molecule task has {', '.join(SPLITS)}")
        x, y = self._tensors[name]
        return x.to(dtype), y.to(dtype)

    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` random frames of ``split`` (with replacement), float32."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        x, y = self._tensors[split] if split in self._tensors else self.split(split)
        pick = torch.randint(x.shape[0], (batch_size,), generator=generator)
        return x[pick].float().to(device), y[pick].float().to(device)

    def energy_statistics(self) -> tuple[float, float]:
        """(mean energy, force RMS) of the training split: the model's energy shift and scale."""
        idx = self.indices["train"]
        t = self.trajectory
        return float(t.energies[idx].mean()), float(np.sqrt((t.forces[idx] ** 2).mean()))

    def model_config(self, sizes: ModelSizes, options: dict[str, Any]) -> MoleculeModelConfig:
        """The energy model's config: the run's sizes and ``model.*`` options, the task's embedding."""
        c = self.config
        fixed = {
            "algebra": "cl3",
            "in_channels": 1 + c.vectors,
            "in_scalars": 1,
            "out_channels": 1,
            "out_scalars": 1,
        }
        rotor = RotorTransformerConfig.from_sizes(sizes, options, **fixed)
        rotor = dataclasses.replace(rotor, in_scalars=rotor.scalars)  # the embedding's width is the model's
        elements = tuple(sorted(set(self.trajectory.atomic_numbers.tolist())))
        return MoleculeModelConfig(
            rotor=rotor,
            elements=elements,
            cutoff=c.cutoff,
            n_rbf=c.n_rbf,
            interactions=c.interactions,
            vectors=c.vectors,
            energy_weight=c.energy_weight,
            force_weight=c.force_weight,
        )

    def _build(self, model: str, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
        shift, scale = self.energy_statistics()
        return MoleculeRotor(self.model_config(sizes, options), energy_shift=shift, energy_scale=scale)

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``energy_mae_mev`` and ``force_mae_mev`` (mean over force components, as MD17 reports)."""
        return mae_metrics(prediction, y)

    def meta(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "config": dataclasses.asdict(self.config),
            "data": self.trajectory.settings,
        }

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """Energy and force MAE on the whole val and test splits, each beside the mean predictor's
        (``{split}_baseline_energy_mae_mev``, ``{split}_baseline_force_mae_mev``: see `baselines`)."""
        out = {}
        for split in ("val", "test"):
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
        energy MAE means something only well below it."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
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
