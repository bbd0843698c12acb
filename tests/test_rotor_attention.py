"""rotor_attention (docs/concepts/rotors.md): the contract against the `clifford` package, reference == auto
(values and gradients), the antiparallel guard, equivariance of each head type, errors, and the bench."""

from __future__ import annotations

import itertools
import math

import clifford
import numpy as np
import pytest
import torch
from conftest import random_o3_versor
from torch.utils._python_dispatch import TorchDispatchMode

import geoattn.core.compile
from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.rotor import blocks, params, rotor_attention, sandwich
from geoattn.attention.rotor import compose as compose_module
from geoattn.attention.rotor import plan as plan_module
from geoattn.cli import main as cli_main

CL3, CL2, PGA = CliffordAlgebra(3), CliffordAlgebra(2), CliffordAlgebra(3, 0, 1)
FORMS = {"rotation": sandwich.ROTATION, "reflection": sandwich.REFLECTION}


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: one thread avoids OpenMP start-up/oversubscription costs on busy CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


HEADS = {
    CL3: ("rotation", "reflection", "projection", "frame"),
    CL2: ("rotation", "reflection", "projection"),
}
HEADS[PGA] = HEADS[CL2]


def _qkv(ga, B=2, H=2, N=7, C=3, Cv=2, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, N, C, ga.dim), (B, H, N, C, ga.dim), (B, H, N, Cv, ga.dim)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes]


def _conditioned_qkv(ga, head_type, seed, margin=0.005, **kw):
    """Inputs whose pairs all keep 1 ± ⟨a, b⟩ ≥ margin (the first such seed). The map itself is
    ill-conditioned near antiparallel pairs (the rotor's plane is undefined there) and the factorised
    sum loses ~eps / (1 ± ⟨a, b⟩) relative on a pair, so 1e-10 (float64) / 1e-5 (float32) are fair
    bounds only away from them. Near-degenerate pairs are covered by the antiparallel-guard tests."""
    metric = torch.tensor(ga.signature, dtype=torch.float64)
    for attempt in range(2000):
        q, k, v = _qkv(ga, seed=seed + attempt, **kw)
        dots = params.directions(q, ga) @ (params.directions(k, ga) * metric.to(q.dtype)).mT
        if head_type not in ("rotation", "reflection") or (1 - dots.abs()).min() > margin:
            return q, k, v
    raise AssertionError("no well-conditioned inputs found")


def _rel(x, y):
    return ((x - y).norm() / y.norm()).item()


# ------------------------------------------------------------------------------------ contract
def _clifford_queries(q, k):
    """§4.1's weights and directions with the `clifford` package (numpy float64), query by query:
    yields ``(i, alpha (N,), a, [b_j])``; also returns the MultiVector constructor."""
    layout, _ = clifford.Cl(3)
    mv = lambda x: layout.MultiVector(value=np.asarray(x, dtype=float))  # noqa: E731
    N, C = q.shape[0], q.shape[1]
    vec = lambda x: mv(np.concatenate([[0.0], x.sum(0)[1:4], np.zeros(4)]))  # noqa: E731
    b = [_unit(vec(k[j])) for j in range(N)]

    def queries():
        for i in range(N):
            logits = np.array([sum((~mv(q[i, c]) * mv(k[j, c]))[()] for c in range(C)) for j in range(N)])
            alpha = np.exp((logits - logits.max()) / math.sqrt(C * 8))
            yield i, alpha / alpha.sum(), _unit(vec(q[i])), b

    return mv, queries()


def _unit(x):
    return x / math.sqrt((x * x)[()])


def _clifford_oracle(q, k, v, head_type):
    """One head of §4.1 written with the `clifford` package, pair by pair (numpy float64)."""
    mv, queries = _clifford_queries(q, k)
    out = np.zeros(v.shape)
    for i, alpha, a, keys in queries:
        for j, b in enumerate(keys):
            for c in range(v.shape[1]):
                x = mv(v[j, c])
                if head_type == "rotation":
                    R = (1 + b * a) / math.sqrt(2 * (1 + (a * b)[()]))
                    y = R * x * ~R
                elif head_type == "reflection":
                    n = _unit(a - b)
                    y = n * x.gradeInvol() * n
                else:
                    y = (x << b) * b.inv()
                out[i, c] += alpha[j] * y.value
    return out


