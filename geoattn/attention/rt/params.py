"""The parameterisation every RT-Filter path shares (docs/concepts/rt-filter.md#the-logit): normalisation,
transport, precision and logit, written once.

For one head, with ``q̂ = q/|q|``, ``k̂ = k/|k|``, ``v̂ = v/|v|``, ``m_j² = |k_j|²`` and
``Δt_ij = t_i − t_j``::

    c(Δt)    = η_t² + σ_t² (e^{2 μ_r Δt} − 1)/(2 μ_r)          (log_noise_variance)
    κ_ij     = m_j² / c(|Δt_ij|)
    logit_ij = log κ_ij + β κ_ij (⟨q̂_i, R(Δt_ij) k̂_j⟩ − 1)   (rt_logits)
    o_i      = Σ_j softmax_j(logit_ij) R(Δt_ij) v̂_j

Transport: ``R(t_i − t_j) = R(t_i) R(−t_j)`` is orthogonal, so ``⟨q̂_i, R(Δt_ij) k̂_j⟩ =
⟨R(−t_i) q̂_i, R(−t_j) k̂_j⟩`` and ``Σ_j A_ij R(Δt_ij) v̂_j = R(t_i) Σ_j A_ij R(−t_j) v̂_j``: every path
rotates per token into a common frame (`prepare`), attends there, and rotates the output back
(`to_query_frame`); never per pair. The native kernel does the same rotations inside its own call,
from the ``(cos θ, sin θ)`` table of `turns`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from geoattn.algebra.rotation import rope_angles, rotate_pairs
from geoattn.rt.precision import rt_noise_variance

# Above this 2 μ_r Δt, e^{2 μ_r Δt} nears float32's largest number: log c is taken in log space there
# (the native kernel takes the same bound as an argument).
FAR = 80.0

_EPS2 = 1e-24  # |x|² below this counts as 1e-24: a zero vector maps to zero with finite gradients


class Call(NamedTuple):
    """One call of `rt_attention`, in the working dtype: what every path and every ``can_use`` reads.

    ``qkv (B, N, 3, H, D)``; ``metric (H, D)`` or None; ``key_scale`` a number or None;
    ``params = (mu_r, sigma_t2, eta_t2, beta)``, each ``(H,)``; ``omega (H, D/2)`` or None (as the
    caller passed it, so that a buffer keeps its identity); ``times (N,) | (B, N)`` or None (the
    default times ``0 … N−1``); ``backend`` the name asked for.
    """

    qkv: Tensor
    metric: Tensor | None
    key_scale: float | None
    params: tuple[Tensor, Tensor, Tensor, Tensor]
    omega: Tensor | None
    times: Tensor | None
    causal: bool
    normalize_values: bool
    backend: str
    return_weights: bool

    @property
    def grad(self) -> bool:
        """Whether autograd records this call (grad mode on and some input requires a gradient)."""
        tensors = (self.qkv, self.metric, self.omega, self.times, *self.params)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    @property
    def learned_omega(self) -> bool:
        """Whether autograd records a gradient for ω in this call."""
        return self.omega is not None and self.omega.requires_grad and torch.is_grad_enabled()


# ----------------------------------------------------------------------------------------------
# Precision and logit.


def log_noise_variance(dt: Tensor, mu_r: Tensor, sigma_t2: Tensor, eta_t2: Tensor) -> Tensor:
    """``log c(Δt)`` of `geoattn.rt.precision.rt_noise_variance`, finite with finite gradients at
    every lag (``Δt ≥ 0``, broadcasting like it).

    ``c`` grows like ``e^{2 μ_r Δt}``: for a fast-decaying head and a long sequence it overflows
    (float32 beyond ``2 μ_r Δt ≈ 88``), and its gradient ``0 · ∞`` is NaN. Beyond `FAR` this takes
    the same quantity in log space, ``logaddexp(log η², log(σ² Δt/x) + x + log(1 − e^{−x}))`` with
    ``x = 2 μ_r Δt``; below, the plain formula. At ``σ_t² = 0`` the far branch is ``log η²``.
    """
    x = 2 * mu_r * dt
    far = x > FAR
    near = torch.log(rt_noise_variance(torch.where(far, 0.0, dt), mu_r, sigma_t2, eta_t2))
    x_far, dt_far = torch.where(far, x, 1.0), torch.where(far, dt, 1.0)  # safe where unused
    noisy = sigma_t2 > 0
    growth = (
        torch.log(torch.where(noisy, sigma_t2, 1.0) * dt_far / x_far)
        + x_far
        + torch.log1p(-torch.exp(-x_far))
    )
    growth = torch.where(noisy, growth, -math.inf)
    return torch.where(far, torch.logaddexp(torch.log(eta_t2).expand_as(growth), growth), near)


def rt_logits(
    dot: Tensor, dt: Tensor, log_m2: Tensor, mu_r: Tensor, sigma_t2: Tensor, eta_t2: Tensor, beta: Tensor
) -> Tensor:
    """``log κ + β κ (dot − 1)`` with ``κ = m²/c(|Δt|)``, elementwise and broadcasting.

    Typical shapes: ``dot (B, H, Nq, Nk)``, ``dt (B|1, 1, Nq, Nk)`` signed, ``log_m2 (B, H, 1, Nk)``,
    parameters ``(1, H, 1, 1)``; FlexAttention's ``score_mod`` calls it on scalars.
    """
    log_kappa = log_m2 - log_noise_variance(dt.abs(), mu_r, sigma_t2, eta_t2)
    return log_kappa + beta * torch.exp(log_kappa) * (dot - 1)


def block(qh, kh, vh, log_m2, t_q, t_k, params, causal: bool, start: int) -> tuple[Tensor, Tensor]:
    """Softmax attention of the queries ``qh (B, H, Nq, D)`` at positions ``start … start + Nq − 1`` on
    the keys ``kh, vh (B, H, Nk, D)``, ``log_m2 (B, H, Nk)``, with query and key times
    ``t_q (B|1, Nq)``, ``t_k (B|1, Nk)`` and ``params`` four ``(H,)`` tensors, all in the common frame.
    Returns ``(Σ_j A_ij vh_j (B, H, Nq, D), A (B, H, Nq, Nk))``; the mask is by token index."""
    dt = (t_q[:, :, None] - t_k[:, None, :]).unsqueeze(1)  # (B|1, 1, Nq, Nk)
    heads = [p.view(1, -1, 1, 1) for p in params]
    logits = rt_logits(qh @ kh.transpose(-1, -2), dt, log_m2.unsqueeze(-2), *heads)
    if causal:
        rows = torch.arange(start, start + qh.shape[-2], device=qh.device)[:, None]
        logits = logits.masked_fill(torch.arange(kh.shape[-2], device=qh.device) > rows, -math.inf)
    weights = torch.softmax(logits, dim=-1)
    return weights @ vh, weights


# ----------------------------------------------------------------------------------------------
# Normalisation and transport.


def explicit_times(times: Tensor | None, n: int, device, dtype) -> Tensor:
    """``(B|1, N)`` times; None stands for ``0, 1, …, N−1``."""
    if times is None:
        return torch.arange(n, device=device, dtype=dtype).unsqueeze(0)
    return times if times.dim() == 2 else times.unsqueeze(0)


def angles(call: Call) -> Tensor | None:
    """The rotation angles ``ω t`` of every token, ``(B|1, H, N, D/2)``, or None without rotation."""
    if call.omega is None:
        return None
    qkv = call.qkv
    t = explicit_times(call.times, qkv.shape[1], qkv.device, qkv.dtype)
    return rope_angles(t, call.omega.to(qkv.dtype))


def prepare(call: Call, angles: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Unit ``q̂, k̂`` (and ``v̂`` unless ``normalize_values`` is off) rotated to the common frame, and
    ``log m²``: ``qh, kh, vh (B, H, N, D)``, ``log_m2 (B, H, N)``. Plain differentiable operations.

    The ``metric (H, D)`` scales q and k before they are normalised; ``m_j = key_scale · |k_j|`` is
    measured before it (``key_scale=None``: ``m_j = 1``).
    """
    q, k, v = (x.transpose(1, 2) for x in call.qkv.unbind(2))  # (B, H, N, D)
    log_m2 = _log_key_norm2(torch.linalg.vecdot(k, k), call.key_scale)
    if call.metric is not None:
        q, k = q * call.metric[:, None], k * call.metric[:, None]
    units = [x * torch.rsqrt(torch.linalg.vecdot(x, x).clamp_min(_EPS2))[..., None] for x in (q, k, v)]
    if not call.normalize_values:
        units[2] = v
    if angles is not None:  # R(−t) on every token: ⟨R(−t_i) q̂_i, R(−t_j) k̂_j⟩ = ⟨q̂_i, R(Δt_ij) k̂_j⟩
        units = [rotate_pairs(x, -angles) for x in units]
    return (*units, log_m2)


