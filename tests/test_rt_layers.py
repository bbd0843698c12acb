"""RT layers (docs/concepts/rt-filter.md#the-block): RTAttention's switches and parameters, the hypersphere
step, RFA kernels.

The kernel maths itself (precision, logits, fast paths vs reference) is tested with the kernel; here
we test what the layers add: projections, key scaling, the switches, the sphere geometry, and the
RFA kernel (which lives with its layer) against an explicit per-pair computation.
"""

from __future__ import annotations

import math

import pytest
import torch

from geoattn.algebra.rotation import rotate_pairs
from geoattn.attention.rfa import rfa_attention
from geoattn.attention.rt import rt_attention
from geoattn.layers.robust_filter import RFAAttention
from geoattn.layers.rt_block import RTAttention, RTBlock
from geoattn.layers.sphere import sphere_step, sphere_update, tangent_part

C, H = 32, 4


def _unit(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(*shape, generator=g, dtype=dtype), dim=-1)


# ------------------------------------------------------------------------------------------------
# The step on the sphere


def test_tangent_part_is_orthogonal_to_the_state_and_idempotent():
    h, o = _unit(5, 7, C, seed=1), torch.randn(5, 7, C, dtype=torch.float64)
    t = tangent_part(o, h)
    assert (t * h).sum(-1).abs().max() < 1e-12
    torch.testing.assert_close(tangent_part(t, h), t)
    # only the radial component is removed
    torch.testing.assert_close(t + (o * h).sum(-1, keepdim=True) * h, o)


@pytest.mark.parametrize("tangent_correction", [True, False])
def test_retraction_keeps_unit_norm(tangent_correction):
    h, o = _unit(6, 9, C, seed=2), _unit(6, 9, C, seed=3)
    alpha = torch.rand(C, dtype=torch.float64) * 0.5
    new = sphere_step(h, o, alpha, tangent_correction=tangent_correction, step="retraction")
    torch.testing.assert_close(new.norm(dim=-1), torch.ones(6, 9, dtype=torch.float64))
    assert (new - h).abs().max() > 1e-3  # it moved


def test_geodesic_step_is_the_exponential_map():
    h, o = _unit(6, 9, C, seed=4), _unit(6, 9, C, seed=5)
    alpha = torch.rand(C, dtype=torch.float64)  # large steps, per channel
    new = sphere_step(h, o, alpha, tangent_correction=True, step="geodesic")
    torch.testing.assert_close(new.norm(dim=-1), torch.ones(6, 9, dtype=torch.float64))
    # moves along the great circle towards a = tangent part of α⊙(tangent of o), by the angle |a|
    a = tangent_part(alpha * tangent_part(o, h), h)
    angle = torch.arccos((new * h).sum(-1).clamp(-1, 1))
    torch.testing.assert_close(angle, a.norm(dim=-1))
    direction = torch.nn.functional.normalize(tangent_part(new, h), dim=-1)
    torch.testing.assert_close(direction, torch.nn.functional.normalize(a, dim=-1))


@pytest.mark.parametrize("tangent_correction", [True, False])
def test_geodesic_step_matches_retraction_for_small_steps(tangent_correction):
    h, o = _unit(4, 8, C, seed=6), _unit(4, 8, C, seed=7)
    alpha = torch.rand(C, dtype=torch.float64)
    errors = []
    for scale in (1e-2, 1e-3):
        kw = dict(tangent_correction=tangent_correction)
        geo = sphere_step(h, o, scale * alpha, step="geodesic", **kw)
        ret = sphere_step(h, o, scale * alpha, step="retraction", **kw)
        errors.append((geo - ret).norm(dim=-1).max().item() / scale)
        assert errors[-1] < 2 * scale  # the two agree to second order in the step
    assert errors[1] < errors[0] / 5


