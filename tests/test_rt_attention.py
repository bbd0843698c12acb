"""`rt_attention` (SPEC §4.1): the formula by hand, every fast path against the reference (values and
gradients), the magnitude precision, degenerate inputs, validation, and O(N) memory on the fast paths."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import geoattn.attention.blockwise as blockwise
import geoattn.attention.rt_kernel as rt
from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rt_kernel import rt_attention, rt_attention_qkv

F64 = torch.float64
REGIMES = ("separable", "tied", "general")


def _inputs(b=2, h=3, n=23, d=8, dtype=F64, seed=0, irregular=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3))
    k = k * (0.3 + 3 * torch.rand(b, h, n, 1, generator=g, dtype=dtype))  # magnitudes vary several-fold
    omega = (0.3 * rope_frequencies(d, h) * torch.linspace(0.5, 2.0, h)[:, None]).to(dtype)
    if irregular:
        positions = torch.cumsum(0.1 + 1.5 * torch.rand(b, n, generator=g, dtype=dtype), -1)
    else:
        positions = torch.arange(n, dtype=dtype)
    return q, k, v, omega, positions


def _params(regime: str, h=3, dtype=F64):
    """Per-head parameters; the regime decides σ_t² (and thus the fast path ``auto`` takes)."""
    mu_r = torch.tensor([0.0, 0.05, 0.4, 0.2, 0.1][:h], dtype=dtype)
    eta_t2 = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3][:h], dtype=dtype)
    beta = torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0][:h], dtype=dtype)
    sigma_t2 = {
        "separable": torch.zeros(h, dtype=dtype),
        "tied": 2 * mu_r * eta_t2,
        "general": torch.tensor([0.1, 0.02, 0.3, 0.05, 0.2][:h], dtype=dtype),
    }[regime]
    return dict(mu_r=mu_r, sigma_t2=sigma_t2, eta_t2=eta_t2, beta=beta)


def _rotation(theta: float) -> torch.Tensor:
    return torch.tensor([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]], dtype=F64)


def test_hand_built_case_matches_the_formula():
    """D = 4, N = 3: logits from explicit R(Δt) blocks and c(Δt) written out here."""
    q = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.3, -0.7, 2.0, 1.0], [-1.0, 0.2, 0.4, -0.6]], dtype=F64)
    k = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.1, 0.4, -0.2, 0.3], [1.5, -2.5, 0.5, 1.0]], dtype=F64)
    v = torch.tensor([[1.0, -1.0, 0.5, 2.0], [0.0, 3.0, -1.0, 1.0], [2.0, 1.0, 1.0, -0.5]], dtype=F64)
    t = [0.0, 0.7, 2.0]
    omega = [0.9, -0.35]
    mu, s2, e2, beta = 0.3, 0.2, 0.5, 1.7

    def rotate(x, dt):
        return torch.cat([_rotation(w * dt) @ x[2 * p : 2 * p + 2] for p, w in enumerate(omega)])

    for causal in (True, False):
        expected = []
        for i in range(3):
            logits, transported = [], []
            for j in range(3):
                if causal and j > i:
                    continue
                dt = t[i] - t[j]
                c = e2 + s2 * (math.exp(2 * mu * abs(dt)) - 1) / (2 * mu)
                kappa = float(k[j] @ k[j]) / c
                cos = float(q[i] @ rotate(k[j], dt)) / float(q[i].norm() * k[j].norm())
                logits.append(math.log(kappa) + beta * kappa * (cos - 1))
                transported.append(rotate(v[j] / v[j].norm(), dt))
            weights = torch.softmax(torch.tensor(logits, dtype=F64), 0)
            expected.append(sum(w * x for w, x in zip(weights, transported)))
        expected = torch.stack(expected)[None, None]
        kwargs = dict(
            mu_r=torch.tensor([mu], dtype=F64),
            sigma_t2=torch.tensor([s2], dtype=F64),
            eta_t2=torch.tensor([e2], dtype=F64),
            beta=torch.tensor([beta], dtype=F64),
            omega=torch.tensor([omega], dtype=F64),
            positions=torch.tensor(t, dtype=F64),
            causal=causal,
        )
        for backend in ("reference", "auto"):
            out = rt_attention(q[None, None], k[None, None], v[None, None], backend=backend, **kwargs)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-12, msg=f"{backend}, causal={causal}")


class _PathSpy:
    """Records which paths ``auto`` ran (the keys of ``rt._PATHS``)."""

    def __init__(self, monkeypatch):
        self.paths = []
        for name, fn in list(rt._PATHS.items()):

            def spy(*args, _name=name, _fn=fn):
                self.paths.append(_name)
                return _fn(*args)

            monkeypatch.setitem(rt._PATHS, name, spy)


def _grads(out, inputs, seed=1):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "regime", [*REGIMES, "tied-chunked", "tied-far", "general-blockwise", "separable-dense"]
)
@pytest.mark.parametrize(("dtype", "tol"), [(F64, 1e-10), (torch.float32, 2e-4)])
def test_auto_matches_reference_values_and_gradients(regime, causal, dtype, tol, monkeypatch):
    # Small tiles, so that several query blocks and key chunks run. The tied family runs on SDPA,
    # in one query chunk while 2 μ_r (t_last − t_first) stays under its bound (here about
    # 2 · 0.4 · 18 < 20), in chunk-relative time beyond it ("tied-chunked": the bound lowered to 2,
    # chunks of a few tokens) and on the general kernel where that takes too many chunks
    # ("tied-far": the same bound, chunks of at least _TIED_MIN_CHUNK tokens asked for).
    monkeypatch.setattr(blockwise, "_MAX_BLOCK_K", 8)
    monkeypatch.setattr(blockwise, "_TILE_ELEMENTS", 6 * 8 * 8)
    monkeypatch.setattr(blockwise, "_MIN_BLOCK_Q", 8)
    far, chunked = regime == "tied-far", regime == "tied-chunked"
    regime = "tied" if far or chunked else regime
    if far or chunked:
        monkeypatch.setattr(rt, "_TIED_MAX_EXPONENT", 2.0)
    if chunked:
        monkeypatch.setattr(rt, "_TIED_MIN_CHUNK", 1)
        chunks = rt._tied_chunks(_inputs(dtype=dtype)[4], 2 * _params("tied", dtype=dtype)["mu_r"])
        assert chunks is not None and len(chunks) > 3, chunks  # several chunks do run
    if regime == "general-blockwise":  # too long for the dense tile: the blockwise kernel
        regime = "general"
        monkeypatch.setattr(rt, "DENSE_MAX_N", 16)
    elif regime in ("separable", "tied"):  # past the dense tile: their SDPA paths
        monkeypatch.setattr(rt, "DENSE_MAX_N", 16)
    elif regime == "separable-dense":  # short: the dense tile, whatever the structure
        regime = "separable"
    q, k, v, omega, positions = _inputs(dtype=dtype)
    params = _params(regime, dtype=dtype)
    # The SDPA paths are exact on their parameter manifold only, so there only what stays on it
    # is differentiated: σ_t² = 0 keeps μ_r, η_t², β free; the tied family fixes all three process
    # parameters. The general path differentiates all four.
    trainable = {"separable": ("mu_r", "eta_t2", "beta"), "tied": ("beta",), "general": tuple(params)}[regime]
    for name in trainable:
        params[name].requires_grad_()
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *(params[n] for n in trainable)]
    kwargs = dict(**params, omega=omega, positions=positions, causal=causal)

    spy = _PathSpy(monkeypatch)
    structure = "general" if regime == "tied" and not causal else regime  # tied needs causal
    out = rt_attention(q, k, v, backend="auto", structure=structure, **kwargs)
    expected = {"separable": ["separable"], "tied": ["tied"], "general": ["blockwise"]}[structure]
    if structure == "tied" and far:
        expected = ["tied", "blockwise"]
    if q.shape[2] <= rt.DENSE_MAX_N:
        expected = ["dense"]
    assert spy.paths == expected
    ref = rt_attention(q, k, v, backend="reference", **kwargs)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for name, g, g_ref in zip(("q", "k", "v", *trainable), _grads(out, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol, msg=f"gradient of {name}")


@pytest.mark.parametrize("backend", ["dense", "blockwise"])
@pytest.mark.parametrize("regime", REGIMES)
def test_general_paths_are_exact_for_every_regime(backend, regime):
    """The general paths make no assumption on the parameters: exact in every regime, μ_r = 0 included."""
    q, k, v, omega, positions = _inputs(n=19)
    params = {name: p.requires_grad_() for name, p in _params(regime).items()}
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *params.values()]
    kwargs = dict(**params, omega=omega, positions=positions)
    out = rt_attention(q, k, v, backend=backend, **kwargs)
    ref = rt_attention(q, k, v, backend="reference", **kwargs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, g_ref in zip(_grads(out, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_declared_structure_with_trainable_process_parameters_falls_back_exactly(monkeypatch):
    """On the tied or separable manifold, gradients off it (∂/∂σ_t² etc.) need the general path."""
    q, k, v, omega, positions = _inputs(n=17)
    for structure in ("tied", "separable"):
        params = {name: p.requires_grad_() for name, p in _params(structure).items()}
        spy = _PathSpy(monkeypatch)
        out = rt_attention(q, k, v, **params, omega=omega, positions=positions, structure=structure)
        assert spy.paths == ["dense"]
        ref = rt_attention(q, k, v, **params, omega=omega, positions=positions, backend="reference")
        for g, g_ref in zip(_grads(out, list(params.values())), _grads(ref, list(params.values()))):
            torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_path_choice_reads_no_values(monkeypatch):
    """``auto`` decides from the declared structure, gradient needs and shapes: parameters on the
    separable manifold take the general path unless declared, and the forward and backward of every
    statically chosen path run without one host read (``aten._local_scalar_dense``) once the
    documented eager value checks are set aside."""
    monkeypatch.setattr(rt, "_validate_values", lambda *args: None)
    q, k, v, omega, positions = _inputs(n=21)
    spy = _PathSpy(monkeypatch)
    for structure, dense_max_n, path in (
        ("general", 512, "dense"),
        ("general", 8, "blockwise"),
        ("separable", 512, "dense"),
        ("separable", 8, "separable"),
    ):
        monkeypatch.setattr(rt, "DENSE_MAX_N", dense_max_n)
        params = _params("separable")  # σ_t² = 0 whatever the structure: values do not choose
        params["beta"].requires_grad_()
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with _HostReads() as reads:
            out = rt_attention(*x, **params, omega=omega, positions=positions, structure=structure)
            out.sum().backward()
        assert spy.paths[-1] == path and reads.count == 0, (structure, path, reads.count)


class _HostReads(TorchDispatchMode):
    """Counts ATen calls that copy a tensor's value to the host (``.item()``, ``bool(tensor)``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_declared_structure_is_checked_in_eager_mode():
    q, k, v, omega, positions = _inputs(n=9)
    with pytest.raises(ValueError, match="structure='separable' needs sigma_t2 = 0"):
        rt_attention(q, k, v, **_params("general"), structure="separable")
    with pytest.raises(ValueError, match="structure='tied' needs sigma_t2 = 2 mu_r eta_t2"):
        rt_attention(q, k, v, **_params("general"), structure="tied")
    with pytest.raises(ValueError, match="non-decreasing positions"):
        rt_attention(q, k, v, **_params("tied"), positions=positions.flip(-1), structure="tied")
    with pytest.raises(ValueError, match="structure must be one of"):
        rt_attention(q, k, v, **_params("tied"), structure="diagonal")


