"""The n-body task's networks: a bidirectional Transformer baseline and the E(3)-equivariant rotor model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.models.base import TaskModel
from geoattn.models.lm import LMConfig, build_backbone
from geoattn.models.rotor_transformer import RotorTransformer, RotorTransformerConfig


def centroid(x: Tensor) -> Tensor:
    """Mean position over bodies ``(B, 1, 3)`` of ``x`` ``(B, n, 3)``."""
    return x.mean(1, keepdim=True)


class NBodyTransformer(TaskModel):
    """A bidirectional transformer over bodies: [mass, position − centroid, velocity] → displacement.

    Translation-equivariant by the centring, permutation-equivariant (no positions), not
    rotation-equivariant. ``forward(x (B, n, 7), y (B, n, 3) | None) -> (final positions, MSE loss)``.
    """

    def __init__(self, backbone_config: LMConfig):
        super().__init__()
        self.config = backbone_config
        width = backbone_config.n_embd
        self.embed = nn.Linear(7, width)
        self.backbone = build_backbone("transformer", backbone_config)
        self.head = nn.Linear(width, 3)

    def _embed(self, x: Tensor) -> Tensor:
        _check_inputs(x)
        m, position, velocity = x[..., :1], x[..., 1:4], x[..., 4:7]
        return self.embed(torch.cat((m, position - centroid(position), velocity), dim=-1))

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        prediction = x[..., 1:4] + self.head(self.backbone(self._embed(x)))
        return prediction, _mse(prediction, y)

    @torch.no_grad()
    def attention_maps(self, x: Tensor) -> list[Tensor]:
        """One ``(B, H, n, n)`` attention-weight tensor per layer, for plots."""
        return self.backbone.attention_maps(self._embed(x))


class NBodyRotor(TaskModel):
    """:class:`RotorTransformer` in Cl(3) on the bodies, E(3)-equivariant by construction.

    Mass → the scalar channel; three vector channels: position − centroid, velocity, and velocity −
    mean velocity; the first output vector channel is the displacement, added to the position. O(3)
    comes from the layers, translations from the centring. The third channel matters: the star
    starts at rest, so with positions and velocities alone its only non-zero vector is its position,
    every query and key direction it forms is exactly (anti)parallel to it, and rotation/reflection
    heads fall into their antiparallel guard, where the frame is arbitrary (equivariance error ~1e-7
    in float64 instead of ~1e-10).

    Float32: the rotor heads' factorised sums lose ``eps / (1 ± ⟨a, b⟩)`` on near-(anti)parallel pairs
    (bounded by their guard at ``sqrt(eps)``), which n-body configurations (planets on opposite sides
    of the star) hit: the equivariance error is ~3e-4 with rotation/reflection heads and ~1e-6 with
    projection heads only (``geoattn/attention/rotor_kernel.py``). ``forward(x (B, n, 7), y | None)``.
    """

    def __init__(self, rotor_config: RotorTransformerConfig):
        super().__init__()
        self.config = rotor_config
        self.model = RotorTransformer(rotor_config)
        self.algebra = self.model.algebra

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        _check_inputs(x)
        m, position, velocity = x[..., :1], x[..., 1:4], x[..., 4:7]
        relative = velocity - velocity.mean(1, keepdim=True)
        vectors = torch.stack((position - centroid(position), velocity, relative), dim=2)  # (B, n, 3, 3)
        mv, _ = self.model(self.algebra.vector(vectors), m)
        prediction = position + self.algebra.vector_part(mv[:, :, 0])
        return prediction, _mse(prediction, y)


def _check_inputs(x: Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] != 7:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, n, 7) = [mass, position, velocity]")


def _mse(prediction: Tensor, y: Tensor | None) -> Tensor | None:
    if y is None:
        return None
    if y.shape != prediction.shape:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {tuple(prediction.shape)}")
    return F.mse_loss(prediction.float(), y.float())
