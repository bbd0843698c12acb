"""The RT-SDE (docs/concepts/rt-filter.md#the-rt-sde): a seeded simulator and the closed-form angular
variance.

    dx = (−μ_r P_R(u) − μ_t P_T(u) + Λ_Ω) x dt + σ_r P_R(u) dw + σ_t P_T(u) dw,   u = x/|x|
    z(t_k) = x(t_k) + v,   v ~ N(0, η_r² P_R(u) + η_t² P_T(u))

``P_R(u) = u uᵀ``, ``P_T(u) = I − u uᵀ`` and ``Λ_Ω`` generates the pair rotation ``R(Δt)`` of
`geoattn.algebra.rotation` (pair k turns at angular frequency ``ω_k``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from geoattn.algebra.rotation import rotate_pairs
from geoattn.rt.precision import rt_noise_variance


@dataclass
class RTSDESample:
    """One simulated batch: ``times (B, T)``, latent states ``x (B, T, D)``, measurements ``z (B, T, D)``."""

    times: Tensor
    x: Tensor
    z: Tensor


@dataclass
class RTSDE:
    """Parameters of eq. 3 for a ``dim``-dimensional state (``dim`` even).

    ``mu_r, mu_t``: radial and tangential decay rates; ``sigma_r, sigma_t``: radial and tangential
    process noise (standard deviations); ``eta_r, eta_t``: radial and tangential measurement noise
    (standard deviations); ``omega``: ``(dim/2,)`` angular frequencies of ``Λ_Ω``, None for none.
    """

    dim: int
    mu_r: float = 0.3
    mu_t: float = 0.3
    sigma_r: float = 0.05
    sigma_t: float = 0.05
    eta_r: float = 0.05
    eta_t: float = 0.05
    omega: Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 2 or self.dim % 2:
            raise ValueError(f"dim must be an even integer ≥ 2 (rotations act on pairs), got {self.dim!r}")
        for f in fields(self):
            if f.name in ("dim", "omega"):
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a finite number ≥ 0, got {value!r}")
        if self.omega is not None and (
            not isinstance(self.omega, Tensor) or self.omega.shape != (self.dim // 2,)
        ):
            shape = tuple(self.omega.shape) if isinstance(self.omega, Tensor) else type(self.omega).__name__
            raise ValueError(f"omega must have shape (dim/2,) = ({self.dim // 2},), got {shape}")

    def angular_variance(self, dt: Tensor | float, m: Tensor | float) -> Tensor:
        """Per-tangent-dimension angular variance ``s²(Δt)`` of the transported direction ``R(Δt) u_z``.

        ``s²(Δt) = [η_t² + σ_t² (e^{2 μ_r Δt} − 1)/(2 μ_r)] / m²`` (limit ``[η_t² + σ_t² Δt]/m²`` at
        ``μ_r = 0``): measurement noise of a key of magnitude ``m`` observed at ``t_j``, plus the
        direction's diffusion ``σ_t²/m(t)²`` while its magnitude decays as ``m e^{−μ_r (t − t_j)}``.

        Args:
            dt: elapsed time ``Δt ≥ 0``; m: magnitude at observation. Tensors broadcast.

        Returns:
            ``s²``, the broadcast shape of ``dt`` and ``m``.
        """
        dt = torch.as_tensor(dt, dtype=torch.get_default_dtype() if not isinstance(dt, Tensor) else None)
        m = torch.as_tensor(m, dtype=dt.dtype, device=dt.device)
        c = rt_noise_variance(dt, torch.tensor(self.mu_r, dtype=dt.dtype), self.sigma_t**2, self.eta_t**2)
        return c / m**2

    def simulate(
        self,
        times: Tensor,
        batch_size: int,
        *,
        m0: float | Tensor = 1.0,
        u0: Tensor | None = None,
        generator: torch.Generator | None = None,
        max_step: float = 0.01,
    ) -> RTSDESample:
        """Simulate ``batch_size`` independent paths observed at ``times``.

        Between observations: steps of at most ``max_step``, each an exact rotation ``R(h)``
        (`rotate_pairs`) followed by an Euler–Maruyama step of the rest of eq. 3. Vectorised over
        the batch; the Python loop runs over time steps only.

        Args:
            times: ``(T,)`` or ``(B, T)`` strictly increasing observation times (irregular allowed);
                its floating dtype and device are the sample's.
            batch_size: B.
            m0: initial magnitude, a float or ``(B,)``.
            u0: ``(D,)`` or ``(B, D)`` initial directions (normalised here); None: uniform random.
            generator: the source of every random number (same seed, same sample).
            max_step: the largest integration step.

        Returns:
            `RTSDESample` with ``times (B, T)``, ``x (B, T, D)``, ``z (B, T, D)``; ``x[:, 0]`` is the
            initial state at ``times[:, 0]``.
        """
        times = self._check_times(times, batch_size)
        if not max_step > 0:
            raise ValueError(f"max_step must be > 0, got {max_step}")
        dtype, device, d = times.dtype, times.device, self.dim

        def normal(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=generator, dtype=dtype, device=device)

        if u0 is None:
            u0 = normal(batch_size, d)
        elif u0.shape not in ((d,), (batch_size, d)):
            raise ValueError(
                f"u0 must have shape (D,) = ({d},) or (B, D) = ({batch_size}, {d}), got {tuple(u0.shape)}"
            )
        u0 = u0.to(dtype=dtype, device=device).expand(batch_size, d)
        m0 = torch.as_tensor(m0, dtype=dtype, device=device)
        if m0.shape not in ((), (batch_size,)):
            raise ValueError(f"m0 must be a float or of shape (B,) = ({batch_size},), got {tuple(m0.shape)}")
        x = m0.expand(batch_size)[:, None] * u0 / u0.norm(dim=-1, keepdim=True)  # (B, D)
        omega = None if self.omega is None else self.omega.to(dtype=dtype, device=device)

        states = [x]
        for k in range(1, times.shape[1]):
            gap = times[:, k] - times[:, k - 1]  # (B,)
            n_steps = max(1, math.ceil(float(gap.max()) / max_step - 1e-9))
            h = (gap / n_steps)[:, None]  # (B, 1): every row takes n_steps steps of ≤ max_step
            if bool((h == h[0]).all()):
                h = h[:1]  # shared times: rotate by one (D/2,) angle instead of B of them
            angle = None if omega is None else h * omega  # (B | 1, D/2)
            sqrt_h = h.sqrt()
            for _ in range(n_steps):
                if angle is not None:
                    x = rotate_pairs(x, angle)
                x = self._euler_maruyama(x, h, sqrt_h, normal(batch_size, d))
            states.append(x)
        x = torch.stack(states, dim=1)  # (B, T, D)
        u = x / x.norm(dim=-1, keepdim=True)
        z = x + _split_noise(u, normal(*x.shape), self.eta_r, self.eta_t)
        return RTSDESample(times=times, x=x, z=z)

    def _euler_maruyama(self, x: Tensor, h: Tensor, sqrt_h: Tensor, noise: Tensor) -> Tensor:
        """One EM step of everything in eq. 3 but ``Λ_Ω``; ``x, noise (B, D)``, ``h, sqrt_h (B | 1, 1)``."""
        u = x / x.norm(dim=-1, keepdim=True)
        radial = (u * x).sum(-1, keepdim=True) * u  # P_R(u) x
        drift = -self.mu_r * radial - self.mu_t * (x - radial)  # the P_T(u) x term is zero up to round-off
        return x + drift * h + _split_noise(u, noise * sqrt_h, self.sigma_r, self.sigma_t)

    def _check_times(self, times: Tensor, batch_size: int) -> Tensor:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(times, Tensor) or times.dim() not in (1, 2) or times.shape[-1] < 1:
            raise ValueError(f"times must have shape (T,) or (B, T), got {getattr(times, 'shape', times)!r}")
        if times.dim() == 2 and times.shape[0] != batch_size:
            raise ValueError(f"times has shape {tuple(times.shape)}, expected (B, T) with B = {batch_size}")
        if not times.is_floating_point():
            times = times.to(torch.get_default_dtype())
        times = times.expand(batch_size, -1)
        if times.shape[1] > 1 and not bool((times.diff(dim=-1) > 0).all()):
            raise ValueError("times must be strictly increasing along T")
        return times


def _split_noise(u: Tensor, eps: Tensor, radial_std: float, tangential_std: float) -> Tensor:
    """``(radial_std P_R(u) + tangential_std P_T(u)) eps``; ``u`` unit, ``u, eps (..., D)``."""
    along = (u * eps).sum(-1, keepdim=True) * u
    return radial_std * along + tangential_std * (eps - along)