def test_flex_score_mod_matches_reference(monkeypatch):
    """The FlexAttention path's ``score_mod`` (fused on GPUs), run unfused on CPU, forward only:
    FlexAttention has no CPU backward."""
    monkeypatch.setattr(rt, "_compiled_flex", lambda flex: flex)
    q, k, v, omega, positions = _inputs(b=2, h=2, n=19)
    params = _params("general", h=2)
    for causal in (True, False):
        kwargs = dict(**params, omega=omega, positions=positions, causal=causal)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile()"
            out = rt_attention(q, k, v, backend="flex", **kwargs)
        torch.testing.assert_close(
            out, rt_attention(q, k, v, backend="reference", **kwargs), rtol=0, atol=1e-12
        )


def test_positions_default_and_broadcast():
    q, k, v, omega, _ = _inputs(n=11)
    params = _params("general")
    default = rt_attention(q, k, v, **params, omega=omega)
    shared = rt_attention(q, k, v, **params, omega=omega, positions=torch.arange(11.0, dtype=F64))
    batched = rt_attention(
        q, k, v, **params, omega=omega, positions=torch.arange(11.0, dtype=F64).expand(2, 11)
    )
    torch.testing.assert_close(default, shared, rtol=0, atol=1e-14)
    torch.testing.assert_close(default, batched, rtol=0, atol=1e-14)


