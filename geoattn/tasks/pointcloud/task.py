"""The ``pointcloud`` task: classify point clouds of ten parametric shapes (:mod:`.shapes`) under the
standard rotation protocols.

A protocol is "train rotations / test rotations": ``z/SO(3)`` trains on clouds rotated about z only and
tests on random 3D rotations; ``SO(3)/SO(3)`` rotates both; ``aligned`` is the canonical pose. Set with
``--set task.train_rotation=z task.test_rotation=so3``. Training clouds get a fresh rotation of the
training kind in every batch (augmentation); validation and test clouds carry one fixed rotation each.
A non-invariant model learns rotation invariance only from its training rotations: under ``z/SO(3)`` the
Transformer on point tokens collapses, while the RotorTransformer's logits are invariant by construction.

A batch is ``x`` ``(B, P, 3)`` float32 points and ``y`` ``(B,)`` long labels (indices into ``CLASSES``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from geoattn.errors import ConfigError
from geoattn.models.base import ModelSizes, TaskModel
from geoattn.models.lm import TransformerConfig
from geoattn.models.rotor_transformer import RotorTransformerConfig
from geoattn.tasks.base import Task
from geoattn.tasks.nbody.simulator import random_rotations
from geoattn.tasks.pointcloud.models import PointRotor, PointTransformer
from geoattn.tasks.pointcloud.shapes import CLASSES, sample_clouds

SPLITS = ("train", "val", "test")
ROTATIONS = ("aligned", "z", "so3")
# the rotor model's inputs and outputs: the centred point (a vector) and its radius in; per point 4
# multivector channels (their norms) and the scalar width out, pooled by the invariant readout
ROTOR_IO = {"algebra": "cl3", "in_channels": 1, "in_scalars": 1, "out_channels": 4}


@dataclass
class PointCloudConfig:
    """The pointcloud task.

    Fields:
        n_points: points per cloud.
        train_size, val_size, test_size: clouds per split (balanced over the classes).
        noise: Gaussian noise std (the clouds have unit maximum radius).
        skew: non-uniform sampling: shape parameters are ``U^γ`` with γ in ``[1/skew, skew]`` per cloud.
        train_rotation: rotations of training clouds: ``aligned`` (none), ``z`` (about z) or ``so3``.
        test_rotation: rotations of validation and test clouds (``so3`` in both standard protocols).
        seed: seeds the three splits' clouds and rotations.
    """

    n_points: int = 128
    train_size: int = 2000
    val_size: int = 500
    test_size: int = 1000
    noise: float = 0.02
    skew: float = 2.0
    train_rotation: str = "z"
    test_rotation: str = "so3"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_points", "train_size", "val_size", "test_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"task.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.noise < 0 or self.skew < 1:
            raise ConfigError(f"task.noise must be ≥ 0 and task.skew ≥ 1, got {self.noise}, {self.skew}")
        for name in ("train_rotation", "test_rotation"):
            value = str(getattr(self, name)).lower().replace("(", "").replace(")", "")
            if value not in ROTATIONS:
                raise ConfigError(
                    f"task.{name} must be one of {', '.join(ROTATIONS)}, got {getattr(self, name)!r}"
                )
            setattr(self, name, value)

    @property
    def protocol(self) -> str:
        """``"z/SO(3)"``-style name of the train/test rotations."""
        names = {"aligned": "aligned", "z": "z", "so3": "SO(3)"}
        return f"{names[self.train_rotation]}/{names[self.test_rotation]}"


def rotations(kind: str, n: int, generator: torch.Generator) -> Tensor:
    """``(n, 3, 3)`` float64 rotations: identities (``aligned``), uniform about z (``z``), Haar (``so3``)."""
    if kind == "so3":
        return random_rotations(n, generator)
    out = torch.eye(3, dtype=torch.float64).repeat(n, 1, 1)
    if kind == "z":
        angle = 2 * torch.pi * torch.rand(n, generator=generator, dtype=torch.float64)
        c, s = torch.cos(angle), torch.sin(angle)
        out[:, 0, 0], out[:, 0, 1], out[:, 1, 0], out[:, 1, 1] = c, -s, s, c
    return out


def rotate(points: Tensor, rotation: Tensor) -> Tensor:
    """``R x`` for clouds ``(B, P, 3)`` and rotations ``(B, 3, 3)``."""
    return torch.einsum("bij,bpj->bpi", rotation.to(points.dtype), points)


class PointCloudTask(Task):
    """Shape classification under rotations (see the module docstring)."""

    name: ClassVar[str] = "pointcloud"
    models: ClassVar[dict[str, str]] = {
        "transformer": "Transformer on point tokens (centred xyz), mean-pooled; not rotation-invariant",
        "rotor": "RotorTransformer (Cl(3)) on points, invariant readout: rotation-invariant logits",
    }
    Settings: ClassVar[type] = PointCloudConfig
    description: ClassVar[str] = "point clouds of 10 parametric shapes, z/SO(3) and SO(3)/SO(3) protocols"

    def __init__(self, config: PointCloudConfig | None = None):
        self.config = config or PointCloudConfig()
        self._sets: dict[str, tuple[Tensor, Tensor]] = {}

    @classmethod
    def from_settings(
        cls,
        settings: PointCloudConfig,
        *,
        data: str | None,
        block_size: int,
        meta: dict[str, Any] | None,
        load_data: bool,
    ) -> PointCloudTask:
        return cls(settings)

    @classmethod
    def model_settings(cls, model: str) -> tuple[type, tuple[str, ...]]:
        if model == "rotor":
            return RotorTransformerConfig, (*ROTOR_IO, "out_scalars")
        return TransformerConfig, ("vocab_size", "block_size", "causal", "pos")

    def dataset(self, split: str) -> tuple[Tensor, Tensor]:
        """Aligned clouds ``(n, P, 3)`` float64 and labels ``(n,)`` of ``split`` (made on first use)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; the pointcloud task has {', '.join(SPLITS)}")
        if split not in self._sets:
            c = self.config
            size = getattr(c, f"{split}_size")
            generator = torch.Generator().manual_seed(c.seed * len(SPLITS) + SPLITS.index(split))
            labels = torch.arange(size) % len(CLASSES)
            labels = labels[torch.randperm(size, generator=generator)]
            clouds = sample_clouds(labels, c.n_points, generator, noise=c.noise, skew=c.skew)
            self._sets[split] = (clouds, labels)
        return self._sets[split]

    def evaluation_set(self, split: str, kind: str | None = None) -> tuple[Tensor, Tensor]:
        """``split`` (val or test), one fixed rotation of ``kind`` (default ``test_rotation``) per cloud."""
        clouds, labels = self.dataset(split)
        kind = kind or self.config.test_rotation
        generator = torch.Generator().manual_seed(1000 + self.config.seed * 10 + ROTATIONS.index(kind))
        return rotate(clouds, rotations(kind, clouds.shape[0], generator)), labels

    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` clouds of ``split``: training clouds freshly rotated (``train_rotation``), others
        with their fixed ``test_rotation``. ``x`` ``(B, P, 3)`` float32, ``y`` ``(B,)`` long."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        if split == "train":
            clouds, labels = self.dataset("train")
            pick = torch.randint(clouds.shape[0], (batch_size,), generator=generator)
            # the rotations come from their own generator, seeded by one draw: every protocol then sees
            # the same clouds in the same order, and an invariant model trains the same under each
            seed = int(torch.randint(2**62, (), generator=generator))
            turn = rotations(self.config.train_rotation, batch_size, torch.Generator().manual_seed(seed))
            x, y = rotate(clouds[pick], turn), labels[pick]
        else:
            clouds, labels = self.evaluation_set(split)
            pick = torch.randint(clouds.shape[0], (batch_size,), generator=generator)
            x, y = clouds[pick], labels[pick]
        return x.float().to(device), y.to(device)

    def _build(self, model: str, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
        n_classes = len(CLASSES)
        if model == "rotor":
            config = RotorTransformerConfig.from_sizes(sizes, options, **ROTOR_IO, out_scalars=1)
            config = dataclasses.replace(config, out_scalars=config.scalars)  # read out the full scalar width
            return PointRotor(config, n_classes)
        config = TransformerConfig.from_sizes(
            sizes, options, vocab_size=1, block_size=self.config.n_points, causal=False, pos="none"
        )
        return PointTransformer(config, n_classes)

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``accuracy`` of the logits."""
        return {"accuracy": float((prediction.argmax(-1) == y).float().mean())}

    def meta(self) -> dict[str, Any]:
        return {"task": self.name, "config": dataclasses.asdict(self.config), "classes": list(CLASSES)}

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """Test accuracy under the protocol's test rotations, and aligned / z / SO(3) separately."""
        out = {"test_accuracy": self.accuracy(model, "test")}
        for kind in ROTATIONS:
            out[f"test_accuracy_{kind}"] = self.accuracy(model, "test", kind)
        return out

    @torch.no_grad()
    def accuracy(
        self, model: nn.Module, split: str, kind: str | None = None, *, batch_size: int = 200
    ) -> float:
        """Accuracy on every cloud of ``split`` rotated by ``kind`` (default: the protocol's test kind)."""
        parameter = next(model.parameters())
        clouds, labels = self.evaluation_set(split, kind)
        was_training = model.training
        model.eval()
        correct = 0
        for start in range(0, clouds.shape[0], batch_size):
            logits, _ = model(clouds[start : start + batch_size].to(parameter.device, parameter.dtype))
            correct += int((logits.argmax(-1).cpu() == labels[start : start + batch_size]).sum())
        model.train(was_training)
        return correct / clouds.shape[0]
