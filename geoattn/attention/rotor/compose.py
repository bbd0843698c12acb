"""The compose aggregation's fast kernel (docs/concepts/rotors.md#compose): one mean rotor per query,
``R̄_i = exp(½ (Σ_j α_ij f(⟨a_i, b_j⟩) b_j) ∧ a_i)``, and ``out_i = R̄_i (Σ_j α_ij v_j) R̄_i~``.

Per query chunk: the logits GEMM, a softmax, ``⟨a_i, b_j⟩``, f on the N×N scalar tiles, then ``α @ v`` and
``(α f) @ b``; large compiled chunks have a backward of their own (`_ComposeFunction`: flash attention's
scheme, α recomputed from a log-sum-exp per query).
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn.attention.rotor.blocks import BlockKernel, block_weights, needs_grad, query_blocks
from geoattn.attention.rotor.params import (
    directions,
    logit_queries,
    rotor_log_scale,
    rotor_log_scale_derivative,
    tables,
)


def _compose_block(qs_c, am_c, kf, b, values, mask) -> tuple[Tensor, Tensor]:
    """One query block of compose: ``(α @ values, (α ⊙ f(⟨a_i, b_j⟩)) @ b)``."""
    alpha = block_weights(qs_c, kf, mask)
    return alpha @ values, (alpha * rotor_log_scale(am_c @ b.transpose(-1, -2))) @ b


_COMPOSE_BLOCK = BlockKernel(_compose_block)


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


_COMPOSE_FORWARD = BlockKernel(_compose_forward)


_COMPOSE_BACKWARD = BlockKernel(_compose_backward)


class _ComposeFunction(torch.autograd.Function):
    """Compose's query block with its own backward (flash attention's scheme): the forward keeps its
    inputs, its two sums and a log-sum-exp per query, and the weights α only where ``keep_weights`` (a
    single block: its memory is bounded like the blocks'); the backward recomputes α from the rest
    otherwise (:func:`_compose_backward`). Against autograd through :func:`_compose_block` with the block
    recomputed (activation checkpointing), the backward skips the recomputed sums and the softmax's
    reductions. Both halves run compiled (:class:`BlockKernel`; eager where that fails, the same
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
    """Compose's query blocks for :func:`query_blocks`. Large ones (``compiled``, outside a caller's
    ``torch.compile``) go through :class:`_ComposeFunction`, which recomputes what its backward needs
    itself (``own_backward``: `query_blocks` calls them with ``single``, whether the block is the only
    one); the others through :func:`_compose_block` under autograd, as every block kernel."""

    own_backward = True

    def __call__(self, compiled: bool, *args, single: bool | None = None):
        if single is not None:
            return _ComposeFunction.apply(*args, single)
        return _COMPOSE_BLOCK(compiled, *args)


def compose(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size) -> Tensor:
    """``R̄_i V̄_i R̄_i~`` with ``V̄_i = Σ_j α_ij v_j`` and ``R̄_i = exp(½ (Σ_j α_ij f(⟨a_i, b_j⟩) b_j) ∧ a_i)``.

    Per query chunk (:func:`_compose_block`): the logits GEMM, a softmax, ``⟨a_i, b_j⟩`` (one GEMM), ``f``
    on that (N×N scalar tiles only), then ``α @ v`` and ``(α f) @ b``; afterwards one wedge, one exp
    and one sandwich per query.
    """
    B, H, N, C, dim = q.shape
    Cv = v.shape[3]
    a, b = directions(q, algebra), directions(k, algebra)  # (B, H, N, n)
    am = a * tables(algebra, q.device, q.dtype)["metric"]  # am @ bᵀ = ⟨a_i, b_j⟩
    # b stored coordinate by coordinate (the same (B, H, N, n) tensor): the blocks' compiled kernels read
    # each coordinate of 16 consecutive keys as one vector, not as a strided gather
    b_by_coordinate = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    mean_values, mean_keys = query_blocks(
        _ComposeBlocks(),
        (logit_queries(q, algebra), am),
        (k.flatten(-2), b_by_coordinate, v.flatten(-2)),
        causal=causal, key_mask=key_mask, chunk_size=chunk_size, algebra=algebra, grad=needs_grad(q, k, v),
    )  # fmt: skip
    # Σ_j α_ij f_ij (b_j ∧ a_i) = (Σ_j α_ij f_ij b_j) ∧ a_i, a simple bivector: closed-form exp
    mean = algebra.outer_product(algebra.vector(mean_keys), algebra.vector(a))  # (B, H, N, dim)
    rotor = algebra.exp(-mean / 2 if inverse else mean / 2, simple=True)
    action = algebra.versor_matrix(rotor)  # (B, H, N, dim, dim), action @ x = R̄ x R̄~
    return mean_values.view(B, H, N, Cv, dim) @ action.transpose(-1, -2)