def test_weights_are_a_causal_softmax():
    q, k, v, omega, positions = _inputs(n=9)
    out, weights = rt_attention(
        q, k, v, **_params("general"), omega=omega, positions=positions, return_weights=True
    )
    assert weights.shape == (2, 3, 9, 9) and out.shape == q.shape
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 9, dtype=F64))
    past = torch.ones(9, 9, dtype=torch.bool).tril()
    assert (weights[..., ~past] == 0).all() and (weights[..., past] > 0).all()


@pytest.mark.parametrize("regime", REGIMES)
def test_larger_key_magnitude_gets_more_weight(regime):
    """Two keys at the same angle to the query and the same time: the longer one is more precise."""
    d = 4
    q = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    direction = torch.tensor([math.cos(0.1), math.sin(0.1), 0.0, 0.0], dtype=F64)
    k = torch.stack([q, 1.0 * direction, 3.0 * direction])[None, None]  # token 0 is the query itself
    v = torch.eye(3, d, dtype=F64)[None, None]
    positions = torch.tensor([0.0, 0.0, 0.0], dtype=F64)  # equal times: Δt = 0 for every pair
    qs = q.expand(1, 1, 3, d)
    _, weights = rt_attention(
        qs, k, v, **_params(regime, h=1), positions=positions, causal=False, return_weights=True
    )
    assert weights[0, 0, 0, 2] > 1.5 * weights[0, 0, 0, 1]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_zero_norm_queries_keys_values_stay_finite(regime, backend):
    q, k, v, omega, positions = _inputs(n=7)
    q[:, :, 2] = 0
    k[:, :, 1] = 0
    k[:, :, 4] = 0
    v[:, :, 3] = 0
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = rt_attention(q, k, v, **_params(regime), omega=omega, positions=positions, backend=backend)
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in _grads(out, [q, k, v]))


