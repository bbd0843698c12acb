"""`rt_attention` (docs/concepts/rt-filter.md#the-functional-contract): the formula by hand, the chunked path
against the reference (values and every gradient), the dispatch table (its rows, its reasons, the only
chooser), the magnitude precision, degenerate inputs, validation, and O(N) memory. The native path:
tests/test_native.py; FlexAttention: tests/test_rt_flex.py."""

from __future__ import annotations

import ast
import importlib
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import geoattn
from geoattn import native
from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rt import chunked, dispatch, rt_attention, rt_attention_qkv
from geoattn.attention.rt.params import FAR, Call

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
    """Records which rows of the dispatch table ran."""

    def __init__(self, monkeypatch):
        self.paths = []
        rows = []
        for path in dispatch.PATHS:

            def spy(call, _path=path):
                self.paths.append(_path.name)
                return _path.run(call)

            rows.append(path._replace(run=spy))
        monkeypatch.setattr(dispatch, "PATHS", tuple(rows))


def _grads(out, inputs, seed=1):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def _call(qkv, *, params=None, omega=None, times=None, backend="auto", return_weights=False):
    h = qkv.shape[3]
    params = params or tuple(torch.ones(h, dtype=qkv.dtype) for _ in range(4))
    return Call(qkv, None, 1.0, params, omega, times, True, True, backend, return_weights)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize(("dtype", "tol"), [(F64, 1e-10), (torch.float32, 2e-4)])
def test_auto_matches_reference_values_and_gradients(regime, causal, dtype, tol, monkeypatch):
    """Irregular times on the CPU: ``auto`` takes the chunked path (small chunks, so that several
    run); every parameter is differentiated, whatever the structure declared."""
    monkeypatch.setattr(chunked, "CHUNK", 8)
    q, k, v, omega, positions = _inputs(dtype=dtype)
    params = {name: p.requires_grad_() for name, p in _params(regime, dtype=dtype).items()}
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *params.values()]
    kwargs = dict(**params, omega=omega, positions=positions, causal=causal)
    spy = _PathSpy(monkeypatch)
    out = rt_attention(q, k, v, backend="auto", structure=regime, **kwargs)
    assert spy.paths == ["chunked"]
    ref = rt_attention(q, k, v, backend="reference", **kwargs)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for name, g, g_ref in zip(("q", "k", "v", *params), _grads(out, leaves), _grads(ref, leaves)):
        torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol, msg=f"gradient of {name}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("times", ["default", "irregular"])
def test_chunked_path_matches_reference(causal, times, monkeypatch):
    """The chunked row against the reference, float64, values and every gradient: q, k, v (stacked),
    the metric, a learned ω and the four per-head parameters, raw values and a key scale, the
    default times and irregular ones, several chunks."""
    monkeypatch.setattr(chunked, "CHUNK", 7)
    q, k, v, omega, positions = _inputs(n=19)
    qkv = torch.stack([x.transpose(1, 2) for x in (q, k, v)], dim=2).requires_grad_()
    params = {name: p.requires_grad_() for name, p in _params("general").items()}
    metric = (0.5 + torch.rand(q.shape[1], q.shape[-1], dtype=F64)).requires_grad_()
    omega = omega.clone().requires_grad_()
    leaves = [qkv, metric, omega, *params.values()]
    for normalize, key_scale in ((True, 1.0), (False, 0.7), (True, None)):
        kwargs = dict(**params, omega=omega, positions=None if times == "default" else positions)
        kwargs.update(causal=causal, metric=metric, key_scale=key_scale, normalize_values=normalize)
        out = rt_attention_qkv(qkv, backend="chunked", **kwargs)
        ref = rt_attention_qkv(qkv, backend="reference", **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for g, g_ref in zip(_grads(out, leaves), _grads(ref, leaves)):
            torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_every_row_names_a_test_that_exists():
    """Each row of the dispatch table names the test that holds it to the reference."""
    assert [p.name for p in dispatch.PATHS] == ["reference", "native", "flex", "chunked"]
    root = Path(__file__).parent.parent
    for path in dispatch.PATHS:
        file, name = path.test.split("::")
        assert (root / file).exists(), path
        module = importlib.import_module(Path(file).stem)
        assert callable(getattr(module, name, None)), path


def test_the_dispatch_table_is_the_only_chooser(monkeypatch):
    """No module but `dispatch` imports a path module (so no other code can run one), and every call
    of `rt_attention` runs exactly the row `dispatch.choose` returns."""
    paths = {f"geoattn.attention.rt.{m}" for m in ("reference", "native_cpu", "flex", "chunked")}
    package = Path(geoattn.__file__).parent
    importers = set()
    for file in package.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            if names & paths:
                importers.add(file.relative_to(package).as_posix())
    assert importers == {"attention/rt/dispatch.py"}
    chosen = []
    choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda call: chosen.append(choose(call).name) or choose(call))
    spy = _PathSpy(monkeypatch)
    q, k, v, omega, positions = _inputs(n=9)
    params = _params("general")
    rt_attention(q, k, v, **params, omega=omega)
    rt_attention(q, k, v, **params, omega=omega, positions=positions)
    rt_attention(q, k, v, **params, return_weights=True)
    rt_attention(q, k, v, **params, backend="chunked")
    assert spy.paths == chosen and len(chosen) == 4


