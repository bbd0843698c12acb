"""CliffordAlgebra against the `clifford` package (float64, ≤ 1e-12) and the algebra's identities.

clifford JIT-compiles every operation per layout (seconds each), so the references here use its
multiplication tables (``layout.gmt`` / ``omt`` / ``lcmt``, ``(e_i e_j)_k = gmt[i, k, j]``) with
numpy, and its JIT-compiled MultiVector methods only for the unary operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import clifford
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geoattn import native
from geoattn.algebra import CliffordAlgebra

SIGNATURES = [(3, 0, 0), (2, 1, 0), (1, 3, 0), (3, 0, 1), (4, 0, 0), (0, 2, 0), (5, 0, 0), (2, 0, 2)]
EUCLIDEAN = [(2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0), (6, 0, 0)]
TOL = 1e-12
SEEDS = st.integers(0, 2**32 - 1)
FEW = settings(max_examples=8, deadline=None, derandomize=True)  # the same examples in CI as here


@dataclass
class Pair:
    """Our algebra and clifford's layout of the same signature, with clifford's dense tables."""

    alg: CliffordAlgebra
    layout: object
    gmt: np.ndarray  # (dim, dim, dim): (e_i e_j)_k = gmt[i, k, j]
    omt: np.ndarray
    lcmt: np.ndarray

    def gp(self, a, b):
        return np.einsum("...i,ikj,...j->...k", a, self.gmt, b)

    def mv(self, x: torch.Tensor):
        return self.layout.MultiVector(x.detach().numpy().astype(np.float64))


def make_pair(sig) -> Pair:
    layout, _ = clifford.Cl(*sig)
    dense = lambda t: t.todense().astype(np.float64)  # noqa: E731
    return Pair(CliffordAlgebra(*sig), layout, dense(layout.gmt), dense(layout.omt), dense(layout.lcmt))


_PAIRS: dict = {}


def make_pair_cached(sig) -> Pair:
    """One Pair per signature for the whole module (hypothesis tests cannot take function fixtures)."""
    if sig not in _PAIRS:
        _PAIRS[sig] = make_pair(sig)
    return _PAIRS[sig]


@pytest.fixture(scope="module", params=SIGNATURES, ids=lambda s: f"Cl{s}")
def pair(request) -> Pair:
    return make_pair_cached(request.param)


def rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape))


def random_versor(alg: CliffordAlgebra, seed: int, k: int, batch: int = 4) -> torch.Tensor:
    """Products of k random vectors: ``(batch, dim)``, even for even k, odd for odd k."""
    v = rand(seed, k, batch, alg.n)
    out = alg.vector(v[0])
    for i in range(1, k):
        out = alg.geometric_product(out, alg.vector(v[i]))
    return out


def close(x: torch.Tensor, ref, tol: float = TOL) -> None:
    if not isinstance(ref, torch.Tensor):
        ref = torch.as_tensor(np.array(ref))
    ref = ref.detach().to(x.dtype)
    err = (x.detach() - ref).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:g}"


# ---------------------------------------------------------------------------- conventions
def test_conventions_match_clifford(pair: Pair):
    alg, layout = pair.alg, pair.layout
    assert alg.blade_names == tuple(layout.names)
    assert alg.signature == tuple(int(s) for s in layout.sig)
    assert alg.grades == tuple(int(g) for g in layout.gradeList)
    assert alg.dim == layout.gaDims == 2**alg.n
    assert alg.grade_indices[1] == tuple(range(1, alg.n + 1))
    assert torch.equal(alg.cayley, torch.from_numpy(pair.gmt.transpose(0, 2, 1)).float())
    dense = torch.zeros(alg.dim, alg.dim, alg.dim)
    for i, j, k, s in alg.cayley_sparse:
        dense[i, j, k] = s
    assert torch.equal(dense, alg.cayley)


def test_named_signatures():
    assert CliffordAlgebra(3).blade_names == ("", "e1", "e2", "e3", "e12", "e13", "e23", "e123")
    assert CliffordAlgebra(3, 0, 1).signature == (0, 1, 1, 1)  # PGA: the null vector first, as GATr
    assert CliffordAlgebra(1, 3).signature == (1, -1, -1, -1)


def test_public_tables_match_clifford(pair: Pair):
    """The tables other modules use (docs/concepts/rotors.md#the-algebra): signs, invariant metric,
    multiplication matrices, blade indices and grade slices, each against clifford's layout."""
    alg, layout = pair.alg, pair.layout
    basis, distinct = np.eye(alg.dim), np.arange(1.0, alg.dim + 1)  # one call per clifford operation
    reverse_signs = (~layout.MultiVector(distinct)).value / distinct
    close(alg.reverse_signs, reverse_signs, 0.0)
    close(alg.involution_signs, layout.MultiVector(distinct).gradeInvol().value / distinct, 0.0)
    close(alg.invariant_metric, pair.gp(basis * reverse_signs[:, None], basis)[:, 0], 0.0)  # ⟨ẽ_A e_A⟩₀
    close(alg.invariant_metric[list(alg.vector_indices)], np.asarray(layout.sig, dtype=float), 0.0)
    x = rand(0, 5, alg.dim)
    products = pair.gp(basis[:, None, :], x.numpy()[None])  # (A, 5, dim): e_A x
    close(torch.einsum("akj,bj->abk", alg.left_multiplication, x), products)
    products = pair.gp(x.numpy()[None], basis[:, None, :])  # x e_A
    close(torch.einsum("akj,bj->abk", alg.right_multiplication, x), products)
    y = rand(1, 5, alg.dim)
    close((alg.left_matrix(x) @ y[..., None])[..., 0], pair.gp(x.numpy(), y.numpy()))
    close((alg.right_matrix(x) @ y[..., None])[..., 0], pair.gp(y.numpy(), x.numpy()))
    assert alg.blade_grades.tolist() == [int(g) for g in layout.gradeList]
    for name in layout.names:
        assert layout.blades[name].value[alg.blade_index(name)] == 1
    assert alg.blade_index("1") == alg.blade_index("") == 0
    for k in range(alg.n + 1):
        assert [int(g) for g in layout.gradeList[alg.grade_slice(k)]] == [k] * len(alg.grade_indices[k])
    assert alg.vector_indices == alg.grade_indices[1] and alg.bivector_indices == alg.grade_indices[2]


def test_blade_index_and_grade_slice_errors():
    alg = CliffordAlgebra(3)
    assert (alg.blade_index("e12"), alg.blade_index("e123"), alg.grade_slice(2)) == (4, 7, slice(4, 7))
    with pytest.raises(ValueError, match="blade_index: unknown blade 'e21'.*'e12'"):
        alg.blade_index("e21")
    with pytest.raises(ValueError, match=r"grade_slice: k must be an integer in \[0, 3\].*k=4"):
        alg.grade_slice(4)
    assert CliffordAlgebra(1).bivector_indices == ()


# ---------------------------------------------------------------------------- products
@FEW
@given(seed=SEEDS)
def test_products_match_clifford(pair: Pair, seed: int):
    alg = pair.alg
    a, b = rand(seed, 3, 1, alg.dim), rand(seed + 1, 4, alg.dim)  # leading dims broadcast to (3, 4)
    an, bn = a.numpy(), b.numpy()
    close(alg.geometric_product(a, b), pair.gp(an, bn))
    close(alg.outer_product(a, b), np.einsum("...i,ikj,...j->...k", an, pair.omt, bn))
    close(alg.left_contraction(a, b), np.einsum("...i,ikj,...j->...k", an, pair.lcmt, bn))
    close(alg.scalar_product(a, b), pair.gp(an, bn)[..., 0])
    assert alg.geometric_product(a, b).shape == (3, 4, alg.dim)
    assert alg.scalar_product(a, b).shape == (3, 4)
    # and the other way round: the left operand with fewer leading dims
    a2, b2 = rand(seed + 2, 4, alg.dim), rand(seed + 3, 3, 1, alg.dim)
    close(alg.geometric_product(a2, b2), pair.gp(a2.numpy(), b2.numpy()))


@FEW
@given(seed=SEEDS)
def test_unary_operations_match_clifford(pair: Pair, seed: int):
    alg = pair.alg
    x, y = rand(seed, alg.dim), rand(seed + 1, alg.dim)
    mx = pair.mv(x)
    close(alg.reverse(x), (~mx).value)
    close(alg.grade_involution(x), mx.gradeInvol().value)
    close(alg.conjugate(x), mx.conjugate().value)
    close(alg.norm(x), abs(mx))
    close(alg.inner_product(x, y), pair.gp((~mx).value, y.numpy())[0])
    for k in range(alg.n + 1):
        close(alg.grade(x, k), mx(k).value)
    v = rand(seed, 5, alg.n)
    close(
        alg.vector(v),
        [(pair.layout.MultiVector(np.r_[0, row, np.zeros(alg.dim - alg.n - 1)])).value for row in v],
    )
    close(alg.vector_part(alg.vector(v)), v)


@FEW
@given(seed=SEEDS)
def test_associativity(pair: Pair, seed: int):
    alg = pair.alg
    a, b, c = rand(seed, 3, alg.dim).unbind(0)
    gp = alg.geometric_product
    close(gp(gp(a, b), c), gp(a, gp(b, c)).numpy(), 1e-11)


# ---------------------------------------------------------------------------- versors
@FEW
@given(seed=SEEDS, k=st.integers(1, 3))
def test_versor_inverse_sandwich_and_matrix(pair: Pair, seed: int, k: int):
    alg = pair.alg
    V = random_versor(alg, seed, k)
    x = rand(seed + 7, 4, alg.dim)
    Vi = alg.inverse(V)
    one = np.zeros(alg.dim)
    one[0] = 1
    close(alg.geometric_product(V, Vi), np.broadcast_to(one, V.shape), 1e-11)
    # reference sandwich with clifford's product: V x V⁻¹ (even V) or V x̂ V⁻¹ (odd V)
    xs = x.numpy() if k % 2 == 0 else np.stack([pair.mv(r).gradeInvol().value for r in x])
    ref = pair.gp(pair.gp(V.numpy(), xs), Vi.numpy())
    scale = max(1.0, float(np.abs(ref).max()))
    close(alg.sandwich(V, x) / scale, ref / scale, 1e-12)
    M = alg.versor_matrix(V)
    assert M.shape == (4, alg.dim, alg.dim)
    close((M @ x.unsqueeze(-1)).squeeze(-1) / scale, ref / scale, 1e-12)


def test_inverse_matches_clifford_inv():
    pair = make_pair_cached((3, 0, 0))
    V = random_versor(pair.alg, 3, 3, batch=1)[0]
    close(pair.alg.inverse(V), pair.mv(V).inv().value)


@pytest.mark.parametrize("sig", [(3, 0, 0), (4, 0, 0), (5, 0, 0)])
def test_rotor_action_preserves_grade_and_norm(sig):
    alg = CliffordAlgebra(*sig)
    R = alg.exp(alg.grade(rand(0, 6, alg.dim), 2) * 3)
    for k in range(alg.n + 1):
        x = alg.grade(rand(k + 1, 6, alg.dim), k)
        y = alg.sandwich(R, x)
        close(y - alg.grade(y, k), np.zeros(y.shape), 1e-12)
        close(alg.norm(y), alg.norm(x).numpy(), 1e-12)


# ---------------------------------------------------------------------------- exp
def _commuting_planes(pair: Pair, seed: int, kinds: list[int], scale: float):
    """A bivector Σ θ_i P_i of commuting orthogonal unit planes (P_i² = -1 rotation, +1 boost) and
    its exponential ∏ (cos θ_i + sin θ_i P_i) / (cosh θ_i + sinh θ_i P_i), via clifford's product.

    Planes are basis planes ``e_{2i+1} e_{2i+2}`` moved by a random even versor ``V = v w``
    (``V⁻¹ = w v / (v² w²)``), so the bivector is generic (all blades nonzero), not axis-aligned.
    """
    alg, rng = pair.alg, np.random.default_rng(seed)
    sig = np.array(alg.signature)
    v, w = np.zeros((2, alg.dim))
    for u in (v, w):  # keep |u²| ≥ |u|²/2: a near-null u would make V ill-conditioned
        while abs((u * u)[1 : alg.n + 1] @ sig) <= 0.5 * (u * u).sum():
            u[1 : alg.n + 1] = rng.standard_normal(alg.n)
    rotor, rotor_rev = pair.gp(v, w), pair.gp(w, v)
    rotor_rev = rotor_rev / pair.gp(rotor, rotor_rev)[0]
    B, R = np.zeros(alg.dim), np.zeros(alg.dim)
    R[0] = 1
    for i, boost in enumerate(kinds):
        plane = np.zeros(alg.dim)
        plane[alg.blade_names.index(f"e{2 * i + 1}{2 * i + 2}")] = 1
        plane = pair.gp(pair.gp(rotor, plane), rotor_rev)
        square = pair.gp(plane, plane)[0]
        assert square == pytest.approx(1.0 if boost else -1.0)
        theta = rng.uniform(-1, 1) * scale
        c, s = (np.cosh(theta), np.sinh(theta)) if boost else (np.cos(theta), np.sin(theta))
        B = B + theta * plane
        R = pair.gp(R, c * np.eye(alg.dim)[0] + s * plane)
    return torch.from_numpy(B), R


@pytest.mark.parametrize(
    "sig, kinds",
    [
        ((3, 0, 0), [0]),
        ((4, 0, 0), [0, 0]),
        ((5, 0, 0), [0, 0]),
        ((6, 0, 0), [0, 0, 0]),
        ((1, 3, 0), [1, 0]),  # e1 e2 is a boost plane in Cl(1,3), e3 e4 a rotation plane
        ((2, 1, 0), [0]),
    ],
)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 10.0, 100.0])
def test_exp_is_exact_for_non_simple_bivectors(sig, kinds, scale):
    pair = make_pair(sig)
    if any(kinds) and scale > 10:
        scale = 10.0  # boosts grow like e^θ: keep the values in a range where 1e-12 relative is meaningful
    for seed in range(3):
        B, ref = _commuting_planes(pair, seed, kinds, scale)
        out = pair.alg.exp(B.unsqueeze(0))[0]
        rel = max(1.0, float(np.abs(ref).max()))
        close(out / rel, ref / rel, 1e-12)