def test_normalize_values_false_uses_raw_values():
    q, k, v, omega, positions = _inputs(n=10)
    kwargs = dict(**_params("general"), omega=omega, positions=positions, normalize_values=False)
    out = rt_attention(q, k, v, **kwargs)
    torch.testing.assert_close(rt_attention(q, k, 2.5 * v, **kwargs), 2.5 * out)  # linear in v
    torch.testing.assert_close(out, rt_attention(q, k, v, backend="reference", **kwargs), rtol=0, atol=1e-12)
    unit = rt_attention(q, k, v, **{**kwargs, "normalize_values": True})
    torch.testing.assert_close(rt_attention(q, k, 2.5 * v, **{**kwargs, "normalize_values": True}), unit)


class _LargestTile(TorchDispatchMode):
    """Largest product of the last two dimensions of any tensor an ATen op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.largest = max(self.largest, t.shape[-1] * t.shape[-2])
        return out


@pytest.mark.parametrize("regime", REGIMES)
def test_auto_never_materialises_n_by_n_beyond_the_dense_tile(regime, monkeypatch):
    monkeypatch.setattr(blockwise, "_MAX_BLOCK_K", 16)
    monkeypatch.setattr(blockwise, "_TILE_ELEMENTS", 1 * 2 * 16 * 16)
    monkeypatch.setattr(blockwise, "_MIN_BLOCK_Q", 16)
    monkeypatch.setattr(rt, "DENSE_MAX_N", 64)
    n = 128
    q, k, v, omega, positions = _inputs(b=1, h=2, n=n, d=8)
    params = _params(regime, h=2)
    for backend, bound in (("auto", n * 16), ("reference", None)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with _LargestTile() as spy:
            out = rt_attention(
                *x, **params, omega=omega, positions=positions, backend=backend, structure=regime
            )
            out.sum().backward()
        if bound is None:
            assert spy.largest >= n * n  # the spy sees the reference's N×N logits
        else:
            assert spy.largest <= bound, f"{regime}: a {spy.largest}-element tile"


def test_dense_tile_only_within_its_bounds():
    """The dense path holds (B, H, N, N) tensors: only for N ≤ DENSE_MAX_N and B·H·N² ≤ DENSE_MAX_ELEMENTS."""
    params = tuple(torch.ones(4) for _ in range(4))
    cpu = torch.device("cpu")
    choose = rt._choose_path
    assert choose("auto", "general", cpu, 48, 64, params, True) == "dense"
    assert choose("auto", "general", cpu, 48, rt.DENSE_MAX_N, params, True) == "dense"
    assert choose("auto", "general", cpu, 48, rt.DENSE_MAX_N + 1, params, True) == "blockwise"
    too_many = rt.DENSE_MAX_ELEMENTS // 64**2 + 1
    assert choose("auto", "general", cpu, too_many, 64, params, True) == "blockwise"
    assert choose("auto", "separable", cpu, 48, 64, params, True) == "dense"  # any structure
    assert choose("auto", "separable", cpu, 48, rt.DENSE_MAX_N + 1, params, True) == "separable"


def test_blockwise_saves_only_linear_statistics():
    q, k, v, omega, positions = _inputs(b=1, h=2, n=64)
    params = {name: p.requires_grad_() for name, p in _params("general", h=2).items()}
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rt_attention(
            q.requires_grad_(), k, v, **params, omega=omega, positions=positions, backend="blockwise"
        )
    assert max(saved) == 3 * q.numel()  # the stacked q, k, v (3, B, H, N, D) at most, no (N, N)


H, N, D = 2, 5, 4
GOOD = dict(mu_r=torch.zeros(H), sigma_t2=torch.zeros(H), eta_t2=torch.ones(H), beta=torch.ones(H))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(q=torch.zeros(1, H, N)), r"q must be a \(B, H, N, D\) tensor, got \(1, 2, 5\)"),
        (dict(k=torch.zeros(1, H, N + 1, D)), r"same shape .* \(1, 2, 6, 4\)"),
        (dict(q=torch.zeros(1, H, N, 3), k=torch.zeros(1, H, N, 3), v=torch.zeros(1, H, N, 3)), "even"),
        (dict(q=torch.zeros(1, H, 0, D), k=torch.zeros(1, H, 0, D), v=torch.zeros(1, H, 0, D)), "one token"),
        (dict(mu_r=torch.zeros(H + 1)), r"mu_r must be a tensor of shape \(H,\) = \(2,\), got \(3,\)"),
        (dict(beta=1.0), r"beta must be a tensor of shape \(H,\)"),
        (dict(mu_r=torch.tensor([0.1, -0.1])), "mu_r must be ≥ 0"),
        (dict(sigma_t2=torch.tensor([-1.0, 0.0])), "sigma_t2 must be ≥ 0"),
        (dict(eta_t2=torch.tensor([1.0, 0.0])), "eta_t2 must be > 0"),
        (dict(beta=torch.tensor([0.0, 1.0])), "beta must be > 0"),
        (dict(omega=torch.zeros(H, D)), r"omega must have shape \(H, D/2\) = \(2, 2\), got \(2, 4\)"),
        (dict(positions=torch.zeros(N + 1)), r"positions must have shape \(N,\) = \(5,\) or \(B, N\)"),
        (dict(backend="fast"), "backend must be one of"),
    ],
)
def test_bad_inputs_raise(change, match):
    args = dict(q=torch.zeros(1, H, N, D), k=torch.zeros(1, H, N, D), v=torch.zeros(1, H, N, D), **GOOD)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        rt_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_compiled_kernels_match_reference(monkeypatch):
    """Large problems run the blockwise tiles and the dense path's elementwise work through
    `torch.compile` (the blockwise ones inside its custom operator)."""
    monkeypatch.setattr(rt, "COMPILE_MIN_PAIRS", 0)
    monkeypatch.setattr(blockwise, "_MAX_BLOCK_K", 8)
    monkeypatch.setattr(blockwise, "_TILE_ELEMENTS", 2 * 3 * 8 * 8)
    monkeypatch.setattr(blockwise, "_MIN_BLOCK_Q", 8)
    q, k, v, omega, positions = _inputs(n=21, dtype=torch.float32)
    params = {name: p.requires_grad_() for name, p in _params("general", dtype=torch.float32).items()}
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *params.values()]
    kwargs = dict(**params, omega=omega, positions=positions)
    for backend in ("blockwise", "dense"):
        out = rt_attention(q, k, v, backend=backend, **kwargs)
        ref = rt_attention(q, k, v, backend="reference", **kwargs)
        torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
        for g, g_ref in zip(_grads(out, leaves), _grads(ref, leaves)):
            torch.testing.assert_close(g, g_ref, rtol=2e-4, atol=2e-4)
    # the normalisation, compiled too: with a metric (its gradient) and raw values
    metric = (0.5 + torch.rand(q.shape[1], q.shape[-1])).requires_grad_()
    qkv = torch.stack([x.detach().transpose(1, 2) for x in (q, k, v)], dim=2).requires_grad_()
    kwargs = dict(**params, omega=omega, positions=positions, metric=metric, key_scale=0.7)
    out = rt_attention_qkv(qkv, backend="dense", normalize_values=False, **kwargs)
    ref = rt_attention_qkv(qkv, backend="reference", normalize_values=False, **kwargs)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
    for g, g_ref in zip(_grads(out, [qkv, metric]), _grads(ref, [qkv, metric])):
        torch.testing.assert_close(g, g_ref, rtol=2e-4, atol=2e-4)
    assert not blockwise.MaybeCompiled.broken
    compiled = (blockwise._FORWARD, rt._RT_TILE_BACKWARD, rt._DENSE_FORWARD, rt._DENSE_BACKWARD)
    assert all(f.compiled is not None for f in (*compiled, rt._UNIT_FORWARD, rt._UNIT_BACKWARD))


def test_bench_attention_entry_point(capsys):
    from geoattn.cli import main

    args = ["bench", "attention", "--sizes", "16", "--heads", "2", "--head-dim", "8", "--repeats", "2"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("keys (|k|") and "κ up to" in line for line in lines)  # input statistics
    assert any(line.startswith("peak memory: RSS growth") for line in lines)  # how memory was measured
    assert any(line.startswith("rt paths: ") for line in lines)  # native kernel or Python paths
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| 16 ")]
    kernels = {(row[1], row[2]) for row in rows}
    assert kernels == {
        ("SDPA (peer)", "trained-like"),
        ("rt σ_t²=0", "trained-like"),
        ("rt tied 2μη²", "trained-like"),
        ("rt general", "trained-like"),
        ("rt σ_t²=0", "unit keys"),
        ("rt general", "unit keys"),
        ("rt reference", "trained-like"),
    }
    sdpa = next(row for row in rows if row[1] == "SDPA (peer)")
    assert sdpa[7] == sdpa[8] == "1.00"  # ratios are against SDPA
    assert float(sdpa[4]) <= float(sdpa[5]) <= float(sdpa[6])  # min <= median <= max
    assert main(["bench", "attention", "--sizes", "16", "--head-dim", "7"]) == 2
    assert "--head-dim must be even" in capsys.readouterr().err


def test_bench_attention_profiles_each_fast_path_when_asked(capsys):
    from geoattn.cli import main

    args = ["bench", "attention", "--sizes", "16", "--heads", "2", "--head-dim", "8", "--repeats", "1"]
    assert main([*args, "--profile"]) == 0
    blocks = capsys.readouterr().out.split("\n\n")[1:]  # after the timing table, one block per kernel
    names = [block.splitlines()[0].split(", ")[1] for block in blocks]
    assert names == ["SDPA (peer)", "rt σ_t²=0", "rt tied 2μη²", "rt general"]
    for block in blocks:
        ops = [line.split("|")[1:-1] for line in block.splitlines()[3:]]
        assert ops and all(float(self_ms) >= 0 and int(calls) >= 1 for _, self_ms, calls in ops)
    assert main(args) == 0
    assert "profile:" not in capsys.readouterr().out  # off by default


def test_bench_attention_compiles_every_fast_kernel_when_asked(capsys, monkeypatch):
    # torch.compile itself is tested on these kernels in test_rt_compile.py; here, which rows the
    # bench sends through it (a recorder standing in for the compiler, so this stays quick)
    from geoattn.cli import main

    wrapped = []

    def record(fn, **kwargs):
        wrapped.append(fn)
        return fn

    monkeypatch.setattr(torch, "compile", record)
    args = ["bench", "attention", "--sizes", "16", "--heads", "2", "--head-dim", "8", "--repeats", "1"]
    assert main([*args, "--compile", "on"]) == 0
    out = capsys.readouterr().out
    assert "cpu, rt compiled, 1 calls each" in out
    assert len(wrapped) == 5  # the five rt rows; SDPA and the reference stay eager
    assert main(args) == 0 and "compiled" not in capsys.readouterr().out


def test_far_lags_stay_finite_and_exact():
    """A fast-decaying head over a long sequence: ``c(Δt)`` grows past e^{80} (float32 overflows near
    e^{88}). The fast paths take log c in log space there: in float64 they still equal the reference,
    and in float32 values and gradients stay finite and agree with the float64 result."""
    n = 160
    q, k, v, omega, _ = _inputs(b=1, h=2, n=n, d=8, irregular=False)
    params = dict(
        mu_r=torch.tensor([0.6, 0.05], dtype=F64),
        sigma_t2=torch.tensor([0.3, 0.1], dtype=F64),
        eta_t2=torch.tensor([1.0, 0.5], dtype=F64),
        beta=torch.tensor([1.0, 2.0], dtype=F64),
    )
    assert float(2 * params["mu_r"].max() * (n - 1)) > 2 * rt._FAR
    grads = {}
    for dtype in (F64, torch.float32):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        p = {name: t.to(dtype).requires_grad_() for name, t in params.items()}
        for backend in ("dense", "blockwise", "reference"):
            if dtype == torch.float32 and backend == "reference":
                continue  # the plain formula overflows in float32: what the fast paths avoid
            for positions in (None, torch.arange(n, dtype=dtype)):  # lag tables, and explicit times
                out = rt_attention(*x, **p, omega=omega.to(dtype), positions=positions, backend=backend)
                weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
                leaves = [*x, *p.values()]
                grads[dtype, backend, positions is None] = [
                    out,
                    *torch.autograd.grad((out * weights.to(dtype)).sum(), leaves),
                ]
    for key, values in grads.items():
        dtype = key[0]
        assert all(torch.isfinite(g).all() for g in values), key
        tol = 1e-10 if dtype == F64 else 5e-4
        for got, want in zip(values, grads[F64, "reference", True]):
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=str(key))


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(blockwise.MaybeCompiled, "broken", False)
    fn = blockwise.MaybeCompiled(lambda x: x + 1)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert fn(True, 1) == 2
    assert blockwise.MaybeCompiled.broken and fn(True, 2) == 3  # stays eager, no second warning


def test_auto_falls_back_to_blockwise_when_flex_fails(monkeypatch):
    """``auto`` picks FlexAttention on CUDA; if it cannot run, the blockwise kernel answers."""
    monkeypatch.setattr(rt, "_choose_path", lambda *args, **kwargs: "flex")
    monkeypatch.setattr(rt, "_compiled_flex", lambda flex: flex)
    q, k, v, omega, positions = _inputs(n=9)
    params = {name: p.requires_grad_() for name, p in _params("general").items()}
    kwargs = dict(**params, omega=omega, positions=positions)
    with pytest.warns(UserWarning, match="FlexAttention failed"):  # no FlexAttention backward on CPU
        out = rt_attention(q.requires_grad_(), k, v, **kwargs)
    torch.testing.assert_close(out, rt_attention(q, k, v, backend="reference", **kwargs), rtol=0, atol=1e-12)
    with pytest.raises(NotImplementedError):  # asked for by name, its errors are the caller's
        rt_attention(q, k, v, backend="flex", **kwargs)


def test_an_evaluation_on_the_dense_path_stays_eager(monkeypatch):
    """Large problems compile their elementwise work, except the dense path without autograd: a
    one-off evaluation on a whole validation pool would pay seconds of compilation for milliseconds
    of work. The rule reads only static facts (the path, the size, whether autograd records)."""
    large, small = rt.COMPILE_MIN_PAIRS, rt.COMPILE_MIN_PAIRS - 1
    assert rt._worth_compiling("dense", large) and rt._worth_compiling("blockwise", large)
    assert not rt._worth_compiling("dense", small) and not rt._worth_compiling("blockwise", small)
    with torch.no_grad():
        assert not rt._worth_compiling("dense", large)
        assert rt._worth_compiling("blockwise", large)
    # the dense call itself: its compiled pieces (stand-ins that count calls) run only under autograd
    calls = []
    for piece in (rt._DENSE_FORWARD, rt._UNIT_FORWARD):
        monkeypatch.setattr(piece, "compiled", lambda *args, fn=piece.fn: calls.append(fn) or fn(*args))
    monkeypatch.setattr(rt, "COMPILE_MIN_PAIRS", 0)
    q, k, v, omega, positions = _inputs(n=21, dtype=torch.float32)
    kwargs = dict(**_params("general", dtype=torch.float32), omega=omega, positions=positions)
    ref = rt_attention(q, k, v, backend="reference", **kwargs)
    with torch.no_grad():
        out = rt_attention(q, k, v, backend="dense", **kwargs)
    assert not calls
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
    rt_attention(q.requires_grad_(), k, v, backend="dense", **kwargs)
    assert rt._DENSE_FORWARD.fn in calls and rt._UNIT_FORWARD.fn in calls