def test_geodesic_step_has_finite_gradients_at_zero_step():
    h = _unit(3, C, seed=8).requires_grad_()
    o = h.detach().clone().requires_grad_()  # o = h: zero tangent step
    alpha = torch.full((C,), 0.1, dtype=torch.float64, requires_grad=True)
    new = sphere_step(h, o, alpha, tangent_correction=True, step="geodesic")
    torch.testing.assert_close(new, h.detach())
    new.sum().backward()
    for p in (h, o, alpha):
        assert torch.isfinite(p.grad).all()


def test_unknown_step_is_rejected():
    h = _unit(2, C)
    with pytest.raises(ValueError, match="step"):
        sphere_step(h, h, torch.ones(C, dtype=h.dtype), tangent_correction=True, step="exp")
    with pytest.raises(ValueError, match="step"):
        RTBlock(C, H, step="exp")


# ------------------------------------------------------------------------------------------------
# RTAttention


def _x(B=2, T=10, seed=0):
    return torch.nn.functional.normalize(
        torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed)), dim=-1
    )


def _scale_rows(layer: RTAttention, part: int, factor: float) -> None:
    """Multiply the q (0), k (1) or v (2) rows of the fused projection by ``factor``."""
    with torch.no_grad():
        layer.c_attn.weight[part * C : (part + 1) * C] *= factor


def test_rt_attention_shapes_and_parameters():
    layer = RTAttention(C, H)
    x = _x()
    assert layer(x).shape == x.shape
    params = layer.precision_parameters()
    assert set(params) == {"mu_r", "sigma_t2", "eta_t2", "beta"}
    for p in params.values():
        assert p.shape == (H,) and (p > 0).all()
    # the documented initialisation: σ_t² = 2 μ_r η_t², windows 4 … 256, β = sqrt(D)
    torch.testing.assert_close(params["sigma_t2"], 2 * params["mu_r"] * params["eta_t2"])
    torch.testing.assert_close(1 / (2 * params["mu_r"]), torch.tensor([4.0, 16.0, 64.0, 256.0]))
    torch.testing.assert_close(params["beta"], torch.full((H,), math.sqrt(C // H)))
    weights = layer.attention_weights(x)
    assert weights.shape == (2, H, 10, 10)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, 10))


def test_larger_key_magnitude_gets_more_weight_at_equal_angle():
    """Two keys with one direction, magnitudes 1 and 3, at the same time; a query aligned with them."""
    torch.manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(C), dim=0)
    x = torch.stack([u, 3 * u, u])[None]  # (1, 3, C)
    positions = torch.tensor([0.0, 0.0, 1.0])
    for magnitude_precision in (True, False):
        layer = RTAttention(C, H, rotation=False, magnitude_precision=magnitude_precision)
        with torch.no_grad():
            layer.c_attn.weight.copy_(torch.eye(C).repeat(3, 1))  # q = k = v = x
        w = layer.attention_weights(x, positions)[0, :, 2]  # (H, 3): last query over the keys
        if magnitude_precision:
            assert (w[:, 1] > 2 * w[:, 0]).all()
        else:
            torch.testing.assert_close(w[:, 1], w[:, 0])


def test_magnitude_precision_switch_controls_key_scale_invariance():
    x = _x(seed=1)
    for magnitude_precision in (True, False):
        torch.manual_seed(0)
        layer = RTAttention(C, H, magnitude_precision=magnitude_precision)
        before = layer(x)
        _scale_rows(layer, 1, 3.0)
        after = layer(x)
        if magnitude_precision:
            assert (after - before).abs().max() > 1e-3
        else:
            torch.testing.assert_close(after, before)


def test_qkv_norm_switch_controls_value_normalisation():
    x = _x(seed=2)
    for qkv_norm in (True, False):
        torch.manual_seed(0)
        layer = RTAttention(C, H, qkv_norm=qkv_norm)
        before = layer(x)
        _scale_rows(layer, 2, 3.0)
        after = layer(x)
        # unit values: invariant to the value scale; raw values: the output is linear in them
        torch.testing.assert_close(after, before if qkv_norm else 3 * before)


