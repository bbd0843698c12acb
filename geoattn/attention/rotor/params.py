"""The parameterisation every rotor head and path shares: the algebra's tables in the kernels' row
convention (made once per signature, device and dtype), the directions ``a_i``, ``b_j``, the pair
weights' logits, the antiparallel guard and the compose head's log scale (docs/concepts/rotors.md).

Shapes: ``q, k (B, H, N, C, dim)``, ``v (B, H, N, Cv, dim)``; ``dim = algebra.dim``, ``n = algebra.n``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from geoattn.algebra.clifford_algebra import CliffordAlgebra

_T = TypeVar("_T")

NORM_EPS = 1e-12  # lower bound of |Σ_c vector part| when normalising directions


_CACHE: dict[tuple, object] = {}


def cached(algebra: CliffordAlgebra | None, key: tuple, build: Callable[[], _T]) -> _T:
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


def base_tables(algebra: CliffordAlgebra) -> dict[str, Tensor]:
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

    return cached(algebra, ("base",), build)


def tables(algebra: CliffordAlgebra, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """:func:`base_tables` on one device and dtype (made once)."""
    return cached(
        algebra,
        ("base", device, dtype),
        lambda: {k: v.to(device, dtype) for k, v in base_tables(algebra).items()},
    )


def sym_pairs(n: int) -> list[tuple[int, int]]:
    """The index pairs ``(l, m)`` with ``l <= m < n``: the entries of a symmetric ``(n, n)`` form."""
    return [(l, m) for l in range(n) for m in range(l, n)]


def monomials(x: Tensor) -> Tensor:
    """``[1, x_l, x_l x_m (l ≤ m)]``: ``(..., n)`` → ``(..., P)``, P = 1 + n + n(n+1)/2.

    As ``(c₁ + x F₁) ⊙ (c₂ + x F₂)`` with 0/1 tables (:func:`_monomial_tables`): the first factor reads
    ``[1, x, x_l]``, the second ``[1, 1, x_m]``, exact (each entry one product by 1, the rest exact zeros),
    two GEMMs and a product where gathers and a concatenation cost scatters in the backward."""
    c1, f1, c2, f2 = _monomial_tables(x.shape[-1], x.device, x.dtype)
    return affine(x, c1, f1) * affine(x, c2, f2)


def affine(x: Tensor, c: Tensor, f: Tensor) -> Tensor:
    """``c + x @ f`` as one GEMM: ``x (..., n)``, ``c (m,)``, ``f (n, m)`` → ``(..., m)``."""
    return torch.addmm(c, x.reshape(-1, x.shape[-1]), f).view(*x.shape[:-1], len(c))


def _monomial_tables(n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """``(c₁ (P,), F₁ (n, P), c₂ (P,), F₂ (n, P))`` of :func:`monomials` (made once)."""

    def build() -> tuple[Tensor, ...]:
        pairs = sym_pairs(n)
        P = 1 + n + len(pairs)
        c1, c2 = torch.zeros(P, dtype=torch.float64), torch.zeros(P, dtype=torch.float64)
        f1, f2 = torch.zeros(n, P, dtype=torch.float64), torch.zeros(n, P, dtype=torch.float64)
        c1[0] = c2[: 1 + n] = 1
        f1[range(n), range(1, 1 + n)] = 1
        for col, (l, m) in enumerate(pairs, start=1 + n):
            f1[l, col] = f2[m, col] = 1
        return tuple(t.to(device, dtype) for t in (c1, f1, c2, f2))

    return cached(None, ("monomials", n, device, dtype), build)


def directions(x: Tensor, algebra: CliffordAlgebra) -> Tensor:
    """``normalize(Σ_c vector_part(x_c))`` in the metric (``a² = 1``): ``(..., C, dim)`` → ``(..., n)``.

    A zero (or, in PGA, purely degenerate) vector part gives a direction of norm ≤ its size / NORM_EPS.
    """
    made = tables(algebra, x.device, x.dtype)
    # the vector blades read by a 0/1 GEMM (exact): a slice's backward writes a zero-filled copy of x
    vec = x.sum(-2) @ made["vector"]
    sq = (vec * vec * made["metric"]).sum(-1, keepdim=True)
    return vec / sq.clamp_min(NORM_EPS**2).sqrt()


def pair_scale(dot: Tensor, sign: float) -> Tensor:
    """The guarded per-pair normaliser ``1 / (2 max(1 + sign · ⟨a, b⟩, guard_eps))``: ``dot`` any shape →
    same shape.

    A head's ``sign`` (`geoattn.attention.rotor.plan.Sandwich`): rotation ``+1``,
    ``|1 + b a|² = 2(1 + ⟨a, b⟩)``; reflection ``−1``, ``|a − b|² = 2(1 − ⟨a, b⟩)`` for unit a, b.
    """
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


def logit_queries(q: Tensor, algebra: CliffordAlgebra) -> Tensor:
    """q with the metric and 1/sqrt(C·dim) folded in: ``(B, H, N, C, dim)`` → ``(B, H, N, C·dim)``.

    Then ``logits = q' @ k.flatten(-2)ᵀ`` is ``Σ_c ⟨reverse(q_c) k_c⟩₀ / sqrt(C · dim)``.
    """
    w = tables(algebra, q.device, q.dtype)["logit"]
    return (q * (w / math.sqrt(q.shape[-2] * q.shape[-1]))).flatten(-2)


def allowed_pairs(nq: int, nk: int, start: int, causal: bool, key_mask: Tensor | None, device) -> Tensor:
    """Bool ``(B|1, 1, nq, nk)``: which (query start + i, key j) pairs attend."""
    allowed = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    if causal:
        i = torch.arange(start, start + nq, device=device)[:, None]
        allowed = allowed & (torch.arange(nk, device=device)[None, :] <= i)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :nk]
    return allowed


def plain_attention(q, k, values: Tensor, algebra, causal: bool, key_mask: Tensor | None) -> Tensor:
    """``softmax_j(Σ_c ⟨reverse(q_ic) k_jc⟩₀ / sqrt(C · dim)) values_j`` with SDPA: q, k
    ``(B, H, N, C, dim)``, values ``(B, H, N, F)`` → ``(B, H, N, F)``. Where every blade's metric weight
    is 1 (Euclidean signatures) q goes in as it is, with SDPA's scale (no extra pass over q)."""
    scale = 1 / math.sqrt(q.shape[-2] * q.shape[-1])
    euclidean = algebra.q == algebra.r == 0  # every ⟨ẽ_A e_A⟩₀ = 1
    qs = q.flatten(-2) if euclidean else (q * tables(algebra, q.device, q.dtype)["logit"]).flatten(-2)
    kf = k.flatten(-2)
    mask = None
    if key_mask is not None and not causal:
        mask = key_mask[:, None, None, :]  # (B, 1, 1, N): broadcast, no N×N
    elif key_mask is not None:
        # SDPA cannot combine is_causal with a mask: padding and causality together cost one
        # (B, 1, N, N) bool mask (1 byte a pair; padded causal sequences are the rare case)
        mask = allowed_pairs(qs.shape[2], kf.shape[2], 0, causal, key_mask, qs.device)
        causal = False
    return F.scaled_dot_product_attention(qs, kf, values, attn_mask=mask, is_causal=causal, scale=scale)
