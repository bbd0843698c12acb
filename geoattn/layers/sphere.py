"""The hypersphere (nGPT) block family (docs/concepts/rt-filter.md#the-block; nGPT, Loshchilov et al. 2025).

The residual stream lives on the unit sphere; each sublayer's output is normalised and the state moves
towards it by a learned per-channel step, followed by a retraction (or an exact geodesic step).
``geoattn.layers.rt_block.RTBlock`` is the same block around RT-Filter attention.

Shapes: ``B`` batch, ``T`` tokens, ``C`` model width, ``H`` heads, ``D = C / H`` head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.layers.common import ScaledVector, check_input, normalize_, swiglu_hidden
from geoattn.layers.transformer import CausalSelfAttention

STEPS = ("retraction", "geodesic")


def to_sphere(x: Tensor) -> Tensor:
    """Unit rows ``x/|x|`` of ``(..., C)``; a zero row, which has no direction, maps to ``(1, …, 1)/sqrt(C)``.

    The fixed direction keeps the hypersphere models finite (values and gradients) on all-zero
    inputs, where ``F.normalize`` would return 0 and backpropagate ``1/eps`` through every layer.
    """
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    nonzero = norm > torch.finfo(x.dtype).tiny
    return torch.where(nonzero, x / norm.clamp_min(torch.finfo(x.dtype).tiny), x.shape[-1] ** -0.5)


def tangent_part(o: Tensor, h: Tensor) -> Tensor:
    """``o − ⟨o, h⟩ h``: the part of ``o`` ``(..., C)`` tangent to the sphere at unit ``h`` ``(..., C)``."""
    return o - (o * h).sum(-1, keepdim=True) * h


def sphere_step(h: Tensor, o: Tensor, alpha: Tensor, *, tangent_correction: bool, step: str) -> Tensor:
    """Move unit states ``h`` towards the unit sublayer outputs ``o`` by per-channel steps ``alpha``.

    Args:
        h: ``(..., C)`` unit-norm residual states.
        o: ``(..., C)`` unit-norm sublayer outputs.
        alpha: ``(C,)`` step sizes (nGPT's eigen learning rates).
        tangent_correction: if True, the update direction is the tangent part ``o − ⟨o,h⟩h``
            (docs/concepts/rt-filter.md#the-block); if False, nGPT's ``o − h`` (the two differ only radially,
            i.e. in the effective step length once retracted).
        step: ``"retraction"``: ``normalize(h + α⊙d)``; ``"geodesic"``: the exact exponential map
            ``cos|a| h + sin|a| a/|a|`` with ``a`` the tangent part of ``α⊙d`` (a per-channel α tilts
            ``α⊙d`` off the tangent plane, so it is projected again).

    Returns:
        ``(..., C)`` unit-norm states.
    """
    s = alpha * (tangent_part(o, h) if tangent_correction else o - h)
    if step == "retraction":
        return to_sphere(h + s)
    if step == "geodesic":
        a = tangent_part(s, h)
        r = torch.linalg.vector_norm(a, dim=-1, keepdim=True)
        return torch.cos(r) * h + torch.sinc(r / math.pi) * a  # sinc(r/π) = sin(r)/r, smooth at r = 0
    raise ValueError(f"step must be one of {STEPS}, got {step!r}")


def sphere_update(h: Tensor, o: Tensor, alpha: Tensor, *, tangent_correction: bool, step: str) -> Tensor:
    """``sphere_step(h, normalize(o), alpha, ...)``: one residual update of a hypersphere block.

    ``h (..., C)`` unit states, ``o (..., C)`` raw sublayer outputs, ``alpha (C,)``. In eager mode the
    retraction runs as one autograd node with its derivatives written out (`_SphereRetraction`):
    about twenty passes over ``(..., C)`` forward and backward instead of some fifty, for an update
    that every block makes twice per step. Compiled graphs and the geodesic step use the plain form.
    """
    if step == "retraction" and not torch.compiler.is_compiling():
        return _SphereRetraction.apply(h, o, alpha, tangent_correction)
    return sphere_step(h, F.normalize(o, dim=-1), alpha, tangent_correction=tangent_correction, step=step)


class _SphereRetraction(torch.autograd.Function):
    """``h' = to_sphere(h + α ⊙ d)`` with ``ô = o / max(|o|, 1e-12)`` (``F.normalize``) and
    ``d = ô − ⟨ô, h⟩ h`` (tangent correction) or ``d = ô − h``.

    Backward, with ``g = ∂h'``: ``∂x = (g − ⟨g, h'⟩ h') / |x|`` (0 where ``x = 0``: there ``h'`` is a
    constant), ``∂α = Σ ∂x ⊙ d``, ``∂d = α ⊙ ∂x``; tangent correction: ``∂ô = ∂d − ⟨∂d, h⟩ h`` and
    ``∂h = ∂x − ⟨ô, h⟩ ∂d − ⟨∂d, h⟩ ô``, else ``∂ô = ∂d``, ``∂h = ∂x − ∂d``; finally
    ``∂o = (∂ô − ⟨∂ô, ô⟩ ô) / |o|`` (``∂ô / 1e-12`` where ``|o| ≤ 1e-12``).
    """

    @staticmethod
    def forward(ctx, h, o, alpha, tangent_correction: bool):
        o_norm = torch.linalg.vector_norm(o, dim=-1, keepdim=True)
        o_unit = o / o_norm.clamp_min(1e-12)
        along = torch.linalg.vecdot(o_unit, h).unsqueeze(-1)  # ⟨ô, h⟩
        d = torch.addcmul(o_unit, along, h, value=-1) if tangent_correction else o_unit - h
        x = torch.addcmul(h, alpha, d)
        x_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        tiny = torch.finfo(x.dtype).tiny
        out = torch.where(x_norm > tiny, x / x_norm.clamp_min(tiny), x.shape[-1] ** -0.5)
        ctx.tangent_correction = tangent_correction
        ctx.save_for_backward(h, alpha, o_unit, o_norm, along, d, x_norm, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, alpha, o_unit, o_norm, along, d, x_norm, out = ctx.saved_tensors
        tiny = torch.finfo(out.dtype).tiny
        radial = torch.linalg.vecdot(grad, out).unsqueeze(-1)
        grad_x = torch.addcmul(grad, radial, out, value=-1).div_(x_norm.clamp_min(tiny))
        grad_x = grad_x.masked_fill_(x_norm <= tiny, 0.0)
        grad_alpha = (grad_x * d).flatten(0, -2).sum(0) if ctx.needs_input_grad[2] else None
        grad_d = grad_x * alpha
        if ctx.tangent_correction:
            on_h = torch.linalg.vecdot(grad_d, h).unsqueeze(-1)  # ⟨∂d, h⟩
            grad_unit = torch.addcmul(grad_d, on_h, h, value=-1)
            grad_h = grad_x.addcmul_(along, grad_d, value=-1).addcmul_(on_h, o_unit, value=-1)
        else:
            grad_unit, grad_h = grad_d, grad_x.sub_(grad_d)
        on_unit = torch.linalg.vecdot(grad_unit, o_unit).unsqueeze(-1)
        # F.normalize below its eps divides by the constant 1e-12: no radial term there
        on_unit = on_unit.masked_fill_(o_norm <= 1e-12, 0.0)
        grad_o = torch.addcmul(grad_unit, on_unit, o_unit, value=-1).div_(o_norm.clamp_min(1e-12))
        return grad_h, grad_o, grad_alpha, None


class NormalizedSwiGLU(nn.Module):
    """nGPT's MLP: ``W_o (s_u⊙W_u x ⊙ silu(s_v⊙W_v x · sqrt(C)))`` with learned scales ``s_u, s_v``.

    ``(B, T, C) → (B, T, C)``. Weight rows are renormalised along the embedding axis by
    :meth:`normalize_weights`; ``sqrt(C)`` restores the pre-activation scale that unit-norm inputs and
    rows remove, so SiLU sees values of order one.
    """

    def __init__(self, n_embd: int, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        hidden = hidden or swiglu_hidden(n_embd)
        self.n_embd, self.hidden = n_embd, hidden
        self.c_fc = nn.Linear(n_embd, 2 * hidden, bias=False)  # [u | v]
        self.c_proj = nn.Linear(hidden, n_embd, bias=False)
        self.s_u = ScaledVector(hidden, 1.0, 1.0)
        self.s_v = ScaledVector(hidden, 1.0, 1.0)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        # s_u and s_v scale output rows of c_fc: applied to its (2·hidden, C) weight instead of the
        # (B, T, 2·hidden) activations, the same product with fewer operations on large tensors
        scale = torch.cat((self.s_u(), self.s_v() * math.sqrt(self.n_embd)))
        u, v = F.linear(x, self.c_fc.weight * scale[:, None]).split(self.hidden, dim=-1)
        return self.dropout(self.c_proj(u * F.silu(v)))

    def normalize_weights(self) -> None:
        """Unit-norm weights along the embedding axis (input rows of c_fc, output columns of c_proj)."""
        normalize_(self.c_fc.weight, dim=1)
        normalize_(self.c_proj.weight, dim=0)


class NGPTAttention(CausalSelfAttention):
    """nGPT attention: RoPE, then unit q and k scaled per dimension by ``s_qk``, logit scale ``sqrt(D)``.

    ``forward(x (B, T, C), positions) -> (B, T, C)`` on SDPA. ``s_qk`` is ``(C,)`` (per head and head
    dimension), init 1, stored with scale ``1/sqrt(C)`` (nGPT).
    """

    def __init__(self, n_embd: int, n_head: int, **kwargs):
        super().__init__(n_embd, n_head, **kwargs)
        self.s_qk = ScaledVector(n_embd, 1.0, n_embd**-0.5)

    def logit_scale(self, head_dim: int) -> float:
        return math.sqrt(head_dim)  # unit q, k: cosines need a large scale to be decisive

    def _qkv(self, x: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super()._qkv(x, positions)
        s_qk = self.s_qk().view(self.n_head, 1, -1)  # (H, 1, D)
        return F.normalize(q, dim=-1) * s_qk, F.normalize(k, dim=-1) * s_qk, v

    def normalize_weights(self) -> None:
        """Unit-norm weights along the embedding axis (rows of c_attn, columns of c_proj)."""
        normalize_(self.c_attn.weight, dim=1)
        normalize_(self.c_proj.weight, dim=0)


class SphereBlock(nn.Module):
    """A residual block on the unit sphere: ``h ← step(h, normalize(sublayer(h)), α)`` per sublayer.

    ``forward(h (B, T, C) unit rows, positions) -> (B, T, C)`` unit rows. ``attn`` is any module
    ``(x, positions) -> (B, T, C)`` (``NGPTAttention`` for nGPT, ``RTAttention`` for the RT block);
    ``mlp`` a ``(B, T, C) -> (B, T, C)`` module or None (attention-only). Each sublayer has its own
    per-channel step ``α`` (``ScaledVector``: init ``alpha_init``, scale ``1/sqrt(C)``). See
    :func:`sphere_step` for ``tangent_correction`` and ``step``.
    """

    def __init__(
        self,
        attn: nn.Module,
        mlp: nn.Module | None,
        n_embd: int,
        *,
        alpha_init: float = 0.05,
        tangent_correction: bool = False,
        step: str = "retraction",
    ):
        super().__init__()
        if step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {step!r}")
        self.n_embd, self.tangent_correction, self.step = n_embd, tangent_correction, step
        self.attn, self.mlp = attn, mlp
        self.alpha_attn = ScaledVector(n_embd, alpha_init, n_embd**-0.5)
        self.alpha_mlp = ScaledVector(n_embd, alpha_init, n_embd**-0.5) if mlp is not None else None

    def _update(self, h: Tensor, o: Tensor, alpha: ScaledVector) -> Tensor:
        return sphere_update(h, o, alpha(), tangent_correction=self.tangent_correction, step=self.step)

    def forward(self, h: Tensor, positions: Tensor | None = None) -> Tensor:
        check_input(h, self.n_embd, "h")
        h = self._update(h, self.attn(h, positions), self.alpha_attn)
        if self.mlp is not None:
            h = self._update(h, self.mlp(h), self.alpha_mlp)
        return h

    def attention_weights(self, h: Tensor, positions: Tensor | None = None) -> Tensor:
        """``(B, H, T, T)`` weights of this block's attention for block input ``h``."""
        return self.attn.attention_weights(h, positions)
