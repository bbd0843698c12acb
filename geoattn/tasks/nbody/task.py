"""The ``nbody`` task behind the trainer's contract, for two systems (``task.system``): GATr's gravity
(five sets, :mod:`.simulator`) and EGNN's charged particles (train / val / test, :mod:`.charged`); the
networks (:mod:`.models`), batches, metrics and the full-set evaluation (MSE on whole sets, E(3) and
object generalisation for gravity, the equivariance error)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.core.errors import ConfigError, DataError
from geoattn.models.base import TaskModel
from geoattn.tasks.base import EvalRow, ModelRow, Task
from geoattn.tasks.nbody import charged
from geoattn.tasks.nbody.bodies import centroid
from geoattn.tasks.nbody.files import system_of
from geoattn.tasks.nbody.models import TABLE
from geoattn.tasks.nbody.simulator import (
    SETS,
    SIMULATED_SIZES,
    SIZE_FIELDS,
    TRAJECTORY_SETS,
    NBodyConfig,
    NBodySet,
    load_gatr_format,
    random_orthogonal,
    random_rotations,
    save_gatr_format,
    simulate_systems,
)
from geoattn.tasks.plots import pyplot, save_figure

EVAL_SETS = ("eval", "e3_generalization", "object_generalization")
EQUIVARIANCE_SAMPLES = 256


@dataclass(frozen=True)
class System:
    """What differs between the task's two systems (``task.system``).

    sets: every set; measured: those measured on every sample at the end of training; test_sets: the
    held-out ones (an exploratory run seals them); probe: whose first samples measure the equivariance
    error (``val`` where it is sealed).
    """

    sets: tuple[str, ...]
    measured: tuple[str, ...]
    test_sets: tuple[str, ...]
    probe: str


SYSTEMS: dict[str, System] = {
    "gravity": System(SETS, ("val", *EVAL_SETS), EVAL_SETS, "eval"),
    "charged": System(charged.SETS, ("val", "test"), ("test",), "val"),
}


class NBodyTask(Task):
    """GATr's n-body problem (see the module docstring and :class:`NBodyConfig`)."""

    name: ClassVar[str] = "nbody"
    table: ClassVar[dict[str, ModelRow]] = TABLE
    Settings: ClassVar[type] = NBodyConfig
    description: ClassVar[str] = "GATr's n-body problem: final positions of a star and its planets"
    # the held-out sets of either system (an instance has its own system's: ``self.test_sets``)
    test_sets: ClassVar[tuple[str, ...]] = tuple(
        dict.fromkeys(s for row in SYSTEMS.values() for s in row.test_sets)
    )
    splits: ClassVar[tuple[str, ...]] = SETS

    def __init__(self, config: NBodyConfig | None = None):
        config = config or NBodyConfig()
        # the system the folder's files are (or the user's, checked against them), else gravity
        system = system_of(config.data, config.system, config.particles) if config.data else config.system
        self.config = dataclasses.replace(config, system=system or "gravity")
        self.system = SYSTEMS[self.config.system]
        self.test_sets = self.system.test_sets
        self._sets: dict[str, NBodySet] = {}
        self._meta: dict[str, Any] | None = None
        if self.config.system == "charged":
            if self.config.data:
                self._charged_sets(charged.load_egnn_format(self.config.data, self.config.particles))
        elif self.config.data:
            for name, data in load_gatr_format(self.config.data).items():
                size = self.config.set_size(name)
                if size is not None and size > len(data):
                    raise DataError(
                        f"task.{SIZE_FIELDS[name]}={size}, but {name}.npz in {self.config.data} holds "
                        f"{len(data)} samples"
                    )
                self._sets[name] = data if size is None else data.head(size)

    @classmethod
    def settings_defaults(cls, *, data: str | None, block_size: int) -> dict[str, Any]:
        return {"data": data}

    @classmethod
    def from_settings(
        cls,
        settings: NBodyConfig,
        *,
        data: str | None,
        block_size: int,
        meta: dict[str, Any] | None,
        load_data: bool,
    ) -> NBodyTask:
        """The simulator described by ``settings``, or GATr's files in ``--data DIR``."""
        return cls(settings)

    @property
    def sets(self) -> tuple[str, ...]:
        """The system's sets: GATr's five (gravity) or EGNN's train / val / test (charged)."""
        return self.system.sets

    @property
    def measured(self) -> tuple[str, ...]:
        """The sets measured on every sample at the end of training, less those sealed in this run."""
        return tuple(name for name in self.system.measured if self.readable(name))

    @property
    def probe(self) -> str:
        """The set whose first samples measure the equivariance error (val where the system's is sealed)."""
        return self.system.probe if self.readable(self.system.probe) else "val"

    @property
    def bodies(self) -> int:
        """The most bodies of a sample in any of the task's sets (the transformer's block): those of
        the files read, else the system's (gravity: the object-generalisation set's planets + the star)."""
        if self.config.data:
            return max(data.m.shape[1] for data in self._sets.values())
        c = self.config
        return c.particles if c.system == "charged" else max(c.n_planets, c.object_planets) + 1

    @property
    def horizon(self) -> float:
        """Simulated time from the input to the target positions."""
        c = self.config
        if c.system == "charged":
            return (c.frame_out - c.frame_in) * charged.SAMPLE_FREQ * charged.DT
        return c.time

    def _charged_sets(self, trajectories: dict[str, charged.ChargedTrajectories]) -> None:
        """The regression sets of EGNN's trajectories, each cut to its ``*_size`` (unset: all, and at
        most EGNN's 3,000 for train, as its loader's ``max_samples``); more than there are is a DataError."""
        c = self.config
        for name, data in trajectories.items():
            frames = data.loc.shape[1]
            if c.data and c.frame_out >= frames:
                file = charged.egnn_file_names((name,), c.particles)[name, "loc"]
                raise DataError(
                    f"nbody charged data: {str(Path(c.data) / file)!r} has {frames} frames, "
                    f"task.frame_out={c.frame_out} needs {c.frame_out + 1}"
                )
            size = c.set_size(name)
            if size is not None and size > len(data):
                where = f"in {c.data}" if c.data else "simulated"
                raise DataError(f"nbody charged: {size} {name} samples asked, {len(data)} {where}")
            if size is None and name == "train":
                size = min(charged.TRAIN_SAMPLES, len(data))
            self._sets[name] = data.head(size or len(data)).task_set(c.frame_in, c.frame_out)

    def dataset(self, name: str) -> NBodySet:
        """The set ``name`` (simulated from its seed on first use, or loaded from ``config.data``)."""
        if name not in self.sets:
            raise ValueError(f"unknown split {name!r}; the nbody task has {', '.join(self.sets)}")
        if not self.readable(name):
            raise ValueError(f"the {name} set is sealed in this run (an exploratory experiment's test set)")
        if name not in self._sets and self.config.system == "charged":
            c = self.config
            keep = {
                n: c.set_size(n) or (charged.TRAIN_SAMPLES if n == "train" else charged.GENERATED[n])
                for n in charged.SETS
            }
            frames = (c.frame_out + 2) * charged.SAMPLE_FREQ  # enough steps for the target frame
            simulated = charged.simulate(
                seed=c.base_seed, particles=c.particles, vel_norm=c.vel_norm, keep=keep, steps=frames
            )
            self._charged_sets(simulated)
        if name not in self._sets:
            c = self.config
            generator = torch.Generator().manual_seed(c.base_seed + SETS.index(name))
            planets = c.object_planets if name == "object_generalization" else c.n_planets
            self._sets[name] = simulate_systems(
                c.set_size(name) or SIMULATED_SIZES[name],
                planets,
                c,
                generator,
                domain_shift=name == "e3_generalization",
                trajectories=name in TRAJECTORY_SETS,
            )
        return self._sets[name]

    def save_gatr_format(self, directory: str | Path) -> None:
        """Write all five sets in GATr's format (``{name}.npz``) to ``directory``."""
        if self.config.system != "gravity":
            raise ConfigError(
                "save_gatr_format writes the gravity system; charged sets: geoattn data make nbody-charged"
            )
        save_gatr_format({name: self.dataset(name) for name in SETS}, directory)

    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """``x`` ``(B, n, 7)``, ``y`` ``(B, n, 3)`` float32: samples of ``split`` drawn with ``generator``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        data = self.dataset(split)
        batch = data.subset(torch.randint(len(data), (batch_size,), generator=generator))
        return batch.inputs().float().to(device), batch.x_final.float().to(device)

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``mse`` of the final positions."""
        return {"mse": float(F.mse_loss(prediction, y))}

    def meta(self) -> dict[str, Any]:
        """The data a run saw (``config.json``): its source and, per set, the samples, bodies and a hash.

        ``source`` is ``{"directory": DIR}`` for GATr's files (the simulator settings do not describe
        them, so they are not recorded) or ``{"simulated": {every NBodyConfig setting}}``; each set's
        ``sha256`` is :meth:`NBodySet.content_hash` of the samples used (after ``*_size``).
        """
        if self._meta is None:
            if self.config.data:
                sizes = {f: getattr(self.config, f) for f in (*SIZE_FIELDS.values(), "test_size")}
                source = {
                    "directory": str(Path(self.config.data).resolve()),
                    "system": self.config.system,
                    "sizes": sizes,
                }
            else:
                source = {"simulated": dataclasses.asdict(self.config)}
            sets = {
                name: {"samples": len(d), "bodies": d.m.shape[1], "sha256": d.content_hash()}
                for name, d in ((name, self.dataset(name)) for name in self.sets if self.readable(name))
            }
            self._meta = {"task": self.name, "source": source, "sets": sets}
        return self._meta

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """MSE on the whole eval, E(3)- and object-generalisation sets; the equivariance error."""
        return self.evaluate_sets(model)

    def plots(self, model: TaskModel, directory: Path) -> list[Path]:
        """``task_errors.png``: each validation sample's error against the smallest distance between
        two of its bodies at the start (log-log), the worst 1 % marked: what makes the set's MSE."""
        data = self.dataset("val")
        errors, closest = sample_errors(model, data), closest_distance(data)
        return [plot_errors_by_distance(errors, closest, directory / "task_errors.png", split="val")]

    def baselines(self, split: str = "eval") -> dict[str, float]:
        """MSE of two predictions without learning on the whole set ``split``: ``static`` (nothing
        moves) and ``free_motion`` (``x + time · v``, no gravity; ``time`` = ``task.time``); none of a
        sealed set."""
        if not self.readable(split):
            return {}
        data = self.dataset(split)
        free = data.x_initial + self.config.time * data.v_initial
        return {
            "static_mse": float(F.mse_loss(data.x_initial, data.x_final)),
            "free_motion_mse": float(F.mse_loss(free, data.x_final)),
        }

    def evaluation(
        self,
        model: TaskModel,
        device: torch.device,
        sampled: Callable[[], dict[str, float]],
        *,
        over: str,
    ) -> list[EvalRow]:
        """``geoattn eval``: the trainer's batch estimates, the model's MSE on every sample of the eval,
        E(3) and object sets (charged: val and test) with the two baselines beside each, and the
        equivariance error."""
        rows = [EvalRow(k, v, over) for k, v in sampled().items()]
        # one error per sample, once per set: the sets' MSEs and how each is made up (typical sample
        # against the worst 1 %), and the training set's own apart from the trainer's last-batch loss
        # (a batch rarely holds the rare samples that make an MSE, so the two are not comparable)
        errors = {n: sample_errors(model, self.dataset(n)) for n in ("train", *self.measured)}
        results = self.evaluate_sets(model, errors=errors)
        for name in self.measured:
            where = f"all {len(self.dataset(name)):,} {name} samples"
            rows.append(EvalRow(_full_key(name), results[_full_key(name)], where))
            rows += [EvalRow(f"{name}_{k}", v, where) for k, v in self.baselines(name).items()]
        rows += self._profile_rows(errors)
        if "e3_generalization_unshifted_mse" in results:
            where = f"the {len(self.dataset('e3_generalization')):,} e3_generalization samples, shift removed"
            name = "e3_generalization_unshifted_mse"
            rows.append(EvalRow(name, results[name], where))
        probe = self.probe
        count = min(EQUIVARIANCE_SAMPLES, len(self.dataset(probe)))
        where = f"first {count} {probe} samples, one random O(3) motion + translation each"
        rows.append(EvalRow("equivariance_error", results["equivariance_error"], where))
        return rows

    def _profile_rows(self, errors: dict[str, Tensor]) -> list[EvalRow]:
        """How each set's MSE is made up (:func:`error_profile`), from its :func:`sample_errors`; the
        training set's MSE over all its samples as ``train_mse_full``."""
        rows = []
        for name, set_errors in errors.items():
            count, whole = len(set_errors), len(self.dataset(name))
            data = self.dataset(name).head(count)
            profile = error_profile(set_errors, closest_distance(data))
            samples = f"all {count:,}" if count == whole else f"the first {count:,} of {whole:,}"
            where = f"{samples} {name} samples, one error per sample"
            if name == "train":
                rows.append(EvalRow("train_mse_full", profile["mse"], where))
            keys = ("mse_median", "worst_1pct_share", "closest_median", "closest_worst_1pct")
            rows += [EvalRow(f"{name}_{k}", profile[k], where) for k in keys]
        return rows

    def prediction_rows(self, predictions: dict[str, Tensor]) -> list[EvalRow]:
        """A peer's predicted final positions ``(S, n, 3)`` per set, measured as :meth:`evaluation`
        measures this project's runs: each set's MSE over all its samples and how it is made up
        (:meth:`_profile_rows`). ``train`` may hold the first S training samples only (a peer that
        trained on them, as GATr's ``data.subsample`` keeps a file's first samples); every other set
        must be whole. ValueError naming the set and the shapes otherwise."""
        known = ("train", *self.system.measured)
        errors = {}
        for name, prediction in predictions.items():
            if name not in known:
                raise ValueError(f"predictions for set {name!r}: this task's sets are {', '.join(known)}")
            if not self.readable(name):
                continue
            target = self.dataset(name).x_final
            if name == "train" and prediction.dim() == 3 and 0 < prediction.shape[0] <= target.shape[0]:
                target = target[: prediction.shape[0]]
            if tuple(prediction.shape) != tuple(target.shape):
                raise ValueError(
                    f"predictions for set {name!r} have shape {tuple(prediction.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            errors[name] = squared_errors(prediction.double(), target.double())
        rows = []
        for name in self.measured:
            if name in errors:
                where = f"all {len(errors[name]):,} {name} samples, the peer's predictions"
                rows.append(EvalRow(_full_key(name), float(errors[name].mean()), where))
        return rows + self._profile_rows(errors)

    @torch.no_grad()
    def evaluate_sets(
        self,
        model: nn.Module,
        *,
        batch_size: int = EQUIVARIANCE_SAMPLES,
        seed: int = 0,
        errors: dict[str, Tensor] | None = None,
    ) -> dict[str, float]:
        """MSE on ``val`` (``val_mse_full``, for model selection), ``eval``, ``e3_generalization``,
        ``object_generalization``, on the E(3) set with its fixed shift removed
        (``e3_generalization_unshifted``), and the equivariance error; for the charged system MSE on
        ``val`` and ``test`` and the equivariance error (on val samples).

        Every set runs in batches of its own number of bodies (no padding). The equivariance error is
        :func:`equivariance_error` on the first ``batch_size`` samples of the eval (charged: val) set,
        each with a random rotation or reflection and a translation (std ``shift_std``) from ``seed``.
        ``errors``: the sets' :func:`sample_errors` where the caller has them already (their means).
        A set sealed in this run (:meth:`readable`) is not read: no metric of it, and the equivariance
        error on val samples where the eval set is sealed.
        """
        parameter = next(model.parameters())
        sets = self.measured
        errors = errors or {}
        # val_mse_full: the whole set, apart from the trainer's batch estimate val_mse
        results = {
            _full_key(name): float(errors[name].mean())
            if name in errors
            else _set_mse(model, self.dataset(name), batch_size)
            for name in sets
        }
        probe = self.probe
        sample = self.dataset(probe).subset(torch.arange(min(batch_size, len(self.dataset(probe)))))
        x = sample.inputs().to(parameter.device, parameter.dtype)
        generator = torch.Generator().manual_seed(seed)
        results["equivariance_error"] = equivariance_error(
            model, x, generator, shift_std=self.config.shift_std
        )
        if "e3_generalization" not in sets:
            return results
        # the E(3) set's samples without its fixed shift: an exactly E(3)-equivariant model reads the
        # same MSE, so the ratio to the eval set measures how hard these samples are in themselves
        shift = torch.zeros(3, dtype=torch.float64)
        shift[0] = self.config.e3_shift
        results["e3_generalization_unshifted_mse"] = _set_mse(
            model, self.dataset("e3_generalization").translated(-shift), batch_size
        )
        return results


def _full_key(name: str) -> str:
    """The metric of set ``name`` measured on all its samples (``val_mse_full``, ``eval_mse``, …)."""
    return "val_mse_full" if name == "val" else f"{name}_mse"


def _set_mse(model: nn.Module, data: NBodySet, batch_size: int) -> float:
    """MSE of ``model`` on every sample of ``data``, in batches of ``batch_size``."""
    return float(sample_errors(model, data, batch_size).mean())


@torch.no_grad()
def sample_errors(model: nn.Module, data: NBodySet, batch_size: int = EQUIVARIANCE_SAMPLES) -> Tensor:
    """``(S,)`` float64: each sample's squared error of the final positions, summed over bodies and
    coordinates and divided by their number (the set's MSE is the mean), in batches of ``batch_size``;
    the model in eval mode (no dropout), its mode restored after."""
    parameter = next(model.parameters())
    was_training = model.training
    model.eval()
    errors = []
    try:
        for start in range(0, len(data), batch_size):
            batch = data.subset(torch.arange(start, min(start + batch_size, len(data))))
            prediction, _ = model(batch.inputs().to(parameter.device, parameter.dtype))
            target = batch.x_final.to(prediction.device, prediction.dtype)
            errors.append(squared_errors(prediction, target).cpu())
    finally:
        model.train(was_training)
    return torch.cat(errors)


def squared_errors(prediction: Tensor, target: Tensor) -> Tensor:
    """``(S,)`` float64: each sample's mean squared error over its bodies and coordinates, from final
    positions ``(S, n, 3)`` (the set's MSE is their mean)."""
    return (prediction - target).double().square().flatten(1).mean(1)


def error_profile(errors: Tensor, closest: Tensor | None = None) -> dict[str, float]:
    """How a set's MSE is made up, from :func:`sample_errors` ``(S,)``: ``mse`` (their mean),
    ``mse_median`` (the typical sample's; torch's median, the lower middle value of an even count), and
    ``worst_1pct_share``, the share of the summed error
    carried by the worst 1 % of samples (at least one): near 1 when a few samples make the MSE. With
    ``closest (S,)`` (each sample's :func:`closest_distance`) also ``closest_median`` over all samples and
    ``closest_worst_1pct``, its median over those worst samples: what they are (close encounters)."""
    order = errors.argsort(descending=True)
    worst = order[: max(1, len(errors) // 100)]
    total = errors.sum()
    profile = {
        "mse": float(errors.mean()),
        "mse_median": float(errors.median()),
        # nan where the errors are (a diverged model), 0 where there is nothing to share
        "worst_1pct_share": float(errors[worst].sum() / total) if total > 0 or not total.isfinite() else 0.0,
    }
    if closest is not None:
        profile["closest_median"] = float(closest.median())
        profile["closest_worst_1pct"] = float(closest[worst].median())
    return profile


def plot_errors_by_distance(errors: Tensor, closest: Tensor, path: Path, *, split: str) -> Path:
    """Scatter of per-sample errors ``(S,)`` against closest distances ``(S,)``, log-log, the worst 1 %
    of samples (by error) in another colour with their share of the summed error in the legend."""
    plt = pyplot()
    profile = error_profile(errors, closest)
    worst = errors.argsort(descending=True)[: max(1, len(errors) // 100)]
    rest = torch.ones(len(errors), dtype=torch.bool)
    rest[worst] = False
    tiny = torch.finfo(torch.float64).tiny  # a zero error or distance stays on a log axis
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter(closest[rest].clamp_min(tiny), errors[rest].clamp_min(tiny), s=4, alpha=0.4, label="samples")
    share = profile["worst_1pct_share"]
    ax.scatter(
        closest[worst].clamp_min(tiny),
        errors[worst].clamp_min(tiny),
        s=10,
        color="C3",
        label=f"worst 1 % ({len(worst)}): {share:.0%} of the summed error",
    )
    ax.axhline(profile["mse"], color="k", lw=0.8, ls="--", label=f"MSE {profile['mse']:.3g}")
    ax.axhline(profile["mse_median"], color="k", lw=0.8, ls=":", label=f"median {profile['mse_median']:.3g}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="closest distance between two bodies at the start",
        ylabel="squared error of the final positions (per sample)",
        title=f"{split}: {len(errors):,} samples",
    )
    ax.legend(fontsize=8, loc="lower left")
    return save_figure(fig, path)


def closest_distance(data: NBodySet) -> Tensor:
    """``(S,)``: each sample's smallest distance between two bodies at the start."""
    x = data.x_initial.double()
    apart = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")  # exact, also for many bodies
    apart = apart + torch.diag(torch.full((x.shape[1],), math.inf, dtype=x.dtype))
    return apart.flatten(1).min(1).values


@torch.no_grad()
def equivariance_error(
    model: nn.Module, x: Tensor, generator: torch.Generator, *, shift_std: float = 1.0, reflect: bool = True
) -> float:
    """Relative E(3)-equivariance error of an n-body model on inputs ``x`` ``(B, n, 7)``.

    With ``g = (Q, t)`` random (Q ∈ O(3), or SO(3) if ``not reflect``; t ~ N(0, shift_std²)) acting
    on positions by ``Q x + t`` and on velocities by ``Q v``:
    ``‖f(g·x) − g·f(x)‖ / ‖f(x) − centroid(x)‖`` (Frobenius norms over the batch).
    """
    batch = x.shape[0]
    q = (random_orthogonal if reflect else random_rotations)(batch, generator).to(x.device, x.dtype)
    t = (shift_std * torch.randn(batch, 1, 3, generator=generator, dtype=torch.float64)).to(x.device, x.dtype)
    position, velocity = x[..., 1:4], x[..., 4:7]

    def act(points: Tensor, shift: Tensor | float) -> Tensor:
        return torch.einsum("bij,bnj->bni", q, points) + shift

    moved = torch.cat((x[..., :1], act(position, t), act(velocity, 0.0)), dim=-1)
    out, _ = model(x)
    out_moved, _ = model(moved)
    scale = (out - centroid(position)).norm()
    return float((out_moved - act(out, t)).norm() / scale.clamp_min(torch.finfo(scale.dtype).tiny))