def to_query_frame(out: Tensor, angles: Tensor | None) -> Tensor:
    """``R(t_i)`` on each output row ``out (B, H, N, D)``: from the common frame back to the query's."""
    return out if angles is None else rotate_pairs(out, angles)


def _log_key_norm2(k_norm2: Tensor, key_scale: float | None) -> Tensor:
    """``log m² = log(key_scale² |k|²)``, with ``|k| = 0`` kept finite; 0 when ``key_scale`` is None."""
    if key_scale is None:
        return torch.zeros_like(k_norm2)
    return torch.log((k_norm2 * key_scale**2).clamp_min(torch.finfo(k_norm2.dtype).tiny))


def turns(omega: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """``(cos θ, sin θ)`` of the default times' angles ``θ = i ω``, ``(H, N, D/2, 2)`` (the native
    kernel's rotation table).

    ω is usually a buffer that never changes: eager calls reuse the table built for the same tensor
    (its identity and version counter, so an in-place update builds afresh), N and dtype. Nothing
    reads ω's values to decide this (no device sync); compiled graphs build the table in place."""
    if torch.compiler.is_compiling() or omega.requires_grad or omega.is_inference():
        return _build_turns(omega.to(dtype), n)
    key = (id(omega), omega._version, n, dtype)
    cached = _TURNS.get(key)
    if cached is None or cached[0] is not omega:
        cached = _TURNS[key] = (omega, _build_turns(omega.to(dtype), n))
        while len(_TURNS) > _TURNS_KEPT:  # a sampling loop calls every N once: keep the latest few
            del _TURNS[next(iter(_TURNS))]
    return cached[1]


def _build_turns(omega: Tensor, n: int) -> Tensor:
    theta = rope_angles(torch.arange(n, device=omega.device, dtype=omega.dtype), omega)[0]  # (H, N, D/2)
    return torch.stack((theta.cos(), theta.sin()), dim=-1)


_TURNS: dict[tuple, tuple[Tensor, Tensor]] = {}
_TURNS_KEPT = 8
