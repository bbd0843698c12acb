"""The factorised sandwich's plan (docs/concepts/rotors.md#the-factorised-sandwich): for a head whose pair
transform is a sandwich polynomial of degree ≤ 2 in the query direction a and the key direction b
(`Sandwich`: rotation, reflection), the constant tables that turn ``Σ_j W_ij N(a_i, b_j, v_j)`` into
per-key features, two weight GEMMs and a per-query map, with the fewest key features its rank allows.
Fitted once per algebra, head and ``inverse`` in float64 on the CPU, checked, then cached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import torch
from torch import Tensor

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.algebra.named import shared_algebra
from geoattn.attention.rotor.params import base_tables, cached, monomials, sym_pairs
from geoattn.core.compile import constant_result

# unscaled(ga, inverse, a, b, v) -> (..., dim); moved_scaled(ga, inverse, a, b, moved) -> (..., dim)
SandwichPolynomial = Callable[..., Tensor]


@dataclass(frozen=True)
class Sandwich:
    """What the factorised kernel and the reference know of a sandwich head (one per head kind, held
    by its registry entry through the kernels made from it).

    Fields:
        name: the plan cache's key (the head's name).
        sign: ``d = 1 + sign · ⟨a, b⟩``, the pair's normaliser (`geoattn.attention.rotor.params.pair_scale`).
        unscaled: the unscaled sandwich ``N(a, b, v)`` for vectors a, b and multivectors v, all
            ``(..., dim)`` (broadcast), of degree ≤ 2 in a and in b; ``inverse`` swaps its direction.
        moved_scaled: the part of N on the blades the versor moves that is d times a function of low
            degree, ``N = d · G + rest`` (:func:`_scaled_part`), as G; None: all of it stays in the rest.
    """

    name: str
    sign: float
    unscaled: SandwichPolynomial
    moved_scaled: SandwichPolynomial | None = None

    def __post_init__(self):
        _FORMS[self.name] = self  # `_plan_tables` is a constant of plain values: it finds the form by name


_FORMS: dict[str, Sandwich] = {}


class Plan(NamedTuple):
    """The rotation / reflection sum as two groups of key features (see :func:`sandwich_plan`).

    ``keys_w (P, dim, r_w)``, ``keys_d (P, dim, r_d)``: a key's features ``φ(b) ⊗ v → (r,)`` per value
    channel, aggregated with the weights ``W`` and ``W ⊙ d`` respectively; ``queries (P, r_w + r_d, dim)``:
    ``ψ(a_i) @ queries`` maps a query's aggregated features (the two groups concatenated) to its output
    (the 1/2 of :func:`pair_scale` folded in); ``sign``: d = 1 + sign · ⟨a, b⟩.
    """

    keys_w: Tensor
    keys_d: Tensor
    queries: Tensor
    sign: float


def signed_lift(algebra: CliffordAlgebra, sign: float, device, dtype) -> tuple[Tensor, Tensor]:
    """``(c (1 + n,), f (n, 1 + n))`` with ``c + a @ f = [1, sign · metric · a]`` (:func:`affine`)."""

    def build() -> tuple[Tensor, Tensor]:
        n = algebra.n
        c = torch.zeros(1 + n, dtype=torch.float64)
        c[0] = 1
        f = torch.zeros(n, 1 + n, dtype=torch.float64)
        f[range(n), range(1, 1 + n)] = sign * base_tables(algebra)["metric"]
        return c.to(device, dtype), f.to(device, dtype)

    return cached(algebra, ("signed lift", sign, device, dtype), build)


def _scaled_part(ga: CliffordAlgebra, form: Sandwich, inverse: bool, a, b, v) -> Tensor:
    """The part of the unscaled sandwich N that is ``d`` times a function of low degree, ``N = d · G + rest``
    with ``d = 1 + sign ⟨a, b⟩`` (unit a, b), returned as G.

    The blades a versor only scales (scalar, pseudoscalar: they commute with every even versor):
    ``N(e_A) = d · 2λ_A e_A``, read off one pair with d = 2. The blades it moves: the form's
    ``moved_scaled`` (rotation: with ``B = b ∧ a``, ``N = (1 + c)(2 c v + [B, v]) + rest`` where, in Cl(3),
    ``rest = 2 k (k · v)`` for ``k`` the dual of B, Rodrigues' ``k kᵀ`` term), or none (reflection).
    """
    passive = base_tables(ga)["scaled"].to(a.dtype)
    # N(e_A) / d is the same for every pair: read it off one with d = 2 (e = b = ±a, a non-null axis)
    e = ga.vector(torch.eye(ga.n, dtype=a.dtype)[ga.signature.index(1)])
    g = form.unscaled(ga, inverse, e, form.sign * e, v * passive) / 2
    g = g.expand(torch.broadcast_shapes(a.shape, b.shape, v.shape))
    if form.moved_scaled is not None:
        g = g + form.moved_scaled(ga, inverse, a, b, v * (1 - passive))
    return g


def _directions_drawn(
    ga: CliffordAlgebra, count: int, generator: torch.Generator, unit: bool = True
) -> Tensor:
    """``(count, n)`` random vectors; ``unit``: directions as :func:`directions` makes them (``a² = 1``;
    in PGA the degenerate coordinate is free)."""
    x = torch.randn(count, ga.n, dtype=torch.float64, generator=generator)
    if not unit:
        return x
    return x / (x * x * base_tables(ga)["metric"]).sum(-1, keepdim=True).sqrt()


def _low_rank(
    values: Tensor, a: Tensor, b: Tensor, ga: CliffordAlgebra, sphere: bool
) -> tuple[Tensor, Tensor]:
    """Fewest key features for a polynomial known on a grid of directions, with exact tables.

    ``values (S, S, dim, dim)``: ``f(a_i, b_j, e_in)_out`` for directions ``a, b (S, n)`` (unit ones
    where ``sphere``), f of degree ≤ 2 in a and in b. Returns ``(keys (P, dim, r), queries (P, r, dim))``
    with ``f(a, b, v) = Σ_r (ψ(a) @ queries)_r (φ(b) ⊗ v @ keys)_r`` (on the sphere where ``sphere``).

    In a basis of the polynomials (the monomials; on the sphere :func:`_sphere_basis`) f has one
    coefficient table T of small rationals (the Cayley table's entries, halves, thirds), which the
    least-squares fit recovers to rounding and :func:`_rationals` restores exactly. The fewest key
    features are r independent columns of T (r = its rank), every other column a rational
    combination of them: the tables are exact (but for the float64 rounding of thirds), so a pair in
    the guard band (divided by sqrt(eps)) is as exact as with the polynomial's own integer table.
    """
    dim = ga.dim
    P = 1 + ga.n + len(sym_pairs(ga.n))
    basis = _sphere_basis(ga) if sphere else torch.eye(P, dtype=torch.float64)  # (P', P)
    Pr = basis.shape[0]
    ea, eb = monomials(a) @ basis.T, monomials(b) @ basis.T
    T = torch.einsum("qi,ijxy,pj->qypx", torch.linalg.pinv(ea), values, torch.linalg.pinv(eb))
    X = _rationals(T.reshape(Pr * dim, Pr * dim))  # ((q, out), (p, in))
    cols = _independent_columns(X)
    coeffs = _rationals(torch.linalg.lstsq(X[:, cols], X).solution)  # (r, (p, in))
    if X.numel() and (X[:, cols] @ coeffs - X).abs().max() > 1e-12:
        raise RuntimeError("rotor_attention: the factorised table's columns have no rational basis")
    r = len(cols)
    keys = torch.einsum("kp,kxr->pxr", basis, coeffs.T.reshape(Pr, dim, r))
    queries = torch.einsum("kp,kyr->pry", basis, X[:, cols].reshape(Pr, dim, r))
    return keys, queries


def _sphere_basis(ga: CliffordAlgebra) -> Tensor:
    """``(P − 1, P)``: a basis of the polynomials of degree ≤ 2 on the directions' sphere, as rows of
    monomial coefficients: the monomials, with the squares of the m non-null axes made traceless
    (``b_l² − Σ_s b_s² / m``, the last one left out: they sum to 0). Traceless, so the representative
    it picks off the sphere is O(n)-covariant: float rounding of ``|b|² = 1`` breaks no symmetry."""
    n = ga.n
    pairs = sym_pairs(n)
    P = 1 + n + len(pairs)
    unit = [l for l in range(n) if ga.signature[l] == 1]
    square = {l: 1 + n + pairs.index((l, l)) for l in range(n)}
    rows = []
    for p in range(P):
        row = torch.zeros(P, dtype=torch.float64)
        row[p] = 1
        axis = next((l for l in unit if square[l] == p), None)
        if axis == unit[-1]:
            continue
        if axis is not None:
            row[[square[s] for s in unit]] -= 1 / len(unit)
        rows.append(row)
    return torch.stack(rows)


def _independent_columns(X: Tensor) -> list[int]:
    """Indices of a maximal set of linearly independent columns of X (greedy, in order)."""
    cols: list[int] = []
    basis = X.new_zeros(X.shape[0], 0)
    for j in range(X.shape[1]):
        x = X[:, j]
        residual = x - basis @ (basis.T @ x)
        if residual.norm() > _RANK_TOL * max(1.0, x.norm().item()):
            cols.append(j)
            basis = torch.cat([basis, (residual / residual.norm())[:, None]], 1)
    return cols


def _rationals(x: Tensor) -> Tensor:
    """x with each entry replaced by the nearest fraction of denominator ≤ 64 where that is within
    1e-9 of it; a RuntimeError where it is not (the tables' coefficients are small rationals)."""
    exact = torch.tensor(
        [float(Fraction(v).limit_denominator(64)) for v in x.flatten().tolist()], dtype=x.dtype
    ).view(x.shape)
    if x.numel() and (exact - x).abs().max() > 1e-9:
        raise RuntimeError("rotor_attention: the factorised table's coefficients are not small rationals")
    return exact


_RANK_TOL = 1e-9  # residuals below this fraction of a column are rounding (the tables are O(1))


_PLAN_SAMPLES = 3  # directions per monomial in the fit (the fit is exact for any count ≥ P)


def sandwich_plan(algebra: CliffordAlgebra, form: Sandwich, inverse: bool) -> Plan:
    """The factorised rotation / reflection sum with the fewest key features (float64, CPU).

    ``N = d · G + rest`` (:func:`_scaled_part`), so with ``W_ij = α_ij / max(d_ij, g)`` the output
    ``Σ_j W_ij N_ij / 2`` is ``Σ_j W_ij rest_ij / 2 + Σ_j (W_ij d_ij) G_ij / 2``: the guard acts on the
    pair exactly as on N. G is the polynomial itself; the rest too, unless on unit directions (the
    only ones :func:`directions` makes, but for vector parts below NORM_EPS) it needs fewer key
    features (:func:`_low_rank`). Cl(3): rotation 16 (on the sphere; 28 as the polynomial) + 14,
    reflection 20 + 2 (the polynomial, so ``N(a, a, v) = 0`` for any |a| and float rounding of the
    norms does not leak into the guard band). Fitted on random directions, checked on fresh unit ones.
    """
    # the shared twin that never compiles: the fit's products are one-off float64 calls
    ga = shared_algebra(algebra.p, algebra.q, algebra.r, compile=False)
    P = len(sym_pairs(ga.n)) + ga.n + 1
    generator = torch.Generator().manual_seed(0)
    sign = form.sign
    metric, active = base_tables(ga)["metric"], 1 - base_tables(ga)["scaled"]

    def fit(part: str, sphere: bool) -> tuple[Tensor, Tensor]:
        S = _PLAN_SAMPLES * P
        a, b = (_directions_drawn(ga, S, generator, sphere) for _ in range(2))
        A, Bv = ga.vector(a)[:, None, None], ga.vector(b)[None, :, None]
        v = torch.eye(ga.dim, dtype=torch.float64)  # every (a_i, b_j, e_in): (S, S, dim, dim)
        if part == "scaled":
            values = _scaled_part(ga, form, inverse, A, Bv, v)
        else:  # the moved blades' rest (the scaled ones are all in G)
            d = (1 + sign * (a @ (b * metric).T))[..., None, None]
            moved = v * active
            values = form.unscaled(ga, inverse, A, Bv, moved)
            values = values - d * _scaled_part(ga, form, inverse, A, Bv, moved)
        return _low_rank(values, a, b, ga, sphere)

    keys_d, queries_d = fit("scaled", sphere=False)
    keys_w, queries_w = min(fit("rest", sphere=False), fit("rest", sphere=True), key=lambda t: t[0].shape[-1])
    plan = Plan(keys_w, keys_d, 0.5 * torch.cat([queries_w, queries_d], 1), sign)
    _check_plan(plan, ga, form, inverse, generator)
    return plan


_PLAN_TABLES: dict[tuple, tuple] = {}


@constant_result  # inside a caller's torch.compile: run, not traced
def _plan_tables(p: int, q: int, r: int, name: str, inverse: bool) -> tuple:
    """:func:`sandwich_plan` of ``Cl(p, q, r)`` for the form ``name`` as plain values:
    ``((shape, values),) * 3 + (sign,)``."""
    key = (p, q, r, name, inverse)
    if key not in _PLAN_TABLES:
        plan = sandwich_plan(shared_algebra(p, q, r, compile=False), _FORMS[name], inverse)
        _PLAN_TABLES[key] = (*((tuple(t.shape), tuple(t.flatten().tolist())) for t in plan[:3]), plan.sign)
    return _PLAN_TABLES[key]


def plan_on(algebra, form: Sandwich, inverse, device, dtype) -> Plan:
    """:func:`sandwich_plan` on one device and dtype (made once)."""

    def build():
        *tables, sign = _plan_tables(algebra.p, algebra.q, algebra.r, form.name, inverse)
        keys_w, keys_d, queries = (
            torch.tensor(values, dtype=torch.float64).view(shape).to(device, dtype)
            for shape, values in tables
        )
        return Plan(keys_w, keys_d, queries, sign)

    return cached(algebra, ("plan", form.name, inverse, device, dtype), build)


def _check_plan(plan: Plan, ga, form: Sandwich, inverse, generator) -> None:
    """The plan against the sandwich itself on fresh unit directions (a wrong fit fails loudly)."""
    a, b = _directions_drawn(ga, 16, generator), _directions_drawn(ga, 16, generator)
    v = torch.randn(16, ga.dim, dtype=torch.float64, generator=generator)
    A, Bv = ga.vector(a), ga.vector(b)
    d = 1 + plan.sign * ga.scalar_product(A, Bv)
    want = form.unscaled(ga, inverse, A, Bv, v) / 2  # the pair's output times d
    feats = [torch.einsum("np,nx,pxr->nr", monomials(b), v, t) for t in (plan.keys_w, plan.keys_d)]
    agg = torch.cat([feats[0], feats[1] * d[:, None]], -1)
    got = torch.einsum("nr,nry->ny", agg, torch.einsum("np,pry->nry", monomials(a), plan.queries))
    err = (got - want).abs().max().item()
    if not err < 1e-10:
        raise RuntimeError(f"rotor_attention: the factorised {form.name} table is off by {err:.2e} ({ga!r})")
