"""The ``pointcloud`` task: classify point clouds, of parametric shapes (:mod:`.shapes`) or read from
files (``--data``, :mod:`.data`: ModelNet40's HDF5 distribution, ScanObjectNN, OFF meshes), under the
standard rotation protocols.

A protocol is "train rotations / test rotations": ``z/SO(3)`` trains on clouds rotated about z only and
tests on random 3D rotations; ``SO(3)/SO(3)`` rotates both (SO(3) augmentation); ``z/z`` tests on
z-rotated clouds too; ``aligned`` is the canonical pose. Set with ``--set task.train_rotation=z
task.test_rotation=so3``. Training clouds get a fresh rotation of the training kind in every batch;
validation clouds carry one fixed rotation each *of the training kind* (selection never sees the test
rotations), test clouds one of ``test_rotation``. Every run's final metrics hold the validation
accuracy and the test accuracy under each kind (aligned, z, SO(3)), so one run trained with z
rotations reports both z/z and z/SO(3).
A non-invariant model learns rotation invariance only from its training rotations: under ``z/SO(3)`` the
Transformer on point tokens collapses, while the RotorTransformer's and VN-DGCNN's logits are invariant
by construction.

Read files have a train and a test split; validation is cut from train by a seeded, stratified
fraction (``task.val_fraction``).

A batch is ``x`` ``(B, P, 3)`` float32 points and ``y`` ``(B,)`` long labels (indices into the task's
``classes``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from geoattn.core.errors import ConfigError, DataError
from geoattn.models.base import TaskModel
from geoattn.tasks.base import Task
from geoattn.tasks.nbody.simulator import random_rotations
from geoattn.tasks.pointcloud.data import SAMPLINGS, Picking, read_clouds, stratified_split
from geoattn.tasks.pointcloud.models import TABLE
from geoattn.tasks.pointcloud.shapes import CLASSES, sample_clouds

SPLITS = ("train", "val", "test")
ROTATIONS = ("aligned", "z", "so3")
# the settings of each source of clouds: a user's setting of the other's is an error, not ignored
GENERATED_ONLY = ("train_size", "val_size", "test_size", "noise", "skew")
READ_ONLY = ("sampling", "val_fraction")


@dataclass
class PointCloudConfig:
    """The pointcloud task.

    The generated set's defaults keep a run short and the set from saturating: 64 points, noise 5 % of
    the radius and a strong sampling skew (with 128 points, noise 2 % and skew 2, PointNet read 98 % on
    aligned test clouds of the ten well-separated classes after 600 steps); 1,000 validation and 2,000
    test clouds, so that an accuracy's sampling error (about 1 % on the test set) stays below the
    differences read.

    Fields:
        data: point-cloud files to read (default --data; none: the generated shapes).
            A folder of ModelNet40 HDF5, ScanObjectNN or OFF meshes (:mod:`.data`).
        points: points per cloud (generated, or kept of each read cloud).
        sampling: how a read cloud keeps its points: random or fps (farthest-point sampling).
        val_fraction: the share of each class of read training clouds held out for validation.
        train_size, val_size, test_size: generated clouds per split (balanced over the classes).
        noise: Gaussian noise std of generated clouds (they have unit maximum radius).
        skew: non-uniform sampling of generated clouds: shape parameters are ``U^γ`` with γ in
            ``[1/skew, skew]`` per cloud.
        train_rotation: rotations of training and validation clouds: aligned, z or so3 (augmentation).
            ``aligned``: none; ``z``: about the z axis; ``so3``: random 3D rotations.
        test_rotation: rotations of test clouds (``so3`` in both standard protocols).
            The final metrics also test under every kind.
        seed: seeds the splits' clouds, the points kept, the validation cut and the rotations.
    """

    data: str | None = None
    points: int = 64
    sampling: str = "random"
    val_fraction: float = 0.1
    train_size: int = 2000
    val_size: int = 1000
    test_size: int = 2000
    noise: float = 0.05
    skew: float = 3.0
    train_rotation: str = "z"
    test_rotation: str = "so3"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("points", "train_size", "val_size", "test_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"task.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.noise < 0 or self.skew < 1:
            raise ConfigError(f"task.noise must be ≥ 0 and task.skew ≥ 1, got {self.noise}, {self.skew}")
        if self.sampling not in SAMPLINGS:
            raise ConfigError(f"task.sampling must be one of {', '.join(SAMPLINGS)}, got {self.sampling!r}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"task.val_fraction must be between 0 and 1, got {self.val_fraction}")
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
    table = TABLE
    Settings: ClassVar[type] = PointCloudConfig
    description: ClassVar[str] = (
        "point clouds of 16 parametric shapes or read (ModelNet40 HDF5, ScanObjectNN, OFF meshes); "
        "z/z, z/SO(3), SO(3)/SO(3) protocols"
    )

    def __init__(self, config: PointCloudConfig | None = None, *, classes: tuple[str, ...] | None = None):
        """The task of ``config``: its files read now (a DataError before any run starts), or the
        generated shapes made on first use. ``classes`` (a checkpoint's) builds a task that reads nothing."""
        self.config = config or PointCloudConfig()
        self._sets: dict[str, tuple[Tensor, Tensor]] = {}
        self._rotated: dict[tuple[str, str], tuple[Tensor, Tensor]] = {}
        self.layout: str | None = None
        if classes is not None:
            self.classes = tuple(classes)
        elif self.config.data:
            self.classes = self._read()
        else:
            self.classes = CLASSES

    @property
    def n_classes(self) -> int:
        """How many classes the clouds have (16 generated shapes, or the read files' classes)."""
        return len(self.classes)

    @classmethod
    def settings_defaults(cls, *, data: str | None, block_size: int) -> dict[str, Any]:
        return {"data": data}

    @classmethod
    def from_options(
        cls, options: dict[str, Any] | None = None, *, data: str | None = None, **kwargs: Any
    ) -> Task:
        """:meth:`Task.from_options`, refusing a setting of the other source of clouds (``noise`` with
        --data, ``sampling`` without) rather than ignoring it."""
        options = options or {}
        reads = bool(options.get("data", data))
        clash = [f"task.{k}" for k in (GENERATED_ONLY if reads else READ_ONLY) if k in options]
        if clash:
            source = "the generated shapes" if reads else "clouds read with --data"
            raise ConfigError(f"{', '.join(clash)} applies only to {source}")
        return super().from_options(options, data=data, **kwargs)

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
        if settings.data and not load_data and meta and "classes" in meta:
            return cls(settings, classes=tuple(meta["classes"]))
        return cls(settings)

    def _read(self) -> tuple[str, ...]:
        """Read ``config.data``: its train and test clouds, validation cut from train; the class names."""
        c = self.config
        read = read_clouds(c.data, Picking(c.points, c.sampling, c.seed))
        clouds, labels = read.sets["train"]
        train, val = stratified_split(labels, c.val_fraction, c.seed)
        if not len(val):
            raise DataError(f"{c.data}: task.val_fraction={c.val_fraction} holds out no validation cloud")
        self._sets = {"train": (clouds[train], labels[train]), "val": (clouds[val], labels[val]),
                      "test": read.sets["test"]}  # fmt: skip
        self.layout = read.layout
        return read.classes

    def dataset(self, split: str) -> tuple[Tensor, Tensor]:
        """Aligned clouds ``(n, P, 3)`` (float64 generated, float32 read) and labels ``(n,)`` of
        ``split`` (generated on first use)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; the pointcloud task has {', '.join(SPLITS)}")
        if split not in self._sets:
            if self.config.data:
                raise DataError(f"this pointcloud task was built without reading {self.config.data}")
            c = self.config
            size = getattr(c, f"{split}_size")
            generator = torch.Generator().manual_seed(c.seed * len(SPLITS) + SPLITS.index(split))
            labels = torch.arange(size) % len(CLASSES)
            labels = labels[torch.randperm(size, generator=generator)]
            clouds = sample_clouds(labels, c.points, generator, noise=c.noise, skew=c.skew)
            self._sets[split] = (clouds, labels)
        return self._sets[split]

    def evaluation_set(self, split: str, kind: str | None = None) -> tuple[Tensor, Tensor]:
        """``split`` (val or test), one fixed rotation of ``kind`` per cloud (default: the training
        kind for val, ``test_rotation`` for test)."""
        kind = kind or self.rotation_kind(split)
        if (split, kind) not in self._rotated:
            clouds, labels = self.dataset(split)
            generator = torch.Generator().manual_seed(1000 + self.config.seed * 10 + ROTATIONS.index(kind))
            self._rotated[split, kind] = rotate(clouds, rotations(kind, clouds.shape[0], generator)), labels
        return self._rotated[split, kind]

    def rotation_kind(self, split: str) -> str:
        """The rotations of ``split``: the training kind for train and val, ``test_rotation`` for test."""
        return self.config.test_rotation if split == "test" else self.config.train_rotation

    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` clouds of ``split``: training clouds freshly rotated (``train_rotation``),
        others with their fixed rotations (:meth:`evaluation_set`). ``x`` ``(B, P, 3)`` float32, ``y``
        ``(B,)`` long."""
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

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``accuracy`` of the logits."""
        return {"accuracy": float((prediction.argmax(-1) == y).float().mean())}

    def meta(self) -> dict[str, Any]:
        """The settings and class names; for read files also their layout and each set's sha256 (the
        experiment reports check that their runs read the same sets)."""
        out = {"task": self.name, "config": dataclasses.asdict(self.config), "classes": list(self.classes)}
        if self.layout is not None:
            out["layout"] = self.layout
            out["sets"] = {split: {"sha256": _digest(*self._sets[split])} for split in SPLITS}
        return out

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """``val_accuracy_full`` on the whole validation split (training rotations: for selection);
        ``test_accuracy_aligned`` / ``_z`` / ``_so3`` on the whole test split under each kind of rotation
        (a run trained with z rotations reports z/z, z/SO(3) and aligned); ``test_accuracy`` under the
        protocol's ``test_rotation``. A sealed test set is not read."""
        out = {"val_accuracy_full": self.accuracy(model, "val")}
        if not self.readable("test"):
            return out
        for kind in ROTATIONS:
            out[f"test_accuracy_{kind}"] = self.accuracy(model, "test", kind)
        out["test_accuracy"] = out[f"test_accuracy_{self.config.test_rotation}"]
        return out

    @torch.no_grad()
    def accuracy(
        self, model: nn.Module, split: str, kind: str | None = None, *, batch_size: int = 200
    ) -> float:
        """Accuracy on every cloud of ``split`` rotated by ``kind`` (default: :meth:`rotation_kind`)."""
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


def _digest(clouds: Tensor, labels: Tensor) -> str:
    """sha256 of a set's clouds and labels (their bytes), for the record of what a run read."""
    digest = hashlib.sha256(clouds.contiguous().numpy().tobytes())
    digest.update(labels.contiguous().numpy().tobytes())
    return digest.hexdigest()
