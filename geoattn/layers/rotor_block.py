"""Rotor attention as modules: :class:`RotorAttention` (multi-head, one head type per head) and
:class:`RotorPositionalEncoding` (``R(t) = exp(t B / 2)``, learned bivector per head; RoPE in 2D), and
the pre-norm :class:`RotorBlock` of the RotorTransformer.

Multivectors are ``(B, N, C, dim)`` (tokens, channels, blades), invariant scalars ``(B, N, S)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from geoattn.algebra.clifford_algebra import CliffordAlgebra, cos_sinc
from geoattn.algebra.layout import blade_major_grad
from geoattn.attention.rotor import rotor_attention
from geoattn.attention.rotor.heads import HEADS, check_head_types
from geoattn.attention.rotor.qkv import qkv_groups
from geoattn.core.compile import disabled
from geoattn.layers.multivector import EquiLinear, GeometricMLP, GradeLayerNorm


class RotorPositionalEncoding(nn.Module):
    """``x ↦ R_h(t) x R̃_h(t)`` with ``R_h(t) = exp(t B_h / 2)``, one learned bivector ``B_h`` per head.

    Applied to the q and k multivector channels, the attention logits see only relative positions:
    ``⟨(R_i q R̃_i)~ (R_j k R̃_j)⟩₀ = ⟨q̃ R(t_j − t_i) k R̃(t_j − t_i)⟩₀`` since one head's rotors commute.
    In Cl(2), ``B = θ e12`` rotates the (e1, e2) plane by ``−θ t``: RoPE (:func:`rotate_pairs`) with
    ``ω = −θ``. Fixed planes pick directions, so this breaks rotation equivariance (as RoPE breaks
    shift-equivariance of absolute coordinates): use it for sequences, not for point sets.

    forward(x ``(B, H, N, C, dim)``, positions ``(N,)`` or ``(B, N)``) → ``(B, H, N, C, dim)``.
    """

    def __init__(self, algebra: CliffordAlgebra, n_heads: int, init_scale: float = 0.1):
        super().__init__()
        if algebra.n < 2:
            raise ValueError(f"RotorPositionalEncoding needs n ≥ 2 (bivectors), got {algebra!r}")
        self.algebra, self.n_heads = algebra, n_heads
        self.bivector_index = list(algebra.bivector_indices)
        self.bivectors = nn.Parameter(init_scale * torch.randn(n_heads, len(self.bivector_index)))
        # the generator L = (B x − x B) / 2 is linear in B's coordinates: one fixed matrix per bivector
        # blade, and ⟨B B⟩₀ = Σ_k b_k² ⟨e_k e_k⟩₀ (distinct bivector blades anticommute, or their product
        # has no scalar part): the closed form (`action`, n ≤ 3) costs a handful of ops per call
        generators = squares = None
        if algebra.n <= 3:
            blades = torch.eye(algebra.dim, dtype=torch.float64)[self.bivector_index]  # (K, dim)
            generators = ((algebra.left_matrix(blades) - algebra.right_matrix(blades)) / 2).float()
            squares = algebra.scalar_product(blades, blades).float()  # (K,)
        self.register_buffer("generators", generators, persistent=False)  # (K, dim, dim)
        self.register_buffer("squares", squares, persistent=False)

    def rotors(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """``R_h(t)``: positions ``(N,)`` / ``(B, N)`` → ``(B|1, H, N, dim)``."""
        t = positions if positions.dim() == 2 else positions[None]
        return self.algebra.exp(t[:, None, :, None].to(dtype) * self._bivectors(dtype)[None, :, None, :] / 2)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        if x.dim() != 5 or x.shape[1] != self.n_heads or x.shape[-1] != self.algebra.dim:
            raise ValueError(
                f"RotorPositionalEncoding: x has shape {tuple(x.shape)}, expected (B, {self.n_heads}, N, C, "
                f"{self.algebra.dim})"
            )
        self.check_positions(positions, x.shape[2])
        return x @ self.action(positions, x.dtype).transpose(-1, -2)

    def check_positions(self, positions: Tensor, n: int) -> None:
        """A ValueError unless ``positions`` is ``(n,)`` or ``(B, n)``."""
        if positions.shape[-1] != n or positions.dim() not in (1, 2):
            raise ValueError(
                f"RotorPositionalEncoding: positions has shape {tuple(positions.shape)}, expected (N,) or "
                f"(B, N) with N = {n}"
            )

    def action(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """The matrix of ``x ↦ R_h(t) x R̃_h(t)``: positions ``(N,)`` / ``(B, N)`` →
        ``(B|1, H, N, dim, dim)``.

        For n ≤ 3 every bivector is simple, and the action is a one-parameter group ``exp(t L_h)``
        whose generator ``L_h x = (B_h x − x B_h) / 2`` satisfies ``L³ = λ L`` with ``λ = B_h²`` (its
        eigenvalues are 0 and ``±sqrt(λ)``: the blades that meet the plane of B_h once turn, the others
        stay). So ``exp(t L) = 1 + t S(t² λ) L + (t²/2) S(t² λ / 4)² L²``, S as in the bivector
        exponential (``sin(tθ)/(tθ)`` for ``λ = −θ²``): two fixed matrices per head and two weights per
        position, where the sandwich would take geometric products per position (tested against it in
        Euclidean, mixed and degenerate signatures). For n ≥ 4 (non-simple bivectors) the sandwich
        matrix of the exponential."""
        ga = self.algebra
        if ga.n > 3:
            return ga.versor_matrix(self.rotors(positions, dtype))
        b = self.bivectors.to(dtype)  # (H, K)
        L = (b @ self.generators.to(dtype).flatten(1)).view(-1, ga.dim, ga.dim)  # (H, dim, dim)
        lam = (b * b) @ self.squares.to(dtype)  # (H,): B_h²
        t = (positions if positions.dim() == 2 else positions[None]).to(dtype)[:, None, :]  # (B|1, 1, N)
        # one C, S pair at μ = t²λ/4 gives both weights: S(4μ) = S(μ) C(μ) (sin 2x = 2 sin x cos x)
        c, s = cos_sinc(t * t * (lam[:, None] / 4))  # (B|1, H, N)
        f1, f2 = t * s * c, t * t / 2 * s * s
        eye = torch.eye(ga.dim, dtype=dtype, device=b.device)
        return eye + f1[..., None, None] * L[:, None] + f2[..., None, None] * (L @ L)[:, None]

    def _bivectors(self, dtype: torch.dtype) -> Tensor:
        """The learned ``B_h`` as multivectors ``(H, dim)``."""
        index = torch.tensor(self.bivector_index, device=self.bivectors.device)
        zeros = self.bivectors.new_zeros(self.n_heads, self.algebra.dim).to(dtype)
        return zeros.index_copy(-1, index, self.bivectors.to(dtype))


class RotorAttention(nn.Module):
    """Multi-head rotor attention over multivector channels (docs/concepts/rotors.md#the-rotor), equivariant
    by construction.

    q, k, v: one :class:`EquiLinear` (scalars feed their scalar grade); head h runs
    :func:`rotor_attention` with ``head_types[h]``; each head's output gets a learned gain per grade
    (the geometric aggregation of the heads), then an output :class:`EquiLinear` mixes the heads'
    channels back to the model width (and produces the scalar outputs).

    Args:
        algebra: the algebra of the channels.
        channels: multivector channels C of input and output; scalars: invariant scalar channels S.
        head_types: one registered head type per head (``geoattn.attention.rotor.heads``; e.g.
            ``"frame"`` needs Cl(3) and ≥ 2 head channels).
        head_channels: multivector channels per head (q, k and v).
        causal: attend to earlier tokens only. inverse: key → query rotors (rotation heads).
        positional_encoding: rotate q, k by :class:`RotorPositionalEncoding` (breaks equivariance;
            needs ``positions`` in forward).
        aggregation: ``"sum"`` or ``"compose"``: how the heads that compose (rotation) aggregate
            (``"compose"``: one mean rotor per query applied to the weighted mean value,
            docs/concepts/rotors.md#compose); other head types always sum. ``"compose"`` needs at least one
            such head.

    forward(x ``(B, N, C, dim)``, s ``(B, N, S)`` | None, mask ``(B, N)`` bool | None (True = real
    token), positions ``(N,)`` | ``(B, N)`` | None) → (``(B, N, C, dim)``, ``(B, N, S)`` | None).
    """

    def __init__(
        self,
        algebra: CliffordAlgebra,
        channels: int,
        head_types: list[str] | tuple[str, ...] = ("rotation",) * 4,
        head_channels: int = 4,
        scalars: int = 0,
        causal: bool = False,
        inverse: bool = False,
        positional_encoding: bool = False,
        *,
        aggregation: str = "sum",
    ):
        super().__init__()
        signature = (algebra.p, algebra.q, algebra.r)
        head_types = check_head_types(
            "RotorAttention",
            head_types,
            signature,
            head_channels,
            algebra=repr(algebra),
            aggregation=aggregation,
        )
        self.algebra, self.channels, self.scalars = algebra, channels, scalars
        self.head_types, self.head_channels = head_types, head_channels
        self.causal, self.inverse, self.aggregation = causal, inverse, aggregation
        H = len(head_types)
        self.qkv = EquiLinear(algebra, channels, 3 * H * head_channels, scalars, 0)
        self.grade_gain = nn.Parameter(torch.ones(H, algebra.n + 1))
        self.out = EquiLinear(algebra, H * head_channels, channels, 0, scalars)
        self.positional = RotorPositionalEncoding(algebra, H) if positional_encoding else None
        # heads of one type run together (`rotor_qkv.qkv_groups` cuts q, k and v so); `order` puts their
        # outputs back in head order, skipped where they are in order already
        self.groups = {
            t: [h for h, ht in enumerate(head_types) if ht == t] for t in dict.fromkeys(head_types)
        }
        concat = [h for idx in self.groups.values() for h in idx]
        self.register_buffer("order", torch.argsort(torch.tensor(concat)), persistent=False)
        self._reorder = concat != sorted(concat)

    def forward(
        self, x: Tensor, s: Tensor | None = None, mask: Tensor | None = None, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        if x.dim() != 4:
            raise ValueError(f"RotorAttention: x has shape {tuple(x.shape)}, expected (B, N, C, dim)")
        B, N = x.shape[:2]
        H, Ch = len(self.head_types), self.head_channels
        o = self._heads(self.project(x, s, positions, list(self.groups.values())), mask)  # (B, H, N, Ch, dim)
        # the heads' channels side by side, stored blade by blade (`blade_major`): one copy, which the
        # output map then reads as it is; the per-head grade gains fold into its weights
        o = o.permute(4, 0, 2, 1, 3).reshape(-1, B, N, H * Ch).permute(1, 2, 3, 0)
        return self.out(o, None, in_gain=self.grade_gain.repeat_interleave(Ch, 0))

    def project(
        self, x: Tensor, s: Tensor | None, positions: Tensor | None, groups: list[list[int]]
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """q, k and v of each group of heads (``groups``: head indices), ``(B, H_g, N, Ch, dim)`` each, q
        and k moved by the rotor positional encoding (:func:`~geoattn.attention.rotor.qkv.qkv_groups`)."""
        B, N = x.shape[:2]
        qkv, _ = self.qkv(x, s)  # (B, N, 3·H·Ch, dim)
        # the heads hand back q, k and v's gradients in the default order; one turn for the map's GEMMs
        qkv = blade_major_grad(qkv).view(B, N, 3, len(self.head_types), self.head_channels, -1)
        action = None
        if self.positional is not None:
            if positions is None:
                raise ValueError("RotorAttention: positional_encoding=True needs positions")
            self.positional.check_positions(positions, N)
            action = self.positional.action(positions, qkv.dtype)  # (B|1, H, N, dim, dim)
        return qkv_groups(qkv, action, groups)

    # Left out of a caller's torch.compile: inductor (torch 2.13, CPU) generated a backward for the heads
    # inside this layer that corrupted the heap (glibc "corrupted double-linked list"; reproduced with
    # `geoattn bench lm --models rotor --compile on`), while the kernel compiled on its own, and the
    # layer with the kernel left out, are exact. The kernel compiles its own block kernels either way.
    @disabled
    def _heads(self, parts: list[tuple[Tensor, Tensor, Tensor]], mask: Tensor | None) -> Tensor:
        """Each group of heads of one type (``parts``: its q, k, v ``(B, H_g, N, Ch, dim)``, in the order
        of ``groups``) through :func:`rotor_attention`; ``(B, H, N, Ch, dim)`` in head order."""
        outs = [
            rotor_attention(
                qg,
                kg,
                vg,
                algebra=self.algebra,
                head_type=t,
                causal=self.causal,
                inverse=self.inverse and HEADS[t].inverse,
                key_mask=mask,
                aggregation=self.aggregation if HEADS[t].compose is not None else "sum",
            )
            for t, (qg, kg, vg) in zip(self.groups, parts)
        ]
        o = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
        return o[:, self.order] if self._reorder else o


class RotorBlock(nn.Module):
    """Pre-norm block: ``x + RotorAttention(norm(x))``, then ``x + GeometricMLP(norm(x))``; scalars alike.

    ``forward(x (B, N, C, dim), s (B, N, S) | None, mask (B, N) | None) -> (x, s)`` of the same shapes.
    ``per_grade_norm``: :class:`GradeLayerNorm` normalises each grade separately (else all blades
    together); the MLP's hidden width is ``mlp_ratio · channels``; ``aggregation`` of the rotation
    heads as in :class:`RotorAttention`. ``layer_scale``: each branch's output multiplied by learned
    per-channel gains (multivector channels and scalars) that start at this value (CaiT's LayerScale;
    0 is ReZero's start: the block starts as the identity and grows each branch only as far as the
    loss asks); None: no gains. A gain per channel scales whole multivectors, so the block stays
    equivariant.
    """

    def __init__(
        self,
        algebra: CliffordAlgebra,
        channels: int,
        head_types: tuple[str, ...],
        head_channels: int,
        *,
        scalars: int = 0,
        inverse: bool = False,
        per_grade_norm: bool = False,
        mlp_ratio: int = 2,
        aggregation: str = "sum",
        layer_scale: float | None = None,
    ):
        super().__init__()
        C, S = channels, scalars
        self.norm1 = GradeLayerNorm(algebra, per_grade=per_grade_norm)
        self.norm2 = GradeLayerNorm(algebra, per_grade=per_grade_norm)
        self.snorm1 = nn.LayerNorm(S) if S else None
        self.snorm2 = nn.LayerNorm(S) if S else None
        self.attn = RotorAttention(
            algebra, C, head_types, head_channels, scalars=S, inverse=inverse, aggregation=aggregation
        )
        self.mlp = GeometricMLP(algebra, C, S, hidden=mlp_ratio * C)
        self.attn_scale = BranchScale(C, S, layer_scale) if layer_scale is not None else None
        self.mlp_scale = BranchScale(C, S, layer_scale) if layer_scale is not None else None

    def forward(self, x: Tensor, s: Tensor | None, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        dx, ds = self.attn(self.norm1(x), self.snorm1(s) if s is not None else None, mask)
        if self.attn_scale is not None:
            dx, ds = self.attn_scale(dx, ds)
        x, s = x + dx, (s + ds if s is not None else None)
        dx, ds = self.mlp(self.norm2(x), self.snorm2(s) if s is not None else None)
        if self.mlp_scale is not None:
            dx, ds = self.mlp_scale(dx, ds)
        return x + dx, (s + ds if s is not None else None)


class BranchScale(nn.Module):
    """Learned per-channel gains on a residual branch's output (CaiT's LayerScale), starting at
    ``init``: ``(dx (B, N, C, dim), ds (B, N, S) | None) → (γ_c dx_c, γ^s ⊙ ds)``. Vectors, not
    matrices, so the trainer does not decay them (a branch the loss does not use stays small)."""

    def __init__(self, channels: int, scalars: int, init: float):
        super().__init__()
        self.gain = nn.Parameter(torch.full((channels,), float(init)))
        self.scalar_gain = nn.Parameter(torch.full((scalars,), float(init))) if scalars else None

    def forward(self, dx: Tensor, ds: Tensor | None) -> tuple[Tensor, Tensor | None]:
        dx = dx * self.gain[:, None]
        if ds is not None and self.scalar_gain is not None:
            ds = ds * self.scalar_gain
        return dx, ds