def test_the_rows_accept_and_decline_with_their_reasons(monkeypatch):
    """What ``auto`` picks for each kind of call, from static facts only, and each row's reasons."""
    qkv = torch.randn(2, 16, 3, 2, 8)
    times = torch.arange(16.0)
    omega = torch.ones(2, 4)
    names = [name for name, _ in dispatch.explain(_call(qkv))]
    assert names == ["reference", "native", "flex", "chunked"]
    reasons = {name: "; ".join(r) for name, r in dispatch.explain(_call(qkv, times=times))}
    assert "materialises" in reasons["reference"] and reasons["chunked"] == ""
    assert "explicit positions" in reasons["native"] and "CUDA" in reasons["flex"]
    assert dispatch.choose(_call(qkv, times=times)).name == "chunked"
    assert dispatch.choose(_call(qkv, return_weights=True)).name == "reference"
    assert dispatch.choose(_call(qkv, backend="reference")).name == "reference"
    assert "float32 or float64" in dispatch.explain(_call(qkv.half()))[1][1][0]
    with torch.enable_grad():
        learned = dict(dispatch.explain(_call(qkv, omega=omega.requires_grad_())))
    assert "omega requires a gradient" in learned["native"][0]
    with torch.no_grad():  # an evaluation with a learned ω: no gradient asked for
        assert dict(dispatch.explain(_call(qkv, omega=omega)))["native"] in ((), (native.NOT_BUILT,))
    expected = "native" if native.available() else "chunked"
    assert dispatch.choose(_call(qkv)).name == expected
    monkeypatch.setattr(native, "available", lambda: False)
    assert dict(dispatch.explain(_call(qkv)))["native"] == (native.NOT_BUILT,)
    assert dispatch.choose(_call(qkv)).name == "chunked"
    with pytest.raises(ValueError, match="backend='native' cannot run this call: explicit positions"):
        dispatch.choose(_call(qkv, times=times, backend="native"))
    with pytest.raises(ValueError, match="backend='flex' cannot run this call: the CUDA path"):
        dispatch.choose(_call(qkv, backend="flex"))


def test_backend_names_are_the_rows_and_auto():
    q, k, v, _, _ = _inputs(n=5)
    for old in ("dense", "blockwise", "separable", "tied", "fast"):
        with pytest.raises(ValueError, match=r"one of \('auto', 'reference', 'native', 'flex', 'chunked'\)"):
            rt_attention(q, k, v, **_params("general"), backend=old)


def test_value_checks_run_only_under_the_debug_switch(monkeypatch):
    """Reading the parameters' values synchronises a GPU: the checks run with GEOATTN_DEBUG=1 only."""
    q, k, v, omega, positions = _inputs(n=9)
    bad = {**_params("general"), "mu_r": torch.tensor([0.1, -0.1, 0.2], dtype=F64)}
    monkeypatch.delenv("GEOATTN_DEBUG", raising=False)
    rt_attention(q, k, v, **bad, backend="reference")  # not read
    monkeypatch.setenv("GEOATTN_DEBUG", "1")
    with pytest.raises(ValueError, match="mu_r must be ≥ 0"):
        rt_attention(q, k, v, **bad)


def test_declared_structure_is_checked_under_the_debug_switch(monkeypatch):
    monkeypatch.setenv("GEOATTN_DEBUG", "1")
    q, k, v, omega, positions = _inputs(n=9)
    with pytest.raises(ValueError, match="structure='separable' needs sigma_t2 = 0"):
        rt_attention(q, k, v, **_params("general"), structure="separable")
    with pytest.raises(ValueError, match="structure='tied' needs sigma_t2 = 2 mu_r eta_t2"):
        rt_attention(q, k, v, **_params("general"), structure="tied")
    with pytest.raises(ValueError, match="non-decreasing positions"):
        rt_attention(q, k, v, **_params("tied"), positions=positions.flip(-1), structure="tied")
    with pytest.raises(ValueError, match="structure must be one of"):
        rt_attention(q, k, v, **_params("tied"), structure="diagonal")