@pytest.mark.parametrize("head_type", ["rotation", "reflection", "projection"])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_matches_clifford_package(head_type, backend):
    q, k, v = _qkv(CL3, B=1, H=1, N=4, C=2, Cv=2)
    out = rotor_attention(q, k, v, algebra=CL3, head_type=head_type, backend=backend)
    expected = _clifford_oracle(q[0, 0].numpy(), k[0, 0].numpy(), v[0, 0].numpy(), head_type)
    assert out.shape == v.shape
    np.testing.assert_allclose(out[0, 0].numpy(), expected, rtol=0, atol=1e-12)


def test_rotation_maps_query_direction_to_key_direction():
    """With one token α = 1, so v = a gives R a R̃ = b; inverse=True takes v = b back to a."""
    q, k, _ = _qkv(CL3, B=1, H=1, N=1, C=2)
    a, b = params.directions(q, CL3), params.directions(k, CL3)  # (1, 1, 1, 3)
    out = rotor_attention(q, k, CL3.vector(a)[..., None, :], algebra=CL3)
    back = rotor_attention(q, k, CL3.vector(b)[..., None, :], algebra=CL3, inverse=True)
    torch.testing.assert_close(out[..., 0, :], CL3.vector(b), rtol=0, atol=1e-12)
    torch.testing.assert_close(back[..., 0, :], CL3.vector(a), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- reference == auto
CASES = [
    (ga, head, causal, inverse)
    for ga in (CL3, CL2, PGA)
    for head in HEADS[ga]
    for causal in (False, True)
    for inverse in ((False, True) if head == "rotation" else (False,))
]


@pytest.mark.parametrize(
    "ga,head_type,causal,inverse", CASES, ids=lambda x: repr(x) if isinstance(x, CliffordAlgebra) else str(x)
)
def test_reference_equals_auto_values_and_gradients(ga, head_type, causal, inverse):
    _assert_backends_agree(ga, head_type, causal=causal, inverse=inverse)


def _assert_backends_agree(ga, head_type, **options):
    """reference == auto (one query block and three) in float64 ≤ 1e-10, values and gradients."""
    outs = {}
    for backend, chunk in (("reference", None), ("auto", None), ("auto", 3)):  # chunk 3: three query blocks
        q, k, v = _conditioned_qkv(ga, head_type, seed=1, B=1, N=5, grad=True)
        out = rotor_attention(
            q, k, v, algebra=ga, head_type=head_type, backend=backend, chunk_size=chunk, **options
        )
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        outs[(backend, chunk)] = (out.detach(), torch.autograd.grad((out * weight).sum(), (q, k, v)))
    ref_out, ref_grads = outs[("reference", None)]
    for key in (("auto", None), ("auto", 3)):
        out, grads = outs[key]
        assert _rel(out, ref_out) < 1e-10, key
        for g, rg in zip(grads, ref_grads):
            assert _rel(g, rg) < 1e-10, key


@pytest.mark.parametrize("head_type", ["rotation", "reflection", "projection", "frame"])
def test_key_mask_matches_reference_and_ignores_masked_keys(head_type):
    q, k, v = _qkv(CL3, N=6)
    mask = torch.tensor([[True] * 6, [True, True, False, True, False, True]])
    outs = [
        rotor_attention(q, k, v, algebra=CL3, head_type=head_type, key_mask=mask, backend=b, chunk_size=c)
        for b, c in (("reference", None), ("auto", None), ("auto", 2))
    ]
    for out in outs[1:]:
        assert _rel(out, outs[0]) < 1e-10
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 2], v2[1, :, 4] = 100.0, -50.0  # masked keys: changing them changes nothing
    again = rotor_attention(q, k2, v2, algebra=CL3, head_type=head_type, key_mask=mask)
    assert _rel(again, outs[1]) < 1e-12


def test_auto_runs_in_query_chunks_without_pair_tensors(monkeypatch):
    """A small chunk budget forces three query blocks (recomputed in the backward); values and gradients
    still agree with the reference, and no intermediate of the auto path (forward or backward) is as
    large as one N×N×dim pairwise tensor."""
    # per-token tables hold up to 544 numbers a token, so N > 544 / dim; B·H·N² < 32768 keeps the
    # reference on the engine's eager kernels (no compilation in the test)
    B, H, N = 1, 2, 96
    q, k, v = _qkv(CL3, B=B, H=H, N=N, C=2, Cv=1, grad=True)
    ref = rotor_attention(q, k, v, algebra=CL3, backend="reference")
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    monkeypatch.setattr(blocks, "AUTO_CHUNK_ELEMENTS", B * H * N * 32)  # 32 queries per block
    largest = 0

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    largest = max(largest, t.numel())
            return out

    with Largest():
        out = rotor_attention(q, k, v, algebra=CL3)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert _rel(out, ref) < 1e-10
    for g, rg in zip(grads, ref_grads):
        assert _rel(g, rg) < 1e-10
    assert largest < B * H * N * N * 8


