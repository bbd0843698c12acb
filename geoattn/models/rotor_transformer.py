"""`RotorTransformer`: an equivariant transformer for point sets on multivector channels
(docs/concepts/rotors.md).

Input per token: multivector channels ``(B, N, C_in, dim)`` and optional invariant scalars
``(B, N, S_in)``; output: ``(B, N, C_out, dim)`` and ``(B, N, S_out)``. Blocks are pre-norm:
``GradeLayerNorm → RotorAttention → residual``, ``GradeLayerNorm → GeometricMLP → residual`` (scalars
ride along with a plain LayerNorm). Every layer is equivariant under the algebra's versors, so the
model is: O(3) in Cl(3) (translations: the caller centres positions, e.g. with :func:`center`), E(3)
in PGA Cl(3,0,1) (GATr's embedding: points as trivectors, translations act by versors too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.algebra.named import algebra_signature, named_algebra
from geoattn.attention.rotor.heads import DEFAULT_HEAD_CYCLE, check_head_types, default_head_types
from geoattn.core.errors import ConfigError
from geoattn.core.settings import settings_from
from geoattn.layers.multivector import EquiLinear
from geoattn.layers.rotor_block import RotorBlock
from geoattn.models.base import ModelSizes

# of the algebra table (geoattn.algebra.named): the ones whose vectors are the tasks' 3D points
ALGEBRA_NAMES = ("cl3", "pga")


@dataclass
class RotorTransformerConfig:
    """Shape and options of a :class:`RotorTransformer`.

    From a run's flags (:meth:`from_sizes`, what ``geoattn train --model rotor`` uses): ``--n-embd``
    is read as about 8 numbers per multivector channel, so ``channels = scalars = n_embd // 8`` (at
    least 2); ``--n-head`` heads cycle through rotation, rotation, reflection, projection with
    ``head_channels = channels // n_head`` (at least 2) each; ``--n-layer`` blocks. ``--set
    model.KEY=VALUE`` overrides any of these (e.g. ``model.scalars=128`` for a wider scalar stream,
    ``model.head_types='["rotation", "projection"]'``); a task fixes the input/output shapes.

    Fields:
        algebra: "cl3" (Cl(3), O(3); the task centres positions) or "pga" (Cl(3,0,1), 16 blades, GATr's).
        in_channels: multivector inputs per token (fixed by the task).
        in_scalars: invariant scalar inputs per token (fixed by the task).
        out_channels: multivector outputs per token (fixed by the task).
        out_scalars: invariant scalar outputs per token (fixed by the task).
        channels: multivector channels of the model (from --n-embd: n_embd // 8, at least 2).
        scalars: invariant scalar channels beside them (from --n-embd: n_embd // 8; 0: none).
        n_layer: blocks (from --n-layer).
        head_types: a registered head type per head, e.g. rotation or frame (from --n-head, cycled).
        head_channels: multivector channels per head in q, k and v (from --n-head: channels // n_head).
        mlp_ratio: hidden multivector channels of each block's geometric MLP / channels.
        inverse: rotation heads use key → query rotors (default query → key).
        norm: "joint" (one invariant norm over all grades, GATr's) or "per_grade" (each grade alone).
        aggregation: how rotation heads aggregate: "sum" (Σ_j α_ij R_ij v_j R̃_ij) or "compose" (one
            mean rotor per query applied to the weighted mean value; docs/concepts/rotors.md#compose).
        layer_scale: learned per-channel gains on every block's attention and MLP outputs, starting
            at this value (0: each block starts as the identity, ReZero); None: none
            (:class:`~geoattn.layers.rotor_block.RotorBlock`).

    ``norm="joint"`` keeps the grades' relative sizes (e.g. |position| against the scalar channels);
    ``"per_grade"`` hides every grade's size from the next layer.
    """

    algebra: str = "cl3"
    in_channels: int = 1
    in_scalars: int = 0
    out_channels: int = 1
    out_scalars: int = 0
    channels: int = 16
    scalars: int = 16
    n_layer: int = 4
    head_types: tuple[str, ...] = DEFAULT_HEAD_CYCLE
    head_channels: int = 4
    mlp_ratio: int = 2
    inverse: bool = False
    norm: str = "joint"
    aggregation: str = "sum"
    layer_scale: float | None = None

    def __post_init__(self) -> None:
        signature = algebra_signature(self.algebra, "RotorTransformerConfig.algebra", ALGEBRA_NAMES)
        for name in ("in_channels", "out_channels", "channels", "n_layer", "head_channels", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"RotorTransformerConfig.{name} must be a positive integer, got {value!r}")
        for name in ("in_scalars", "out_scalars", "scalars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"RotorTransformerConfig.{name} must be an integer ≥ 0, got {value!r}")
        scale = self.layer_scale
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
        ):
            raise ConfigError(f"RotorTransformerConfig.layer_scale must be a number or None, got {scale!r}")
        self.head_types = check_head_types(
            "RotorTransformerConfig.head_types",
            self.head_types,
            signature,
            self.head_channels,
            algebra=f"algebra={self.algebra!r}",
            aggregation=self.aggregation,
        )
        if self.norm not in ("joint", "per_grade"):
            raise ConfigError(
                f"RotorTransformerConfig.norm must be 'joint' or 'per_grade', got {self.norm!r}"
            )
        if (self.in_scalars or self.out_scalars) and not self.scalars:
            raise ConfigError(
                "RotorTransformerConfig: scalar inputs/outputs need scalars > 0 (the scalar width)"
            )

    @classmethod
    def from_sizes(
        cls, sizes: ModelSizes, options: dict[str, Any] | None = None, **fixed: Any
    ) -> RotorTransformerConfig:
        """The config for a run: ``n_layer`` from the sizes, ``n_embd`` read as ≈ 8 numbers per
        multivector channel (``channels = scalars = n_embd // 8``), ``n_head`` heads cycling through
        rotation, rotation, reflection, projection with ``channels // n_head`` channels each; then the
        user's ``model.*`` options; ``fixed`` (the task's input/output shapes) last.
        """
        channels = max(2, sizes.n_embd // 8)
        defaults = {
            "n_layer": sizes.n_layer,
            "channels": channels,
            "scalars": channels,
            "head_types": default_head_types(sizes.n_head),
            "head_channels": max(2, channels // sizes.n_head),
        }
        return settings_from(cls, options, prefix="model", fixed=fixed, defaults=defaults)

    def make_algebra(self) -> CliffordAlgebra:
        return named_algebra(self.algebra)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["head_types"] = list(self.head_types)
        return d


def center(points: Tensor, mask: Tensor | None = None) -> Tensor:
    """Subtract the (masked) mean over tokens: ``(B, N, ...)`` → ``(B, N, ...)``. Makes Cl(3) inputs
    translation-invariant (positions only; velocities are already translation-invariant).

    mask: ``(B, N)`` bool, True for real tokens.
    """
    if mask is None:
        return points - points.mean(1, keepdim=True)
    w = mask.to(points.dtype).reshape(*mask.shape, *([1] * (points.dim() - 2)))
    return points - (points * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)


class RotorTransformer(nn.Module):
    """Equivariant transformer on multivector channels (see the module docstring).

    forward(mv ``(B, N, C_in, dim)``, scalars ``(B, N, S_in)`` | None, mask ``(B, N)`` bool | None
    (True = real token; padded tokens are never attended to)) → (mv_out ``(B, N, C_out, dim)``,
    scalars_out ``(B, N, S_out)``; ``S_out = 0`` gives an empty last dimension).
    """

    def __init__(self, config: RotorTransformerConfig):
        super().__init__()
        self.config = config
        self.algebra = config.make_algebra()
        C, S = config.channels, config.scalars
        self.embed = EquiLinear(self.algebra, config.in_channels, C, config.in_scalars, S)
        self.blocks = nn.ModuleList(
            RotorBlock(
                self.algebra,
                C,
                config.head_types,
                config.head_channels,
                scalars=S,
                inverse=config.inverse,
                per_grade_norm=config.norm == "per_grade",
                mlp_ratio=config.mlp_ratio,
                aggregation=config.aggregation,
                layer_scale=config.layer_scale,
            )
            for _ in range(config.n_layer)
        )
        self.head = EquiLinear(self.algebra, C, config.out_channels, S, config.out_scalars)

    def forward(
        self,
        mv: Tensor,
        scalars: Tensor | None = None,
        mask: Tensor | None = None,
        before_block: Callable[[int, Tensor, Tensor | None], tuple[Tensor, Tensor | None]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``mv (B, N, in_channels, dim)``, ``scalars (B, N, in_scalars)``, ``mask (B, N)`` bool →
        (``(B, N, out_channels, dim)``, ``(B, N, out_scalars)``). ``before_block(l, x, s) → (x, s)``, if
        given, updates the hidden multivectors ``(B, N, channels, dim)`` and scalars before block ``l``
        (a task's own layers between the blocks, e.g. messages over pairs)."""
        cfg, dim = self.config, self.algebra.dim
        if mv.dim() != 4 or mv.shape[2:] != (cfg.in_channels, dim):
            raise ValueError(
                f"RotorTransformer: mv has shape {tuple(mv.shape)}, expected (B, N, {cfg.in_channels}, {dim})"
            )
        B, N = mv.shape[:2]
        if cfg.in_scalars and (scalars is None or tuple(scalars.shape) != (B, N, cfg.in_scalars)):
            shape = None if scalars is None else tuple(scalars.shape)
            raise ValueError(
                f"RotorTransformer: scalars has shape {shape}, expected {(B, N, cfg.in_scalars)}"
            )
        if not cfg.in_scalars and scalars is not None and scalars.shape[-1] != 0:
            raise ValueError(
                f"RotorTransformer: got scalars {tuple(scalars.shape)} but config.in_scalars = 0"
            )
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, N)):
            raise ValueError(
                f"RotorTransformer: mask must be bool of shape {(B, N)}, got {mask.dtype} {tuple(mask.shape)}"
            )
        x, s = self.embed(mv, scalars if cfg.in_scalars else None)
        for layer, block in enumerate(self.blocks):
            if before_block is not None:
                x, s = before_block(layer, x, s)
            x, s = block(x, s, mask)
        mv_out, s_out = self.head(x, s)  # no final norm: outputs keep magnitudes (regression targets)
        if s_out is None:
            s_out = mv_out.new_zeros(B, N, 0)
        return mv_out, s_out
