"""The factorised sandwich (docs/concepts/rotors.md#the-factorised-sandwich), the fast kernel of the heads
whose pair transform is a sandwich polynomial (`geoattn.attention.rotor.plan.Sandwich`), and the two
such forms, `ROTATION` and `REFLECTION`.

The unscaled sandwich N (``(1 + b a) v (1 + a b)``, ``(a − b) v̂ (a − b)``) is a polynomial of degree ≤ 2
in a and in b, so ``o_i = Σ_r (ψ(a_i) @ Q)_r Σ_j W_ij (φ(b_j) ⊗ v_j @ K)_r`` with monomials ``φ(b) = [1, b_l,
b_l b_m (l ≤ m)]``, ``W_ij = α_ij · pair_scale(⟨a_i, b_j⟩)`` and constant tables K, Q (the plan). With
``d = 1 ± ⟨a, b⟩`` the sandwich splits as ``N = d G + rest``, G aggregated with the weights ``W ⊙ d``.
Per query chunk (`geoattn.attention.rotor.blocks.query_blocks`): the logits GEMM, ``⟨a_i, b_j⟩``,
softmax and weights, the two weight GEMMs with the key features, then the small per-query
contraction. Memory O(chunk · N) per (B, H), never an N×N×dim tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.rotor.blocks import BlockKernel, block_weights, needs_grad, query_blocks
from geoattn.attention.rotor.params import (
    affine,
    directions,
    guard_eps,
    logit_queries,
    monomials,
    pair_scale,
    tables,
)
from geoattn.attention.rotor.plan import Plan, Sandwich, plan_on, signed_lift


def _one(ga: CliffordAlgebra, like: Tensor) -> Tensor:
    """The scalar 1 as a ``(dim,)`` multivector on ``like``'s device and dtype."""
    one = torch.zeros(ga.dim, dtype=like.dtype, device=like.device)
    one[ga.blade_index("")] = 1
    return one


def _rotation(ga: CliffordAlgebra, inverse: bool, a, b, v) -> Tensor:
    """``(1 + b a) v (1 + a b)`` (inverse: a and b swapped), all ``(..., dim)`` (broadcast)."""
    gp, one = ga.geometric_product, _one(ga, a)
    left, right = (one + gp(a, b), one + gp(b, a)) if inverse else (one + gp(b, a), one + gp(a, b))
    return gp(gp(left, v), right)


def _rotation_moved(ga: CliffordAlgebra, inverse: bool, a, b, moved) -> Tensor:
    """G on the moved blades: ``2 c v + [B, v]`` with ``B = b ∧ a`` (inverse: ``a ∧ b``), ``c = ⟨a, b⟩``."""
    B = ga.outer_product(b, a) * (-1 if inverse else 1)
    c = ga.scalar_product(a, b)[..., None]
    return 2 * c * moved + ga.geometric_product(B, moved) - ga.geometric_product(moved, B)


def _reflection(ga: CliffordAlgebra, inverse: bool, a, b, v) -> Tensor:
    """``(a − b) v̂ (a − b)`` (v̂ the grade involution; it maps a to b and b to a: ``inverse`` is the same)."""
    n = a - b
    return ga.geometric_product(ga.geometric_product(n, ga.grade_involution(v)), n)


ROTATION = Sandwich("rotation", 1.0, _rotation, _rotation_moved)
REFLECTION = Sandwich("reflection", -1.0, _reflection)


def factorised(form: Sandwich):
    """The fast kernel of a sandwich head (the registry's kernel signature)."""

    def kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
        return _factorised(q, k, v, algebra, form, causal, inverse, key_mask, chunk_size)

    return kernel


def pair_values(form: Sandwich):
    """The reference's pair transform of a sandwich head (`geoattn.attention.rotor.reference.pairwise`):
    ``N(a_i, b_j, v_j) · pair_scale(⟨a_i, b_j⟩)``, i.e. ``R v R̃`` with the normalised versor, per block
    of pairs ``(B, H, qb, kb, Cv, dim)``, built with the algebra engine's products."""

    def values(q, k, v, ga, inverse):
        a, b = directions(q, ga), directions(k, ga)  # (B, H, N, n)
        metric = tables(ga, q.device, q.dtype)["metric"]

        def block(s: int, e: int, t: int, u: int) -> Tensor:
            a_, b_ = a[:, :, s:e, None], b[:, :, None, t:u]
            scale = pair_scale((a_ * b_ * metric).sum(-1), form.sign)[..., None, None]
            A, Bv = ga.vector(a_)[..., None, :], ga.vector(b_)[..., None, :]  # (B, H, qb|1, 1|kb, 1, dim)
            return form.unscaled(ga, inverse, A, Bv, v[:, :, None, t:u]) * scale

        return block

    return values