def test_compiled_block_kernels_match_eager(monkeypatch):
    """Large query blocks run their N×N work as torch.compile'd kernels (dynamic shapes, the blocks
    recomputed in the backward; compose's with its own backward, `_ComposeFunction`): values and
    gradients equal the eager blocks'. Backend aot_eager: dynamo's tracing and AOT autograd without
    code generation, to stay quick (the bench runs inductor)."""
    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "aot_eager")
    compose = [
        blocks.BlockKernel(f) for f in (compose_module._compose_forward, compose_module._compose_backward)
    ]
    monkeypatch.setattr(compose_module, "_COMPOSE_FORWARD", compose[0])
    monkeypatch.setattr(compose_module, "_COMPOSE_BACKWARD", compose[1])
    monkeypatch.setattr(sandwich, "_SANDWICH_BLOCKS", {})
    mask = torch.tensor([[True, True, False, True, True, False]])
    # two blocks of 3 queries (a block of 1, or nq == nk, would specialise and recompile): 1 graph a kernel
    for head_type, aggregation in [("reflection", "sum"), ("rotation", "compose")]:
        results = []
        for min_pairs in (2**62, 1):  # eager, then compiled
            monkeypatch.setattr(geoattn.core.compile, "COMPILE_MIN_ELEMENTS", min_pairs)
            q, k, v = _conditioned_qkv(CL3, head_type, seed=2, B=1, N=6, grad=True)
            kw = dict(head_type=head_type, aggregation=aggregation, key_mask=mask, chunk_size=3)
            out = rotor_attention(q, k, v, algebra=CL3, **kw)
            results.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
        assert _rel(results[1][0], results[0][0]) < 1e-12, (head_type, aggregation)
        for g, rg in zip(results[1][1], results[0][1]):
            assert _rel(g, rg) < 1e-12, (head_type, aggregation)
    kernels = [*compose, *sandwich._SANDWICH_BLOCKS.values()]
    assert len(kernels) == 3 and all(kernel._compiled and not kernel.failed for kernel in kernels)


@torch._dynamo.config.patch(recompile_limit=1)  # (monkeypatch would delete the setting on undo)
def test_block_kernel_compiles_each_variant_once(monkeypatch):
    """Two dtypes × grad on / off: four variants, each its own compiled copy, so none recompiles another's
    graph (here at dynamo's recompile limit 1; its default 8 was reached by one function shared by all
    variants, issue #12)."""
    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")
    kernel = blocks.BlockKernel(compose_module._compose_block)
    g = torch.Generator().manual_seed(0)
    for dtype, grad in itertools.product((torch.float32, torch.float64), (False, True)):
        qs, kf = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
        a, b = (torch.nn.functional.normalize(torch.randn(1, 2, n, 3, generator=g), dim=-1) for n in (3, 5))
        args = [
            x.to(dtype).requires_grad_(grad) for x in (qs, a, kf, b, torch.randn(1, 2, 5, 4, generator=g))
        ]
        with torch.set_grad_enabled(grad):
            for compiled, eager in zip(kernel(True, *args, None), kernel(False, *args, None)):
                torch.testing.assert_close(compiled, eager)
    assert len(kernel._compiled) == 4 and not kernel.failed


@pytest.mark.parametrize(
    "head_type,aggregation", [*((h, "sum") for h in HEADS[CL3]), ("rotation", "compose")]
)
def test_every_head_compiles_without_graph_breaks(head_type, aggregation):
    """``torch.compile(fullgraph=True)`` of rotor_attention: no graph break, so no value is read back to
    the host on the way (the path is chosen from shapes and settings only); equal to eager."""
    torch._dynamo.reset()
    q, k, v = _qkv(CL3, B=1, N=6, C=2, Cv=1, grad=True)
    mask = torch.tensor([[True, True, True, False, True, True]])

    def run(q, k, v):
        return rotor_attention(
            q, k, v, algebra=CL3, head_type=head_type, aggregation=aggregation, key_mask=mask, chunk_size=4
        )

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")(q, k, v)
    eager = run(q, k, v)
    assert _rel(compiled, eager) < 1e-12
    grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in (compiled, eager)]
    for g, rg in zip(*grads):
        assert _rel(g, rg) < 1e-12


