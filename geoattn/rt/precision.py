"""The one implementation of the RT and RFA noise variances (docs/concepts/rt-filter.md#precision).

Every caller (the RT-SDE simulator, the reference and fast attention kernels, the filter task,
plots) computes the transported angular variance through `rt_noise_variance`, so the stable
small-``mu`` handling lives in one place.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Below this |x| the series of (e^x − 1)/x is used: its truncation error x⁴/120 is far below float64
# round-off, and expm1(x)/x would divide 0 by 0 at x = 0 (and give NaN gradients).
_SERIES_BELOW = 1e-4


def expm1_ratio(x: Tensor) -> Tensor:
    """``(e^x − 1)/x`` with its limit 1 at ``x = 0``; finite values and gradients everywhere.

    Shapes: any; elementwise.
    """
    small = x.abs() < _SERIES_BELOW
    safe = torch.where(small, torch.ones_like(x), x)
    series = 1 + x * (0.5 + x * (1.0 / 6.0 + x / 24.0))
    return torch.where(small, series, torch.expm1(safe) / safe)


def rt_noise_variance(dt: Tensor, mu_r: Tensor, sigma_t2: Tensor, eta_t2: Tensor) -> Tensor:
    """``c(Δt) = η_t² + σ_t² (e^{2 μ_r Δt} − 1)/(2 μ_r)``, the RT transported angular noise variance.

    Multiplied by ``1/m²`` this is the per-tangent-dimension angular variance ``s²(Δt)`` of
    docs/concepts/rt-filter.md#precision; ``κ = m²/c`` is the attention precision. The ``μ_r → 0`` limit
    ``η_t² + σ_t² Δt`` is handled exactly (values and gradients).

    Args:
        dt: elapsed time ``Δt ≥ 0``, any shape broadcastable with the parameters.
        mu_r, sigma_t2, eta_t2: radial decay rate, tangential process and measurement noise
            variances, broadcastable (e.g. ``(H, 1, 1)`` against ``dt`` of shape ``(N, N)``).

    Returns:
        ``c(Δt)``, the broadcast shape.
    """
    return eta_t2 + sigma_t2 * dt * expm1_ratio(2 * mu_r * dt)


def rfa_precision(
    dt: Tensor, mu: Tensor, sigma2: Tensor, eta2: Tensor, gamma2: Tensor | float = 0.0
) -> Tensor:
    """The isotropic RFA precision ``1 / (σ² (1 − e^{−2μΔt})/(2μ) + η² e^{−2μΔt} + γ²)``
    (docs/concepts/rt-filter.md#precision).

    ``(1 − e^{−2μΔt})/(2μ) = Δt · expm1_ratio(−2μΔt)``, so ``μ → 0`` is exact here too.

    Args:
        dt: ``Δt ≥ 0``, any shape broadcastable with the parameters.
        mu, sigma2, eta2, gamma2: decay rate, process, measurement and anchor noise variances.

    Returns:
        The precision, the broadcast shape.
    """
    x = 2 * mu * dt
    return 1.0 / (sigma2 * dt * expm1_ratio(-x) + eta2 * torch.exp(-x) + gamma2)
