"""Standard Transformer pieces and the nGPT hypersphere block (SPEC §1.4, §1.6).

Two families share this file:

* the pre-norm GPT block (``Block``): norm → causal self-attention (RoPE via SDPA) → residual, norm →
  MLP (SwiGLU or GELU) → residual; the baseline every geometric layer is measured against;
* the hypersphere block (``SphereBlock``, nGPT, Loshchilov et al. 2025): the residual stream lives on
  the unit sphere, each sublayer's output is normalised and the state moves towards it by a learned
  per-channel step, followed by a retraction (or an exact geodesic step). ``geoattn.layers.rt.RTBlock``
  is the same block around RT-Filter attention.

All shapes: ``B`` batch, ``T`` tokens, ``C`` model width, ``H`` heads, ``D = C / H`` head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.algebra.rotation import rope_angles, rope_frequencies, rotate_pairs

STEPS = ("retraction", "geodesic")


def default_positions(x: Tensor, positions: Tensor | None) -> Tensor:
    """Token times ``(T,)`` or ``(B, T)`` for ``x`` ``(B, T, C)``; ``arange(T)`` if ``positions`` is None."""
    B, T = x.shape[0], x.shape[1]
    if positions is None:
        return torch.arange(T, device=x.device, dtype=torch.float32)
    if positions.shape not in ((T,), (B, T)):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({T},) or ({B}, {T})")
    return positions


def check_input(x: Tensor, n_embd: int, name: str = "x") -> None:
    """Raise a ValueError unless ``x`` is ``(B, T, n_embd)``."""
    if x.dim() != 3 or x.shape[-1] != n_embd:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected (B, T, {n_embd})")


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """``(B, T, H·D)`` → ``(B, H, T, D)``."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``(B, H, T, D)`` → ``(B, T, H·D)``."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def causal_softmax(logits: Tensor, causal: bool) -> Tensor:
    """Softmax over the last axis of ``(..., T, T)`` logits, masking keys after the query if ``causal``."""
    if causal:
        T = logits.shape[-1]
        mask = torch.ones(T, T, dtype=torch.bool, device=logits.device).tril()
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(dim=-1)


def swiglu_hidden(n_embd: int) -> int:
    """SwiGLU width matched to a 4× GELU MLP (3·C·h = 8·C²), rounded to a multiple of 4: 340 at C=128."""
    return 4 * round(8 * n_embd / 3 / 4)


@torch.no_grad()
def normalize_(weight: Tensor, dim: int) -> None:
    """Renormalise ``weight`` in place to unit norm along ``dim`` (nGPT's weight projection)."""
    weight.copy_(F.normalize(weight, dim=dim))


class ScaledVector(nn.Module):
    """A learnable vector in nGPT's parameterisation: stored as ``scale``, used as ``stored · init / scale``.

    At initialisation the effective value is ``init``; Adam moves the stored value by about ``lr`` per
    step, so the effective value moves by ``lr · init / scale``: ``scale`` sets the effective learning
    rate of the vector independently of the optimiser's global rate.
    """

    def __init__(self, size: int, init: float, scale: float):
        super().__init__()
        if init <= 0 or scale <= 0:
            raise ValueError(f"ScaledVector needs init > 0 and scale > 0, got init={init}, scale={scale}")
        self.init, self.scale = init, scale
        self.weight = nn.Parameter(torch.full((size,), scale))

    def forward(self) -> Tensor:
        """The effective vector ``(size,)``."""
        return self.weight * (self.init / self.scale)


class RMSNorm(nn.Module):
    """``x / rms(x) · g`` over the last axis ``(..., C)``; computed in float32 for bf16 inputs."""

    def __init__(self, n_embd: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_embd))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


def make_norm(kind: str, n_embd: int) -> nn.Module:
    """``"layernorm"`` (bias-free, nanoGPT) or ``"rmsnorm"``."""
    if kind == "layernorm":
        return nn.LayerNorm(n_embd, bias=False)
    if kind == "rmsnorm":
        return RMSNorm(n_embd)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


