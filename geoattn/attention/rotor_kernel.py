"""Rotor attention (docs/concepts/rotors.md): attention whose values are moved by a per-pair versor.

Shapes: ``q, k`` are ``(B, H, N, C, dim)`` multivectors, ``v`` is ``(B, H, N, Cv, dim)``, the output is
``(B, H, N, Cv, dim)``; ``dim = algebra.dim``, ``n = algebra.n``.

Weights (every head type): ``α_ij = softmax_j(Σ_c ⟨reverse(q_ic) k_jc⟩₀ / sqrt(C · dim))``, GATr's
invariant inner product summed over channels. Directions: ``a_i = normalize(Σ_c vector_part(q_ic))``,
``b_j`` likewise from k, normalised in the algebra's metric (``a² = 1``; in PGA the degenerate ``e0``
coordinate does not count, so the construction stays E(3)-equivariant).

Head types, ``o_i = Σ_j α_ij T_ij(v_j)``:

* ``rotation``: ``T = R v R̃`` with ``R = (1 + b a) / sqrt(2(1 + ⟨a, b⟩))``, the rotor with ``R a R̃ = b``
  (the seed's query → key convention); ``inverse=True`` uses ``R = (1 + a b)/...`` (key → query).
* ``reflection``: ``T = n v̂ n`` with ``n = (a − b) / |a − b|`` (v̂ = grade involution): the reflection
  that maps a to b (and b to a, so ``inverse`` changes nothing).
* ``projection``: ``T = (v ⌋ b) b⁻¹``, the projection onto the line of b (keeps the scalar part and the
  component of the vector part along b; higher grades contract to 0). It does not involve a.
* ``frame`` (our extension, docs/concepts/rotors.md#frame-transport; Cl(3) only, C ≥ 2): each token carries
  the orthonormal frame ``x = normalize(vec c0)``, ``y = normalize(vec c1 − ⟨vec c1, x⟩ x)``, ``z = x × y``;
  ``T = R v R̃`` with R the rotor taking the key's frame to the query's. O(3)-equivariant, not only SO(3):
  a reflection g flips z in *both* frames, so ``F_i F̃_j`` is conjugated by g (tested).

Aggregation (``aggregation=``, rotation heads): ``"sum"`` is the sum above. ``"compose"`` is the
seed's composition of fractional rotors ``R_i1^{α_i1} R_i2^{α_i2} ⋯`` (docs/concepts/rotors.md#compose), made
order-free as the weighted mean in the Lie algebra::

    R̄_i = exp(½ Σ_j α_ij θ_ij B̂_ij),   out_i = R̄_i (Σ_j α_ij v_j) R̄_i~,

with ``R_ij = exp(½ θ_ij B̂_ij)`` the pair rotor above (θ_ij the angle from a_i to b_j, ``B̂_ij`` the unit
bivector of ``b_j ∧ a_i``; ``inverse=True``: the key → query rotors, so the mean bivector changes sign).
Equivariance: a global versor S moves every direction, ``a_i → S a_i S⁻¹`` (for odd S with the sign
of the grade involution), leaves every ``⟨a_i, b_j⟩``, θ_ij and α_ij unchanged and conjugates every
``b_j ∧ a_i``, so the mean bivector, R̄_i (exp commutes with conjugation) and the output transform by S
(tested for rotations and reflections). When the pair rotors of a query commute (one plane) R̄_i is
their ordered product; when they don't, the two differ by BCH's commutator term, ``½ Σ_{j<l}
[X_j, X_l]`` with ``X_j = ½ α_ij θ_ij B̂_ij`` to second order. Measured for random directions and
softmax weights of unit-variance logits (2000 queries; recomputed by
``test_compose_against_the_ordered_product_of_fractional_rotors``): the rotation between
``∏_j R_ij^{α_ij}`` (in key order) and R̄_i turns by a median 5.3° (90 %: 17.8°) for 2 keys, 3.5°
(10.7°) for 8, 0.8° (2.4°) for 64, while R̄_i itself turns by a median 69°, 40°, 15°.
Cheap: ``θ B̂ = f(⟨a, b⟩) (b ∧ a)`` with ``f(c) = arccos(c) / sqrt(1 − c²)`` (:func:`rotor_log_scale`), so
``Σ_j α_ij θ_ij B̂_ij = (Σ_j α_ij f_ij b_j) ∧ a_i``: an attention-shaped sum of key vectors with
weights ``α_ij f_ij`` (f depends on the pair, so it is computed on the N×N scalar tiles), one wedge
and one closed-form exp per query (the mean is a simple bivector).

Antiparallel guard (both backends): the rotor's normaliser ``1 / (2(1 + ⟨a, b⟩))`` uses
``max(1 + ⟨a, b⟩, g)`` (reflection: ``max(1 − ⟨a, b⟩, g)``), g = :func:`guard_eps` (:func:`pair_scale`).
At exactly antiparallel a, b the unnormalised rotor ``1 + b a`` is 0, so the pair contributes 0 (the
limit of the guarded expression), with finite values and gradients; within the guard band
(angle within ~sqrt(2g) of π) the pair's contribution fades to 0 smoothly. The same holds for
``a = b`` in the reflection head. A zero vector part gives the direction 0 (rotation: ``R = 1/√2``)
in the reference; the factorised rotation and reflection sums use ``|a| = |b| = 1`` (the scaled
blades, and the rotation's rest on the sphere), so for a vector part below NORM_EPS they differ from
the reference: a measure-zero case.
Compose: f is guarded the same way (:func:`rotor_log_scale`): the pair's rotation fades to 0 at
antiparallel directions, where its plane is undefined (its value still counts in the mean value).

Precision: the factorised sum's rounding error on a pair is ~ eps / (1 ± ⟨a, b⟩) of its value (terms
of size 1 cancel to a result of size 1 ± ⟨a, b⟩ before the division), hence the guard g = sqrt(eps).
Near-antiparallel pairs are ill-conditioned in any form (the rotor's plane is barely defined there).

Backends:

* ``reference``: the naive pairwise form, the oracle: N×N rotors / normals (compose: N×N pair
  bivectors ``θ_ij B̂_ij``) built with the algebra engine's products, each value sandwiched (pair tiles
  only bound the memory).
* ``auto``: exact factorised forms. Rotation and reflection (docs/concepts/rotors.md#the-factorised-sandwich):
  the unscaled sandwich N (``(1 + b a) v (1 + a b)``, ``(a − b) v̂ (a − b)``) is a polynomial of degree ≤ 2 in
  a and in b, so ``o_i = Σ_r (ψ(a_i) @ Q)_r Σ_j W_ij (φ(b_j) ⊗ v_j @ K)_r`` with monomials ``φ(b) = [1, b_l,
  b_l b_m (l ≤ m)]`` (1 + 3 + 6 = 10 in 3D), ``W_ij = α_ij · pair_scale(⟨a_i, b_j⟩)`` and constant tables K, Q
  (:func:`_sandwich_plan`). With ``d = 1 ± ⟨a, b⟩`` the sandwich splits as ``N = d G + rest``: the
  scalar and the pseudoscalar are only scaled by a versor (``N = 2 d e_A``), and the rotation's
  moved blades give ``G = 2⟨a, b⟩ v + [b ∧ a, v]`` and, in Cl(3), ``rest = 2 k (k · v)`` with k the
  dual of ``b ∧ a`` (Rodrigues' ``k kᵀ`` term); G is aggregated with the weights ``W ⊙ d``. Each part
  takes as few key features as its rank allows (on the unit sphere of directions, where that is
  fewer): Cl(3) rotation 16 + 14 features per value channel, reflection 20 + 2, where the plain
  monomial products took 62 (PGA rotation 88 instead of 212). Per query chunk
  (:func:`_query_blocks`): the logits GEMM, ``⟨a_i, b_j⟩``, softmax and weights, the two weight GEMMs
  with the key features, then the small per-query contraction. Compose: the
  same chunks with ``α @ v`` and ``(α f) @ b``. Chunks large enough run their softmax / guard / weight
  work as one ``torch.compile``d kernel between the GEMMs (:class:`_BlockKernel`; off with
  ``CliffordAlgebra(compile=False)``). Memory O(chunk · N) per (B, H), never an N×N×dim tensor; with
  gradients and several chunks, each chunk is recomputed in the backward (activation checkpointing),
  so training memory is O(N) too; compose's compiled chunks have a backward of their own instead
  (:class:`_ComposeFunction`: flash attention's scheme, α recomputed from a log-sum-exp per query).
  Projection and frame factorise completely into per-key transforms
  around plain attention (``scaled_dot_product_attention``) and, for frame, per-query transforms.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from geoattn import native
from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.algebra.named import shared_algebra
from geoattn.attention.dtypes import outside_autocast
from geoattn.attention.rotor_heads import HEADS, HeadType, check_head_types, register_head_type
from geoattn.compile import constant_result, own_code, worth_compiling
from geoattn.gradients import dense_grad, torch_form_grads

_T = TypeVar("_T")
BACKENDS = ("auto", "reference")

NORM_EPS = 1e-12  # lower bound of |Σ_c vector part| when normalising directions
_AUTO_CHUNK_ELEMENTS = 1 << 21  # B·H·chunk·N logits per query chunk (8 MiB in float32)
# rows (B·H·pairs·channels) per engine call in the reference: bounds its memory (the engine runs calls
# of ≥ 32768 rows through its compiled kernel, far cheaper than many small eager calls)
_REFERENCE_ROWS = 1 << 18


@outside_autocast
def rotor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    algebra: CliffordAlgebra,
    head_type: str = "rotation",
    causal: bool = False,
    backend: str = "auto",
    inverse: bool = False,
    key_mask: Tensor | None = None,
    chunk_size: int | None = None,
    aggregation: str = "sum",
) -> Tensor:
    """Rotor attention over multivector channels (docs/concepts/rotors.md#the-functional-contract).

    Args:
        q, k: ``(B, H, N, C, dim)`` multivectors; v: ``(B, H, N, Cv, dim)``.
        algebra: the :class:`CliffordAlgebra` the multivectors live in (``dim == algebra.dim``).
        head_type: ``"rotation" | "reflection" | "projection" | "frame"`` (see the module docstring),
            or any type registered in ``geoattn.attention.rotor_heads``.
        causal: attend to keys ``j ≤ i`` only.
        backend: ``"auto"`` (fast exact factorised form) or ``"reference"`` (naive pairwise oracle).
        inverse: rotation head only: use the key → query rotor ``(1 + a b)/sqrt(2(1 + ⟨a, b⟩))``
            instead of the query → key one (reflection: accepted, identical; others: ValueError).
        key_mask: optional ``(B, N)`` bool, True for keys that may be attended to (padding mask).
        chunk_size: queries per block on the ``auto`` rotation / reflection path (default: sized so a
            block's logits hold ~4 M numbers); any value gives the same result.
        aggregation: ``"sum"`` (``Σ_j α_ij R_ij v_j R̃_ij``) or, rotation heads only, ``"compose"``
            (one mean rotor per query, docs/concepts/rotors.md#compose; see the module docstring).

    Returns:
        ``(B, H, N, Cv, dim)``, dtype of v.
    """
    _check_inputs(q, k, v, algebra, head_type, backend, inverse, key_mask, chunk_size, aggregation)
    out_dtype = v.dtype
    # low-precision inputs are computed in float32: 1 + ⟨a, b⟩ cancels catastrophically in bf16
    dtype = torch.promote_types(
        torch.promote_types(q.dtype, k.dtype), torch.promote_types(v.dtype, torch.float32)
    )
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    head = HEADS[head_type]
    kernel, reference = head.compose if aggregation == "compose" else (head.kernel, head.reference)
    if backend == "reference" and reference is not None:
        kernel = reference
    out = kernel(q, k, v, algebra, causal=causal, inverse=inverse, key_mask=key_mask, chunk_size=chunk_size)
    # the kernels' batched products want a dense gradient; `out.sum().backward()` sends an expanded one
    return dense_grad(out).to(out_dtype)


# ---------------------------------------------------------------------------------------------- checks
def _check_inputs(q, k, v, algebra, head_type, backend, inverse, key_mask, chunk_size, aggregation) -> None:
    if not isinstance(algebra, CliffordAlgebra):
        raise ValueError(f"rotor_attention: algebra must be a CliffordAlgebra, got {type(algebra).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"rotor_attention: unknown backend {backend!r}, expected one of {BACKENDS}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 5:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"rotor_attention: {name} has shape {shape}, expected (B, H, N, C, dim)")
        if x.shape[-1] != algebra.dim:
            raise ValueError(
                f"rotor_attention: {name} has shape {tuple(x.shape)}: last dim {x.shape[-1]} does not match "
                f"algebra.dim = {algebra.dim} of {algebra!r}"
            )
        if not x.is_floating_point():
            raise ValueError(f"rotor_attention: {name} must be floating point, got {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(
            f"rotor_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"rotor_attention: v {tuple(v.shape)} must share (B, H, N) = {tuple(k.shape[:3])} with k"
        )
    check_head_types(
        "rotor_attention",
        (head_type,),
        (algebra.p, algebra.q, algebra.r),
        q.shape[3],
        algebra=repr(algebra),
        aggregation=aggregation,
        inverse=inverse,
    )
    if key_mask is not None and (
        key_mask.dtype != torch.bool or tuple(key_mask.shape) != (q.shape[0], q.shape[2])
    ):
        raise ValueError(
            f"rotor_attention: key_mask must be a bool tensor of shape (B, N) = {(q.shape[0], q.shape[2])}, "
            f"got {key_mask.dtype} {tuple(key_mask.shape)}"
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"rotor_attention: chunk_size must be a positive int, got {chunk_size!r}")


# ------------------------------------------------------------------------- shared parameterisation
_CACHE: dict[tuple, object] = {}


def _cached(algebra: CliffordAlgebra | None, key: tuple, build: Callable[[], _T]) -> _T:
    """A constant derived from the algebra's tables (or, with ``algebra=None``, from ``key`` alone),
    built once per signature and ``key``.

    Inside a torch.compile trace a missing entry is built without caching (a traced tensor must not
    leak into the cache); the graph then holds the construction.
    """
    full = (algebra.p, algebra.q, algebra.r, *key) if algebra is not None else key
    if full in _CACHE:
        return _CACHE[full]
    value = build()
    if not torch.compiler.is_compiling():
        _CACHE[full] = value
    return value


def _base_tables(algebra: CliffordAlgebra) -> dict[str, Tensor]:
    """The algebra's tables in the kernels' row-vector convention ``y = x @ M`` (float64, CPU).

    ``logit``: ``(dim,)`` ⟨ẽ_A e_A⟩₀; ``metric``: ``(n,)`` e_k²; ``scaled``: ``(dim,)`` 1 on the blades a
    versor only scales (scalar, pseudoscalar), 0 on those it moves; ``vector``: ``(dim, n)``, ``x @ vector``
    is the vector part's coordinates.
    """

    def build() -> dict[str, Tensor]:
        metric = algebra.invariant_metric
        scaled = torch.zeros(algebra.dim, dtype=torch.float64)
        scaled[[*algebra.grade_indices[0], *algebra.grade_indices[algebra.n]]] = 1
        vectors = list(algebra.vector_indices)
        vector = torch.zeros(algebra.dim, algebra.n, dtype=torch.float64)
        vector[vectors, range(algebra.n)] = 1
        return {"logit": metric, "metric": metric[vectors], "scaled": scaled, "vector": vector}

    return _cached(algebra, ("base",), build)


def _tables(algebra: CliffordAlgebra, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """:func:`_base_tables` on one device and dtype (made once)."""
    return _cached(
        algebra,
        ("base", device, dtype),
        lambda: {k: v.to(device, dtype) for k, v in _base_tables(algebra).items()},
    )


def _sym_pairs(n: int) -> list[tuple[int, int]]:
    return [(l, m) for l in range(n) for m in range(l, n)]


def monomials(x: Tensor) -> Tensor:
    """``[1, x_l, x_l x_m (l ≤ m)]``: ``(..., n)`` → ``(..., P)``, P = 1 + n + n(n+1)/2.

    As ``(c₁ + x F₁) ⊙ (c₂ + x F₂)`` with 0/1 tables (:func:`_monomial_tables`): the first factor reads
    ``[1, x, x_l]``, the second ``[1, 1, x_m]``, exact (each entry one product by 1, the rest exact zeros),
    two GEMMs and a product where gathers and a concatenation cost scatters in the backward."""
    c1, f1, c2, f2 = _monomial_tables(x.shape[-1], x.device, x.dtype)
    return _affine(x, c1, f1) * _affine(x, c2, f2)


def _affine(x: Tensor, c: Tensor, f: Tensor) -> Tensor:
    """``c + x @ f`` as one GEMM: ``x (..., n)``, ``c (m,)``, ``f (n, m)`` → ``(..., m)``."""
    return torch.addmm(c, x.reshape(-1, x.shape[-1]), f).view(*x.shape[:-1], len(c))


def _signed_lift(algebra: CliffordAlgebra, sign: float, device, dtype) -> tuple[Tensor, Tensor]:
    """``(c (1 + n,), f (n, 1 + n))`` with ``c + a @ f = [1, sign · metric · a]`` (:func:`_affine`)."""

    def build() -> tuple[Tensor, Tensor]:
        n = algebra.n
        c = torch.zeros(1 + n, dtype=torch.float64)
        c[0] = 1
        f = torch.zeros(n, 1 + n, dtype=torch.float64)
        f[range(n), range(1, 1 + n)] = sign * _base_tables(algebra)["metric"]
        return c.to(device, dtype), f.to(device, dtype)

    return _cached(algebra, ("signed lift", sign, device, dtype), build)


def _monomial_tables(n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """``(c₁ (P,), F₁ (n, P), c₂ (P,), F₂ (n, P))`` of :func:`monomials` (made once)."""

    def build() -> tuple[Tensor, ...]:
        pairs = _sym_pairs(n)
        P = 1 + n + len(pairs)
        c1, c2 = torch.zeros(P, dtype=torch.float64), torch.zeros(P, dtype=torch.float64)
        f1, f2 = torch.zeros(n, P, dtype=torch.float64), torch.zeros(n, P, dtype=torch.float64)
        c1[0] = c2[: 1 + n] = 1
        f1[range(n), range(1, 1 + n)] = 1
        for col, (l, m) in enumerate(pairs, start=1 + n):
            f1[l, col] = f2[m, col] = 1
        return tuple(t.to(device, dtype) for t in (c1, f1, c2, f2))

    return _cached(None, ("monomials", n, device, dtype), build)


class _Plan(NamedTuple):
    """The rotation / reflection sum as two groups of key features (see :func:`_sandwich_plan`).

    ``keys_w (P, dim, r_w)``, ``keys_d (P, dim, r_d)``: a key's features ``φ(b) ⊗ v → (r,)`` per value
    channel, aggregated with the weights ``W`` and ``W ⊙ d`` respectively; ``queries (P, r_w + r_d, dim)``:
    ``ψ(a_i) @ queries`` maps a query's aggregated features (the two groups concatenated) to its output
    (the 1/2 of :func:`pair_scale` folded in); ``sign``: d = 1 + sign · ⟨a, b⟩.
    """

    keys_w: Tensor
    keys_d: Tensor
    queries: Tensor
    sign: float


def _unscaled_sandwich(ga: CliffordAlgebra, head_type: str, inverse: bool, a, b, v) -> Tensor:
    """``(1 + b a) v (1 + a b)`` (rotation; inverse: a and b swapped) or ``(a − b) v̂ (a − b)``
    (reflection) for vectors a, b and multivectors v, all ``(..., dim)`` (broadcast)."""
    gp = ga.geometric_product
    if head_type == "reflection":
        n = a - b
        return gp(gp(n, ga.grade_involution(v)), n)
    one = torch.zeros(ga.dim, dtype=a.dtype)
    one[ga.blade_index("")] = 1
    left, right = (one + gp(a, b), one + gp(b, a)) if inverse else (one + gp(b, a), one + gp(a, b))
    return gp(gp(left, v), right)


def _scaled_part(ga: CliffordAlgebra, head_type: str, inverse: bool, a, b, v) -> Tensor:
    """The part of the unscaled sandwich N that is ``d`` times a function of low degree, ``N = d · G + rest``
    with ``d = 1 ± ⟨a, b⟩`` (unit a, b), returned as G.

    The blades a versor only scales (scalar, pseudoscalar: they commute with every even versor):
    ``N(e_A) = d · 2λ_A e_A``. Rotation, the blades it moves: with ``B = b ∧ a`` (``1 + b a = (1 + c) + B``,
    c = ⟨a, b⟩), ``N = (1 + c)(2 c v + [B, v]) + rest`` where, in Cl(3), ``rest = 2 k (k · v)`` for
    ``k`` the dual of B (Rodrigues' ``k kᵀ`` term): 12 + 16 features per value channel instead of the
    42 of N itself on the sphere. Reflection: the moved blades stay in the rest (N has 20 there).
    """
    passive = _base_tables(ga)["scaled"].to(a.dtype)
    # N(e_A) / d is the same for every pair: read it off one with d = 2 (e = b = ±a, a non-null axis)
    e = ga.vector(torch.eye(ga.n, dtype=a.dtype)[ga.signature.index(1)])
    g = _unscaled_sandwich(ga, head_type, inverse, e, e if head_type == "rotation" else -e, v * passive) / 2
    g = g.expand(torch.broadcast_shapes(a.shape, b.shape, v.shape))
    if head_type == "rotation":
        B = ga.outer_product(b, a) * (-1 if inverse else 1)
        moved = v * (1 - passive)
        c = ga.scalar_product(a, b)[..., None]
        g = g + 2 * c * moved + ga.geometric_product(B, moved) - ga.geometric_product(moved, B)
    return g


def _directions_drawn(
    ga: CliffordAlgebra, count: int, generator: torch.Generator, unit: bool = True
) -> Tensor:
    """``(count, n)`` random vectors; ``unit``: directions as :func:`directions` makes them (``a² = 1``;
    in PGA the degenerate coordinate is free)."""
    x = torch.randn(count, ga.n, dtype=torch.float64, generator=generator)
    if not unit:
        return x
    return x / (x * x * _base_tables(ga)["metric"]).sum(-1, keepdim=True).sqrt()


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
    P = 1 + ga.n + len(_sym_pairs(ga.n))
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
    pairs = _sym_pairs(n)
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


def _sandwich_plan(algebra: CliffordAlgebra, head_type: str, inverse: bool) -> _Plan:
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
    P = len(_sym_pairs(ga.n)) + ga.n + 1
    generator = torch.Generator().manual_seed(0)
    sign = 1.0 if head_type == "rotation" else -1.0
    metric, active = _base_tables(ga)["metric"], 1 - _base_tables(ga)["scaled"]

    def fit(part: str, sphere: bool) -> tuple[Tensor, Tensor]:
        S = _PLAN_SAMPLES * P
        a, b = (_directions_drawn(ga, S, generator, sphere) for _ in range(2))
        A, Bv = ga.vector(a)[:, None, None], ga.vector(b)[None, :, None]
        v = torch.eye(ga.dim, dtype=torch.float64)  # every (a_i, b_j, e_in): (S, S, dim, dim)
        if part == "scaled":
            values = _scaled_part(ga, head_type, inverse, A, Bv, v)
        else:  # the moved blades' rest (the scaled ones are all in G)
            d = (1 + sign * (a @ (b * metric).T))[..., None, None]
            moved = v * active
            values = _unscaled_sandwich(ga, head_type, inverse, A, Bv, moved)
            values = values - d * _scaled_part(ga, head_type, inverse, A, Bv, moved)
        return _low_rank(values, a, b, ga, sphere)

    keys_d, queries_d = fit("scaled", sphere=False)
    keys_w, queries_w = min(fit("rest", sphere=False), fit("rest", sphere=True), key=lambda t: t[0].shape[-1])
    plan = _Plan(keys_w, keys_d, 0.5 * torch.cat([queries_w, queries_d], 1), sign)
    _check_plan(plan, ga, head_type, inverse, generator)
    return plan


_PLAN_TABLES: dict[tuple, tuple] = {}


@constant_result  # inside a caller's torch.compile: run, not traced
def _plan_tables(p: int, q: int, r: int, head_type: str, inverse: bool) -> tuple:
    """:func:`_sandwich_plan` of ``Cl(p, q, r)`` as plain values: ``((shape, values),) * 3 + (sign,)``."""
    key = (p, q, r, head_type, inverse)
    if key not in _PLAN_TABLES:
        plan = _sandwich_plan(shared_algebra(p, q, r, compile=False), head_type, inverse)
        _PLAN_TABLES[key] = (*((tuple(t.shape), tuple(t.flatten().tolist())) for t in plan[:3]), plan.sign)
    return _PLAN_TABLES[key]


def _plan_on(algebra, head_type, inverse, device, dtype) -> _Plan:
    """:func:`_sandwich_plan` on one device and dtype (made once)."""

    def build():
        *tables, sign = _plan_tables(algebra.p, algebra.q, algebra.r, head_type, inverse)
        keys_w, keys_d, queries = (
            torch.tensor(values, dtype=torch.float64).view(shape).to(device, dtype)
            for shape, values in tables
        )
        return _Plan(keys_w, keys_d, queries, sign)

    return _cached(algebra, ("plan", head_type, inverse, device, dtype), build)


def _check_plan(plan: _Plan, ga, head_type, inverse, generator) -> None:
    """The plan against the sandwich itself on fresh unit directions (a wrong fit fails loudly)."""
    a, b = _directions_drawn(ga, 16, generator), _directions_drawn(ga, 16, generator)
    v = torch.randn(16, ga.dim, dtype=torch.float64, generator=generator)
    A, Bv = ga.vector(a), ga.vector(b)
    d = 1 + plan.sign * ga.scalar_product(A, Bv)
    want = _unscaled_sandwich(ga, head_type, inverse, A, Bv, v) / 2  # the pair's output times d
    feats = [torch.einsum("np,nx,pxr->nr", monomials(b), v, t) for t in (plan.keys_w, plan.keys_d)]
    agg = torch.cat([feats[0], feats[1] * d[:, None]], -1)
    got = torch.einsum("nr,nry->ny", agg, torch.einsum("np,pry->nry", monomials(a), plan.queries))
    err = (got - want).abs().max().item()
    if not err < 1e-10:
        raise RuntimeError(f"rotor_attention: the factorised {head_type} table is off by {err:.2e} ({ga!r})")


def directions(x: Tensor, algebra: CliffordAlgebra) -> Tensor:
    """``normalize(Σ_c vector_part(x_c))`` in the metric (``a² = 1``): ``(..., C, dim)`` → ``(..., n)``.

    A zero (or, in PGA, purely degenerate) vector part gives a direction of norm ≤ its size / NORM_EPS.
    """
    tables = _tables(algebra, x.device, x.dtype)
    # the vector blades read by a 0/1 GEMM (exact): a slice's backward writes a zero-filled copy of x
    vec = x.sum(-2) @ tables["vector"]
    sq = (vec * vec * tables["metric"]).sum(-1, keepdim=True)
    return vec / sq.clamp_min(NORM_EPS**2).sqrt()


def pair_scale(dot: Tensor, head_type: str) -> Tensor:
    """The guarded per-pair normaliser: ``1 / (2 max(1 ± ⟨a, b⟩, guard_eps))`` (+ rotation, − reflection).

    rotation: ``|1 + b a|² = 2(1 + ⟨a, b⟩)``; reflection: ``|a − b|² = 2(1 − ⟨a, b⟩)`` for unit a, b.
    """
    sign = 1.0 if head_type == "rotation" else -1.0
    return 0.5 / (1.0 + sign * dot).clamp_min(guard_eps(dot.dtype))


def guard_eps(dtype: torch.dtype) -> float:
    """``sqrt(machine eps)``: the factorised sum's rounding error grows like eps / (1 ± ⟨a, b⟩), so this
    bounds it by sqrt(eps) relative (float32: 3.5e-4, the guard band is within 1.5° of antiparallel)."""
    return torch.finfo(dtype).eps ** 0.5


def rotor_log_scale(dot: Tensor) -> Tensor:
    """``f(c) = arccos(c) / sqrt(1 − c²) = θ / sin θ``, so a pair's rotor is ``exp(½ f(⟨a, b⟩) (b ∧ a))``.

    Guards (g = :func:`guard_eps`), finite values and gradients for every c:
    c > 1 − g (parallel): the Taylor series ``1 + u/3 + 2u²/15 + 2u³/35`` in u = 1 − c (error < u⁴/39;
    f → 1, the plane b ∧ a → 0); c < −1 + g (antiparallel): ``arccos(−1 + g) / sqrt((1 − c) g)``, so
    ``|f (b ∧ a)|`` falls from ≈ π to 0 at c = −1, continuously: as the rotation head's guarded rotor,
    the pair's rotation fades where its plane is undefined (no plane is chosen: any choice of a plane
    would break equivariance). dot: any shape → same shape.
    """
    g = guard_eps(dot.dtype)
    u = 1 - dot
    parallel = u < g
    c = torch.where(parallel, torch.zeros_like(dot), dot)  # the direct form away from c = 1 (its gradient)
    direct = torch.arccos(c.clamp_min(-1 + g)) * torch.rsqrt((1 - c) * (1 + c).clamp_min(g))
    return torch.where(parallel, 1 + u * (1 / 3 + u * (2 / 15 + u * (2 / 35))), direct)


def rotor_log_scale_derivative(dot: Tensor) -> Tensor:
    """``f'(c)`` of :func:`rotor_log_scale`, guards included: the derivative autograd takes through it
    (zero where a clamp holds the argument), written out for compose's own backward. Same shape as dot."""
    g = guard_eps(dot.dtype)
    u = 1 - dot
    parallel = u < g
    c = torch.where(parallel, torch.zeros_like(dot), dot)
    lower = c.clamp_min(-1 + g)
    one_plus = (1 + c).clamp_min(g)
    r = torch.rsqrt((1 - c) * one_plus)
    angle = torch.arccos(lower)
    d_angle = torch.where(c >= -1 + g, -torch.rsqrt(1 - lower * lower), torch.zeros_like(c))
    d_h = -one_plus + torch.where(1 + c >= g, 1 - c, torch.zeros_like(c))  # of h = (1 − c) max(1 + c, g)
    direct = d_angle * r + angle * (-0.5 * r * r * r) * d_h
    return torch.where(parallel, -(1 / 3 + u * (4 / 15 + u * (6 / 35))), direct)


def _logit_queries(q: Tensor, algebra: CliffordAlgebra) -> Tensor:
    """q with the metric and 1/sqrt(C·dim) folded in: ``(B, H, N, C, dim)`` → ``(B, H, N, C·dim)``.

    Then ``logits = q' @ k.flatten(-2)ᵀ`` is ``Σ_c ⟨reverse(q_c) k_c⟩₀ / sqrt(C · dim)``.
    """
    w = _tables(algebra, q.device, q.dtype)["logit"]
    return (q * (w / math.sqrt(q.shape[-2] * q.shape[-1]))).flatten(-2)


# ------------------------------------------------------------------------------------ reference
def _reference(q, k, v, algebra, head_type, causal, inverse, key_mask, aggregation) -> Tensor:
    """Naive pairwise oracle: explicit α (B, H, N, N) and one versor per pair, built with the engine.

    Pairs are processed in (query block × key block) tiles of at most ``_REFERENCE_ROWS`` rows.
    """
    B, H, N, C, dim = q.shape
    Cv = v.shape[3]
    ga = algebra
    qb, kb = _tiles(N, B * H * max(C, Cv))
    rows = []
    for s in range(0, N, qb):
        qs = ga.reverse(q[:, :, s : s + qb, None])
        tiles = [ga.scalar_product(qs, k[:, :, None, t : t + kb]).sum(-1) for t in range(0, N, kb)]
        rows.append(torch.cat(tiles, dim=-1))
    logits = torch.cat(rows, dim=2) / math.sqrt(C * dim)
    logits = logits.masked_fill(~_allowed(N, N, 0, causal, key_mask, q.device), float("-inf"))
    alpha = torch.softmax(logits, dim=-1)  # (B, H, N, N)
    if aggregation == "compose":
        return _reference_compose(q, k, v, ga, alpha, inverse)
    if head_type == "projection":
        b = ga.vector(directions(k, ga))[:, :, :, None]  # (B, H, N, 1, dim)
        step = max(1, _REFERENCE_ROWS // (B * H * Cv))
        moved = torch.cat(
            [
                ga.geometric_product(ga.left_contraction(v[:, :, t : t + step], b[:, :, t : t + step]),
                                     ga.inverse(b[:, :, t : t + step]))
                for t in range(0, N, step)
            ],
            dim=2,
        )  # fmt: skip
        return torch.einsum("bhij,bhjcd->bhicd", alpha, moved)
    versors = _frame_rotors(q, k, ga) if head_type == "frame" else _pair_versors(q, k, ga, head_type, inverse)
    values = ga.grade_involution(v) if head_type == "reflection" else v
    qb, kb = _tiles(N, B * H * Cv)
    outs = []
    for s in range(0, N, qb):
        acc = 0
        for t in range(0, N, kb):
            Rv = versors(s, s + qb, t, t + kb)[..., None, :]  # (B, H, qb, kb, 1, dim)
            right = Rv if head_type == "reflection" else ga.reverse(Rv)
            moved = ga.geometric_product(ga.geometric_product(Rv, values[:, :, None, t : t + kb]), right)
            acc = acc + torch.einsum("bhij,bhijcd->bhicd", alpha[:, :, s : s + qb, t : t + kb], moved)
        outs.append(acc)
    return torch.cat(outs, dim=2)


def _reference_compose(q, k, v, ga, alpha, inverse) -> Tensor:
    """``R̄_i (Σ_j α_ij v_j) R̄_i~`` with ``R̄_i = exp(½ Σ_j α_ij θ_ij B̂_ij)``, every pair's ``θ_ij B̂_ij``
    built explicitly with the engine (``(B, H, qb, kb, dim)`` tiles), its exp and sandwich too."""
    B, H, N = q.shape[:3]
    a, b = ga.vector(directions(q, ga)), ga.vector(directions(k, ga))  # (B, H, N, dim)
    qb, kb = _tiles(N, B * H)
    rows = []
    for s in range(0, N, qb):
        a_ = a[:, :, s : s + qb, None]  # (B, H, qb, 1, dim)
        acc = 0
        for t in range(0, N, kb):
            b_ = b[:, :, None, t : t + kb]  # (B, H, 1, kb, dim)
            # θ B̂ = θ (b ∧ a) / |b ∧ a| and |b ∧ a| = sin θ for unit a, b
            log = rotor_log_scale(ga.inner_product(a_, b_))[..., None] * ga.outer_product(b_, a_)
            acc = acc + torch.einsum("bhij,bhijd->bhid", alpha[:, :, s : s + qb, t : t + kb], log)
        rows.append(acc)
    mean = torch.cat(rows, dim=2)  # (B, H, N, dim): Σ_j α_ij θ_ij B̂_ij
    rotor = ga.exp(-mean / 2 if inverse else mean / 2)  # inverse: the key → query rotors, R̃_ij
    return ga.sandwich(rotor[:, :, :, None], torch.einsum("bhij,bhjcd->bhicd", alpha, v))


def _tiles(N: int, rows_per_pair: int) -> tuple[int, int]:
    """Query and key block sizes with ``qb · kb · rows_per_pair ≤ _REFERENCE_ROWS`` (at least 1 × 1)."""
    pairs = max(1, _REFERENCE_ROWS // rows_per_pair)
    kb = min(N, pairs)
    return max(1, pairs // kb), kb


def _pair_versors(q, k, ga, head_type, inverse):
    """Blocks of the per-pair versors: rotors ``(1 + b a)·sqrt(scale)`` or normals ``(a − b)·sqrt(scale)``."""
    a, b = directions(q, ga), directions(k, ga)  # (B, H, N, n)
    one = torch.zeros(ga.dim, dtype=q.dtype, device=q.device)
    one[ga.blade_index("")] = 1

    def block(s: int, e: int, t: int, u: int) -> Tensor:
        a_, b_ = a[:, :, s:e, None], b[:, :, None, t:u]
        A, Bv = ga.vector(a_), ga.vector(b_)  # (B, H, qb, 1, dim), (B, H, 1, kb, dim)
        metric = _tables(ga, q.device, q.dtype)["metric"]
        scale = pair_scale((a_ * b_ * metric).sum(-1), head_type).sqrt()[..., None]
        if head_type == "reflection":
            return (A - Bv) * scale
        prod = ga.geometric_product(A, Bv) if inverse else ga.geometric_product(Bv, A)
        return (one + prod) * scale

    return block


def _frame_rotors(q, k, ga):
    """Blocks of ``R_ij`` taking key j's frame to query i's: ``R_ij = R2 R1`` with ``R1 = rotor_between``
    (key x → query x) and ``R2 = exp(φ/2 · y_i ∧ z_i)``, the turn about query x by the signed angle φ
    (atan2, well-defined up to a half turn) that takes the moved key y onto the query y."""
    qx, qy = _frame_axes(ga.vector_part(q[..., 0, :]), ga.vector_part(q[..., 1, :]))
    kx, ky = _frame_axes(ga.vector_part(k[..., 0, :]), ga.vector_part(k[..., 1, :]))
    qz = torch.linalg.cross(qx, qy)

    def block(s: int, e: int, t: int, u: int) -> Tensor:
        r1 = ga.rotor_between(kx[:, :, None, t:u], qx[:, :, s:e, None])  # (B, H, qb, kb, dim)
        y_moved = ga.vector_part(ga.sandwich(r1, ga.vector(ky[:, :, None, t:u])))  # ⟂ query x
        y_i, z_i = qy[:, :, s:e, None], qz[:, :, s:e, None]
        phi = torch.atan2((y_moved * z_i).sum(-1), (y_moved * y_i).sum(-1))
        plane = ga.outer_product(ga.vector(y_i), ga.vector(z_i))  # unit bivector ⟂ query x
        r2 = ga.exp(phi[..., None] / 2 * plane)
        return ga.geometric_product(r2, r1)

    return block


def _allowed(nq: int, nk: int, start: int, causal: bool, key_mask: Tensor | None, device) -> Tensor:
    """Bool ``(B|1, 1, nq, nk)``: which (query start + i, key j) pairs attend."""
    allowed = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    if causal:
        i = torch.arange(start, start + nq, device=device)[:, None]
        allowed = allowed & (torch.arange(nk, device=device)[None, :] <= i)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :nk]
    return allowed


# ---------------------------------------------------------------------------- fast: query blocks
# Blocks whose pair weights (B · H · queries · keys) pass `geoattn.compile.worth_compiling` run their
# N×N work (softmax, guards, weights) as one torch.compile'd kernel between the GEMMs; eager, each of
# those steps is a pass over the block (eager, those pointwise passes dominate the compose head's time).
# torch.compile backend of the block kernels (tests use "aot_eager": tracing without code generation)
COMPILE_BACKEND = "inductor"


class _BlockKernel:
    """A query-block function, eager or under ``torch.compile`` (built on first use: specialised to the
    first shape, dynamic from a second one on, torch's default).

    ``kernel(compiled, *args)`` runs the compiled form when ``compiled`` is true and compilation
    works here; a missing compiler or a compile limit warns once and leaves the eager form, which
    computes the same values. Inside a caller's ``torch.compile`` the eager form is traced into its graph.
    Each variant of a call (dtype, device, grad mode, which arguments are None) compiles its own copy
    of the function: dynamo keeps its graphs per code object with a recompile limit (8), which one
    shared function would reach in a process that trains and evaluates in two dtypes (issue #12's
    crash, for these kernels).
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self._compiled: dict[tuple, Callable] = {}
        self.failed = False

    def __call__(self, compiled: bool, *args):
        if compiled and not self.failed and not torch.compiler.is_compiling():
            first = args[0]
            key = (first.dtype, first.device, torch.is_grad_enabled(), tuple(x is None for x in args))
            if key not in self._compiled:
                copy = own_code(self.fn, f"{self.fn.__name__}_{len(self._compiled)}")
                self._compiled[key] = torch.compile(
                    copy, backend=COMPILE_BACKEND, dynamic=None, fullgraph=True
                )
            try:
                return self._compiled[key](*args)
            except (
                torch._dynamo.exc.BackendCompilerFailed,
                torch._dynamo.exc.FailOnRecompileLimitHit,
            ) as err:
                warnings.warn(f"rotor_attention: {self.fn.__name__} stays eager ({err!r})", stacklevel=2)
                self.failed = True
        return self.fn(*args)


def _block_weights(qs_c: Tensor, kf: Tensor, mask: Tensor | None) -> Tensor:
    """``α = softmax(qs_c @ kfᵀ)`` with disallowed pairs masked: ``(B, H, nq, nk)``."""
    logits = qs_c @ kf.transpose(-1, -2)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _sandwich_block(
    qs_c, a1_c, psi_c, kf, b1, feats_w, feats_d, mask, queries, guard: float
) -> tuple[Tensor]:
    """One query block of the rotation / reflection sum, ``((B, H, nq, Cv, dim),)``: the key features
    ``feats_w (B, H, nk, Cv · r_w)`` aggregated with ``W = α / max(d, guard)`` (``d_ij = 1 ± ⟨a_i, b_j⟩ =
    a1_c @ b1ᵀ``), ``feats_d (B, H, nk, Cv · r_d)`` with ``W ⊙ d``, both contracted with the query's map
    ``ψ(a_i) @ queries`` (:func:`_sandwich_plan`)."""
    B, H, nq = qs_c.shape[:3]
    if torch.compiler.is_compiling():  # a sum of n + 1 broadcast products, fused with the softmax
        d = (a1_c[..., :, None, :] * b1[..., None, :, :]).sum(-1)  # (B, H, nq, nk)
    else:  # eager, one GEMM (compiled, the broadcast sum fuses with the softmax and costs less than it)
        d = a1_c @ b1.transpose(-1, -2)
    weights = _block_weights(qs_c, kf, mask) / d.clamp_min(guard)
    r = queries.shape[1]
    Cv = (feats_w.shape[-1] + feats_d.shape[-1]) // r
    query_map = (psi_c @ queries.flatten(1)).view(B, H, nq, r, queries.shape[2])  # (B, H, nq, r, dim)
    agg_w = (weights @ feats_w).view(B, H, nq, Cv, -1)
    agg_d = ((weights * d) @ feats_d).view(B, H, nq, Cv, -1)
    return (torch.cat([agg_w, agg_d], -1) @ query_map,)


def _compose_block(qs_c, am_c, kf, b, values, mask) -> tuple[Tensor, Tensor]:
    """One query block of compose: ``(α @ values, (α ⊙ f(⟨a_i, b_j⟩)) @ b)``."""
    alpha = _block_weights(qs_c, kf, mask)
    return alpha @ values, (alpha * rotor_log_scale(am_c @ b.transpose(-1, -2))) @ b


_COMPOSE_BLOCK = _BlockKernel(_compose_block)


def _compose_forward(qs_c, am_c, kf, b, values, mask) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_compose_block` as :class:`_ComposeFunction` runs it: the two sums, the log-sum-exp of each
    query's logits ``(B, H, nq, 1)`` and the weights α ``(B, H, nq, nk)`` (the caller keeps or drops them)."""
    logits = qs_c @ kf.transpose(-1, -2)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, -1, keepdim=True)
    alpha = torch.exp(logits - lse)
    if torch.compiler.is_compiling():  # a sum of n broadcast products, fused with f
        cosine = (am_c[..., :, None, :] * b[..., None, :, :]).sum(-1)
    else:
        cosine = am_c @ b.transpose(-1, -2)
    return alpha @ values, (alpha * rotor_log_scale(cosine)) @ b, lse, alpha


def _compose_backward(
    qs_c, am_c, kf, b, values, mask, lse, alpha, out_v, out_k, g_v, g_k
) -> tuple[Tensor, ...]:
    """The gradients of :func:`_compose_forward`'s two sums with respect to ``qs_c, am_c, kf, b, values``.

    α is the forward's (``alpha``), or, where None, recomputed from the logits and the saved
    log-sum-exp; with ``f = f(⟨a_i, b_j⟩)`` and ``γ_ij = g_k,i · b_j``: ``dα = g_v valuesᵀ + f ⊙ γ``; the
    softmax's ``dlogits = α ⊙ (dα − δ)`` with ``δ_i = Σ_j α_ij dα_ij = g_v,i · out_v,i + g_k,i · out_k,i``
    (the two sums themselves); the cosines get ``α ⊙ γ ⊙ f'``. With α recomputed: five (nq × N)-sized
    GEMMs, as flash attention's backward, and no (nq × N) tensor kept between forward and backward.
    """
    if alpha is None:
        logits = qs_c @ kf.transpose(-1, -2)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        alpha = torch.exp(logits - lse)
    if torch.compiler.is_compiling():
        cosine = (am_c[..., :, None, :] * b[..., None, :, :]).sum(-1)
        gamma = (g_k[..., :, None, :] * b[..., None, :, :]).sum(-1)
    else:
        cosine = am_c @ b.transpose(-1, -2)
        gamma = g_k @ b.transpose(-1, -2)
    f = rotor_log_scale(cosine)
    delta = (g_v * out_v).sum(-1, keepdim=True) + (g_k * out_k).sum(-1, keepdim=True)
    d_logits = alpha * (g_v @ values.transpose(-1, -2) + f * gamma - delta)
    d_cosine = alpha * gamma * rotor_log_scale_derivative(cosine)
    # (Gᵀ A)ᵀ for Aᵀ G with G of n columns: the same sums, where MKL's GEMM with n output columns and a
    # transposed left operand ran several times slower than with n output rows
    g_b = (g_k.transpose(-1, -2) @ (alpha * f) + am_c.transpose(-1, -2) @ d_cosine).transpose(-1, -2)
    return (
        d_logits @ kf,
        d_cosine @ b,
        d_logits.transpose(-1, -2) @ qs_c,
        g_b,
        alpha.transpose(-1, -2) @ g_v,
    )


_COMPOSE_FORWARD = _BlockKernel(_compose_forward)
_COMPOSE_BACKWARD = _BlockKernel(_compose_backward)


class _ComposeFunction(torch.autograd.Function):
    """Compose's query block with its own backward (flash attention's scheme): the forward keeps its
    inputs, its two sums and a log-sum-exp per query, and the weights α only where ``keep_weights`` (a
    single block: its memory is bounded like the blocks'); the backward recomputes α from the rest
    otherwise (:func:`_compose_backward`). Against autograd through :func:`_compose_block` with the block
    recomputed (activation checkpointing), the backward skips the recomputed sums and the softmax's
    reductions. Both halves run compiled (:class:`_BlockKernel`; eager where that fails, the same
    maths). First derivatives only, as the compiled block it replaces."""

    @staticmethod
    def forward(ctx, qs_c, am_c, kf, b, values, mask, keep_weights: bool):
        out_v, out_k, lse, alpha = _COMPOSE_FORWARD(True, qs_c, am_c, kf, b, values, mask)
        kept = alpha if keep_weights else None
        ctx.save_for_backward(qs_c, am_c, kf, b, values, mask, lse, kept, out_v, out_k)
        return out_v, out_k

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_v, g_k):
        grads = _COMPOSE_BACKWARD(True, *ctx.saved_tensors, g_v.contiguous(), g_k.contiguous())
        return (*grads, None, None)


class _ComposeBlocks:
    """Compose's query blocks for :func:`_query_blocks`. Large ones (``compiled``, outside a caller's
    ``torch.compile``) go through :class:`_ComposeFunction`, which recomputes what its backward needs
    itself (``own_backward``: `_query_blocks` calls them with ``single``, whether the block is the only
    one); the others through :func:`_compose_block` under autograd, as every block kernel."""

    own_backward = True

    def __call__(self, compiled: bool, *args, single: bool | None = None):
        if single is not None:
            return _ComposeFunction.apply(*args, single)
        return _COMPOSE_BLOCK(compiled, *args)


# one sandwich kernel per table shape (P, r, dim, r_w): heads of other feature counts would otherwise
# share one compiled copy, and the second would turn it dynamic (slower) for both
_SANDWICH_BLOCKS: dict[tuple, _BlockKernel] = {}


def _sandwich_kernel(plan: _Plan) -> _BlockKernel:
    key = (*plan.queries.shape, plan.keys_w.shape[-1])
    if key not in _SANDWICH_BLOCKS:
        _SANDWICH_BLOCKS[key] = _BlockKernel(_sandwich_block)
    return _SANDWICH_BLOCKS[key]


def _query_blocks(
    block: _BlockKernel,
    queries: tuple[Tensor, ...],
    keys: tuple[Tensor, ...],
    extra: tuple = (),
    *,
    causal: bool,
    key_mask: Tensor | None,
    chunk_size: int | None,
    algebra: CliffordAlgebra,
    grad: bool,
) -> tuple[Tensor, ...]:
    """``block(*query_chunk, *keys_seen, mask, *extra)`` over query chunks, outputs concatenated.

    ``queries``: ``(B, H, N, ·)`` tensors, sliced per chunk; ``keys``: ``(B, H, N, ·)`` tensors, cut to the
    keys the chunk may see (causal: later keys are never attended); mask: the chunk's
    ``(B|1, 1, nq, nk)`` allowed pairs or None. Memory
    O(chunk · N) per (B, H): with gradients and several chunks each chunk is recomputed in the
    backward (activation checkpointing), so training memory is O(N) too, unless the block recomputes
    what its backward needs itself (``block.own_backward``, where compiled: then it is called with
    ``single``, whether it is the only chunk).
    """
    B, H, N = queries[0].shape[:3]
    chunk = chunk_size or max(16, _AUTO_CHUNK_ELEMENTS // max(1, B * H * N))
    compiled = algebra.compile and worth_compiling(B * H * min(chunk, N) * N)
    # a compiled block that recomputes what its backward needs itself is not checkpointed
    own_backward = compiled and getattr(block, "own_backward", False) and not torch.compiler.is_compiling()
    starts = range(0, N, chunk)
    parts = []
    for s in starts:
        nq = min(chunk, N - s)
        nk = s + nq if causal else N
        masked = causal or key_mask is not None
        mask = _allowed(nq, nk, s, causal, key_mask, queries[0].device) if masked else None
        args = (
            *(x[:, :, s : s + nq] for x in queries),
            *(x[:, :, :nk] for x in keys),
            mask,
            *extra,
        )
        if own_backward:
            parts.append(block(compiled, *args, single=len(starts) == 1))
        elif len(starts) > 1 and grad:
            parts.append(checkpoint(block, compiled, *args, use_reentrant=False))
        else:
            parts.append(block(compiled, *args))
    return tuple(torch.cat(x, dim=2) if len(parts) > 1 else x[0] for x in zip(*parts))


def _needs_grad(*xs: Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def _factorised(q, k, v, algebra, head_type, causal, inverse, key_mask, chunk_size) -> Tensor:
    """Rotation / reflection, sum aggregation: see the module docstring and :func:`_sandwich_plan`."""
    plan = _plan_on(algebra, head_type, inverse, q.device, q.dtype)
    a, b = directions(q, algebra), directions(k, algebra)  # (B, H, N, n)
    mono = monomials(b)  # (B, H, N, P)
    # 1 ± ⟨a_i, b_j⟩ = [1, ±metric·a_i] · [1, b_j], one GEMM per block; [1, b_j] are b_j's first monomials
    a1 = _affine(a, *_signed_lift(algebra, plan.sign, q.device, q.dtype))  # (B, H, N, 1 + n)
    b1 = mono[..., : 1 + algebra.n]  # (B, H, N, 1 + n), a view
    # each key's features, channel-major: v_c @ (Σ_p φ_p(b) keys[p]) → (B, H, N, Cv · r)
    feats_w, feats_d = (
        (v @ (mono @ t.flatten(1)).unflatten(-1, t.shape[1:])).flatten(-2) for t in (plan.keys_w, plan.keys_d)
    )
    (out,) = _query_blocks(
        _sandwich_kernel(plan),
        (_logit_queries(q, algebra), a1, monomials(a)),
        (k.flatten(-2), b1, feats_w, feats_d),
        (plan.queries, guard_eps(q.dtype)),
        causal=causal, key_mask=key_mask, chunk_size=chunk_size, algebra=algebra, grad=_needs_grad(q, k, v),
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------- fast: compose
def _compose(q, k, v, algebra, causal, inverse, key_mask, chunk_size) -> Tensor:
    """``R̄_i V̄_i R̄_i~`` with ``V̄_i = Σ_j α_ij v_j`` and ``R̄_i = exp(½ (Σ_j α_ij f(⟨a_i, b_j⟩) b_j) ∧ a_i)``.

    Per query chunk (:func:`_compose_block`): the logits GEMM, a softmax, ``⟨a_i, b_j⟩`` (one GEMM), ``f``
    on that (N×N scalar tiles only), then ``α @ v`` and ``(α f) @ b``; afterwards one wedge, one exp
    and one sandwich per query.
    """
    B, H, N, C, dim = q.shape
    Cv = v.shape[3]
    a, b = directions(q, algebra), directions(k, algebra)  # (B, H, N, n)
    am = a * _tables(algebra, q.device, q.dtype)["metric"]  # am @ bᵀ = ⟨a_i, b_j⟩
    # b stored coordinate by coordinate (the same (B, H, N, n) tensor): the blocks' compiled kernels read
    # each coordinate of 16 consecutive keys as one vector, not as a strided gather
    b_by_coordinate = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    mean_values, mean_keys = _query_blocks(
        _ComposeBlocks(),
        (_logit_queries(q, algebra), am),
        (k.flatten(-2), b_by_coordinate, v.flatten(-2)),
        causal=causal, key_mask=key_mask, chunk_size=chunk_size, algebra=algebra, grad=_needs_grad(q, k, v),
    )  # fmt: skip
    # Σ_j α_ij f_ij (b_j ∧ a_i) = (Σ_j α_ij f_ij b_j) ∧ a_i, a simple bivector: closed-form exp
    mean = algebra.outer_product(algebra.vector(mean_keys), algebra.vector(a))  # (B, H, N, dim)
    rotor = algebra.exp(-mean / 2 if inverse else mean / 2, simple=True)
    action = algebra.versor_matrix(rotor)  # (B, H, N, dim, dim), action @ x = R̄ x R̄~
    return mean_values.view(B, H, N, Cv, dim) @ action.transpose(-1, -2)


# ---------------------------------------------------------------------------- fast: projection, frame
def _plain_attention(q, k, values: Tensor, algebra, causal: bool, key_mask: Tensor | None) -> Tensor:
    """``softmax_j(Σ_c ⟨reverse(q_ic) k_jc⟩₀ / sqrt(C · dim)) values_j`` with SDPA: q, k
    ``(B, H, N, C, dim)``, values ``(B, H, N, F)`` → ``(B, H, N, F)``. Where every blade's metric weight
    is 1 (Euclidean signatures) q goes in as it is, with SDPA's scale (no extra pass over q)."""
    scale = 1 / math.sqrt(q.shape[-2] * q.shape[-1])
    euclidean = algebra.q == algebra.r == 0  # every ⟨ẽ_A e_A⟩₀ = 1
    qs = q.flatten(-2) if euclidean else (q * _tables(algebra, q.device, q.dtype)["logit"]).flatten(-2)
    kf = k.flatten(-2)
    mask = None
    if key_mask is not None and not causal:
        mask = key_mask[:, None, None, :]  # (B, 1, 1, N): broadcast, no N×N
    elif key_mask is not None:
        # SDPA cannot combine is_causal with a mask: padding and causality together cost one
        # (B, 1, N, N) bool mask (1 byte a pair; padded causal sequences are the rare case)
        mask = _allowed(qs.shape[2], kf.shape[2], 0, causal, key_mask, qs.device)
        causal = False
    return F.scaled_dot_product_attention(qs, kf, values, attn_mask=mask, is_causal=causal, scale=scale)


def _projection(q, k, v, algebra, causal, key_mask) -> Tensor:
    """``(v ⌋ b) b⁻¹`` per key (b unit: scalar part kept, vector part → ⟨v, b⟩ b), then plain attention."""
    B, H, N, Cv, dim = v.shape
    metric = _tables(algebra, q.device, q.dtype)["metric"]
    b = directions(k, algebra)[..., None, :]  # (B, H, N, 1, n)
    bb = (b * b * metric).sum(-1, keepdim=True)  # b² (1 unless the direction is zero)
    inv_b = b / bb.clamp_min(guard_eps(bb.dtype))
    scalar = v[..., algebra.grade_slice(0)] * (bb / bb.clamp_min(guard_eps(bb.dtype)))  # (v₀ b) b⁻¹
    vec = (v[..., algebra.grade_slice(1)] * b * metric).sum(-1, keepdim=True) * inv_b
    moved = algebra.vector(vec) + F.pad(scalar, (0, dim - 1))  # the scalar is blade 0
    out = _plain_attention(q, k, moved.flatten(-2), algebra, causal, key_mask)
    return out.view(B, H, N, Cv, dim)


def _frame_axes(c0: Tensor, c1: Tensor) -> tuple[Tensor, Tensor]:
    """Gram–Schmidt x, y axes from the vector parts of channels 0, 1: two ``(..., 3)`` → two ``(..., 3)``."""
    ex = c0 / c0.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    y = c1 - (c1 * ex).sum(-1, keepdim=True) * ex
    return ex, y / y.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


def _rotation_action_table(algebra: CliffordAlgebra) -> tuple[Tensor, Tensor, Tensor]:
    """``(T0 (8, 8), T (9, 64), Tt (9, 64))`` (Cl(3), float64): the action of a rotation on Cl(3) row
    vectors is ``T0 + vec(A) @ T`` for the row-convention rotation A (``u ↦ u @ A`` on vector
    coordinates, ``vec`` row-major); ``Tt`` takes ``vec(Aᵀ)`` instead.

    The rotor fixes the scalar and the pseudoscalar I (det = 1) and moves vectors by A; a bivector is
    ``v I`` for a vector v (I is central), so ``R (v I) R̃ = (R v R̃) I``: with D the matrix of
    ``v ↦ v I`` (vector → bivector coordinates, from the right multiplication by I) bivector rows move
    by ``D⁻ᵀ A Dᵀ``, linear in A.
    """
    vec, biv = list(algebra.vector_indices), list(algebra.bivector_indices)
    fixed = [*algebra.grade_indices[0], *algebra.grade_indices[algebra.n]]
    pseudoscalar = algebra.grade_indices[algebra.n][0]
    D = algebra.right_multiplication[pseudoscalar][biv][:, vec]  # (bivector, vector): column v ↦ v I
    n, dim = len(vec), algebra.dim
    T = torch.zeros(n, n, dim, dim, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            unit = torch.zeros(n, n, dtype=torch.float64)
            unit[i, j] = 1.0
            T[i, j, vec[0] : vec[-1] + 1, vec[0] : vec[-1] + 1] = unit
            T[i, j, biv[0] : biv[-1] + 1, biv[0] : biv[-1] + 1] = torch.linalg.inv(D).T @ unit @ D.T
    T0 = torch.diag(torch.zeros(dim, dtype=torch.float64).index_fill(0, torch.tensor(fixed), 1.0))
    return T0, T.reshape(n * n, dim * dim), T.transpose(0, 1).reshape(n * n, dim * dim)


def _frame_transform(frames: Tensor, m: Tensor, T0: Tensor, T: Tensor, vec: slice) -> Tensor:
    """``m`` moved by each token's frame rotor: the frame from the vector parts (``vec``) of channels
    0 and 1 of ``frames (B, H, N, C, 8)``, m ``(B, H, N, Cv, 8)``, T0 and T (out of the frame) or Tt
    (into it) from :func:`_rotation_action_table` → ``(B, H, N, Cv, 8)``. On the CPU, the native kernel
    (`geoattn.native`: one pass over the tokens, forward and backward) where it is built."""
    if m.device.type == "cpu" and m.dtype in (torch.float32, torch.float64) and native.available():
        flat = torch.ops.geoattn.frame_transform(frames.flatten(0, 2), m.flatten(0, 2), T0, T, vec.start)
        return flat.view(m.shape)
    return _frame_transform_torch(frames, m, T0, T, vec)


def _frame_transform_torch(frames: Tensor, m: Tensor, T0: Tensor, T: Tensor, vec: slice) -> Tensor:
    """:func:`_frame_transform` in torch operators (any leading dims)."""
    c0, c1 = frames[..., 0, vec], frames[..., 1, vec]
    ex, ey = _frame_axes(c0, c1)
    # [x y z] concatenated is vec(Rotᵀ) for the frame's rotation Rot = [x y z] (axes as columns)
    axes = torch.cat([ex, ey, torch.linalg.cross(ex, ey)], dim=-1)  # (B, H, N, 9)
    return m @ ((axes @ T).view(*axes.shape[:-1], *T0.shape) + T0)


# The native frame transform as custom operators: compiled graphs call them whole.
@torch.library.custom_op("geoattn::frame_transform", mutates_args=())
def _frame_transform_op(frames: Tensor, m: Tensor, t0: Tensor, table: Tensor, vec: int) -> Tensor:
    tensors = (x.contiguous() for x in (frames, m, t0, table))
    return native.cpu_kernels().frame_forward(*tensors, NORM_EPS, vec)


@_frame_transform_op.register_fake
def _(frames, m, t0, table, vec):
    return torch.empty_like(m, memory_format=torch.contiguous_format)


@torch.library.custom_op("geoattn::frame_transform_backward", mutates_args=())
def _frame_transform_backward_op(
    frames: Tensor, m: Tensor, t0: Tensor, table: Tensor, grad_out: Tensor, vec: int
) -> list[Tensor]:
    tensors = (x.contiguous() for x in (frames, m, t0, table, grad_out))
    return list(native.cpu_kernels().frame_backward(*tensors, NORM_EPS, vec))


@_frame_transform_backward_op.register_fake
def _(frames, m, t0, table, grad_out, vec):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (frames, m)]


def _frame_transform_setup(ctx, inputs, output):
    frames, m, t0, table, vec = inputs
    ctx.vec = vec
    ctx.save_for_backward(frames, m, t0, table)


def _frame_transform_grad(ctx, grad_out):
    if torch.is_grad_enabled():  # create_graph: the kernel's backward is a first derivative only
        frames, m, t0, table = ctx.saved_tensors
        vec = slice(ctx.vec, ctx.vec + 3)
        forms = torch_form_grads(
            lambda: _frame_transform_torch(frames, m, t0, table, vec),
            (frames, m),
            ctx.needs_input_grad[:2],
            grad_out,
        )
        return *forms, None, None, None
    g_frames, g_m = torch.ops.geoattn.frame_transform_backward(*ctx.saved_tensors, grad_out, ctx.vec)
    return g_frames, g_m, None, None, None


_frame_transform_op.register_autograd(_frame_transform_grad, setup_context=_frame_transform_setup)


def _frame(q, k, v, algebra, causal, key_mask) -> Tensor:
    """``F_i (Σ_j α_ij F̃_j v_j F_j) F̃_i``: values into key frames, plain attention, out of query frames."""
    B, H, N, Cv, dim = v.shape
    T0, T, Tt = _cached(
        algebra,
        ("rotation_action", q.device, q.dtype),
        lambda: tuple(t.to(q.device, q.dtype) for t in _rotation_action_table(algebra)),
    )
    vec = algebra.grade_slice(1)
    local = _frame_transform(k, v, T0, Tt, vec)  # into the key frames
    agg = _plain_attention(q, k, local.flatten(-2), algebra, causal, key_mask)
    return _frame_transform(q, agg.view(B, H, N, Cv, dim), T0, T, vec)


# --------------------------------------------------------------------------- the built-in head types
# Each: its kernels in the registry's signature (rotor_heads.py), then one register_head_type.
def _factorised_kernel(head_type: str):
    def kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
        return _factorised(q, k, v, algebra, head_type, causal, inverse, key_mask, chunk_size)

    return kernel


def _reference_kernel(head_type: str, aggregation: str = "sum"):
    def kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
        return _reference(q, k, v, algebra, head_type, causal, inverse, key_mask, aggregation)

    return kernel


def _compose_kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
    return _compose(q, k, v, algebra, causal, inverse, key_mask, chunk_size)


def _projection_kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
    return _projection(q, k, v, algebra, causal, key_mask)


def _frame_kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
    return _frame(q, k, v, algebra, causal, key_mask)


register_head_type(
    HeadType(
        "rotation",
        _factorised_kernel("rotation"),
        _reference_kernel("rotation"),
        inverse=True,
        compose=(_compose_kernel, _reference_kernel("rotation", "compose")),
    )
)
register_head_type(
    HeadType("reflection", _factorised_kernel("reflection"), _reference_kernel("reflection"), inverse=True)
)
register_head_type(HeadType("projection", _projection_kernel, _reference_kernel("projection")))
register_head_type(
    HeadType(
        "frame",
        _frame_kernel,
        _reference_kernel("frame"),
        signatures=((3, 0, 0),),
        why="a frame is x, y, x × y",
        min_channels=2,
    )
)