def _series_exp(pair: Pair, B: np.ndarray) -> np.ndarray:
    """exp(B) by scaling, a 40-term Taylor series and squaring, with clifford's product (float64)."""
    squarings = max(0, int(np.ceil(np.log2(max(np.abs(B).sum(), 1e-300)))) + 1)
    scaled = B / 2**squarings
    term = np.eye(len(B))[0]
    total = term.copy()
    for m in range(1, 40):
        term = pair.gp(term, scaled) / m
        total = total + term
    for _ in range(squarings):
        total = pair.gp(total, total)
    return total


@FEW
@given(seed=SEEDS, log_scale=st.floats(-4, 1.3))
def test_exp_matches_series(pair: Pair, seed: int, log_scale: float):
    alg = pair.alg
    B = alg.grade(rand(seed, 3, alg.dim), 2) * 10**log_scale
    ref = np.stack([_series_exp(pair, b) for b in B.numpy()])
    rel = np.maximum(1.0, np.abs(ref).max(-1, keepdims=True))
    close(alg.exp(B) / torch.from_numpy(rel), ref / rel, 1e-11)


@pytest.mark.parametrize("sig", [(4, 0, 0), (5, 0, 0), (3, 0, 1), (2, 2, 0)])
def test_exp_simple_equals_exp_for_blades(sig):
    """``exp(B, simple=True)`` (closed form, no grade check) equals the general exp for 2-blades a ∧ b."""
    alg = CliffordAlgebra(*sig)
    a, b = alg.vector(rand(0, 6, alg.n)), alg.vector(rand(1, 6, alg.n))
    blade = alg.outer_product(a, b) * 0.7
    close(alg.exp(blade, simple=True), alg.exp(blade).numpy(), 1e-12)