# ------------------------------------------------------------------------------ factorised tables
@pytest.mark.parametrize(
    "ga,head_type,inverse,features",
    [
        (CL3, "rotation", False, (16, 14)),
        (CL3, "rotation", True, (16, 10)),
        (CL3, "reflection", False, (20, 2)),
        (PGA, "rotation", False, (50, 38)),
        (CliffordAlgebra(4), "rotation", False, (70, 46)),
    ],
    ids=str,
)
def test_factorised_tables_are_few_and_exact(ga, head_type, inverse, features):
    """The sandwich as ``N = d G + rest`` in the fewest key features (Cl(3) rotation: 30 per value
    channel where the monomial products took 62), with tables of small rationals (multiples of 1/72),
    equal to the engine's pair sandwich ``R v R̃ / (2(1 ± ⟨a, b⟩))`` on random unit directions."""
    plan = plan_module.sandwich_plan(ga, FORMS[head_type], inverse)
    assert (plan.keys_w.shape[-1], plan.keys_d.shape[-1]) == features
    for table in plan[:3]:
        torch.testing.assert_close(table * 72, (table * 72).round(), rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 40, ga.n, dtype=torch.float64, generator=g)
    metric = torch.tensor(ga.signature, dtype=torch.float64)
    a, b = x / (x * x * metric).sum(-1, keepdim=True).sqrt()
    v = torch.randn(40, ga.dim, dtype=torch.float64, generator=g)
    A, Bv = ga.vector(a), ga.vector(b)
    one = torch.zeros(ga.dim, dtype=torch.float64).index_fill(0, torch.tensor([0]), 1.0)
    if head_type == "reflection":
        want = ga.geometric_product(ga.geometric_product(A - Bv, ga.grade_involution(v)), A - Bv)
    else:
        R, Rt = (one + ga.geometric_product(A, Bv), one + ga.geometric_product(Bv, A))
        R, Rt = (R, Rt) if inverse else (Rt, R)
        want = ga.geometric_product(ga.geometric_product(R, v), Rt)
    d = 1 + plan.sign * (a * b * metric).sum(-1, keepdim=True)
    feats = [torch.einsum("np,nx,pxr->nr", params.monomials(b), v, t) for t in plan[:2]]
    query = torch.einsum("np,pry->nry", params.monomials(a), plan.queries)
    got = torch.einsum("nr,nry->ny", torch.cat([feats[0] / d, feats[1]], -1), query)
    torch.testing.assert_close(got, want / (2 * d), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ antiparallel guard
@pytest.mark.parametrize("head_type,sign", [("rotation", -1.0), ("reflection", 1.0)])
def test_guard_at_exactly_antiparallel_directions(head_type, sign):
    """k = ∓q makes every diagonal pair exactly antiparallel (rotation) / equal (reflection)."""
    _assert_finite_and_backends_agree(sign, head_type=head_type)
    # the guarded pair contributes nothing: with a single token the output is exactly 0
    q1, _, v1 = _qkv(CL3, N=1, seed=4)
    for backend in ("reference", "auto"):
        out = rotor_attention(q1, sign * q1, v1, algebra=CL3, head_type=head_type, backend=backend)
        assert out.abs().max() < 1e-6


def _assert_finite_and_backends_agree(sign, **options):
    """k = sign · q: values and gradients finite with both backends, which agree to 1e-6."""
    results = []
    for backend in ("reference", "auto"):
        q, _, v = _qkv(CL3, N=5, grad=True, seed=3)
        out = rotor_attention(q, sign * q, v, algebra=CL3, backend=backend, **options)
        grads = torch.autograd.grad(out.square().sum(), (q, v))
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        results.append((out, grads))
    assert _rel(results[1][0], results[0][0]) < 1e-6
    for g, rg in zip(results[1][1], results[0][1]):
        assert _rel(g, rg) < 1e-6


def test_low_precision_inputs_keep_their_dtype():
    q, k, v = _qkv(CL3, dtype=torch.bfloat16)
    out = rotor_attention(q, k, v, algebra=CL3)
    ref = rotor_attention(q.double(), k.double(), v.double(), algebra=CL3)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out.double(), ref) < 3e-2


