"""The standard pre-norm Transformer (GPT) pieces (docs/concepts/rt-filter.md#baselines): norms, MLPs, RoPE
self-attention, ``Block``.

The pre-norm GPT block (``Block``): norm → causal self-attention (RoPE via SDPA) → residual, norm →
MLP (SwiGLU or GELU) → residual; the baseline every geometric layer is measured against.

Shapes: ``B`` batch, ``T`` tokens, ``C`` model width, ``H`` heads, ``D = C / H`` head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.algebra.rotation import rope_angles, rope_frequencies, rotate_pairs
from geoattn.attention.rt import rt_attention_qkv
from geoattn.layers.common import (
    causal_softmax,
    check_input,
    default_positions,
    merge_heads,
    split_heads,
    swiglu_hidden,
)


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

    Two of the RT paper's changes can be added here one at a time (the rt-predictions experiment);
    either replaces the logit ``q·k/sqrt(D)`` by RT-Filter's without process noise,
    ``log κ_j + β κ_j (⟨q̂_i, k̂_j⟩ − 1)``, computed by ``rt_attention_qkv`` on the RoPE-rotated q, k
    (values are not transported, as here), with learned per-head ``β`` (init sqrt(D)) and ``η²``
    (init 1) and no attention dropout:

    * ``magnitude_precision``: ``κ_j = m_j²/η²`` with ``m_j = sqrt(H)·|k_j|`` (RTAttention's scale);
      values stay raw. The logit reads q and k through their directions, which is how the precision
      is defined (the magnitude is the confidence, the direction the measurement).
    * ``qkv_norm``: q, k and v normalised after projection: ``κ = 1/η²`` (no magnitude), unit values;
      ``β/η²`` is the learned logit scale that unit q, k need (``1/sqrt(D)`` on a cosine would leave
      the softmax almost uniform).

    Both together are RT-Filter attention with separable precision, without value transport.
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
        alibi: bool = False,
        magnitude_precision: bool = False,
        qkv_norm: bool = False,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
        if alibi and rope:
            raise ValueError("alibi and rope are two position schemes; choose one")
        self.rt_logit = magnitude_precision or qkv_norm
        if alibi and self.rt_logit:
            raise ValueError(
                "alibi adds a bias to the dot-product logit; magnitude_precision and qkv_norm replace it"
            )
        self.n_embd, self.n_head, self.causal, self.dropout = n_embd, n_head, causal, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.resid_dropout = nn.Dropout(dropout)
        if rope:
            self.register_buffer("omega", rope_frequencies(n_embd // n_head, 1, rope_base), persistent=False)
        else:
            self.omega = None
        # ALiBi (Press et al. 2022): a linear distance penalty per head, slopes 2^(-8h/H), the
        # standard length-extrapolation baseline
        slopes = 2.0 ** (-8.0 * torch.arange(1, n_head + 1) / n_head) if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        self.magnitude_precision, self.qkv_norm = magnitude_precision, qkv_norm
        if self.rt_logit:
            head_dim = n_embd // n_head
            self.log_eta_t2 = nn.Parameter(torch.zeros(n_head))
            self.log_beta = nn.Parameter(torch.full((n_head,), 0.5 * math.log(head_dim)))
            self.key_scale = math.sqrt(n_head) if magnitude_precision else None

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

    def _alibi_bias(self, x: Tensor, positions: Tensor | None) -> Tensor:
        """``(B|1, H, T, T)`` bias ``−slope_h |t_i − t_j|``, −inf above the diagonal if causal.

        ALiBi needs this explicit (T, T) bias per head (it is not separable), as every ALiBi
        implementation on SDPA; it is a baseline, not one of geoattn's kernels.
        """
        t = default_positions(x, positions).to(x.device, torch.float32)
        t = t if t.dim() == 2 else t[None]  # (B|1, T)
        bias = -(t[:, None, :, None] - t[:, None, None, :]).abs() * self.alibi_slopes.view(1, -1, 1, 1)
        if self.causal:
            T = x.shape[1]
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            bias = bias.masked_fill(future, float("-inf"))
        return bias.to(x.dtype)

    def _rt(self, q: Tensor, k: Tensor, v: Tensor, backend: str, return_weights: bool):
        """RT-Filter's logit on ``q, k, v (B, H, T, D)`` (see the class docstring)."""
        zeros = torch.zeros_like(self.log_beta)
        return rt_attention_qkv(
            torch.stack((q, k, v)).permute(1, 3, 0, 2, 4),  # (B, T, 3, H, D)
            key_scale=self.key_scale,
            mu_r=zeros,
            sigma_t2=zeros,
            eta_t2=self.log_eta_t2.exp(),
            beta=self.log_beta.exp(),
            causal=self.causal,
            backend=backend,
            return_weights=return_weights,
            normalize_values=self.qkv_norm,
            structure="separable",
        )

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        q, k, v = self._qkv(x, positions)
        if self.rt_logit:
            return self.resid_dropout(self.c_proj(merge_heads(self._rt(q, k, v, "auto", False))))
        alibi = self.alibi_slopes is not None
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self._alibi_bias(x, positions) if alibi else None,
            is_causal=self.causal and not alibi,
            scale=self.logit_scale(q.shape[-1]),
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.resid_dropout(self.c_proj(merge_heads(y)))

    def attention_weights(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """The explicit softmax weights ``(B, H, T, T)`` (what SDPA computes without materialising)."""
        q, k, v = self._qkv(x, positions)
        if self.rt_logit:
            return self._rt(q, k, v, "reference", True)[1]
        logits = q @ k.transpose(-2, -1) * self.logit_scale(q.shape[-1])
        if self.alibi_slopes is not None:
            logits = logits + self._alibi_bias(x, positions)
        return causal_softmax(logits, self.causal)


class Block(nn.Module):
    """Pre-norm GPT block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (MLP optional).

    ``tangent_correction=True`` adds the RT block's third change to the Euclidean residual stream:
    each sublayer output ``o`` loses its component along the current state's direction before the
    residual step, ``x ← x + (o − ⟨o, x̂⟩ x̂)`` with ``x̂ = x/|x|`` (for the rt-predictions ablation).
    """

    def __init__(
        self,
        attn: nn.Module,
        mlp: nn.Module | None,
        n_embd: int,
        norm: str = "layernorm",
        *,
        tangent_correction: bool = False,
    ):
        super().__init__()
        self.ln_1, self.attn = make_norm(norm, n_embd), attn
        self.ln_2 = make_norm(norm, n_embd) if mlp is not None else None
        self.mlp = mlp
        self.tangent_correction = tangent_correction

    def _step(self, x: Tensor, o: Tensor) -> Tensor:
        if self.tangent_correction:
            direction = F.normalize(x, dim=-1)
            o = o - (o * direction).sum(-1, keepdim=True) * direction
        return x + o

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        x = self._step(x, self.attn(self.ln_1(x), positions))
        if self.mlp is not None:
            x = self._step(x, self.mlp(self.ln_2(x)))
        return x

    def attention_weights(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """``(B, H, T, T)`` weights of this block's attention for block input ``x``."""
        return self.attn.attention_weights(self.ln_1(x), positions)