@pytest.mark.parametrize("sig", [(2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0), (0, 2, 0)])
def test_exp_of_bivector_is_a_rotor(sig):
    alg = CliffordAlgebra(*sig)
    R = alg.exp(alg.grade(rand(1, 16, alg.dim), 2) * 5)
    close(alg.geometric_product(R, alg.reverse(R)), np.broadcast_to(np.eye(alg.dim)[0], R.shape))
    odd = sum(alg.grade(R, k) for k in range(1, alg.n + 1, 2))
    close(odd, np.zeros(R.shape), 0.0)  # R is even


@pytest.mark.parametrize("sig", [(3, 0, 0), (1, 3, 0), (4, 0, 0)])
def test_inner_product_is_invariant_under_versors(sig):
    """⟨x̃ y⟩₀ is unchanged when x and y move by the same versor (rotations and reflections)."""
    alg = CliffordAlgebra(*sig)
    x, y = rand(0, 4, alg.dim), rand(1, 4, alg.dim)
    for k in (1, 2, 3):
        V = random_versor(alg, 10 + k, k)
        V = V / alg.norm(V).unsqueeze(-1)  # |⟨V Ṽ⟩₀| = 1 so the action is an isometry, not a scaling
        moved = alg.inner_product(alg.sandwich(V, x), alg.sandwich(V, y))
        close(moved, alg.inner_product(x, y).numpy(), 1e-11)