# ----------------------------------------------------------------------------------- equivariance
EQUI_CASES = [(ga, head) for ga in (CL3, PGA) for head in HEADS[ga]]


@pytest.mark.parametrize(
    "ga,head_type", EQUI_CASES, ids=lambda x: repr(x) if isinstance(x, CliffordAlgebra) else str(x)
)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_equivariance_under_rotations_and_reflections(ga, head_type, dtype, tol):
    """O(3) elements (products of 1, 2, 3 vectors) acting on every channel commute with the kernel.

    The frame head too: a reflection flips z = x × y in both frames, so the relative rotor
    F_i F̃_j is conjugated by g and the head is O(3)-, not only SO(3)-equivariant
    (docs/concepts/rotors.md#frame-transport)."""
    q, k, v = _conditioned_qkv(ga, head_type, seed=5, margin=0.05, N=5, dtype=dtype)
    tol = 1e-4 if ga.r and dtype == torch.float32 else tol  # see PGA_FLOAT32_TOL in test_rotor_layers.py
    for n_vectors, backend in itertools.product((1, 2, 3), ("auto", "reference")):
        g = ga.versor_matrix(random_o3_versor(ga, n_vectors, dtype, seed=n_vectors))
        act = lambda x, g=g: x @ g.transpose(-1, -2)  # noqa: E731
        moved = rotor_attention(act(q), act(k), act(v), algebra=ga, head_type=head_type, backend=backend)
        expected = act(rotor_attention(q, k, v, algebra=ga, head_type=head_type, backend=backend))
        assert _rel(moved, expected) < tol, (n_vectors, backend)


# ---------------------------------------------------------------------------- compose (rotors.md#compose)
def _compose_oracle(q, k, v):
    """One compose head written with the `clifford` package (numpy float64): θ from arccos, B̂ from the
    normalised wedge, the mean rotor from cos / sin of the mean bivector's size."""
    mv, queries = _clifford_queries(q, k)
    out = np.zeros(v.shape)
    for i, alpha, a, keys in queries:
        mean = 0 * a
        for j, b in enumerate(keys):
            plane = b ^ a
            mean = mean + alpha[j] * math.acos((a * b)[()]) * plane / abs(plane)
        half = abs(mean) / 2
        rotor = math.cos(half) + math.sin(half) * mean / abs(mean)
        for c in range(v.shape[1]):
            mean_value = sum(alpha[j] * mv(v[j, c]) for j in range(len(keys)))
            out[i, c] = (rotor * mean_value * ~rotor).value
    return out


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_compose_matches_clifford_package(backend):
    q, k, v = _qkv(CL3, B=1, H=1, N=4, C=2, Cv=2)
    out = rotor_attention(q, k, v, algebra=CL3, aggregation="compose", backend=backend)
    expected = _compose_oracle(q[0, 0].numpy(), k[0, 0].numpy(), v[0, 0].numpy())
    np.testing.assert_allclose(out[0, 0].numpy(), expected, rtol=0, atol=1e-12)


