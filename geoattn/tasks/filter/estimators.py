"""Reference estimators of the direction u(t_i) of an RT-SDE (docs/concepts/rt-filter.md#the-rt-sde) from its
measurements.

Every estimator is causal: the estimate at ``t_i`` uses ``z_1 .. z_i`` only. Inputs are the
measurements ``z`` ``(B, T, D)`` at times ``times`` ``(B, T)`` and the true SDE parameters (an
:class:`geoattn.rt.RTSDE`, read through its fields ``mu_r, sigma_r, sigma_t, eta_r, eta_t, omega``).
Outputs are unit vectors ``(B, T, D)``.

* :func:`raw_directions` — ``z / |z|``, no filtering.
* :func:`uniform_transported_mean` — every past measurement direction transported to ``t_i`` by
  ``R(Δt)`` and averaged with equal weights (precision ignored).
* :func:`rt_filter` — the closed-form RT-Filter: ``rt_attention`` with ``q = k = v = z`` and the true
  ``μ_r, σ_t², η_t², ω``, so ``κ_ij = |z_j|² / c(Δt_ij)`` (docs/concepts/rt-filter.md#precision).
* :func:`tangent_kalman_filter` — a recursive Kalman filter on the sphere (tangent-space EKF).
* :func:`particle_filter` — a bootstrap particle filter on the full latent state: with enough
  particles, an estimate of the best attainable error (not a bound: it still falls with more).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from geoattn.algebra.rotation import rotate_pairs
from geoattn.attention.rt import rt_attention
from geoattn.rt.precision import expm1_ratio, rt_noise_variance

_EPS = 1e-12


def _unit(x: Tensor) -> Tensor:
    """``x / |x|`` over the last dimension, finite at 0."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def _omega(sde: Any, like: Tensor) -> Tensor:
    """The SDE's angular frequencies ``(D/2,)`` (zeros when it has none) in ``like``'s dtype/device."""
    if sde.omega is None:
        return like.new_zeros(like.shape[-1] // 2)
    return torch.as_tensor(sde.omega, dtype=like.dtype, device=like.device)


def _check(z: Tensor, times: Tensor) -> None:
    if z.dim() != 3 or z.shape[-1] % 2:
        raise ValueError(f"z must have shape (B, T, D) with D even, got {tuple(z.shape)}")
    if times.shape != z.shape[:2]:
        raise ValueError(f"times must have shape (B, T) = {tuple(z.shape[:2])}, got {tuple(times.shape)}")


def angular_error_deg(estimate: Tensor, target: Tensor) -> Tensor:
    """Angle in degrees between ``estimate`` and ``target`` ``(..., D)`` → ``(...)`` (any scale)."""
    cos = (_unit(estimate) * _unit(target)).sum(-1).clamp(-1.0, 1.0)
    return torch.rad2deg(torch.acos(cos))


def process_variance(sde: Any, dt: Tensor) -> Tensor:
    """``σ_t² (e^{2 μ_r Δt} − 1) / (2 μ_r)`` ``(...)``: the tangential process part of ``c(Δt)``.

    Divided by ``m(t_j)²`` it is the angular diffusion of the direction over ``dt``
    (docs/concepts/rt-filter.md#the-rt-sde).
    """

    def scalar(value: float) -> Tensor:
        return torch.tensor(float(value), dtype=dt.dtype, device=dt.device)

    return rt_noise_variance(dt, scalar(sde.mu_r), scalar(sde.sigma_t) ** 2, scalar(0.0))


def raw_directions(z: Tensor) -> Tensor:
    """``z / |z|``: ``(B, T, D)`` → ``(B, T, D)``."""
    return _unit(z)


def uniform_transported_mean(z: Tensor, times: Tensor, sde: Any) -> Tensor:
    """``normalize(Σ_{j≤i} R(t_i − t_j) ẑ_j)``: equal weights, O(T·D).

    ``R(t_i − t_j) = R(t_i) R(−t_j)``, so rotating every ``ẑ_j`` back to time 0, a cumulative sum and
    one rotation forward give all prefixes at once.

    Args:
        z: ``(B, T, D)`` measurements. times: ``(B, T)``. sde: the true parameters (uses ``omega``).
    """
    _check(z, times)
    omega = _omega(sde, z)
    angle = times.to(z.dtype)[..., None] * omega  # (B, T, D/2)
    back = rotate_pairs(_unit(z), -angle)
    return _unit(rotate_pairs(back.cumsum(dim=1), angle))


def rt_filter(z: Tensor, times: Tensor, sde: Any, *, beta: float = 1.0, backend: str = "auto") -> Tensor:
    """The closed-form RT-Filter (docs/concepts/rt-filter.md#the-logit) with the true SDE parameters, one
    head.

    ``q = k = v = z``: ``κ_ij = |z_j|² / c(t_i − t_j)`` with ``c`` from the true ``μ_r, σ_t², η_t²``
    (``|z_j|`` estimates the magnitude ``m_j``), ``logit_ij = log κ_ij + β κ_ij (⟨ẑ_i, R ẑ_j⟩ − 1)``,
    causal, estimate ``normalize(Σ_j A_ij R(Δt_ij) ẑ_j)``. With ``β = 1`` the second term is the
    von Mises–Fisher log-likelihood of ``ẑ_j`` around the current measurement direction.

    Args:
        z: ``(B, T, D)``. times: ``(B, T)``. sde: the true parameters. beta: the robustness weight.

    Returns:
        ``(B, T, D)`` unit vectors.
    """
    _check(z, times)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    head = z[:, None]  # (B, 1, T, D)

    def param(value: float) -> Tensor:
        return torch.full((1,), float(value), dtype=z.dtype, device=z.device)

    out = rt_attention(
        head,
        head,
        head,
        mu_r=param(sde.mu_r),
        sigma_t2=param(float(sde.sigma_t) ** 2),
        eta_t2=param(float(sde.eta_t) ** 2),
        beta=param(beta),
        omega=_omega(sde, z)[None],
        positions=times.to(z.dtype),
        causal=True,
        backend=backend,
    )
    return _unit(out[:, 0])


def _tangent_log(u: Tensor, w: Tensor) -> Tensor:
    """Log map of the unit sphere at ``u``: the tangent vector pointing to unit ``w`` with length ∠(u, w)."""
    cos = (u * w).sum(-1, keepdim=True).clamp(-1.0, 1.0)
    tangent = w - cos * u
    return _unit(tangent) * torch.acos(cos)


def _tangent_exp(u: Tensor, e: Tensor) -> Tensor:
    """Exp map of the unit sphere at ``u`` of the tangent vector ``e``."""
    length = e.norm(dim=-1, keepdim=True)
    return _unit(torch.cos(length) * u + torch.sin(length) * _unit(e))


def tangent_kalman_filter(z: Tensor, times: Tensor, sde: Any, *, gain_ratio: float = 1.0) -> Tensor:
    """Recursive tangent-space Kalman filter (EKF on the sphere) for the direction, vectorised over B.

    Noise is isotropic in the tangent space, so the direction covariance stays ``p · P_T(û)`` and one
    scalar ``p`` per sequence (angular variance per tangent dimension) carries it. Per step:

    * the token magnitude ``g m`` is measured by ``|z|² − η_r² − (D − 1) η_t²`` (the noise's share of
      ``|z|²`` removed) and fused, in log space, with the tracked latent magnitude and the gain prior;
    * predict: ``û ← R(Δt) û``, ``p ← p + σ_t² (e^{2μ_rΔt} − 1) / (2μ_r) / m̂²``
      (docs/concepts/rt-filter.md#precision) with ``m̂`` the latent magnitude, tracked in log space (``log m̂
      ← log m̂ − μ_rΔt``, diffusing with ``σ_r²Δt/m̂²``) and updated with the log token magnitude, whose noise
      is the gain's ``Var log g = (log gain_ratio)²/12`` plus the measurement's;
    * update the direction with ``ẑ`` in the tangent space at ``û``, with the token's own angular
      noise ``r = η_t² / (g m)²``: ``û ← exp_û(K log_û(ẑ))``, ``K = p / (p + r)``, ``p ← (1 − K) p``.

    The first measurement initialises ``û = ẑ_1``. A loop over time, O(B·D) per step.

    Args:
        z: ``(B, T, D)``. times: ``(B, T)``. sde: the true parameters.
        gain_ratio: the measurement gains' range (:class:`geoattn.tasks.filter.FilterConfig`).

    Returns:
        ``(B, T, D)`` the filtered directions.
    """
    _check(z, times)
    omega = _omega(sde, z)
    mu_r, eta_r2, eta_t2 = float(sde.mu_r), float(sde.eta_r) ** 2, float(sde.eta_t) ** 2
    sigma_r2, gain_var = float(sde.sigma_r) ** 2, math.log(gain_ratio) ** 2 / 12
    times = times.to(z.dtype)
    # Token magnitude g·m from E|z|² = (g m)² + η_r² + (D − 1) η_t², floored at η_t (angular noise ≤ 1 rad);
    # the variance of its log from Var|z|² ≈ 2 (D − 1) η_t⁴ + 4 (g m)² η_r².
    tangent_dims = z.shape[-1] - 1
    magnitude2 = (z.square().sum(-1) - eta_r2 - tangent_dims * eta_t2).clamp_min(eta_t2)  # (B, T)
    log_magnitude = 0.5 * magnitude2.log()
    log_magnitude_var = 0.5 * tangent_dims * eta_t2**2 / magnitude2.square() + eta_r2 / magnitude2

    u = _unit(z[:, 0])
    log_m, var_log_m = log_magnitude[:, 0], log_magnitude_var[:, 0] + gain_var
    p = eta_t2 / magnitude2[:, 0]
    out = [u]
    for i in range(1, z.shape[1]):
        dt = times[:, i] - times[:, i - 1]  # (B,)
        u = rotate_pairs(u, dt[:, None] * omega)
        p = p + process_variance(sde, dt) * torch.exp(-2 * log_m)
        log_m = log_m - mu_r * dt
        var_log_m = var_log_m + sigma_r2 * dt * torch.exp(-2 * log_m)
        # This token's log(g m): the tracked log m (prior, plus the gain's spread) fused with its own |z|.
        prior_var, measured_var = var_log_m + gain_var, log_magnitude_var[:, i]
        weight = prior_var / (prior_var + measured_var)
        log_token = log_m + weight * (log_magnitude[:, i] - log_m)
        gain_m = var_log_m / (var_log_m + gain_var + measured_var)
        log_m = log_m + gain_m * (log_magnitude[:, i] - log_m)
        var_log_m = (1 - gain_m) * var_log_m
        gain = p / (p + eta_t2 * torch.exp(-2 * log_token))
        u = _tangent_exp(u, gain[:, None] * _tangent_log(u, _unit(z[:, i])))
        p = (1 - gain) * p
        out.append(u)
    return torch.stack(out, dim=1)


def _draw(
    shape: tuple[int, ...], generator: torch.Generator | None, *, like: Tensor, uniform: bool = False
) -> Tensor:
    """Normal (or uniform) numbers drawn on the generator's device, returned on ``like``'s."""
    device = generator.device if generator is not None else like.device
    sample = torch.rand if uniform else torch.randn
    return sample(*shape, generator=generator, dtype=like.dtype, device=device).to(like.device)


def _systematic_resample(log_w: Tensor, generator: torch.Generator | None) -> Tensor:
    """Indices ``(B, P)`` of a systematic resampling of the normalised log-weights ``(B, P)``."""
    batch, n = log_w.shape
    cdf = torch.softmax(log_w, dim=-1).cumsum(-1)
    cdf[:, -1] = 1.0
    offset = _draw((batch, 1), generator, like=log_w, uniform=True)
    grid = (torch.arange(n, dtype=log_w.dtype, device=log_w.device) + offset) / n
    return torch.searchsorted(cdf, grid).clamp_max(n - 1)


def _log_normal_interval(low: Tensor, high: Tensor) -> Tensor:
    """``log(Φ(high) − Φ(low))`` for ``low ≤ high``, accurate in both tails."""
    flip = low > 0  # upper tail: Φ(h) − Φ(l) = Φ(−l) − Φ(−h)
    low, high = torch.where(flip, -high, low), torch.where(flip, -low, high)
    log_high = torch.special.log_ndtr(high)
    ratio = (torch.special.log_ndtr(low) - log_high).clamp_max(-1e-12)
    return log_high + torch.log1p(-torch.exp(ratio))


def _log_likelihood(z: Tensor, x: Tensor, eta_r2: float, eta_t2: float, gain_ratio: float) -> Tensor:
    """``log p(z | x)`` up to a constant for ``z = g x + v``, ``v ~ N(0, η_r² P_R(u) + η_t² P_T(u))``.

    The tangential part of ``z − g x`` is ``P_T(u) z`` whatever the gain. The radial part
    ``r = ⟨z, u⟩ ~ N(g m, η_r²)`` is integrated over the log-uniform gain on ``[a, b] = [ρ^{−1/2},
    ρ^{1/2}]``: the Gaussian in ``g`` is narrow (width ``η_r/m``), so ``1/g ≈ m/r`` over it and
    ``p(r | m) ≈ [Φ((b m − r)/η_r) − Φ((a m − r)/η_r)] / (r log ρ)``; the ``1/(r log ρ)`` factor is the
    same for every particle and drops out of the weights. ``ρ = 1``: the plain Gaussian.

    Args:
        z: ``(B, 1, D)``. x: ``(B, P, D)`` particles.

    Returns:
        ``(B, P)``.
    """
    m = x.norm(dim=-1)
    radial = (z * x).sum(-1) / m.clamp_min(_EPS)
    log_tangent = -0.5 * (z.square().sum(-1) - radial.square()).clamp_min(0.0) / eta_t2
    eta_r = math.sqrt(eta_r2)
    if gain_ratio == 1.0:
        return log_tangent - 0.5 * (radial - m).square() / eta_r2
    a, b = gain_ratio**-0.5, gain_ratio**0.5
    return log_tangent + _log_normal_interval((a * m - radial) / eta_r, (b * m - radial) / eta_r)


def particle_filter(
    z: Tensor,
    times: Tensor,
    sde: Any,
    *,
    m0_range: tuple[float, float],
    gain_ratio: float = 1.0,
    n_particles: int = 1000,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Bootstrap particle filter on the latent state ``x`` ``(D,)``, vectorised over batch and particles.

    * Initialisation by importance sampling from the first measurement: directions
      ``exp_ẑ₁(τ)`` with ``τ ~ N(0, s² P_T)`` in the tangent plane at ``ẑ_1`` (``s = 2 η_t / |z_1|``,
      at most 0.5 rad), magnitudes from the prior (log-uniform on ``m0_range``), weighted by
      likelihood / proposal density (``N(τ) (|τ| / sin|τ|)^{D−2}`` on the sphere; the direction
      prior is uniform).
    * Transition over ``Δt`` (one step per observation): ``x ← R(Δt) (e^{−μ_rΔt} x + ε)`` with ε the
      exact OU noise of eq. 3 for projectors frozen at the particle's direction,
      ``Cov ε = (1 − e^{−2μ_rΔt})/(2μ_r) (σ_r² P_R + σ_t² P_T)`` — exact up to second order in the
      (small) angle moved during Δt.
    * Weights: the measurement likelihood of ``z = g x + v`` with the unknown gain ``g`` integrated
      over its log-uniform prior on ``[ρ^{−1/2}, ρ^{1/2}]`` (ρ = ``gain_ratio``; see ``_log_likelihood``);
      systematic resampling when the effective sample size falls under ``P / 2``.
    * Estimate: the normalised weighted mean of the particle directions.

    Args:
        z: ``(B, T, D)``. times: ``(B, T)``. sde: the true parameters.
        m0_range: ``(low, high)`` of the simulator's initial magnitudes. gain_ratio: ρ.
        n_particles: P. generator: for every draw (the stream does not depend on the data).

    Returns:
        ``(B, T, D)`` the filtered directions.
    """
    _check(z, times)
    if n_particles < 2:
        raise ValueError(f"n_particles must be ≥ 2, got {n_particles}")
    out_dtype = z.dtype
    z, times = z.float(), times.float()  # float32 halves the cost; Monte Carlo error dominates anyway
    low, high = m0_range
    batch, length, dim = z.shape
    omega = _omega(sde, z)
    mu_r, eta_r2, eta_t2 = float(sde.mu_r), float(sde.eta_r) ** 2, float(sde.eta_t) ** 2
    sigma_r, sigma_t = float(sde.sigma_r), float(sde.sigma_t)
    times = times.to(z.dtype)

    def draw(*shape: int, uniform: bool = False) -> Tensor:
        return _draw(shape, generator, like=z, uniform=uniform)

    # Initialisation: tangent-Gaussian directions around ẑ_1, prior magnitudes.
    z1 = z[:, :1]  # (B, 1, D)
    u1 = _unit(z1)
    s = (2 * math.sqrt(eta_t2) / z1.norm(dim=-1, keepdim=True).clamp_min(_EPS)).clamp_max(0.5)
    tau = draw(batch, n_particles, dim)
    tau = s * (tau - (tau * u1).sum(-1, keepdim=True) * u1)
    angle = tau.norm(dim=-1)
    log_m = math.log(low) + (math.log(high) - math.log(low)) * draw(batch, n_particles, uniform=True)
    x = log_m.exp()[..., None] * _tangent_exp(u1.expand_as(tau), tau)
    sinc = torch.where(angle > 1e-6, torch.sin(angle) / angle.clamp_min(1e-6), torch.ones_like(angle))
    log_proposal = -0.5 * (angle / s[..., 0]).square() - (dim - 2) * torch.log(sinc.abs())
    # The proposal is the Gaussian restricted to |τ| < π, where exp is one-to-one (its density there
    # is the one above up to a constant); a draw beyond π (a few in 10⁴ at s = 0.5 in R⁸) would
    # count a point of the sphere twice and once gave sin|τ| < 0, i.e. NaN weights for every particle.
    log_proposal = torch.where(angle < math.pi, log_proposal, math.inf)
    log_w = torch.log_softmax(_log_likelihood(z1, x, eta_r2, eta_t2, gain_ratio) - log_proposal, dim=-1)

    def estimate() -> Tensor:
        return _unit((torch.softmax(log_w, -1)[..., None] * _unit(x)).sum(1))

    out = [estimate()]
    for i in range(1, length):
        dt = (times[:, i] - times[:, i - 1])[:, None, None]  # (B, 1, 1)
        decay = torch.exp(-mu_r * dt)
        var = dt * expm1_ratio(-2 * mu_r * dt)  # (1 − e^{−2μΔt})/(2μ), → Δt as μ → 0
        u = _unit(x)
        eps = draw(batch, n_particles, dim)
        eps = sigma_t * eps + (sigma_r - sigma_t) * (eps * u).sum(-1, keepdim=True) * u
        x = rotate_pairs(decay * x + var.sqrt() * eps, dt * omega)
        log_w = log_w + _log_likelihood(z[:, i : i + 1], x, eta_r2, eta_t2, gain_ratio)
        log_w = torch.log_softmax(log_w, dim=-1)
        out.append(estimate())
        resample = 1.0 / torch.softmax(log_w, -1).square().sum(-1) < n_particles / 2  # ESS, (B,)
        # Resample every sequence, keep only those that need it: the generator's stream stays data-free.
        index = _systematic_resample(log_w, generator)
        x = torch.where(resample[:, None, None], x.gather(1, index[..., None].expand_as(x)), x)
        log_w = torch.where(resample[:, None], torch.full_like(log_w, -math.log(n_particles)), log_w)
    return torch.stack(out, dim=1).to(out_dtype)