def test_process_noise_switch_removes_the_time_dependence():
    x = _x(seed=3)
    torch.manual_seed(0)
    with_noise = RTAttention(C, H)
    torch.manual_seed(0)
    without = RTAttention(C, H, process_noise=False)
    assert (without.precision_parameters()["sigma_t2"] == 0).all()
    assert (with_noise(x) - without(x)).abs().max() > 1e-3
    # without process noise μ_r has no effect (κ_j = m_j²/η_t² for every lag)
    before = without(x)
    with torch.no_grad():
        without.log_mu_r.add_(2.0)
    torch.testing.assert_close(without(x), before)


def test_rotation_and_learned_omega():
    x = _x(seed=4)
    torch.manual_seed(0)
    fixed = RTAttention(C, H)
    torch.manual_seed(0)
    learned = RTAttention(C, H, learn_omega=True)
    torch.manual_seed(0)
    none = RTAttention(C, H, rotation=False)
    torch.testing.assert_close(fixed(x), learned(x))  # same RoPE initialisation
    assert (fixed(x) - none(x)).abs().max() > 1e-3
    assert "omega" not in dict(fixed.named_parameters())
    learned(x).sum().backward()
    assert learned.omega.grad is not None and learned.omega.grad.abs().max() > 0


def test_rt_attention_gradients_reach_every_parameter():
    layer = RTAttention(C, H)
    layer(_x(seed=5)).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


def test_zero_inputs_stay_finite():
    x = torch.zeros(2, 6, C, requires_grad=True)
    for module in (
        RTAttention(C, H),
        RTBlock(C, H),
        RTBlock(C, H, step="geodesic", mlp=None),
        RFAAttention(C, H),
    ):
        y = module(x)
        assert torch.isfinite(y).all()
        y.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