def test_exp_gradient_finite_at_zero():
    for sig in [(3, 0, 0), (4, 0, 0)]:
        alg = CliffordAlgebra(*sig)
        B = torch.zeros(alg.dim, dtype=torch.float64, requires_grad=True)
        alg.exp(B).pow(2).sum().backward()
        assert torch.isfinite(B.grad).all()
    x = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    CliffordAlgebra(3).norm(x).backward()
    assert torch.equal(x.grad, torch.zeros(8, dtype=torch.float64))
    # rotor_between at a = b (identity rotor) and at a zero vector: finite gradients
    for a, b in [(rand(0, 3), rand(0, 3)), (torch.zeros(3, dtype=torch.float64), rand(1, 3))]:
        a, b = a.requires_grad_(), b.requires_grad_()
        CliffordAlgebra(3).rotor_between(a, b).pow(2).sum().backward()
        assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()


# ---------------------------------------------------------------------------- rotor_between
@FEW
@given(seed=SEEDS)
def test_rotor_between_matches_formula_and_maps_a_to_b(seed):
    for sig in [(3, 0, 0), (4, 0, 0), (2, 0, 0)]:
        pair = make_pair_cached(sig)
        alg = pair.alg
        a, b = rand(seed, 5, alg.n), rand(seed + 1, 5, alg.n) * 3
        R = alg.rotor_between(a, b)
        ah, bh = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
        numer = pair.gp(alg.vector(bh).numpy(), alg.vector(ah).numpy()) + np.eye(alg.dim)[0]
        one_plus_c = 1 + (ah * bh).sum(-1, keepdim=True).numpy()
        ref = numer / np.sqrt(2 * one_plus_c)
        # the closed form loses ~eps / (1 + ⟨â, b̂⟩) relative near antiparallel (found by hypothesis)
        close(R, ref, max(1e-11, 1e-14 / one_plus_c.min()))
        close(alg.sandwich(R, alg.vector(ah)), alg.vector(bh).numpy())
        close(alg.geometric_product(R, alg.reverse(R)), np.broadcast_to(np.eye(alg.dim)[0], R.shape))


