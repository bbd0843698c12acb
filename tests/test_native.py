"""The native CPU path of RT-Filter attention (`geoattn.attention.rt.native_cpu` around
`geoattn.native`): exact against the float64 reference (values and every gradient, every
switch of the layers), chosen by ``auto`` from static facts, compiled around as one operator, and
optional (a failed build warns once and leaves the chunked path in charge)."""

from __future__ import annotations

import warnings

import pytest
import torch

from geoattn import native
from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rt import dispatch, native_cpu, params, rt_attention, rt_attention_qkv
from geoattn.attention.rt.params import Call

F64, F32 = torch.float64, torch.float32

pytestmark = pytest.mark.skipif(
    native.cpu_kernels() is None, reason="no C++ toolchain here: the native kernel cannot be built"
)


def _inputs(b=2, h=3, n=150, d=8, dtype=F64, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=F64) for _ in range(3))
    k = k * (0.3 + spread * torch.rand(b, h, n, 1, generator=g, dtype=F64))  # trained-like magnitudes
    omega = 0.3 * rope_frequencies(d, h).to(F64)
    return tuple(x.to(dtype) for x in (q, k, v, omega))  # the same numbers in either dtype


def _params(regime: str, dtype=F64):
    # "fast": far lags (2 μ_r Δt up to 900) whose log c every path takes in log space
    mu_r = torch.tensor({"fast": [0.0, 0.5, 3.0]}.get(regime, [0.0, 0.05, 0.2]), dtype=dtype)
    eta_t2 = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)
    sigma_t2 = {
        "separable": torch.zeros(3, dtype=dtype),
        "tied": 2 * mu_r * eta_t2,
    }.get(regime, torch.tensor([0.1, 0.02, 0.3], dtype=dtype))
    return dict(mu_r=mu_r, sigma_t2=sigma_t2, eta_t2=eta_t2, beta=torch.tensor([1.0, 2.0, 0.5], dtype=dtype))


def _call(n=16):
    qkv = torch.randn(2, n, 3, 3, 8)
    return Call(qkv, None, 1.0, tuple(torch.ones(3) for _ in range(4)), None, None, True, True, "auto", False)


def _grads(out, leaves, seed=1):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)
    return torch.autograd.grad((out * weights).sum(), leaves)


def _run(backend, dtype, regime, causal, **kw):
    q, k, v, omega = _inputs(dtype=dtype, **kw)
    params = {name: p.requires_grad_() for name, p in _params(regime, dtype).items()}
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *params.values()]
    out = rt_attention(q, k, v, **params, omega=omega, causal=causal, backend=backend)
    return out, _grads(out, leaves)


class _Calls:
    """Counts the native kernel's forward and backward calls per entry point (``qkv``: `rt_qkv.h`)."""

    def __init__(self, monkeypatch):
        self.counts = {}
        module = native.cpu_kernels()
        spy = self

        class Spy:
            def __getattr__(self, name):
                entry, direction = name.removeprefix("rt_").split("_")
                spy.counts.setdefault(entry, [0, 0])[direction == "backward"] += 1
                return getattr(module, name)

        monkeypatch.setattr(native, "cpu_kernels", lambda: Spy())

    def __getitem__(self, entry: str) -> tuple[int, int]:
        return tuple(self.counts.get(entry, (0, 0)))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("regime", ["general", "separable", "tied", "fast"])
