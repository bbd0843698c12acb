"""The ``filter`` task: estimate the direction of an RT-SDE (docs/tasks.md#filter) causally from its
measurements.

Sequences come from :class:`geoattn.rt.RTSDE` (eq. 3), generated on the fly from the trainer's
generator for ``train`` and from fixed seeds for ``val`` and ``eval`` (a pool of sequences drawn
once, from which batches are sampled), so every evaluation sees the same data. ``eval`` is the
held-out pool (an exploratory run seals it); ``FilterConfig.pool_seed`` draws both pools afresh.
The learned models are compared with reference estimators on the same pool
(:meth:`FilterTask.baselines`).

A batch is ``x`` ``(B, T, D + 1)``: the measurements ``z`` in the first ``D`` channels and the
observation times in the last; ``y`` ``(B, T, D)``: the true unit directions ``u(t_i)``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from geoattn.core.errors import ConfigError
from geoattn.rt.sde import RTSDE

SPLIT_SEEDS = {"val": 1_000_003, "eval": 2_000_003}


def split_seed(split: str, pool_seed: int = 0) -> int:
    """The seed of the fixed pool ``split`` (``val`` or ``eval``) under ``pool_seed``: 0 gives
    ``SPLIT_SEEDS[split]``, any other value a seed hashed from ``(split, pool_seed)`` (63 bits),
    so the two splits of one pool seed, and any two pool seeds, draw different pools."""
    if pool_seed == 0:
        return SPLIT_SEEDS[split]
    digest = hashlib.sha256(f"filter/{split}/{pool_seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class FilterConfig:
    """Simulator and reference-estimator settings of the filter task (all overridable as task options).

    The RT-SDE (docs/concepts/rt-filter.md#the-rt-sde) in ``dim`` dimensions, observed at ``seq_len``
    irregular times with intervals uniform on ``dt_range`` (mean 1), from a uniform random direction and an
    initial magnitude log-uniform on ``m0_range``. Each token is measured through a gain ``g_i``, log-uniform
    on ``[ρ^{−1/2}, ρ^{1/2}]`` (ρ = ``gain_ratio``): ``z_i = g_i x(t_i) + v_i`` with the SDE's
    measurement noise ``v_i``. The gain is equivalent to a per-token measurement noise ``η/g_i`` with
    the token reported at scale ``g_i``, so the token magnitude ``|z_i| ≈ g_i m_i`` *is* its confidence
    (angular noise ``η_t / |z_i|``), as the RT model assumes, and varies several-fold along every
    sequence (the property precision weighting needs).

    Defaults and why (measured on the 256-sequence val pool, seed ``SPLIT_SEEDS["val"]``):

    * ``sigma_t = 0.08``, ``eta_t = 0.5`` with magnitudes ~1–2: the direction diffuses by a median
      ~8° per token (small-angle regime), while one measurement is ~40° off (raw directions), so
      averaging many transported tokens pays and old tokens go stale;
    * ``mu_r = 0.01``: a slow decay (the Itô drift ``(D−1)σ_t²/(2m)`` of the tangential noise keeps
      the latent magnitude near 1–2 along the sequence); ``mu_t`` does not act on the state
      (``P_T(u) x ≡ 0``) and is kept for completeness;
    * ``gain_ratio = 10``: token magnitudes vary ≥ 3× within every sequence (min 3.5×, median 5.2×);
    * ``omega``: a transport rotation in each of the ``dim/2`` planes, slow to fast;
    * ``beta = 0.05`` for the closed-form RT-Filter baseline: with ``q = k = v = z`` the robust term
      ``β κ (⟨ẑ_i, R ẑ_j⟩ − 1)`` compares keys with the *noisy* current measurement, so a large β
      makes the weights follow that noise. Closed-form error against β on the val pool: 0.01 → 23.8°,
      0.05 → 23.8°, 0.1 → 24.2°, 0.2 → 26.1°, 1 (the von Mises–Fisher likelihood) → 37.5°.

    Reference errors with these defaults (val pool; eval within 0.4°): raw directions 40.9°, uniform
    transported mean 27.4°, closed-form RT-Filter 23.8°, tangent Kalman 17.9°, particle filter
    (1000 particles) 18.4°.

    Fields:
        dim: state dimension D (even). seq_len: tokens per sequence T.
        mu_r, mu_t, sigma_r, sigma_t, eta_r, eta_t: the RT-SDE parameters
        (docs/concepts/rt-filter.md#the-rt-sde).
        omega: ``dim/2`` angular frequencies of ``R(Δt)``.
        m0_range: initial magnitudes, log-uniform. gain_ratio: ρ ≥ 1 (1: no gains).
        dt_range: observation intervals, uniform. max_step: Euler–Maruyama step of the simulator.
        val_size, eval_size: sequences in the fixed val / eval pools.
        pool_seed: which val and eval pools (and particle-filter draws): 0 the fixed ``SPLIT_SEEDS``
            (every result measured so far), any other value fresh pools from seeds derived from it,
            one per split (:func:`split_seed`): data no earlier run has read, for a confirmation.
        beta: β of the closed-form RT-Filter baseline. n_particles: particle-filter size.
        particle_sizes: further particle-filter sizes for the convergence check (baselines
            ``particle_N``; the largest, an estimate of the best attainable error that still falls
            with more particles, is what a learned model's gap is measured against).
    """

    dim: int = 8
    seq_len: int = 64
    mu_r: float = 0.01
    mu_t: float = 0.0
    sigma_r: float = 0.03
    sigma_t: float = 0.08
    eta_r: float = 0.1
    eta_t: float = 0.5
    omega: tuple[float, ...] = (0.2, 0.1, 0.05, 0.02)
    m0_range: tuple[float, float] = (1.0, 2.0)
    gain_ratio: float = 10.0
    dt_range: tuple[float, float] = (0.5, 1.5)
    max_step: float = 0.25
    val_size: int = 256
    eval_size: int = 256
    pool_seed: int = 0
    beta: float = 0.05
    n_particles: int = 1000
    particle_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.omega = tuple(float(w) for w in self.omega)
        self.particle_sizes = tuple(int(n) for n in self.particle_sizes)
        if any(n < 2 for n in self.particle_sizes):
            raise ConfigError(f"FilterConfig.particle_sizes must all be ≥ 2, got {self.particle_sizes}")
        self.m0_range = _pair("m0_range", self.m0_range)
        self.dt_range = _pair("dt_range", self.dt_range)
        if not isinstance(self.dim, int) or self.dim < 2 or self.dim % 2:
            raise ConfigError(f"FilterConfig.dim must be an even integer ≥ 2, got {self.dim!r}")
        least = {"seq_len": 2, "val_size": 1, "eval_size": 1, "n_particles": 2, "pool_seed": 0}
        for name, low in least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"FilterConfig.{name} must be an integer ≥ {low}, got {value!r}")
        for name in ("mu_r", "mu_t", "sigma_r", "sigma_t"):
            if getattr(self, name) < 0:
                raise ConfigError(f"FilterConfig.{name} must be ≥ 0, got {getattr(self, name)}")
        for name in ("eta_r", "eta_t", "max_step", "beta"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"FilterConfig.{name} must be > 0, got {getattr(self, name)}")
        if len(self.omega) != self.dim // 2:
            raise ConfigError(
                f"FilterConfig.omega has {len(self.omega)} frequencies, expected dim/2 = {self.dim // 2}"
            )
        if self.gain_ratio < 1:
            raise ConfigError(f"FilterConfig.gain_ratio must be ≥ 1, got {self.gain_ratio}")

    def sde(self) -> RTSDE:
        """The :class:`geoattn.rt.RTSDE` with these parameters."""
        return RTSDE(
            dim=self.dim,
            mu_r=self.mu_r,
            mu_t=self.mu_t,
            sigma_r=self.sigma_r,
            sigma_t=self.sigma_t,
            eta_r=self.eta_r,
            eta_t=self.eta_t,
            omega=torch.tensor(self.omega, dtype=torch.float64),
        )


def _pair(name: str, value: Any) -> tuple[float, float]:
    low, high = (float(v) for v in value)
    if not 0 < low <= high:
        raise ConfigError(f"FilterConfig.{name} must be (low, high) with 0 < low ≤ high, got {tuple(value)}")
    return low, high


@dataclass
class FilterSample:
    """A simulated batch: ``times`` ``(B, T)``, latent ``x`` and measurements ``z`` ``(B, T, D)``."""

    times: Tensor
    x: Tensor
    z: Tensor
    gains: Tensor = field(repr=False)  # (B, T)

    @property
    def directions(self) -> Tensor:
        """The targets ``u(t_i) = x/|x|`` ``(B, T, D)``."""
        return F.normalize(self.x, dim=-1)


def simulate(config: FilterConfig, batch_size: int, generator: torch.Generator) -> FilterSample:
    """Draw ``batch_size`` sequences (float64, CPU) from ``generator`` as ``FilterConfig`` describes."""
    t, dtype = config.seq_len, torch.float64
    low, high = config.dt_range
    steps = low + (high - low) * torch.rand(batch_size, t - 1, generator=generator, dtype=dtype)
    times = torch.cat((torch.zeros(batch_size, 1, dtype=dtype), steps.cumsum(1)), dim=1)  # (B, T)
    log_low, log_high = (math.log(m) for m in config.m0_range)
    m0 = torch.exp(log_low + (log_high - log_low) * torch.rand(batch_size, generator=generator, dtype=dtype))
    sample = config.sde().simulate(times, batch_size, m0=m0, generator=generator, max_step=config.max_step)
    log_ratio = math.log(config.gain_ratio)
    gains = torch.exp(log_ratio * (torch.rand(batch_size, t, generator=generator, dtype=dtype) - 0.5))
    x = sample.x.to(dtype)
    z = gains[..., None] * x + (sample.z.to(dtype) - x)  # z = g x + v
    return FilterSample(times=times, x=x, z=z, gains=gains)
