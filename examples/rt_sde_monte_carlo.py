"""Monte Carlo of the RT-SDE (eq. 3) against the closed-form angular variance (docs/concepts/rt-filter.md).

Prints, at Δt = 0.5, 1, 2, the per-tangent-dimension angular variance of the transported
measurement direction R(Δt) u_z(0) around the true direction u(Δt), from 4000 simulated paths, next
to `RTSDE.angular_variance` and the paper-style "frozen-frame" variant (μ_t damping the tangent).
The same simulation is asserted in tests/test_rt_sde.py.

    python examples/rt_sde_monte_carlo.py
"""

import math

import torch

from geoattn.algebra import rotate_pairs
from geoattn.rt import RTSDE

DIM, PATHS, M0, LAGS = 8, 4000, 2.0, (0.5, 1.0, 2.0)


def main() -> None:
    omega = torch.linspace(0.2, 1.5, DIM // 2, dtype=torch.float64)
    sde = RTSDE(dim=DIM, mu_r=0.3, mu_t=0.3, sigma_r=0.02, sigma_t=0.05, eta_r=0.05, eta_t=0.05, omega=omega)
    u0 = torch.tensor([1.0, 0.5, -0.3, 0.2, 0.0, 0.7, -0.4, 0.1], dtype=torch.float64)
    times = torch.tensor((0.0, *LAGS), dtype=torch.float64)
    sample = sde.simulate(times, PATHS, m0=M0, u0=u0, generator=torch.Generator().manual_seed(0))

    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    print(f"RT-SDE d={DIM}, mu_r=mu_t=0.3, sigma_t=0.05, eta_t=0.05, m={M0}, {PATHS} paths")
    print("| Δt | Monte Carlo s² | closed form | diff | frozen-frame | diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, lag in enumerate(LAGS, start=1):
        predicted = rotate_pairs(unit(sample.z[:, 0]), omega * lag)
        u = unit(sample.x[:, i])
        tangent = predicted - (predicted * u).sum(-1, keepdim=True) * u
        per_path = tangent.square().sum(-1) / (DIM - 1)
        mc, se = per_path.mean().item(), per_path.std().item() / math.sqrt(PATHS)
        closed = float(sde.angular_variance(lag, M0))
        decay = math.exp(-2 * sde.mu_t * lag)
        frozen = (sde.eta_t**2 * decay + sde.sigma_t**2 * (1 - decay) / (2 * sde.mu_t)) / M0**2
        print(
            f"| {lag} | {mc:.4e} ± {se:.1e} | {closed:.4e} | {closed / mc - 1:+.1%} "
            f"| {frozen:.4e} | {frozen / mc - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