def test_pair_rotor_is_exp_of_half_log_and_log_scale_is_smooth():
    """``exp(½ f(⟨a, b⟩) (b ∧ a)) = (1 + b a) / sqrt(2(1 + ⟨a, b⟩))``, the rotation head's rotor, also
    in the Taylor band next to c = 1; f and its derivative are continuous where the branches meet."""
    g = torch.Generator().manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(400, 3, generator=g, dtype=torch.float64), dim=-1)
    b = torch.nn.functional.normalize(torch.randn(400, 3, generator=g, dtype=torch.float64), dim=-1)
    b[:100] = torch.nn.functional.normalize(a[:100] + 1e-5 * b[:100], dim=-1)  # nearly parallel
    A, Bv = CL3.vector(a), CL3.vector(b)
    dot = (a * b).sum(-1)
    rotor = CL3.exp(0.5 * params.rotor_log_scale(dot)[:, None] * CL3.outer_product(Bv, A))
    one = CL3.vector(torch.zeros(3, dtype=torch.float64)).index_fill(0, torch.tensor([0]), 1.0)
    expected = (one + CL3.geometric_product(Bv, A)) / torch.sqrt(2 * (1 + dot))[:, None]
    keep = 1 + dot > 1e-3  # the closed form itself is ill-conditioned next to antiparallel
    torch.testing.assert_close(rotor[keep], expected[keep], rtol=0, atol=1e-12)
    for dtype in (torch.float64, torch.float32):  # values continuous at both band edges, C¹ at c = 1 − g
        gap = params.guard_eps(dtype)
        for edge, smooth in ((1 - gap, True), (-1 + gap, False)):
            c = torch.tensor([edge * (1 - 1e-3 * gap), edge, edge * (1 + 1e-3 * gap)], dtype=torch.float64)
            c = c.to(dtype).requires_grad_()
            f = params.rotor_log_scale(c)
            (df,) = torch.autograd.grad(f.sum(), c)
            assert (f.max() - f.min()) / f.mean() < 1e-3 and torch.isfinite(df).all()
            assert not smooth or (df.max() - df.min()).abs() < 1e-2 * df.abs().max()
    c = torch.tensor([1.0, -1.0, 1 + 1e-16, -1 - 1e-16], dtype=torch.float64, requires_grad=True)
    f = params.rotor_log_scale(c)
    (df,) = torch.autograd.grad(f.sum(), c)
    assert f[0] == 1 and torch.isfinite(f).all() and torch.isfinite(df).all()


COMPOSE_CASES = [
    (ga, causal, inverse) for ga in (CL3, CL2, PGA) for causal in (False, True) for inverse in (False, True)
]


@pytest.mark.parametrize(
    "ga,causal,inverse", COMPOSE_CASES, ids=lambda x: repr(x) if isinstance(x, CliffordAlgebra) else str(x)
)
def test_compose_reference_equals_auto_values_and_gradients(ga, causal, inverse):
    _assert_backends_agree(ga, "rotation", causal=causal, inverse=inverse, aggregation="compose")


def test_compose_equals_sum_when_the_rotors_agree():
    """All keys with one direction: every R_ij = R_i, so R̄_i = R_i and both aggregations agree."""
    q, k, v = _qkv(CL3, N=6)
    k[..., 1:4] = k[..., :1, :, 1:4]  # the same vector parts for every key (other blades differ)
    outs = [rotor_attention(q, k, v, algebra=CL3, aggregation=agg) for agg in ("sum", "compose")]
    assert _rel(outs[1], outs[0]) < 1e-12


EAGER_CL3 = CliffordAlgebra(3, compile=False)  # 2000 × 64 pairs would compile the engine's kernels


def _ordered_product(ga, logs, alpha):
    """``∏_j exp(½ α_j θ_j B̂_j)`` in key order (j = 0 leftmost): logs ``(T, N, dim)``, alpha ``(T, N)``."""
    product = ga.exp(alpha[:, 0, None] * logs[:, 0] / 2)
    for j in range(1, logs.shape[1]):
        product = ga.geometric_product(product, ga.exp(alpha[:, j, None] * logs[:, j] / 2))
    return product


def _random_pairs(T, N, g, commuting=False):
    """T queries with N keys each: unit a ``(T, 1, 3)``, b ``(T, N, 3)``, softmax weights of unit-variance
    logits ``(T, N)``, the pair logs θ_j B̂_j ``(T, N, 8)``; ``commuting``: every b in one plane with a."""
    a = torch.nn.functional.normalize(torch.randn(T, 1, 3, generator=g, dtype=torch.float64), dim=-1)
    alpha = torch.softmax(torch.randn(T, N, generator=g, dtype=torch.float64), -1)
    b = torch.randn(T, N, 3, generator=g, dtype=torch.float64)
    if commuting:
        plane = torch.linalg.cross(a, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).expand_as(a))
        b = b[..., :1] * a + b[..., 1:2] * plane
    b = torch.nn.functional.normalize(b, dim=-1)
    dot = (a * b).sum(-1)
    return alpha, params.rotor_log_scale(dot)[..., None] * EAGER_CL3.outer_product(
        EAGER_CL3.vector(b), EAGER_CL3.vector(a)
    )


def _turn_degrees(rotor):
    return torch.rad2deg(2 * torch.arccos(rotor[..., 0].abs().clamp(max=1)))


