"""Rotor attention (SPEC §2.2–2.4, contract §4.1): attention whose values are moved by a per-pair versor.

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
* ``frame`` (our extension, SPEC §2.4; Cl(3) only, C ≥ 2): each token carries the orthonormal frame
  ``x = normalize(vec c0)``, ``y = normalize(vec c1 − ⟨vec c1, x⟩ x)``, ``z = x × y``; ``T = R v R̃`` with
  R the rotor taking the key's frame to the query's. O(3)-equivariant, not only SO(3) as SPEC §2.4
  expected: a reflection g flips z in *both* frames, so ``F_i F̃_j`` is conjugated by g (tested).

Antiparallel guard (both backends, one helper :func:`pair_scale`): the rotor's normaliser
``1 / (2(1 + ⟨a, b⟩))`` uses ``max(1 + ⟨a, b⟩, g)`` (reflection: ``max(1 − ⟨a, b⟩, g)``),
g = :func:`guard_eps`.
At exactly antiparallel a, b the unnormalised rotor ``1 + b a`` is 0, so the pair contributes 0 (the
limit of the guarded expression), with finite values and gradients; within the guard band
(angle within ~sqrt(2g) of π) the pair's contribution fades to 0 smoothly. The same holds for
``a = b`` in the reflection head. A zero vector part gives the direction 0 (rotation: ``R = 1/√2``).

Precision: the factorised sum's rounding error on a pair is ~ eps / (1 ± ⟨a, b⟩) of its value (terms
of size 1 cancel to a result of size 1 ± ⟨a, b⟩ before the division), hence the guard g = sqrt(eps).
Near-antiparallel pairs are ill-conditioned in any form (the rotor's plane is barely defined there).

Backends:

* ``reference``: the naive pairwise form, the oracle: N×N rotors / normals built with the algebra
  engine's geometric products, each value sandwiched (pair tiles only bound the memory).
* ``auto``: exact factorised forms. Rotation and reflection (SPEC §2.3): the sandwich is a polynomial
  of degree ≤ 2 in a and in b, so ``o_i = Σ_{p,q} ψ_q(a_i) (Σ_j W_ij φ_p(b_j) ⊗ v_j) M_qp`` with monomials
  ``φ(b) = [1, b_l, b_l b_m (l ≤ m)]`` (symmetric storage: 1 + 3 + 6 = 10 in 3D, so 80 features per
  value channel, 68 after dropping those the scalar and pseudoscalar never need, see
  :func:`_reduced_table`), ``W_ij = α_ij · pair_scale(⟨a_i, b_j⟩)`` and a constant table M built from
  the Cayley table. Per query chunk: one GEMM for the logits, one for ``⟨a_i, b_j⟩``, a softmax, the
  weight GEMM ``W @ features``, then a small per-query contraction. Memory O(chunk · N) per (B, H); with
  gradients and several chunks, each chunk is recomputed in the backward (activation checkpointing),
  so training memory is O(N) too. Projection and frame factorise completely into per-key transforms
  around plain attention (``scaled_dot_product_attention``) and, for frame, per-query transforms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.dtypes import outside_autocast

_T = TypeVar("_T")
HEAD_TYPES = ("rotation", "reflection", "projection", "frame")
BACKENDS = ("auto", "reference")

NORM_EPS = 1e-12  # lower bound of |Σ_c vector part| when normalising directions
_AUTO_CHUNK_ELEMENTS = 1 << 22  # B·H·chunk·N logits per query chunk (16 MiB in float32)
# rows (B·H·pairs·channels) per engine call in the reference: bounds its memory (the engine runs calls
# of ≥ 32768 rows through its compiled kernel, 15× faster here than many small eager calls)
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
) -> Tensor:
    """Rotor attention over multivector channels (SPEC §4.1).

    Args:
        q, k: ``(B, H, N, C, dim)`` multivectors; v: ``(B, H, N, Cv, dim)``.
        algebra: the :class:`CliffordAlgebra` the multivectors live in (``dim == algebra.dim``).
        head_type: ``"rotation" | "reflection" | "projection" | "frame"`` (see the module docstring).
        causal: attend to keys ``j ≤ i`` only.
        backend: ``"auto"`` (fast exact factorised form) or ``"reference"`` (naive pairwise oracle).
        inverse: rotation head only: use the key → query rotor ``(1 + a b)/sqrt(2(1 + ⟨a, b⟩))``
            instead of the query → key one (reflection: accepted, identical; others: ValueError).
        key_mask: optional ``(B, N)`` bool, True for keys that may be attended to (padding mask).
        chunk_size: queries per block on the ``auto`` rotation / reflection path (default: sized so a
            block's logits hold ~4 M numbers); any value gives the same result.

    Returns:
        ``(B, H, N, Cv, dim)``, dtype of v.
    """
    _check_inputs(q, k, v, algebra, head_type, backend, inverse, key_mask, chunk_size)
    out_dtype = v.dtype
    # low-precision inputs are computed in float32: 1 + ⟨a, b⟩ cancels catastrophically in bf16
    dtype = torch.promote_types(
        torch.promote_types(q.dtype, k.dtype), torch.promote_types(v.dtype, torch.float32)
    )
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if backend == "reference":
        out = _reference(q, k, v, algebra, head_type, causal, inverse, key_mask)
    elif head_type in ("rotation", "reflection"):
        out = _factorised(q, k, v, algebra, head_type, causal, inverse, key_mask, chunk_size)
    elif head_type == "projection":
        out = _projection(q, k, v, algebra, causal, key_mask)
    else:
        out = _frame(q, k, v, algebra, causal, key_mask)
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------- checks
def _check_inputs(q, k, v, algebra, head_type, backend, inverse, key_mask, chunk_size) -> None:
    if not isinstance(algebra, CliffordAlgebra):
        raise ValueError(f"rotor_attention: algebra must be a CliffordAlgebra, got {type(algebra).__name__}")
    if head_type not in HEAD_TYPES:
        raise ValueError(f"rotor_attention: unknown head_type {head_type!r}, expected one of {HEAD_TYPES}")
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
    if head_type != "frame" and algebra.q > 0:
        raise ValueError(
            f"rotor_attention: head_type {head_type!r} needs unit directions a² = 1, so no basis vector "
            f"squaring to -1; got {algebra!r}"
        )
    if head_type == "frame":
        if (algebra.p, algebra.q, algebra.r) != (3, 0, 0):
            raise ValueError(f"rotor_attention: head_type 'frame' needs Cl(3), got {algebra!r}")
        if q.shape[3] < 2:
            raise ValueError(
                f"rotor_attention: head_type 'frame' needs C ≥ 2 channels in q and k (the frame comes from "
                f"channels 0 and 1), got C = {q.shape[3]}"
            )
    if inverse and head_type not in ("rotation", "reflection"):
        raise ValueError(
            f"rotor_attention: inverse=True applies to 'rotation' (and 'reflection'), not {head_type!r}"
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


def _cached(algebra: CliffordAlgebra, key: tuple, build: Callable[[], _T]) -> _T:
    """A constant derived from the algebra's tables, built once per signature and ``key``.

    Inside a torch.compile trace a missing entry is built without caching (a traced tensor must not
    leak into the cache); the graph then holds the construction.
    """
    full = (algebra.p, algebra.q, algebra.r, *key)
    if full in _CACHE:
        return _CACHE[full]
    value = build()
    if not torch.compiler.is_compiling():
        _CACHE[full] = value
    return value


def _base_tables(algebra: CliffordAlgebra) -> dict[str, Tensor]:
    """The algebra's tables in the kernels' row-vector convention ``y = x @ M`` (float64, CPU).

    ``logit``: ``(dim,)`` ⟨ẽ_A e_A⟩₀; ``metric``: ``(n,)`` e_k²; ``left``/``right``: ``(n, dim, dim)``
    matrices of ``x ↦ e_k x`` / ``x ↦ x e_k``; ``involution``: ``(dim, dim)`` diagonal grade involution.
    """

    def build() -> dict[str, Tensor]:
        vec = list(algebra.vector_indices)
        metric = algebra.invariant_metric
        return {
            "logit": metric,
            "metric": metric[vec],
            "left": algebra.left_multiplication[vec].mT,
            "right": algebra.right_multiplication[vec].mT,
            "involution": torch.diag(algebra.involution_signs),
        }

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
    """``[1, x_l, x_l x_m (l ≤ m)]``: ``(..., n)`` → ``(..., P)``, P = 1 + n + n(n+1)/2."""
    l, m = zip(*_sym_pairs(x.shape[-1]))
    return torch.cat([torch.ones_like(x[..., :1]), x, x[..., list(l)] * x[..., list(m)]], -1)


def _bilinear_table(algebra: CliffordAlgebra, head_type: str, inverse: bool) -> Tensor:
    """``M (P, P, dim, dim)`` with ``unscaled T(a, b, v) = Σ_{q,p} ψ_q(a) φ_p(b) (v @ M[q, p])``.

    ψ, φ = :func:`monomials`. Unscaled T: rotation ``(1 + b a) v (1 + a b)`` (inverse:
    ``(1 + a b) v (1 + b a)``), reflection ``(a − b) v̂ (a − b)``. Ordered index tuples are summed into
    the symmetric monomial slots, so each monomial gets the coefficient of its whole orbit.
    """
    t = _base_tables(algebra)
    L, R, G = t["left"], t["right"], t["involution"]
    n, dim = L.shape[0], L.shape[1]
    sym = {pair: 1 + n + i for i, pair in enumerate(_sym_pairs(n))}
    slot = lambda k, k2: sym[(min(k, k2), max(k, k2))]  # noqa: E731
    P = 1 + n + len(sym)
    M = torch.zeros(P, P, dim, dim, dtype=torch.float64)
    idx = range(n)
    if head_type == "rotation":
        M[0, 0] = torch.eye(dim, dtype=torch.float64)
        for k in idx:
            for l in idx:
                if inverse:  # v b a + a b v
                    M[1 + k, 1 + l] = R[l] @ R[k] + L[l] @ L[k]
                else:  # v a b + b a v
                    M[1 + k, 1 + l] = R[k] @ R[l] + L[k] @ L[l]
                for k2 in idx:
                    for l2 in idx:
                        if inverse:  # a b v b a = e_k e_l v e_l2 e_k2
                            M[slot(k, k2), slot(l, l2)] += L[l] @ L[k] @ R[l2] @ R[k2]
                        else:  # b a v a b = e_l e_k v e_k2 e_l2
                            M[slot(k, k2), slot(l, l2)] += L[k] @ L[l] @ R[k2] @ R[l2]
    elif head_type == "reflection":  # a v̂ a − a v̂ b − b v̂ a + b v̂ b
        for k in idx:
            for k2 in idx:
                M[slot(k, k2), 0] += G @ L[k] @ R[k2]
                M[0, slot(k, k2)] += G @ L[k] @ R[k2]
            for l in idx:
                M[1 + k, 1 + l] = -G @ (L[k] @ R[l] + L[l] @ R[k])
    else:
        raise ValueError(f"no bilinear table for head_type {head_type!r}")
    return M


def _reduced_table(algebra: CliffordAlgebra, head_type: str, inverse: bool) -> tuple[Tensor, Tensor]:
    """The factorised form with the constant 1/2 of :func:`pair_scale` folded in, minus redundant features.

    The scalar and the pseudoscalar blade e_A commute with every even versor, so ``R e_A R̃ = R R̃ e_A
    = 2(1 + ⟨a, b⟩) e_A``; likewise ``n ê_A n = λ_A 2(1 − ⟨a, b⟩) e_A`` (λ = 1 scalar, −1 pseudoscalar).
    They only need the key features ``[1, b] ⊗ v_A`` (``2(1 + n)`` instead of ``2P``): 68 features per
    value channel in Cl(3) instead of 80. Feature f is a pair (key monomial p, blade A): first every
    ``(p, A)`` with A active (not scalar/pseudoscalar), p-major, then ``(p ≤ n, A)`` for A passive.

    Returns ``(M, E)``: ``M (P, F · dim)`` maps the query monomials ψ(a) to the ``(F, dim)`` matrix
    applied to a query's aggregated features; ``E (P, dim · F)`` maps the key monomials φ(b) to the
    ``(dim, F)`` matrix that turns a value channel into its features (``v @ (φ(b) @ E)``).
    """
    full = _bilinear_table(algebra, head_type, inverse)
    P, dim, n = full.shape[0], algebra.dim, algebra.n
    passive = [*algebra.grade_indices[0], *algebra.grade_indices[n]]
    active = [i for i in range(dim) if i not in passive]
    features = [(k, A) for k in range(P) for A in active] + [(k, A) for k in range(1 + n) for A in passive]
    E = torch.zeros(P, dim, len(features), dtype=torch.float64)
    for f, (k, A) in enumerate(features):
        E[k, A, f] = 1.0
    M = 0.5 * full[:, :, active]  # (P, P, |active|, dim)
    sign = 1.0 if head_type == "rotation" else -1.0  # 1 ± ⟨a, b⟩ = 1 ± Σ_k e_k² a_k b_k
    metric = _base_tables(algebra)["metric"]
    passive_part = torch.zeros(P, 1 + n, len(passive), dim, dtype=torch.float64)
    for j, blade in enumerate(passive):
        lam = -1.0 if head_type == "reflection" and algebra.grades[blade] == n else 1.0
        passive_part[0, 0, j, blade] = lam
        for k in range(n):
            passive_part[1 + k, 1 + k, j, blade] = sign * lam * metric[k]
    M = torch.cat([M.flatten(1, 2), passive_part.flatten(1, 2)], dim=1)  # (P, F, dim)
    return M.flatten(1), E.flatten(1)


def _reduced_table_on(algebra, head_type, inverse, device, dtype) -> tuple[Tensor, Tensor]:
    """:func:`_reduced_table` on one device and dtype (made once)."""
    return _cached(
        algebra,
        ("reduced", head_type, inverse, device, dtype),
        lambda: tuple(t.to(device, dtype) for t in _reduced_table(algebra, head_type, inverse)),
    )


def directions(x: Tensor, algebra: CliffordAlgebra) -> Tensor:
    """``normalize(Σ_c vector_part(x_c))`` in the metric (``a² = 1``): ``(..., C, dim)`` → ``(..., n)``.

    A zero (or, in PGA, purely degenerate) vector part gives a direction of norm ≤ its size / NORM_EPS.
    """
    metric = _tables(algebra, x.device, x.dtype)["metric"]
    vec = x[..., algebra.grade_slice(1)].sum(-2)
    sq = (vec * vec * metric).sum(-1, keepdim=True)
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


def _logit_queries(q: Tensor, algebra: CliffordAlgebra) -> Tensor:
    """q with the metric and 1/sqrt(C·dim) folded in: ``(B, H, N, C, dim)`` → ``(B, H, N, C·dim)``.

    Then ``logits = q' @ k.flatten(-2)ᵀ`` is ``Σ_c ⟨reverse(q_c) k_c⟩₀ / sqrt(C · dim)``.
    """
    w = _tables(algebra, q.device, q.dtype)["logit"]
    return (q * (w / math.sqrt(q.shape[-2] * q.shape[-1]))).flatten(-2)


# ------------------------------------------------------------------------------------ reference
def _reference(q, k, v, algebra, head_type, causal, inverse, key_mask) -> Tensor:
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
    qx, qy = _frame_axes(q, ga)
    kx, ky = _frame_axes(k, ga)
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


# ---------------------------------------------------------------------------- fast: rotation, reflection
def _factorised(q, k, v, algebra, head_type, causal, inverse, key_mask, chunk_size) -> Tensor:
    B, H, N, C, dim = q.shape
    Cv = v.shape[3]
    M, E = _reduced_table_on(algebra, head_type, inverse, q.device, q.dtype)
    Fd = M.shape[1] // dim  # F features per value channel (68 in Cl(3))
    qs, kf = _logit_queries(q, algebra), k.flatten(-2)  # (B, H, N, C·dim)
    a, b = directions(q, algebra), directions(k, algebra)  # (B, H, N, n)
    metric = _tables(algebra, q.device, q.dtype)["metric"]
    # 1 ± ⟨a_i, b_j⟩ as one GEMM of [1, ±metric·a] and [1, b]
    sign = 1.0 if head_type == "rotation" else -1.0
    a1 = torch.cat([torch.ones_like(a[..., :1]), sign * metric * a], -1)  # (B, H, N, 1 + n)
    b1 = torch.cat([torch.ones_like(b[..., :1]), b], -1).transpose(-1, -2)  # (B, H, 1 + n, N)
    psi = monomials(a)  # (B, H, N, P)
    feats = (v @ (monomials(b) @ E).view(B, H, N, dim, Fd)).flatten(-2)  # (B, H, N, Cv·F), channel-major
    kt = kf.transpose(-1, -2)  # (B, H, C·dim, N)
    guard = guard_eps(q.dtype)
    chunk = chunk_size or max(16, _AUTO_CHUNK_ELEMENTS // max(1, B * H * N))

    def block(
        s: int, qs_c: Tensor, a1_c: Tensor, psi_c: Tensor, kt: Tensor, b1: Tensor, feats: Tensor
    ) -> Tensor:
        nq = qs_c.shape[2]
        nk = min(s + nq, N) if causal else N  # causal: later keys are never attended
        logits = qs_c @ kt[..., :nk]  # (B, H, nq, nk)
        if causal or key_mask is not None:
            logits = logits.masked_fill(~_allowed(nq, nk, s, causal, key_mask, q.device), float("-inf"))
        # W_ij = α_ij / max(1 ± ⟨a_i, b_j⟩, guard); the 1/2 of pair_scale is folded into M
        weights = torch.softmax(logits, dim=-1) / (a1_c @ b1[..., :nk]).clamp_min_(guard)
        agg = weights @ feats[:, :, :nk]  # (B, H, nq, Cv·F)
        query_map = (psi_c @ M).view(B, H, nq, Fd, dim)  # (B, H, nq, F, dim)
        return agg.view(B, H, nq, Cv, Fd) @ query_map  # (B, H, nq, Cv, dim)

    starts = range(0, N, chunk)
    recompute = len(starts) > 1 and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs = []
    for s in starts:
        args = (s, qs[:, :, s : s + chunk], a1[:, :, s : s + chunk], psi[:, :, s : s + chunk], kt, b1, feats)
        outs.append(checkpoint(block, *args, use_reentrant=False) if recompute else block(*args))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


# ---------------------------------------------------------------------------- fast: projection, frame
def _plain_attention(qs: Tensor, kf: Tensor, values: Tensor, causal: bool, key_mask: Tensor | None) -> Tensor:
    """``softmax(qs kfᵀ) values`` (scale already in qs): ``(B, H, N, ·)`` → ``(B, H, N, F)``, SDPA."""
    mask = None
    if key_mask is not None and not causal:
        mask = key_mask[:, None, None, :]  # (B, 1, 1, N): broadcast, no N×N
    elif key_mask is not None:
        # SDPA cannot combine is_causal with a mask: padding and causality together cost one
        # (B, 1, N, N) bool mask (1 byte a pair; padded causal sequences are the rare case)
        mask = _allowed(qs.shape[2], kf.shape[2], 0, causal, key_mask, qs.device)
        causal = False
    return F.scaled_dot_product_attention(qs, kf, values, attn_mask=mask, is_causal=causal, scale=1.0)


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
    out = _plain_attention(_logit_queries(q, algebra), k.flatten(-2), moved.flatten(-2), causal, key_mask)
    return out.view(B, H, N, Cv, dim)


def _frame_axes(x: Tensor, algebra: CliffordAlgebra) -> tuple[Tensor, Tensor]:
    """Gram–Schmidt x, y axes from channels 0, 1: ``(B, H, N, C, 8)`` → two ``(B, H, N, 3)``."""
    c0, c1 = algebra.vector_part(x[..., 0, :]), algebra.vector_part(x[..., 1, :])
    ex = c0 / c0.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    y = c1 - (c1 * ex).sum(-1, keepdim=True) * ex
    return ex, y / y.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


def _frame_rotation(x: Tensor, algebra: CliffordAlgebra) -> Tensor:
    """The frame ``[x y z]`` as a rotation matrix (columns = axes): ``(B, H, N, C, 8)`` → ``(..., 3, 3)``."""
    ex, ey = _frame_axes(x, algebra)
    return torch.stack([ex, ey, torch.linalg.cross(ex, ey)], dim=-1)


def _rotation_action_table(algebra: CliffordAlgebra) -> tuple[Tensor, Tensor]:
    """``(T0 (8, 8), T (9, 64))`` (Cl(3), float64): the action of a rotation on Cl(3) row vectors is
    ``T0 + vec(A) @ T`` for the row-convention rotation A (``u ↦ u @ A`` on vector coordinates).

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
    return T0, T.reshape(n * n, dim * dim)


def _rotate_cl3(m: Tensor, rot: Tensor, algebra: CliffordAlgebra, inverse: bool) -> Tensor:
    """Apply the rotation (``inverse``: its transpose) to Cl(3) multivectors: the versor action of the
    frame's rotor F (F̃ for ``inverse``). m ``(B, H, N, Cv, 8)``, rot ``(B, H, N, 3, 3)`` → like m."""
    T0, T = _cached(
        algebra,
        ("rotation_action", rot.device, rot.dtype),
        lambda: tuple(t.to(rot.device, rot.dtype) for t in _rotation_action_table(algebra)),
    )
    act = rot if inverse else rot.transpose(-1, -2)  # row vectors: u @ R = (Rᵀ u)ᵀ
    return m @ (T0 + (act.flatten(-2) @ T).unflatten(-1, (algebra.dim, algebra.dim)))


def _frame(q, k, v, algebra, causal, key_mask) -> Tensor:
    """``F_i (Σ_j α_ij F̃_j v_j F_j) F̃_i``: values into key frames, plain attention, out of query frames."""
    B, H, N, Cv, dim = v.shape
    local = _rotate_cl3(v, _frame_rotation(k, algebra), algebra, inverse=True)
    agg = _plain_attention(_logit_queries(q, algebra), k.flatten(-2), local.flatten(-2), causal, key_mask)
    return _rotate_cl3(agg.view(B, H, N, Cv, dim), _frame_rotation(q, algebra), algebra, inverse=False)