@pytest.mark.parametrize("tangent_correction", [True, False])
def test_fused_retraction_is_the_plain_step(tangent_correction):
    """`sphere_update`'s one-node retraction (eager mode) against `sphere_step` on normalised outputs:
    values and gradients in float64 (a zero output row included), and a finite-difference check."""
    h = _unit(3, 5, 16, seed=1).requires_grad_()
    o = torch.randn(3, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    o[0, 1] = 0  # F.normalize maps it to 0: the update then only retracts h + α⊙(−h)
    o.requires_grad_()
    alpha = (0.1 + torch.rand(16, dtype=torch.float64)).requires_grad_()
    kw = dict(tangent_correction=tangent_correction, step="retraction")
    fused = sphere_update(h, o, alpha, **kw)
    plain = sphere_step(h, torch.nn.functional.normalize(o, dim=-1), alpha, **kw)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-14)
    weights = torch.randn(fused.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((fused * weights).sum(), (h, o, alpha))
    grads_plain = torch.autograd.grad((plain * weights).sum(), (h, o, alpha))
    for g, g_plain in zip(grads, grads_plain):
        torch.testing.assert_close(g, g_plain, rtol=1e-12, atol=1e-12 * g_plain.abs().max().item())
    o_smooth = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    h_small = _unit(2, 3, 16, seed=4).requires_grad_()
    assert torch.autograd.gradcheck(lambda h, o, a: sphere_update(h, o, a, **kw), (h_small, o_smooth, alpha))


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"magnitude_precision": False},
        {"qkv_norm": False},
        {"process_noise": False},
        {"learn_omega": True},
    ],
    ids=["default", "no-magnitude", "no-qkv-norm", "no-process-noise", "learned-omega"],
)
def test_rt_attention_is_its_documented_definition(switches):
    """The layer's fused path (one projection, s_qk as a metric, magnitudes |k|·sqrt(C/D) before it)
    against the definition written with the public kernel's reference backend: q·s_qk and
    normalize(k·s_qk)·|k|·sqrt(H) (unit k without magnitude precision), values and gradients."""
    torch.manual_seed(0)
    layer = RTAttention(C, H, **switches).double()
    with torch.no_grad():
        layer.s_qk.weight.mul_(1 + 0.3 * torch.rand(C, dtype=torch.float64))  # a non-trivial metric
    x = _x(seed=11).double().requires_grad_()
    positions = torch.cumsum(0.2 + torch.rand(10, dtype=torch.float64), 0)

    def definition(x):
        q, k, v = (t.view(2, 10, H, C // H).transpose(1, 2) for t in layer.c_attn(x).split(C, dim=-1))
        s_qk = layer.s_qk().view(H, 1, C // H)
        k_dir = torch.nn.functional.normalize(k * s_qk, dim=-1)
        if layer.magnitude_precision:
            k_dir = k_dir * k.norm(dim=-1, keepdim=True) * math.sqrt(H)
        y = rt_attention(
            q * s_qk,
            k_dir,
            v,
            **layer.precision_parameters(),
            omega=layer.omega,
            positions=positions,
            backend="reference",
            normalize_values=layer.qkv_norm,
        )
        return layer.c_proj(y.transpose(1, 2).reshape(2, 10, C))

    out, expected = layer(x, positions), definition(x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    params = [x, *(p for p in layer.parameters() if p.requires_grad)]
    for g, g_ref in zip(torch.autograd.grad(out.sum(), params), torch.autograd.grad(expected.sum(), params)):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-11)


def test_rt_block_keeps_the_stream_on_the_sphere():
    h = _x(seed=6)
    for kw in ({}, {"step": "geodesic"}, {"tangent_correction": False}, {"mlp": None}):
        block = RTBlock(C, H, **kw)
        out = block(h)
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(2, 10), atol=1e-5, rtol=0)
        assert (out - h).abs().max() > 1e-4
    assert not any("mlp" in n for n, _ in RTBlock(C, H, mlp=None).named_parameters())


def test_tangent_correction_switch_changes_the_block():
    h = _x(seed=7)
    torch.manual_seed(0)
    on = RTBlock(C, H)
    torch.manual_seed(0)
    off = RTBlock(C, H, tangent_correction=False)
    assert (on(h) - off(h)).abs().max() > 1e-4


def test_causal_rt_attention_ignores_the_future():
    layer = RTAttention(C, H)
    x = _x(seed=8)
    y = x.clone()
    y[:, 6:] = _x(seed=9)[:, 6:]
    torch.testing.assert_close(layer(x)[:, :6], layer(y)[:, :6])
    assert (layer(x)[:, 6:] - layer(y)[:, 6:]).abs().max() > 1e-3


def test_bad_inputs_and_parameters_raise():
    layer = RTAttention(C, H)
    with pytest.raises(ValueError, match=r"expected \(B, T, 32\)"):
        layer(torch.zeros(2, 5, C + 2))
    with pytest.raises(ValueError, match=r"expected \(B, T, 32\)"):
        layer(torch.zeros(5, C))
    with pytest.raises(ValueError, match="positions"):
        layer(_x(T=5), torch.arange(6.0))
    with pytest.raises(ValueError, match="even"):
        RTAttention(12, 4)  # head dimension 3
    with pytest.raises(ValueError, match="multiple of n_head"):
        RTAttention(30, 4)
    with pytest.raises(ValueError, match="omega_init"):
        RTAttention(C, H, omega_init=torch.ones(H, C // H))
    with pytest.raises(ValueError, match="window"):
        RTAttention(C, H, window=(-1.0, 8.0))
    with pytest.raises(ValueError, match="beta_init"):
        RTAttention(C, H, beta_init=-1.0)
    with pytest.raises(ValueError, match="rotation=False"):
        RTAttention(C, H, rotation=False, learn_omega=True)


# ------------------------------------------------------------------------------------------------
# Isotropic RFA


def _rfa_inputs(B=2, N=11, D=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))
    params = dict(
        mu=torch.rand(H, generator=g, dtype=dtype) * 0.3 + 0.01,
        sigma2=torch.rand(H, generator=g, dtype=dtype),
        eta2=torch.rand(H, generator=g, dtype=dtype) + 0.5,
        gamma2=torch.rand(H, generator=g, dtype=dtype) * 0.1,
        beta=torch.rand(H, generator=g, dtype=dtype) * 0.3 + 0.05,
        omega=torch.rand(H, D // 2, generator=g, dtype=dtype),
    )
    positions = torch.cumsum(torch.rand(B, N, generator=g, dtype=dtype) + 0.2, dim=-1)  # irregular
    return q, k, v, params, positions


@pytest.mark.parametrize("causal", [True, False])
def test_rfa_reference_matches_the_per_pair_definition(causal):
    q, k, v, p, t = _rfa_inputs(B=1, N=5)
    o, a = rfa_attention(q, k, v, **p, positions=t, causal=causal, backend="reference", return_weights=True)
    B, _, N, _ = q.shape
    expected = torch.zeros_like(q)
    for h in range(H):
        mu, s2, e2, g2, beta = (p[n][h].item() for n in ("mu", "sigma2", "eta2", "gamma2", "beta"))
        for i in range(N):
            logits, transported = [], []
            for j in range(i + 1 if causal else N):
                dt = (t[0, i] - t[0, j]).item()
                angle = p["omega"][h] * dt  # R(t_i − t_j)
                decay = math.exp(-mu * abs(dt))
                var = (
                    s2 * (1 - math.exp(-2 * mu * abs(dt))) / (2 * mu) + e2 * math.exp(-2 * mu * abs(dt)) + g2
                )
                r2 = (q[0, h, i] - decay * rotate_pairs(k[0, h, j], angle)).square().sum().item()
                logits.append(-math.log(var) - beta / var * r2)
                transported.append(decay * rotate_pairs(v[0, h, j], angle))
            w = torch.tensor(logits, dtype=q.dtype).softmax(0)
            torch.testing.assert_close(a[0, h, i, : len(logits)], w)
            expected[0, h, i] = (w[:, None] * torch.stack(transported)).sum(0)
    torch.testing.assert_close(o, expected)
    if causal:
        assert (a.triu(1) == 0).all()


@pytest.mark.parametrize("causal", [True, False])
def test_rfa_chunked_matches_reference_values_and_gradients(causal):
    q, k, v, p, t = _rfa_inputs(N=23)
    leaves = [q, k, v, p["mu"], p["sigma2"], p["eta2"], p["gamma2"], p["beta"]]
    for x in leaves:
        x.requires_grad_()
    grads = {}
    for backend in ("reference", "chunked"):
        o = rfa_attention(q, k, v, **p, positions=t, causal=causal, backend=backend, chunk_size=5)
        grads[backend] = (o, torch.autograd.grad(o.sin().sum(), leaves))
    torch.testing.assert_close(grads["chunked"][0], grads["reference"][0])
    for g_fast, g_ref in zip(grads["chunked"][1], grads["reference"][1]):
        torch.testing.assert_close(g_fast, g_ref)


def test_rfa_rejects_bad_parameters(monkeypatch):
    monkeypatch.setenv("GEOATTN_DEBUG", "1")  # the parameters' signs are value checks
    q, k, v, p, _ = _rfa_inputs()
    with pytest.raises(ValueError, match="mu"):
        rfa_attention(q, k, v, **{**p, "mu": -p["mu"]})
    with pytest.raises(ValueError, match="beta"):
        rfa_attention(q, k, v, **{**p, "beta": p["beta"][:2]})
    with pytest.raises(ValueError, match="omega"):
        rfa_attention(q, k, v, **{**p, "omega": p["omega"][:, :1]})
    with pytest.raises(ValueError, match="positions"):
        rfa_attention(q, k, v, **p, positions=torch.arange(3.0))
    with pytest.raises(ValueError, match="reference"):
        rfa_attention(q, k, v, **p, return_weights=True)