def test_compose_against_the_ordered_product_of_fractional_rotors():
    """R̄ = exp(½ Σ_j α_j θ_j B̂_j) equals ∏_j R_j^{α_j} when the rotors commute (one plane), and otherwise
    differs by BCH's commutator term ``½ Σ_{j<l} [X_j, X_l]`` (X_j = ½ α_j θ_j B̂_j) to second order.
    Also recomputes the module docstring's figures: the median turn between the ordered product and R̄
    for 2, 8 and 64 keys (2000 random queries each)."""
    ga, g = EAGER_CL3, torch.Generator().manual_seed(0)
    alpha, logs = _random_pairs(50, 6, g, commuting=True)
    mean = ga.exp((alpha[..., None] * logs).sum(1) / 2)
    torch.testing.assert_close(_ordered_product(ga, logs, alpha), mean, rtol=0, atol=1e-12)
    alpha, logs = _random_pairs(50, 6, g)
    logs = 0.02 * logs  # small angles: the second-order term dominates
    mean = ga.exp((alpha[..., None] * logs).sum(1) / 2)
    X = alpha[..., None] * logs / 2
    bch = sum(
        (ga.geometric_product(X[:, j], X[:, m]) - ga.geometric_product(X[:, m], X[:, j])) / 2
        for j in range(6) for m in range(j + 1, 6)
    )  # fmt: skip
    gap = ga.geometric_product(_ordered_product(ga, logs, alpha), ga.reverse(mean))  # ≈ 1 + bch
    gap[:, 0] -= 1
    assert _rel(gap, bch) < 0.05
    documented = {2: (5.3, 69.2), 8: (3.5, 39.9), 64: (0.8, 15.5)}  # median turns (°), module docstring
    for N, (between, own) in documented.items():
        alpha, logs = _random_pairs(2000, N, torch.Generator().manual_seed(N))
        mean = ga.exp((alpha[..., None] * logs).sum(1) / 2)
        relative = ga.geometric_product(_ordered_product(ga, logs, alpha), ga.reverse(mean))
        assert round(_turn_degrees(relative).median().item(), 1) == between, N
        assert round(_turn_degrees(mean).median().item(), 1) == own, N


@pytest.mark.parametrize("ga", [CL3, PGA], ids=repr)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_compose_is_equivariant_under_rotations_and_reflections(ga, dtype, tol):
    """Under a global versor S every pair bivector B_ij → S B_ij S⁻¹ (the directions move with S, their
    inner products do not), so the mean bivector and R̄_i are conjugated by S and so is the output."""
    q, k, v = _conditioned_qkv(ga, "rotation", seed=5, margin=0.05, N=5, dtype=dtype)
    tol = 1e-4 if ga.r and dtype == torch.float32 else tol  # see PGA_FLOAT32_TOL in test_rotor_layers.py
    for n_vectors, backend in itertools.product((1, 2, 3), ("auto", "reference")):
        g = ga.versor_matrix(random_o3_versor(ga, n_vectors, dtype, seed=n_vectors))
        act = lambda x, g=g: x @ g.transpose(-1, -2)  # noqa: E731
        run = lambda *x, b=backend: rotor_attention(*x, algebra=ga, aggregation="compose", backend=b)  # noqa: E731
        assert _rel(run(act(q), act(k), act(v)), act(run(q, k, v))) < tol, (n_vectors, backend)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["identical", "antiparallel"])
def test_compose_finite_at_identical_and_antiparallel_directions(sign):
    """k = ±q: every diagonal pair is exactly parallel (f = 1, no rotation) or antiparallel (the pair's
    rotation fades to 0); values and gradients finite, both backends agree."""
    _assert_finite_and_backends_agree(sign, aggregation="compose")
    q1, _, v1 = _qkv(CL3, N=1, seed=4)  # one token: R̄ = 1 in both cases, the output is v
    for backend in ("reference", "auto"):
        out = rotor_attention(q1, sign * q1, v1, algebra=CL3, aggregation="compose", backend=backend)
        assert _rel(out, v1) < 1e-12


