"""Precision policy of the kernels: autocast stays outside, bf16 modules keep exact positions, and the
process_noise=False ablation leaves no parameter without a gradient (DDP needs every one)."""

from __future__ import annotations

import torch

from geoattn.algebra import CliffordAlgebra, rope_angles
from geoattn.attention import rfa_attention, rotor_attention, rt_attention
from geoattn.layers import RTAttention


def _rt_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = 1, 2, 64, 16
    q, v = torch.randn(2, B, H, N, D, generator=g)
    k = 3 * D**0.5 * torch.randn(B, H, N, D, generator=g)  # large |k|: κ large, logits cancel
    params = dict(
        mu_r=torch.tensor([0.05, 0.1]),
        sigma_t2=torch.tensor([0.01, 0.02]),
        eta_t2=torch.full((H,), 0.1),
        beta=torch.full((H,), 4.0),
        omega=torch.rand(H, D // 2, generator=g),
    )
    return q, k, v, params


def test_autocast_does_not_reach_inside_the_kernels():
    """Under bf16 autocast the float32 kernels return what they return without it (was 0.64 off)."""
    q, k, v, p = _rt_inputs()
    for backend in ("reference", "auto"):
        expected = rt_attention(q, k, v, **p, backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = rt_attention(q, k, v, **p, backend=backend)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    rfa = dict(mu=p["mu_r"], sigma2=p["sigma_t2"], eta2=p["eta_t2"], gamma2=p["eta_t2"], beta=p["beta"])
    expected = rfa_attention(q, k / 10, v, **rfa, omega=p["omega"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rfa_attention(q, k / 10, v, **rfa, omega=p["omega"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    cl3 = CliffordAlgebra(3)
    qm, km, vm = torch.randn(3, 1, 2, 32, 2, cl3.dim, generator=torch.Generator().manual_seed(1)).unbind(0)
    expected = rotor_attention(qm, km, vm, algebra=cl3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rotor_attention(qm, km, vm, algebra=cl3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_rope_angles_keep_integer_positions_exact_with_bf16_frequencies():
    positions = torch.tensor([255.0, 257.0, 259.0, 1001.0])
    omega = torch.ones(1, 1, dtype=torch.bfloat16)
    angles = rope_angles(positions, omega)
    assert angles.dtype == torch.float32
    assert angles.flatten().tolist() == positions.tolist()


def test_every_parameter_gets_a_gradient_without_process_noise():
    attn = RTAttention(32, 2, process_noise=False)
    attn(torch.randn(2, 8, 32)).square().sum().backward()
    missing = [name for name, p in attn.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient (DDP would fail): {missing}"
