"""The ``filter`` task behind the trainer's contract: sequences from :mod:`.simulator`, the learned
estimator of :mod:`.models`, and the reference estimators (:mod:`.estimators`) as baselines on the
same validation pool. The ``eval`` pool is the held-out set (``test_sets``): a run that may read it
also reports the learned model and the closed-form references on it (``eval_*``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from geoattn.core.cache import cache_dir
from geoattn.core.errors import ConfigError
from geoattn.models.base import TaskModel
from geoattn.rt.sde import RTSDE
from geoattn.tasks.base import ModelRow, Task
from geoattn.tasks.filter import estimators
from geoattn.tasks.filter.models import FILTER_TABLE
from geoattn.tasks.filter.simulator import SPLIT_SEEDS, FilterConfig, FilterSample, simulate, split_seed

# The reference estimators in closed form, ``(pool, config, sde) -> (B, T, D)``: seconds on a pool,
# where the particle filters (:meth:`FilterTask.particle_estimates`) take minutes at 10^4-10^5 particles.
CLOSED_FORM: dict[str, Callable[[FilterSample, FilterConfig, RTSDE], Tensor]] = {
    "rt_filter": lambda pool, c, sde: estimators.rt_filter(pool.z, pool.times, sde, beta=c.beta),
    "uniform": lambda pool, c, sde: estimators.uniform_transported_mean(pool.z, pool.times, sde),
    "kalman": lambda pool, c, sde: estimators.tangent_kalman_filter(
        pool.z, pool.times, sde, gain_ratio=c.gain_ratio
    ),
    "raw": lambda pool, c, sde: estimators.raw_directions(pool.z),
}


class FilterTask(Task):
    """RT-SDE direction filtering (see the module docstring and :class:`FilterConfig`)."""

    name: ClassVar[str] = "filter"
    table: ClassVar[dict[str, ModelRow]] = FILTER_TABLE
    Settings: ClassVar[type] = FilterConfig
    description: ClassVar[str] = (
        "estimate a direction drifting on the sphere (the RT-SDE) from noisy measurements"
    )
    splits: ClassVar[tuple[str, ...]] = ("train", "val", "eval")
    test_sets: ClassVar[tuple[str, ...]] = ("eval",)

    def __init__(self, config: FilterConfig | None = None):
        self.config = config or FilterConfig()
        # keyed by the seed a pool is drawn from (its split and ``config.pool_seed``)
        self._pools: dict[int, FilterSample] = {}
        self._baselines: dict[int, dict[str, float]] = {}

    @classmethod
    def settings_defaults(cls, *, data: str | None, block_size: int) -> dict[str, Any]:
        return {"seq_len": block_size}

    @classmethod
    def from_settings(
        cls,
        settings: FilterConfig,
        *,
        data: str | None,
        block_size: int,
        meta: dict[str, Any] | None,
        load_data: bool,
    ) -> FilterTask:
        """The simulator described by ``settings``; the filter task generates its data (no ``--data``)."""
        if data is not None:
            raise ConfigError("the filter task generates its data; it takes no --data")
        return cls(settings)

    def pool_seed(self, split: str) -> int:
        """The seed the ``split`` pool is drawn from (:func:`~.simulator.split_seed` under
        ``config.pool_seed``); ValueError for a split with no pool or one sealed in this run."""
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split {split!r} has no fixed pool; pools: {', '.join(SPLIT_SEEDS)}")
        if not self.readable(split):
            raise ValueError(f"the {split} pool is sealed in this run")
        return split_seed(split, self.config.pool_seed)

    def pool(self, split: str) -> FilterSample:
        """The fixed sequences of ``val`` or ``eval`` (drawn once from :meth:`pool_seed`, cached)."""
        seed = self.pool_seed(split)
        if seed not in self._pools:
            size = self.config.val_size if split == "val" else self.config.eval_size
            self._pools[seed] = simulate(self.config, size, torch.Generator().manual_seed(seed))
        return self._pools[seed]

    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """``x`` ``(B, T, D + 1)`` = [z, times], ``y`` ``(B, T, D)`` = u; train fresh, val/eval pooled."""
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; the filter task has {', '.join(self.splits)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        if split == "train":
            sample = simulate(self.config, batch_size, generator)
        else:
            pool = self.pool(split)
            index = torch.randint(pool.times.shape[0], (batch_size,), generator=generator)
            sample = FilterSample(pool.times[index], pool.x[index], pool.z[index], pool.gains[index])
        x = torch.cat((sample.z, sample.times[..., None]), dim=-1).float()
        return x.to(device), sample.directions.float().to(device)

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """On the whole val pool: the learned model's ``angle_deg_full``, every reference estimator
        (``baseline_*``) and the gap to the largest particle filter in percent (``gap_to_particle_pct``:
        against the particle filter with the most particles). Where the run may read the held-out
        ``eval`` pool, on all of it: the learned model's ``eval_angle_deg_full`` and the closed-form
        references' ``eval_baseline_*`` (not the particle filters: minutes each)."""
        learned = self.angle_deg_full(model, "val", device)
        baselines = self.baselines("val")
        sizes = [self.config.n_particles, *self.config.particle_sizes]
        largest = max(sizes)
        bound = baselines["particle" if largest == self.config.n_particles else f"particle_{largest}"]
        out = {
            "angle_deg_full": learned,
            "gap_to_particle_pct": 100.0 * (learned / bound - 1.0),
            **{f"baseline_{k}": v for k, v in baselines.items()},
        }
        if self.readable("eval"):
            out["eval_angle_deg_full"] = self.angle_deg_full(model, "eval", device)
            errors = self.errors("eval", self.estimates("eval", particles=False))
            out.update({f"eval_baseline_{k}": v for k, v in errors.items()})
        return out

    @torch.no_grad()
    def angle_deg_full(self, model: TaskModel, split: str, device: torch.device) -> float:
        """The mean angular error (degrees) of ``model``'s estimates over every sequence of the
        ``split`` pool, in one batch ``(B, T, D + 1)`` as :meth:`get_batch` makes them."""
        pool = self.pool(split)
        x = torch.cat((pool.z, pool.times[..., None]), dim=-1).float().to(device)
        was_training = model.training
        model.eval()
        prediction, _ = model(x)
        model.train(was_training)
        return float(estimators.angular_error_deg(prediction.float().cpu(), pool.directions.float()).mean())

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``angle_deg``: mean angular error (degrees) of the causal estimates."""
        return {"angle_deg": float(estimators.angular_error_deg(prediction, y).mean())}

    def meta(self) -> dict[str, Any]:
        return {"task": self.name, "config": dataclasses.asdict(self.config)}

    def estimates(self, split: str = "val", *, particles: bool = True) -> dict[str, Tensor]:
        """Every reference estimator's causal estimates ``(B, T, D)`` on the ``split`` pool: those of
        ``CLOSED_FORM``, then (``particles``) the particle filters, ``particle`` and ``particle_N``."""
        pool, c, sde = self.pool(split), self.config, self.config.sde()
        estimates = {name: estimate(pool, c, sde) for name, estimate in CLOSED_FORM.items()}
        if particles:
            estimates["particle"] = self.particle_estimates(split, c.n_particles)
            for n in c.particle_sizes:
                estimates[f"particle_{n}"] = self.particle_estimates(split, n)
        return estimates

    def errors(self, split: str, estimates: dict[str, Tensor]) -> dict[str, float]:
        """``{name: mean angular error in degrees}`` of ``estimates`` ``(B, T, D)`` on the ``split`` pool."""
        target = self.pool(split).directions
        return {
            name: float(estimators.angular_error_deg(estimate, target).mean())
            for name, estimate in estimates.items()
        }

    def particle_estimates(self, split: str, n_particles: int, *, max_elements: int = 2**23) -> Tensor:
        """The bootstrap particle filter with ``n_particles`` on the ``split`` pool ``(B, T, D)``,
        in chunks of sequences so that one state tensor holds at most ``max_elements`` numbers."""
        pool, c, sde = self.pool(split), self.config, self.config.sde()
        generator = torch.Generator().manual_seed(self.pool_seed(split) + 1)
        chunk = max(1, max_elements // (n_particles * c.dim))
        return torch.cat(
            [
                estimators.particle_filter(
                    pool.z[i : i + chunk],
                    pool.times[i : i + chunk],
                    sde,
                    m0_range=c.m0_range,
                    gain_ratio=c.gain_ratio,
                    n_particles=n_particles,
                    generator=generator,
                )
                for i in range(0, pool.z.shape[0], chunk)
            ]
        )

    def baselines(self, split: str = "val") -> dict[str, float]:
        """``{name: mean angular error in degrees}`` of the reference estimators on the ``split`` pool.

        ``rt_filter``: closed-form RT-Filter with the true μ_r, σ_t², η_t², ω and ``config.beta``;
        ``uniform``: transported mean, precision ignored; ``kalman``: tangent-space Kalman filter;
        ``particle``: bootstrap particle filter (an estimate of the best attainable error); ``raw``:
        ``z/|z|``. Computed once per pool and cached; ValueError for a sealed pool, cached or not.
        """
        seed = self.pool_seed(split)
        if seed not in self._baselines:
            # the particle filter at 10^5 particles takes minutes: results are cached on disk, keyed
            # by every simulator setting (the pools are drawn from their seeds, so they are the same).
            # pool_seed 0 draws the pools of SPLIT_SEEDS: its key leaves it out, so the files cached
            # for those pools stay valid.
            settings = dataclasses.asdict(self.config)
            if settings["pool_seed"] == 0:
                del settings["pool_seed"]
            key = json.dumps({"split": split, **settings}, sort_keys=True)
            path = cache_dir() / "filter-baselines" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
            if path.is_file():
                self._baselines[seed] = json.loads(path.read_text())
            else:
                self._baselines[seed] = self.errors(split, self.estimates(split))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(self._baselines[seed]))
        return dict(self._baselines[seed])