@pytest.mark.parametrize("blocks", [(64, 256), (16, 24)], ids=["default-blocks", "many-blocks"])
def test_native_path_matches_reference(regime, causal, blocks, monkeypatch):
    """float64, every regime (μ_r = 0, σ_t² = 0, the tied family, far lags), N = 150 not a multiple of
    the blocks: values and the gradients of q, k, v and all four parameters equal the reference's to
    rounding, through ``auto`` (which takes the native path) and by name."""
    monkeypatch.setattr(native_cpu, "BLOCKS", blocks)
    calls = _Calls(monkeypatch)
    out, grads = _run("auto", F64, regime, causal)
    assert calls["qkv"] == (1, 1)
    by_name, _ = _run("native", F64, regime, causal)
    assert calls["qkv"] == (2, 2)
    ref, ref_grads = _run("reference", F64, regime, causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(by_name, out, rtol=0, atol=0)
    for name, g, g_ref in zip(("q", "k", "v", "mu_r", "sigma_t2", "eta_t2", "beta"), grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")


@pytest.mark.parametrize("blocks", [(64, 256), (16, 24)], ids=["default-blocks", "many-blocks"])
@pytest.mark.parametrize("flushed", [True, False], ids=["subnormals-flushed", "subnormals-kept"])
@pytest.mark.parametrize("d", [8, 32])
def test_native_float32_matches_the_reference(d, flushed, blocks, monkeypatch):
    """float32 with wide key magnitudes (sharp weights, factors that would be subnormal): the native
    kernel agrees with the float64 reference whether or not the calling thread flushes subnormals.
    D = 32 runs the rows in whole SIMD lanes, D = 8 one value at a time. Many blocks: key blocks of
    24 columns, whose causal rows end in a masked vector of 16 lanes or in single values."""
    monkeypatch.setattr(native_cpu, "BLOCKS", blocks)
    try:
        torch.set_flush_denormal(flushed)
        out, grads = _run("native", F32, "general", True, spread=12.0, d=d)
    finally:
        torch.set_flush_denormal(False)
    ref, ref_grads = _run("reference", F64, "general", True, spread=12.0, d=d)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)
    for g, g_ref in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-3, atol=1e-3)