# ------------------------------------------------------------------------------- dense gradients
class _ExpandedBmmOperands(TorchDispatchMode):
    """Counts the batched products that get an operand with a stride-0 dimension (an expanded tensor)."""

    def __init__(self):
        super().__init__()
        self.bmm = self.expanded = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default:
            self.bmm += 1
            self.expanded += any(
                0 in (st for st, size in zip(a.stride(), a.shape) if size > 1) for a in args[:2]
            )
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("head_type", ["rotation", "reflection", "frame"])
def test_summed_loss_sends_dense_gradients_to_the_batched_products(head_type):
    """``out.sum().backward()`` sends an expanded (stride 0) gradient, on which torch runs a batched
    product one batch entry at a time; the heads' products get it dense, with the same gradients."""
    q, k, v = _qkv(CL3, N=16, dtype=torch.float32, grad=True)
    out = rotor_attention(q, k, v, algebra=CL3, head_type=head_type, causal=True)
    with _ExpandedBmmOperands() as mode:
        out.sum().backward()
    assert mode.bmm > 0 and mode.expanded == 0
    summed = [x.grad for x in (q, k, v)]
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = rotor_attention(q, k, v, algebra=CL3, head_type=head_type, causal=True)
    out.backward(torch.ones_like(out))
    for a, b in zip(summed, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dense_grad_passes_second_derivatives():
    from geoattn.native.gradients import dense_grad

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: dense_grad(t * t).sum(), (x,))
    y = x.detach()
    assert dense_grad(y) is y  # nothing recorded where no gradient flows


# ---------------------------------------------------------------------------------------- errors
def test_errors_name_the_problem():
    q, k, v = _qkv(CL3)
    with pytest.raises(ValueError, match="expected \\(B, H, N, C, dim\\)"):
        rotor_attention(q[0], k, v, algebra=CL3)
    with pytest.raises(ValueError, match="does not match algebra.dim = 8"):
        rotor_attention(q[..., :4], k[..., :4], v[..., :4], algebra=CL3)
    with pytest.raises(ValueError, match="must have the same shape"):
        rotor_attention(q, k[:, :, :3], v, algebra=CL3)
    with pytest.raises(ValueError, match="must share \\(B, H, N\\)"):
        rotor_attention(q, k, v[:, :, :3], algebra=CL3)
    with pytest.raises(ValueError, match="unknown head_type 'rotor'"):
        rotor_attention(q, k, v, algebra=CL3, head_type="rotor")
    with pytest.raises(ValueError, match="unknown backend 'dense'.*'auto', 'reference', 'fast'"):
        rotor_attention(q, k, v, algebra=CL3, backend="dense")
    with pytest.raises(ValueError, match="'frame' needs Cl\\(3\\)"):
        rotor_attention(*_qkv(PGA), algebra=PGA, head_type="frame")
    with pytest.raises(ValueError, match="needs C ≥ 2"):
        rotor_attention(q[..., :1, :], k[..., :1, :], v, algebra=CL3, head_type="frame")
    with pytest.raises(ValueError, match="no basis vector squaring to -1"):
        ga = CliffordAlgebra(2, 1)
        rotor_attention(*_qkv(ga), algebra=ga)
    with pytest.raises(ValueError, match="inverse=True applies"):
        rotor_attention(q, k, v, algebra=CL3, head_type="projection", inverse=True)
    with pytest.raises(ValueError, match="key_mask must be a bool tensor of shape \\(B, N\\)"):
        rotor_attention(q, k, v, algebra=CL3, key_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        rotor_attention(q, k, v, algebra=CL3, chunk_size=0)
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        rotor_attention(q, k, v, algebra=CL3, aggregation="mean")
    with pytest.raises(
        ValueError, match="aggregation='compose' .* needs head_type 'rotation', got .*'reflection'"
    ):
        rotor_attention(q, k, v, algebra=CL3, head_type="reflection", aggregation="compose")


# ----------------------------------------------------------------------------------------- bench
def test_bench_entry_point_tiny(capsys):
    args = ["bench", "rotor", "--sizes", "8", "--channels", "2", "--heads", "1", "--repeats", "1"]
    code = cli_main([*args, "--head-types", "rotation", "compose", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("forward+backward", "| rotation | 8", "| compose  | 8", "auto/SDPA",
                 "reference/auto", "auto min / med / max", "1 threads"):  # fmt: skip
        assert text in out
    assert cli_main(["bench", "rotor", "--sizes", "0"]) == 2  # a ValueError, reported as a usage error
    assert cli_main([*args, "--head-types", "compose", "--threads", "1", "--profile"]) == 0
    out = capsys.readouterr().out
    for text in ("profile: N = 8, compose, auto, forward+backward", "N = 8, compose, SDPA", "self ms"):
        assert text in out
