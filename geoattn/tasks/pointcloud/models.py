"""The pointcloud task's networks: a Transformer on point tokens (not rotation-invariant) and the
RotorTransformer with an invariant readout (logits invariant under rotations, reflections and
translations by construction).

``forward(x (B, P, 3) points, y (B,) class labels | None) -> (logits (B, classes), cross-entropy | None)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.models.base import TaskModel
from geoattn.models.lm import LMConfig, build_backbone
from geoattn.models.rotor_transformer import RotorTransformer, RotorTransformerConfig, center


class PointTransformer(TaskModel):
    """Bidirectional Transformer over points: ``Linear(centred xyz)`` tokens, no positions (a set), mean
    pooling, a linear classifier. Translation-invariant by the centring, not rotation-invariant: what it
    learns about orientation comes from the training rotations (augmentation)."""

    def __init__(self, config: LMConfig, n_classes: int):
        super().__init__()
        self.config = config
        self.embed = nn.Linear(3, config.n_embd)
        self.backbone = build_backbone("transformer", config)
        self.head = nn.Linear(config.n_embd, n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_points(x)
        logits = self.head(self.backbone(self.embed(center(x))).mean(1))
        return logits, _cross_entropy(logits, y)

    def attention_maps(self, x: Tensor) -> list[Tensor]:
        return self.backbone.attention_maps(self.embed(center(x)))


class PointRotor(TaskModel):
    """:class:`RotorTransformer` (Cl(3)) on points with an invariant readout.

    Token i: the centred point ``x_i`` as a vector channel and ``|x_i|`` as a scalar. Readout: the
    per-point invariant scalars and the norms of the output multivector channels (invariant under O(3)),
    mean-pooled over points, then LayerNorm and a linear classifier. Rotations and reflections act on
    the vectors only, so every readout feature, hence every logit, is unchanged; translations cancel in
    the centring.
    """

    def __init__(self, config: RotorTransformerConfig, n_classes: int):
        super().__init__()
        self.config = config
        self.model = RotorTransformer(config)
        self.algebra = self.model.algebra
        features = config.out_scalars + config.out_channels
        self.norm = nn.LayerNorm(features)
        self.head = nn.Linear(features, n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_points(x)
        points = center(x)
        radius = points.norm(dim=-1, keepdim=True)  # (B, P, 1)
        mv, scalars = self.model(self.algebra.vector(points[:, :, None, :]), radius)
        # (B, P, C_out): blade-coefficient norms; versors act orthogonally on Cl(3), so they are invariant
        norms = (mv * mv).sum(-1).clamp_min(1e-12).sqrt()
        features = self.norm(torch.cat((scalars, norms), -1).mean(1))
        logits = self.head(features)
        return logits, _cross_entropy(logits, y)


def check_points(x: Tensor) -> None:
    """ValueError unless ``x`` is a batch of clouds ``(B, P, 3)``."""
    if x.dim() != 3 or x.shape[-1] != 3:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, P, 3) points")


def _cross_entropy(logits: Tensor, y: Tensor | None) -> Tensor | None:
    if y is None:
        return None
    if y.shape != logits.shape[:1]:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected ({logits.shape[0]},) class labels")
    return F.cross_entropy(logits.float(), y)