def test_a_derivative_of_the_native_gradients_is_refused_by_name():
    """The native path's gradients are not differentiable themselves: a loss on them (create_graph)
    raises naming the path that takes it, and that path gives the reference's second derivatives."""
    q, k, v, omega = _inputs(n=20)
    q.requires_grad_()
    params = _params("general")
    second = []
    for backend in ("native", "chunked", "reference"):
        out = rt_attention(q, k, v, **params, omega=omega, causal=True, backend=backend)
        if backend == "native":
            with pytest.raises(RuntimeError, match="first derivatives only.*backend='chunked'"):
                torch.autograd.grad(out.square().sum(), q, create_graph=True)
            continue
        (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        second.append(torch.autograd.grad(g.square().sum(), q)[0])
    torch.testing.assert_close(second[0], second[1], rtol=1e-9, atol=1e-10)


def test_auto_takes_the_native_kernel_for_the_default_times_and_a_fixed_omega_only(monkeypatch):
    """With the default times every structure runs natively on the CPU (static facts: the device,
    ``positions is None``, ω not learned, the built kernel); explicit times and a learned ω take the
    chunked path."""
    calls = _Calls(monkeypatch)
    q, k, v, omega = _inputs(n=40)
    for structure in ("general", "separable", "tied"):
        rt_attention(q, k, v, **_params(structure), omega=omega, structure=structure)
    assert calls["qkv"] == (3, 0)
    positions = torch.arange(40, dtype=F64) * 0.5
    rt_attention(q, k, v, **_params("general"), omega=omega, positions=positions)
    rt_attention(q, k, v, **_params("general"), omega=omega.clone().requires_grad_())
    assert calls.counts == {"qkv": [3, 0]}
    with torch.no_grad():  # a learned ω without autograd (an evaluation): native again
        rt_attention(q, k, v, **_params("general"), omega=omega.clone().requires_grad_())
    assert calls["qkv"] == (4, 0)


def test_native_path_compiles_as_one_graph():
    """The native kernel is one custom operator: ``fullgraph=True`` holds (the dispatch reads static
    facts; the kernel's availability is a constant of the process), and compiled == eager."""
    torch._dynamo.reset()
    q, k, v, omega = _inputs(n=40)
    params = {name: p.requires_grad_() for name, p in _params("general").items()}

    def attend(q, k, v):
        return rt_attention(q, k, v, **params, omega=omega)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, out_c = attend(*leaves), compiled(*leaves)
    torch.testing.assert_close(out_c, out, rtol=1e-12, atol=1e-12)
    trainable = [*leaves, *params.values()]
    for g, g_c in zip(_grads(out, trainable), _grads(out_c, trainable)):
        torch.testing.assert_close(g_c, g, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_a_failed_build_warns_once_and_leaves_the_chunked_path(monkeypatch, tmp_path):
    """No compiler (or ninja, or BLAS symbols): one warning, None, and ``auto`` takes the chunked
    path, exact."""
    import torch.utils.cpp_extension as cpp

    def broken(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load", broken)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv("GEOATTN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: nothing built to load
    with pytest.warns(UserWarning, match="native CPU kernels unavailable .*Ninja is required"):
        assert native.cpu_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert native.cpu_kernels() is None
    assert dispatch.choose(_call()).name == "chunked"
    out, _ = _run("auto", F64, "general", True)
    ref, _ = _run("reference", F64, "general", True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_the_environment_switches_it_off(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    monkeypatch.setattr(native, "_state", {})
    assert native.cpu_kernels() is None


def test_token_major_gradients_are_read_in_place():
    """The output gradient of a layer that merges heads token-major is a strided (B, H, N, D) view:
    it goes to the kernel without a copy."""
    g = torch.randn(2, 70, 3, 8).transpose(1, 2)
    assert native_cpu._rows(g)[0].data_ptr() == g.data_ptr()
    assert native_cpu._rows(g.transpose(-1, -2))[0].data_ptr() != g.data_ptr()  # columns: copied


@pytest.mark.parametrize(
    ("metric", "key_scale", "normalize_values", "rotation"),
    [
        (True, 1.7, True, True),
        (False, 1.0, True, True),
        (True, None, True, True),
        (True, 0.5, False, True),
        (True, 2.0, True, False),
    ],
    ids=["metric", "no-metric", "no-magnitudes", "raw-values", "no-rotation"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("token_major", [False, True], ids=["grad-head-major", "grad-token-major"])
def test_fused_entry_matches_reference(
    metric, key_scale, normalize_values, rotation, causal, token_major, monkeypatch
):
    """The fused entry (`rt_qkv.h`: normalisation through the metric, key magnitudes, the rotations
    into and out of the common frame, all in the native call) equals the reference in float64 for
    every switch of the layers, values and the gradients of qkv, the metric and the four parameters,
    also with zero rows (the normalisation's clamp) among the queries, keys and values. Token-major:
    the output goes on as ``(B, N, H·D)``, as the layers merge the heads, so that ∂o reaches the
    backward as a strided ``(B, H, N, D)`` view, read where it lies."""
    monkeypatch.setattr(native_cpu, "BLOCKS", (16, 24))
    g = torch.Generator().manual_seed(7)
    b, n, h, d = 2, 90, 3, 8
    qkv = torch.randn(b, n, 3, h, d, generator=g, dtype=F64)
    qkv[:, :, 1] *= 0.3 + 3 * torch.rand(b, n, 1, 1, generator=g, dtype=F64)
    qkv[0, 5], qkv[1, 17, 1], qkv[1, 30, 2, 0] = 0.0, 0.0, 0.0
    scales = 0.5 + torch.rand(h, d, generator=g, dtype=F64) if metric else None
    omega = 0.3 * rope_frequencies(d, h).to(F64) if rotation else None
    weights = torch.randn(b, h, n, d, generator=g, dtype=F64)
    results = []
    for backend in ("native", "reference"):
        calls = _Calls(monkeypatch)
        params = {name: p.requires_grad_() for name, p in _params("general").items()}
        leaves = [qkv.clone().requires_grad_(), *params.values()]
        m = None if scales is None else scales.clone().requires_grad_()
        out = rt_attention_qkv(
            leaves[0],
            metric=m,
            key_scale=key_scale,
            **params,
            omega=omega,
            causal=causal,
            backend=backend,
            normalize_values=normalize_values,
        )
        merged = out.transpose(1, 2).reshape(b, n, h * d) if token_major else out
        target = weights.transpose(1, 2).reshape(b, n, h * d) if token_major else weights
        grads = torch.autograd.grad((merged * target).sum(), leaves + ([m] if m is not None else []))
        results.append((out, grads))
        assert calls["qkv"] == ((1, 1) if backend == "native" else (0, 0))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # a zero row's gradient is its unit's divided by the clamped norm 1e-12: rounding of order 1e-16
    # in the unit's gradient (summed in another order by each kernel) shows at 1e-4 there, where
    # those gradients are of order 10
    zero = (qkv == 0).all(-1, keepdim=True).expand_as(qkv)
    torch.testing.assert_close(grads[0][zero], ref_grads[0][zero], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(grads[0][~zero], ref_grads[0][~zero], rtol=1e-9, atol=1e-10)
    for name, a, e in zip(("mu_r", "sigma_t2", "eta_t2", "beta", "metric"), grads[1:], ref_grads[1:]):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")


def test_the_rotation_table_follows_omega():
    """Eager calls reuse the (cos, sin) table of the default times for the same ω tensor: ω changed
    in place (its version counter moves), or another ω, gets its own table (the result equals the
    reference each time), and only the latest few tables are kept."""
    q, k, v, omega = _inputs(n=40)
    p = _params("general")
    for _ in range(2):
        out = rt_attention(q, k, v, **p, omega=omega)
        ref = rt_attention(q, k, v, **p, omega=omega, backend="reference")
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        omega.mul_(1.7)  # in place: the same tensor, new values
    for n in range(1, 3 * params._TURNS_KEPT):
        rt_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], **p, omega=omega)
    assert len(params._TURNS) <= params._TURNS_KEPT


@pytest.mark.parametrize("degenerate", ["generic", "parallel-channels", "zero-channel"])
def test_native_frame_transform_matches_the_python_form(degenerate, monkeypatch):
    """The frame head's per-token transform (rotor.frame._frame_transform), both directions: the
    native pass equals the tensor-operation form in float64, values and the gradients of the frames'
    multivectors (nonzero at channels 0 and 1's vector parts only) and of the moved ones, and second
    derivatives, also where Gram–Schmidt meets its clamps (c1 ∥ c0; c0 = 0)."""
    import geoattn.attention.rotor.frame as rk
    from geoattn.algebra.clifford_algebra import CliffordAlgebra

    T0, T, Tt = (t.to(F64) for t in rk._rotation_action_table(CliffordAlgebra(3)))
    g = torch.Generator().manual_seed(5)
    c0, c1 = (torch.randn(2, 3, 33, 3, generator=g, dtype=F64) for _ in range(2))
    m = torch.randn(2, 3, 33, 4, 8, generator=g, dtype=F64)
    if degenerate == "parallel-channels":  # exactly: y' = 0 (nearly parallel is rounding noise in any form)
        c0[:, :, ::3] = torch.tensor([2.0, 0.0, 0.0], dtype=F64)
        c1[:, :, ::3] = torch.tensor([-3.0, 0.0, 0.0], dtype=F64)
    elif degenerate == "zero-channel":
        c0[:, :, ::4] = 0.0
    weights = torch.randn(2, 3, 33, 4, 8, generator=g, dtype=F64)
    frames = torch.randn(2, 3, 33, 3, 8, generator=g, dtype=F64)  # 3 channels: the frame's are 0 and 1
    frames[..., 0, 1:4], frames[..., 1, 1:4] = c0, c1
    results = []
    for built in (True, False):
        monkeypatch.setattr(rk.native, "available", lambda built=built: built)
        for table in (T, Tt):
            leaves = [x.clone().requires_grad_() for x in (frames, m)]
            out = rk._frame_transform(*leaves, T0, table, slice(1, 4))
            first = torch.autograd.grad((out * weights).sum() ** 2, leaves, create_graph=True)
            # a second derivative (a loss on the gradients, as a force loss), where the frame is
            # differentiable twice (at the clamps the first derivatives are ~1e14 already): the kernel's
            # backward hands it to the tensor form
            second = (
                ()
                if degenerate != "generic"
                else torch.autograd.grad(sum(x.square().sum() for x in first), leaves)
            )
            results.append((out, *first, *second))
    for native_result, python_result in zip(results[:2], results[2:]):
        names = ("out", "∂frames", "∂m", "∂²frames", "∂²m")
        for a, e, name in zip(native_result, python_result, names):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)


def test_the_frame_head_takes_the_native_transform():
    """rotor_attention's frame head on the CPU runs the native transform (into and out of the frames)."""
    from geoattn.algebra.clifford_algebra import CliffordAlgebra
    from geoattn.attention import rotor_attention

    q, k, v = (torch.randn(1, 2, 10, 3, 8, dtype=F64, requires_grad=True) for _ in range(3))
    with torch.profiler.profile() as prof:
        rotor_attention(q, k, v, algebra=CliffordAlgebra(3), head_type="frame").sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("geoattn::frame_transform") == 2
    assert names.count("geoattn::frame_transform_backward") == 2