@pytest.mark.parametrize("gap", [0.0, 1e-20, 1e-12, 1e-9, 1e-6, 1e-3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rotor_between_nearly_antiparallel(gap, dtype):
    alg = CliffordAlgebra(3)
    a = torch.tensor([[1.0, 2.0, -0.5], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    a = a / a.norm(dim=-1, keepdim=True)
    perp = torch.linalg.cross(a, torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64).expand_as(a))
    b = -a + gap * perp / perp.norm(dim=-1, keepdim=True)
    b = b / b.norm(dim=-1, keepdim=True)
    R = alg.rotor_between(a.to(dtype), b.to(dtype))
    assert torch.isfinite(R).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    close(alg.sandwich(R, alg.vector(a.to(dtype))).double(), alg.vector(b).numpy(), tol)
    close(alg.norm(R).double(), np.ones(3), tol)


def test_rotor_between_accepts_pure_vector_multivectors_and_zero():
    alg = CliffordAlgebra(3)
    a, b = rand(0, 2, 3), rand(1, 2, 3)
    close(alg.rotor_between(alg.vector(a), alg.vector(b)), alg.rotor_between(a, b).numpy(), 0.0)
    close(alg.rotor_between(a, a), np.broadcast_to(np.eye(8)[0], (2, 8)), 1e-15)
    close(alg.rotor_between(torch.zeros(3, dtype=torch.float64), b[0]), np.eye(8)[0], 0.0)


# ---------------------------------------------------------------------------- autograd
def test_gradcheck():
    from functools import partial

    from torch.autograd import gradcheck

    check = partial(gradcheck, fast_mode=True)  # random projections of the Jacobian: seconds, not minutes
    alg3, alg4 = CliffordAlgebra(3), CliffordAlgebra(4)
    r = lambda seed, *s: rand(seed, *s).requires_grad_()  # noqa: E731
    assert check(alg3.geometric_product, (r(0, 2, 8), r(1, 8)))
    assert check(CliffordAlgebra(3, 0, 1).geometric_product, (r(0, 2, 16), r(1, 2, 16)))
    V = random_versor(alg3, 2, 2, batch=2).requires_grad_()
    assert check(alg3.sandwich, (V, r(3, 2, 8)))
    assert check(alg3.versor_matrix, (V,))
    assert check(lambda b: alg3.exp(alg3.grade(b, 2)), (r(4, 3, 8),))
    assert check(lambda b: alg4.exp(alg4.grade(b, 2)), (r(5, 2, 16),))
    assert check(lambda b: alg4.exp(alg4.grade(b, 2) * 0.01), (r(5, 2, 16),))  # Taylor branch
    assert check(alg3.rotor_between, (r(6, 4, 3), r(7, 4, 3)))
    a = rand(8, 3)
    assert check(alg3.rotor_between, ((-a + 1e-3 * rand(9, 3)).requires_grad_(), a.requires_grad_()))
    assert check(alg3.norm, (r(10, 3, 8),))


# ---------------------------------------------------------------------------- dtype / compile
def test_float32_and_tables_per_dtype():
    alg = CliffordAlgebra(3, 0, 1)
    a, b = rand(0, 10, 16), rand(1, 10, 16)
    out32 = alg.geometric_product(a.float(), b.float())
    assert out32.dtype == torch.float32
    close(out32.double(), alg.geometric_product(a, b).numpy(), 1e-5)
    assert alg.geometric_product(a.float(), b).dtype == torch.float64  # promotion
    assert {key[1] for key in alg._cache} >= {torch.float32, torch.float64}
    alg4 = CliffordAlgebra(4)
    B = alg4.grade(rand(2, 10, 16), 2)
    R = alg4.exp(B.bfloat16())  # matrix_exp has no bfloat16 kernel: computed in float32, cast back
    assert R.dtype == torch.bfloat16
    close(R.double(), alg4.exp(B).numpy(), 2e-2)


def test_compiled_equals_eager_inductor():
    """The core path through inductor (values and gradients); fullgraph: no graph breaks."""
    alg = CliffordAlgebra(3)

    def f(a, b, B):
        return alg.sandwich(alg.exp(B), alg.geometric_product(a, b))

    a, b = rand(0, 6, 8).requires_grad_(), rand(1, 6, 8)
    B = alg.grade(rand(2, 6, 8), 2)
    out = torch.compile(f, fullgraph=True)(a, b, B)
    (grad,) = torch.autograd.grad(out.sum(), a)
    close(out, f(a, b, B).detach().numpy())
    close(grad, torch.autograd.grad(f(a, b, B).sum(), a)[0].numpy())


def test_every_operation_traces_without_graph_breaks():
    """Every public operation under torch.compile(fullgraph=True) equals eager (aot_eager backend:
    the tracing and autograd of torch.compile without code generation, to stay quick)."""
    alg, alg4 = CliffordAlgebra(3), CliffordAlgebra(4)

    def f(a, b, B4):
        parts = [
            alg.outer_product(a, b),
            alg.left_contraction(a, b),
            alg.scalar_product(a, b)[..., None],
            alg.inner_product(a, b)[..., None],
            alg.reverse(a) + alg.grade_involution(b) + alg.conjugate(a) + alg.grade(b, 2),
            alg.norm(a)[..., None],
            alg.inverse(a),
            (alg.versor_matrix(a) @ b[..., None])[..., 0],
            alg.vector(alg.vector_part(a)),
            alg.rotor_between(a[..., 1:4], b[..., 1:4]),
            alg.rotor_between(a[..., 1:4], -a[..., 1:4]),  # antiparallel branch
            alg4.exp(B4)[..., :8],
        ]
        return torch.cat(parts, -1)

    a, b = rand(0, 5, 8), rand(1, 5, 8)
    B4 = alg4.grade(rand(2, 5, 16), 2)
    close(torch.compile(f, backend="aot_eager", fullgraph=True)(a, b, B4), f(a, b, B4).numpy())


# ---------------------------------------------------------------------------- bad input
def test_bad_signature():
    with pytest.raises(ValueError, match="p=-1"):
        CliffordAlgebra(-1)
    with pytest.raises(ValueError, match=r"n = p \+ q \+ r ≤ 6.*n=7"):
        CliffordAlgebra(4, 3)
    with pytest.raises(ValueError, match="n=0"):
        CliffordAlgebra(0)


def test_bad_input_raises_value_error():
    alg = CliffordAlgebra(3)
    x = torch.zeros(5, 8)
    with pytest.raises(ValueError, match=r"geometric_product: b has shape \(5, 7\), expected \(\.\.\., 8\)"):
        alg.geometric_product(x, torch.zeros(5, 7))
    with pytest.raises(ValueError, match=r"shapes \(5, 8\) and \(4, 8\) do not broadcast"):
        alg.outer_product(x, torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"sandwich: shapes \(5, 8\) and \(3, 8\) do not broadcast"):
        alg.sandwich(x, torch.zeros(3, 8))
    with pytest.raises(ValueError, match=r"exp: B of shape \(5, 8\) is not a pure bivector"):
        alg.exp(x + torch.eye(8)[1])
    with pytest.raises(ValueError, match=r"rotor_between: a of shape \(8,\) is not a pure vector"):
        alg.rotor_between(torch.eye(8)[4], torch.eye(8)[1])
    with pytest.raises(ValueError, match=r"rotor_between: b has shape \(4,\), expected \(\.\.\., 3\)"):
        alg.rotor_between(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match=r"rotor_between: shapes \(2, 3\) and \(5, 3\) do not broadcast"):
        alg.rotor_between(torch.ones(2, 3), torch.ones(5, 3))
    with pytest.raises(ValueError, match=r"grade: k must be an integer in \[0, 3\].*k=4"):
        alg.grade(x, 4)
    with pytest.raises(ValueError, match=r"vector: v has shape \(5, 8\), expected \(\.\.\., 3\)"):
        alg.vector(x)
    with pytest.raises(ValueError, match="floating-point"):
        alg.reverse(torch.zeros(8, dtype=torch.long))


@pytest.fixture(params=["native", "compiled"])
def large_batch_kernel(request, monkeypatch) -> str:
    """The kernel of the large eager batches: the native one (`geoattn.native`, where it can be built),
    or, with it switched off, the compiled per-blade expression."""
    from geoattn.algebra import kernels

    monkeypatch.setattr(kernels, "_SHARED", {})  # fresh products: what ran is this test's
    if request.param == "compiled":
        monkeypatch.setattr(kernels, "native_products", lambda x: None)
    elif native.cpu_kernels() is None:
        pytest.skip("no C++ toolchain here: the native kernels cannot be built")
    else:
        monkeypatch.setattr(kernels, "NATIVE_MIN_ROWS", 1)  # the tests' few rows take it too
    return request.param


def kernels_that_ran(products, kernel: str) -> set[str]:
    """The tables a `CompiledProducts` ran through ``kernel`` ("native" or "compiled")."""
    if kernel == "native":
        return set(products._native_entries)
    return {key.removesuffix(" (blades first)") for key in products._compiled}


def test_compiled_kernels_match_the_eager_form_values_and_gradients(monkeypatch, large_batch_kernel):
    """The large-batch path (native or compiled per-blade kernels with their own backward) against the
    eager dense-table form."""
    import geoattn.core.compile

    monkeypatch.setattr(geoattn.core.compile, "COMPILE_MIN_ELEMENTS", 1)
    fast, slow = CliffordAlgebra(2, 0, 1), CliffordAlgebra(2, 0, 1, compile=False)  # small: quick to compile
    a, b, g = rand(0, 3, 1, 8), rand(1, 4, 8), rand(2, 3, 4, 8)
    outs = []
    for alg in (fast, slow):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = alg.geometric_product(a_, b_)
        assert out.is_contiguous()  # the user's batch-major layout, not a transposed view
        grad_a, grad_b = torch.autograd.grad(out, (a_, b_), g, create_graph=True)
        (second,) = torch.autograd.grad(grad_a.pow(2).sum(), b_)  # a second derivative
        outs.append((out.detach(), grad_a.detach(), grad_b.detach(), second))
    for x, y in zip(*outs):
        close(x, y.numpy())
    ran = kernels_that_ran(fast._products, large_batch_kernel)
    # the large-batch path really ran, second derivative included
    assert {"geometric", "geometric.grad_a", "geometric.grad_b", "geometric.grad_a.grad_b"} <= ran


@pytest.mark.parametrize("signature", [(3, 0, 0), (3, 0, 1)])
def test_the_product_of_two_halves_writes_both_gradients_where_the_layer_reads_them(
    monkeypatch, large_batch_kernel, signature
):
    """`geometric_product_of_halves` of a blade-major ``h (..., 2H, dim)``: values, the gradient (one
    tensor laid out as ``h``: the native kernel writes each half's gradient into its runs) and a second
    derivative equal the eager dense-table form of the two halves' product, float64; the native path
    really ran where it is built."""
    from geoattn.algebra import kernels
    from geoattn.algebra.layout import blade_major, is_blade_major

    fast, slow = CliffordAlgebra(*signature), CliffordAlgebra(*signature, compile=False)
    torch.manual_seed(3)
    h = blade_major(torch.randn(3, 8, 2 * 5, fast.dim, dtype=torch.float64))  # 120 rows of 5 channels
    g = torch.randn(3, 8, 5, fast.dim, dtype=torch.float64)
    outs = []
    for alg in (fast, slow):

        def product(h_, alg=alg):
            if alg is fast:
                return alg.geometric_product_of_halves(h_)
            return alg.geometric_product(h_[..., :5, :], h_[..., 5:, :])

        h_ = h.clone(memory_format=torch.preserve_format).requires_grad_()
        out = product(h_)
        (grad,) = torch.autograd.grad(out, h_, g)  # a first derivative: the kernel writes it in place
        (grad_graph,) = torch.autograd.grad(product(h_), h_, g, create_graph=True)
        (second,) = torch.autograd.grad(grad_graph.pow(2).sum(), h_)
        outs.append((out.detach(), grad, grad_graph.detach(), second))
        if alg is fast and large_batch_kernel == "native":
            assert kernels.takes_halves(h_) and is_blade_major(out) and is_blade_major(grad)
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"h has shape \(3, 5, 8\)"):
        fast.geometric_product_of_halves(torch.zeros(3, 5, 8))


def test_the_native_kernel_takes_batches_from_its_minimum_rows(monkeypatch):
    """Where the native kernel is built it takes a product from `NATIVE_MIN_ROWS` rows (broadcast
    rows counted), with no compile threshold; fewer rows stay on the eager dense form. Same values."""
    from geoattn.algebra import kernels

    if native.cpu_kernels() is None:
        pytest.skip("no C++ toolchain here: the native kernels cannot be built")
    monkeypatch.setattr(kernels, "_SHARED", {})
    fast, slow = CliffordAlgebra(3), CliffordAlgebra(3, compile=False)
    rows = kernels.NATIVE_MIN_ROWS
    a, b = rand(0, 1, 8), rand(1, rows - 1, 8)
    close(fast.geometric_product(a, b), slow.geometric_product(a, b).numpy())
    assert not fast._products._native_entries  # rows − 1: the dense form
    b = rand(2, rows, 8)
    close(fast.geometric_product(a, b), slow.geometric_product(a, b).numpy())
    assert set(fast._products._native_entries) == {"geometric"}


def test_compiled_kernels_read_and_keep_a_blade_major_layout(monkeypatch, large_batch_kernel):
    """Operands stored blade by blade (`blade_major`, also a channel slice of such a tensor) take the
    blades-first kernels: the same values and gradients as the eager form, and the result stored
    blade by blade too (what the layers after it read without a copy)."""
    import geoattn.core.compile
    from geoattn.algebra.layout import blade_major

    monkeypatch.setattr(geoattn.core.compile, "COMPILE_MIN_ELEMENTS", 1)
    fast, slow = CliffordAlgebra(2, 0, 1), CliffordAlgebra(2, 0, 1, compile=False)
    h, g = blade_major(rand(0, 3, 6, 8)), blade_major(rand(1, 3, 3, 8))
    outs = []
    for alg in (fast, slow):
        h_ = h.clone(memory_format=torch.preserve_format).requires_grad_()
        a, b = h_.split(3, -2)  # channel slices: strided, still blade by blade
        out = alg.geometric_product(a, b)
        if alg is fast:
            assert out.movedim(-1, 0).is_contiguous() and not out.is_contiguous()
        (grad,) = torch.autograd.grad(out, h_, g)
        outs.append((out.detach(), grad))
    for x, y in zip(*outs):
        close(x, y.numpy())
    assert {"geometric", "geometric.grad_a"} <= kernels_that_ran(fast._products, large_batch_kernel)
    if large_batch_kernel == "compiled":
        blades_first = {"geometric (blades first)", "geometric.grad_a (blades first)"}
        assert blades_first <= set(fast._products._compiled)


@torch._dynamo.config.patch(recompile_limit=1)  # (monkeypatch would delete the setting on undo)
def test_many_algebras_and_widths_in_one_process(monkeypatch):
    """Issue #12: models of several widths and algebras built in one process. Every large product
    (rows · 4ⁿ ≥ COMPILE_MIN_ELEMENTS, forward and backward) goes through torch.compile'd per-blade kernels;
    one function shared by all tables was recompiled per table and failed at dynamo's recompile
    limit (8) on the third algebra. Here the limit is 1: any recompile (per width, per algebra
    instance, per table) makes a product give up its kernel and fails the test; the "eager" backend
    keeps dynamo's tracing and caching without code generation. Small algebras keep the tracing
    quick (9 kernels here; Cl(3,0,1) and Cl(4) differ only in the size of their tables)."""
    from geoattn.algebra import kernels

    monkeypatch.setattr(kernels, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(kernels, "_SHARED", {})  # fresh kernels, compiled with the backend above
    monkeypatch.setattr(kernels, "native_products", lambda x: None)  # the compiled kernels, not the native
    import geoattn.core.compile

    rows = geoattn.core.compile.COMPILE_MIN_ELEMENTS // 4  # every algebra here has at least 4 blades
    runs = 0
    for sig in [(2, 0, 0), (1, 0, 1), (3, 0, 0), (2, 0, 0)]:
        for width, dtype in ((1, torch.float32), (3, torch.float32)):
            fast, slow = CliffordAlgebra(*sig), CliffordAlgebra(*sig, compile=False)
            a, b = rand(runs, width, rows, fast.dim).to(dtype), rand(runs + 1, rows, fast.dim).to(dtype)
            results = []
            for alg in (fast, slow):
                a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
                out = alg.geometric_product(a_, b_)  # (width, rows, dim)
                results.append((out, *torch.autograd.grad(out.square().sum(), (a_, b_))))
            for x, y in zip(*results):  # float32: the two forms sum in different orders
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-4 if dtype == torch.float32 else 1e-12)
            runs += 1
    assert len(kernels._SHARED) == 3  # one set of kernels per signature, shared by its instances
    for products in kernels._SHARED.values():
        assert {"geometric", "geometric.grad_a", "geometric.grad_b"} <= set(products._compiled)
        assert all(kernel is not None for kernel in products._compiled.values())  # none gave up