class GELUMLP(nn.Module):
    """nanoGPT's MLP: ``(B, T, C) → GELU(C → hidden) → C``, no biases (hidden 4·C by default)."""

    def __init__(self, n_embd: int, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.c_fc = nn.Linear(n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """``(B, T, C) → W_o (W_u x ⊙ silu(W_v x))``, no biases; width parameter-matched to 4× GELU by default."""

    def __init__(self, n_embd: int, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        hidden = hidden or swiglu_hidden(n_embd)
        self.hidden = hidden
        self.c_fc = nn.Linear(n_embd, 2 * hidden, bias=False)  # [u | v]
        self.c_proj = nn.Linear(hidden, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        u, v = self.c_fc(x).split(self.hidden, dim=-1)
        return self.dropout(self.c_proj(u * F.silu(v)))


def make_mlp(kind: str | None, n_embd: int, hidden: int | None, dropout: float) -> nn.Module | None:
    """``"swiglu"``, ``"gelu"`` or ``None`` (no MLP sublayer)."""
    if kind is None:
        return None
    if kind == "swiglu":
        return SwiGLU(n_embd, hidden, dropout)
    if kind == "gelu":
        return GELUMLP(n_embd, hidden, dropout)
    raise ValueError(f"mlp must be 'swiglu', 'gelu' or None, got {kind!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head softmax attention with optional RoPE, on SDPA; no biases.

    ``forward(x (B, T, C), positions (T,) | (B, T) | None) -> (B, T, C)``. RoPE rotates q and k by
    ``rotate_pairs`` with the standard spectrum ``rope_base^(−2k/D)`` at the (float) token times.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        rope: bool = True,
        rope_base: float = 10000.0,
        causal: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
        self.n_embd, self.n_head, self.causal, self.dropout = n_embd, n_head, causal, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.resid_dropout = nn.Dropout(dropout)
        if rope:
            self.register_buffer("omega", rope_frequencies(n_embd // n_head, 1, rope_base), persistent=False)
        else:
            self.omega = None

    def _qkv(self, x: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        check_input(x, self.n_embd)
        positions = default_positions(x, positions)
        q, k, v = (split_heads(t, self.n_head) for t in self.c_attn(x).split(self.n_embd, dim=-1))
        if self.omega is not None:
            angle = rope_angles(positions.to(x.device), self.omega)  # (B|1, 1, T, D/2)
            q, k = rotate_pairs(q, angle), rotate_pairs(k, angle)
        return q, k, v  # (B, H, T, D)

    def logit_scale(self, head_dim: int) -> float:
        """The factor on ``q·k``: ``1/sqrt(D)`` here."""
        return 1.0 / math.sqrt(head_dim)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        q, k, v = self._qkv(x, positions)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=self.causal,
            scale=self.logit_scale(q.shape[-1]),
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.resid_dropout(self.c_proj(merge_heads(y)))

    def attention_weights(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """The explicit softmax weights ``(B, H, T, T)`` (what SDPA computes without materialising)."""
        q, k, _ = self._qkv(x, positions)
        return causal_softmax(q @ k.transpose(-2, -1) * self.logit_scale(q.shape[-1]), self.causal)


class Block(nn.Module):
    """Pre-norm GPT block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (MLP optional)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module | None, n_embd: int, norm: str = "layernorm"):
        super().__init__()
        self.ln_1, self.attn = make_norm(norm, n_embd), attn
        self.ln_2 = make_norm(norm, n_embd) if mlp is not None else None
        self.mlp = mlp

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), positions)
        if self.mlp is not None:
            x = x + self.mlp(self.ln_2(x))
        return x

    def attention_weights(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """``(B, H, T, T)`` weights of this block's attention for block input ``x``."""
        return self.attn.attention_weights(self.ln_1(x), positions)


# ------------------------------------------------------------------------------------------------
# The hypersphere (nGPT) family


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
        tangent_correction: if True, the update direction is the tangent part ``o − ⟨o,h⟩h`` (SPEC
            §1.3); if False, nGPT's ``o − h`` (the two differ only radially, i.e. in the effective
            step length once retracted).
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
        u, v = self.c_fc(x).split(self.hidden, dim=-1)
        u, v = u * self.s_u(), v * (self.s_v() * math.sqrt(self.n_embd))
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
        o = F.normalize(o, dim=-1)
        return sphere_step(h, o, alpha(), tangent_correction=self.tangent_correction, step=self.step)

    def forward(self, h: Tensor, positions: Tensor | None = None) -> Tensor:
        check_input(h, self.n_embd, "h")
        h = self._update(h, self.attn(h, positions), self.alpha_attn)
        if self.mlp is not None:
            h = self._update(h, self.mlp(h), self.alpha_mlp)
        return h

    def attention_weights(self, h: Tensor, positions: Tensor | None = None) -> Tensor:
        """``(B, H, T, T)`` weights of this block's attention for block input ``h``."""
        return self.attn.attention_weights(h, positions)
