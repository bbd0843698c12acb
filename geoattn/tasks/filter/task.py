"""The ``filter`` task behind the trainer's contract: sequences from :mod:`.simulator`, the learned
estimator of :mod:`.models`, and the reference estimators (:mod:`.estimators`) as baselines on the
same validation pool."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar

import torch
from torch import Tensor

from geoattn.core.cache import cache_dir
from geoattn.core.errors import ConfigError
from geoattn.models.base import TaskModel
from geoattn.tasks.base import ModelRow, Task
from geoattn.tasks.filter import estimators
from geoattn.tasks.filter.models import FILTER_TABLE
from geoattn.tasks.filter.simulator import SPLIT_SEEDS, FilterConfig, FilterSample, simulate


class FilterTask(Task):
    """RT-SDE direction filtering (see the module docstring and :class:`FilterConfig`)."""

    name: ClassVar[str] = "filter"
    table: ClassVar[dict[str, ModelRow]] = FILTER_TABLE
    Settings: ClassVar[type] = FilterConfig
    description: ClassVar[str] = (
        "estimate a direction drifting on the sphere (the RT-SDE) from noisy measurements"
    )
    splits: ClassVar[tuple[str, ...]] = ("train", "val", "eval")

    def __init__(self, config: FilterConfig | None = None):
        self.config = config or FilterConfig()
        self._pools: dict[str, FilterSample] = {}
        self._baselines: dict[str, dict[str, float]] = {}

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

    def pool(self, split: str) -> FilterSample:
        """The fixed sequences of ``val`` or ``eval`` (drawn once from the split's seed, cached)."""
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split {split!r} has no fixed pool; pools: {', '.join(SPLIT_SEEDS)}")
        if split not in self._pools:
            size = self.config.val_size if split == "val" else self.config.eval_size
            generator = torch.Generator().manual_seed(SPLIT_SEEDS[split])
            self._pools[split] = simulate(self.config, size, generator)
        return self._pools[split]

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

    @torch.no_grad()
    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """On the whole val pool: the learned model's ``angle_deg_full``, every reference estimator
        (``baseline_*``) and the gap to the largest particle filter in percent (``gap_to_particle_pct``:
        against the particle filter with the most particles)."""
        pool = self.pool("val")
        x = torch.cat((pool.z, pool.times[..., None]), dim=-1).float().to(device)  # as get_batch
        was_training = model.training
        model.eval()
        prediction, _ = model(x)
        model.train(was_training)
        learned = float(
            estimators.angular_error_deg(prediction.float().cpu(), pool.directions.float()).mean()
        )
        baselines = self.baselines("val")
        sizes = [self.config.n_particles, *self.config.particle_sizes]
        largest = max(sizes)
        bound = baselines["particle" if largest == self.config.n_particles else f"particle_{largest}"]
        return {
            "angle_deg_full": learned,
            "gap_to_particle_pct": 100.0 * (learned / bound - 1.0),
            **{f"baseline_{k}": v for k, v in baselines.items()},
        }

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """``angle_deg``: mean angular error (degrees) of the causal estimates."""
        return {"angle_deg": float(estimators.angular_error_deg(prediction, y).mean())}

    def meta(self) -> dict[str, Any]:
        return {"task": self.name, "config": dataclasses.asdict(self.config)}

    def estimates(self, split: str = "val") -> dict[str, Tensor]:
        """Every reference estimator's causal estimates ``(B, T, D)`` on the ``split`` pool."""
        pool, c, sde = self.pool(split), self.config, self.config.sde()
        estimates = {
            "rt_filter": estimators.rt_filter(pool.z, pool.times, sde, beta=c.beta),
            "uniform": estimators.uniform_transported_mean(pool.z, pool.times, sde),
            "kalman": estimators.tangent_kalman_filter(pool.z, pool.times, sde, gain_ratio=c.gain_ratio),
            "particle": self.particle_estimates(split, c.n_particles),
            "raw": estimators.raw_directions(pool.z),
        }
        for n in c.particle_sizes:
            estimates[f"particle_{n}"] = self.particle_estimates(split, n)
        return estimates

    def particle_estimates(self, split: str, n_particles: int, *, max_elements: int = 2**23) -> Tensor:
        """The bootstrap particle filter with ``n_particles`` on the ``split`` pool ``(B, T, D)``,
        in chunks of sequences so that one state tensor holds at most ``max_elements`` numbers."""
        pool, c, sde = self.pool(split), self.config, self.config.sde()
        generator = torch.Generator().manual_seed(SPLIT_SEEDS[split] + 1)
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
        ``z/|z|``. Computed once per split and cached.
        """
        if split not in self._baselines:
            # the particle filter at 10^5 particles takes minutes: results are cached on disk, keyed
            # by every simulator setting (the pools are drawn from fixed seeds, so they are the same)
            key = json.dumps({"split": split, **dataclasses.asdict(self.config)}, sort_keys=True)
            path = cache_dir() / "filter-baselines" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
            if path.is_file():
                self._baselines[split] = json.loads(path.read_text())
            else:
                target = self.pool(split).directions
                self._baselines[split] = {
                    name: float(estimators.angular_error_deg(estimate, target).mean())
                    for name, estimate in self.estimates(split).items()
                }
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(self._baselines[split]))
        return dict(self._baselines[split])