class _SyncOps(TorchDispatchMode):
    """Records the ATen calls that copy a tensor's value to the host or wait for it (what
    `torch.cuda.set_sync_debug_mode` reports on a GPU): ``.item()``/``bool()`` (``_local_scalar_dense``),
    ``torch.equal``, and the ops whose output size depends on values."""

    SYNCING = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten._unique2.default,
    }

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("times", ["default", "irregular"])
def test_a_training_step_reads_no_values(times):
    """Forward and backward of the CPU paths ``auto`` takes in training (native with the default
    times where built, chunked with irregular times), as the layers call them (stacked projections,
    a metric, every parameter learned), with a fixed ω as a buffer, called twice (the second call
    reuses the rotation table): no ATen call that would synchronise a GPU. The same wrappers run
    around FlexAttention on CUDA (tests/test_rt_flex.py checks its own call)."""
    q, k, v, omega, positions = _inputs(n=21, dtype=torch.float32)
    qkv = torch.stack([x.transpose(1, 2) for x in (q, k, v)], dim=2).requires_grad_()
    params = {name: p.requires_grad_() for name, p in _params("general", dtype=torch.float32).items()}
    metric = torch.ones(q.shape[1], q.shape[-1], requires_grad=True)
    kwargs = dict(**params, omega=omega, metric=metric, positions=None if times == "default" else positions)
    for _ in range(2):
        with _SyncOps() as sync:
            out = rt_attention_qkv(qkv, **kwargs)
            out.square().sum().backward()
        assert sync.calls == []


@pytest.mark.parametrize("regime", REGIMES)
def test_the_chunked_path_never_materialises_n_by_n(regime, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK", 16)
    n = 128
    q, k, v, omega, positions = _inputs(b=1, h=2, n=n, d=8)
    params = _params(regime, h=2)
    for backend, bound in (("chunked", n * 16), ("reference", None)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with _LargestTile() as spy:
            out = rt_attention(*x, **params, omega=omega, positions=positions, backend=backend)
            out.sum().backward()
        if bound is None:
            assert spy.largest >= n * n  # the spy sees the reference's N×N logits
        else:
            assert spy.largest <= bound, f"{regime}: a {spy.largest}-element tile"


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
def test_bad_inputs_raise(change, match, monkeypatch):
    monkeypatch.setenv("GEOATTN_DEBUG", "1")  # the value checks too
    args = dict(q=torch.zeros(1, H, N, D), k=torch.zeros(1, H, N, D), v=torch.zeros(1, H, N, D), **GOOD)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        rt_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


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
    e^{88}). Every path takes log c in log space there (`log_noise_variance`): in float64 they equal the
    reference, and in float32 values and gradients stay finite and agree with the float64 result."""
    n = 160
    q, k, v, omega, _ = _inputs(b=1, h=2, n=n, d=8, irregular=False)
    params = dict(
        mu_r=torch.tensor([0.6, 0.05], dtype=F64),
        sigma_t2=torch.tensor([0.3, 0.1], dtype=F64),
        eta_t2=torch.tensor([1.0, 0.5], dtype=F64),
        beta=torch.tensor([1.0, 2.0], dtype=F64),
    )
    assert float(2 * params["mu_r"].max() * (n - 1)) > 2 * FAR
    grads = {}
    for dtype in (F64, torch.float32):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        p = {name: t.to(dtype).requires_grad_() for name, t in params.items()}
        for backend in ("auto", "chunked", "reference"):
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


def test_explain_lists_every_reason_of_every_row():
    """A half-precision call with explicit positions and the weights asked of the native row: each row
    gives all its reasons, not the first one only (as SDPA does when no kernel fits)."""
    qkv = torch.randn(2, 16, 3, 2, 8).half()
    call = _call(qkv, times=torch.arange(16.0), return_weights=True, backend="native")
    reasons = dict(dispatch.explain(call))
    assert set(reasons) == {"reference", "native", "flex", "chunked"}
    native_reasons = " | ".join(reasons["native"])
    for fact in ("float32 or float64", "explicit positions", "return_weights"):
        assert fact in native_reasons, native_reasons
    assert reasons["reference"] == ()  # the weights were asked for
    with pytest.raises(ValueError, match="float32 or float64.*; explicit positions.*; return_weights"):
        dispatch.choose(call)


def test_an_explicit_backend_is_honoured_or_refused_never_overridden():
    """``return_weights`` under an explicit non-reference backend is refused by name (it used to run
    the reference silently); an explicit backend that serves the call runs it."""
    q, k, v, omega, positions = _inputs(n=9)
    params = _params("general")
    with pytest.raises(ValueError, match="backend='chunked' cannot run this call: return_weights"):
        rt_attention(q, k, v, **params, backend="chunked", return_weights=True)
    out, weights = rt_attention(q, k, v, **params, backend="reference", return_weights=True)
    assert weights.shape == (2, 3, 9, 9)
    torch.testing.assert_close(rt_attention(q, k, v, **params, backend="chunked"), out)