def _sandwich_block(
    qs_c, a1_c, psi_c, kf, b1, feats_w, feats_d, mask, queries, guard: float
) -> tuple[Tensor]:
    """One query block of the rotation / reflection sum, ``((B, H, nq, Cv, dim),)``: the key features
    ``feats_w (B, H, nk, Cv · r_w)`` aggregated with ``W = α / max(d, guard)`` (``d_ij = 1 ± ⟨a_i, b_j⟩ =
    a1_c @ b1ᵀ``), ``feats_d (B, H, nk, Cv · r_d)`` with ``W ⊙ d``, both contracted with the query's map
    ``ψ(a_i) @ queries`` (:func:`sandwich_plan`)."""
    B, H, nq = qs_c.shape[:3]
    if torch.compiler.is_compiling():  # a sum of n + 1 broadcast products, fused with the softmax
        d = (a1_c[..., :, None, :] * b1[..., None, :, :]).sum(-1)  # (B, H, nq, nk)
    else:  # eager, one GEMM (compiled, the broadcast sum fuses with the softmax and costs less than it)
        d = a1_c @ b1.transpose(-1, -2)
    weights = block_weights(qs_c, kf, mask) / d.clamp_min(guard)
    r = queries.shape[1]
    Cv = (feats_w.shape[-1] + feats_d.shape[-1]) // r
    query_map = (psi_c @ queries.flatten(1)).view(B, H, nq, r, queries.shape[2])  # (B, H, nq, r, dim)
    agg_w = (weights @ feats_w).view(B, H, nq, Cv, -1)
    agg_d = ((weights * d) @ feats_d).view(B, H, nq, Cv, -1)
    return (torch.cat([agg_w, agg_d], -1) @ query_map,)


# one sandwich kernel per table shape (P, r, dim, r_w): heads of other feature counts would otherwise
# share one compiled copy, and the second would turn it dynamic (slower) for both
_SANDWICH_BLOCKS: dict[tuple, BlockKernel] = {}


def _sandwich_kernel(plan: Plan) -> BlockKernel:
    key = (*plan.queries.shape, plan.keys_w.shape[-1])
    if key not in _SANDWICH_BLOCKS:
        _SANDWICH_BLOCKS[key] = BlockKernel(_sandwich_block)
    return _SANDWICH_BLOCKS[key]


def _factorised(q, k, v, algebra, form: Sandwich, causal, inverse, key_mask, chunk_size) -> Tensor:
    """The sum aggregation of a sandwich head: see the module docstring and :func:`sandwich_plan`."""
    plan = plan_on(algebra, form, inverse, q.device, q.dtype)
    a, b = directions(q, algebra), directions(k, algebra)  # (B, H, N, n)
    mono = monomials(b)  # (B, H, N, P)
    # 1 ± ⟨a_i, b_j⟩ = [1, ±metric·a_i] · [1, b_j], one GEMM per block; [1, b_j] are b_j's first monomials
    a1 = affine(a, *signed_lift(algebra, plan.sign, q.device, q.dtype))  # (B, H, N, 1 + n)
    b1 = mono[..., : 1 + algebra.n]  # (B, H, N, 1 + n), a view
    # each key's features, channel-major: v_c @ (Σ_p φ_p(b) keys[p]) → (B, H, N, Cv · r)
    feats_w, feats_d = (
        (v @ (mono @ t.flatten(1)).unflatten(-1, t.shape[1:])).flatten(-2) for t in (plan.keys_w, plan.keys_d)
    )
    (out,) = query_blocks(
        _sandwich_kernel(plan),
        (logit_queries(q, algebra), a1, monomials(a)),
        (k.flatten(-2), b1, feats_w, feats_d),
        (plan.queries, guard_eps(q.dtype)),
        causal=causal, key_mask=key_mask, chunk_size=chunk_size, algebra=algebra, grad=needs_grad(q, k, v),
    )  # fmt: skip
    return out
