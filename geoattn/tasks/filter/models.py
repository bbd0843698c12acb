"""The filter task's network: a sequence backbone wrapped as a causal direction estimator."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.models.base import TaskModel, decay_groups
from geoattn.models.lm import LMConfig, build_backbone
from geoattn.models.rotor_lm import RotorBackbone, RotorLMConfig


class FilterModel(TaskModel):
    """A sequence backbone as a causal direction estimator.

    Tokens enter as ``[ẑ, log|z|]`` (direction and log-magnitude, ``D + 1`` features) through a
    Linear to width C: the magnitude is kept as a feature because the hypersphere backbones
    (``rt``, ``ngpt``) project their input onto the unit sphere, where a raw magnitude would be lost;
    the RT layers can then map it into their key norms ``|k|`` (their confidence). The backbone runs
    causally with ``positions`` = the observation times; a Linear maps back to ``D`` and the output
    is normalised. ``forward(x (B, T, D + 1), y (B, T, D) | None) -> (prediction (B, T, D), loss)``,
    loss = mean(1 − cos(prediction, y)). ``rotor`` (a :class:`RotorLMConfig`): the
    :class:`RotorBackbone`, whose width is its invariant features (rotor positions at the times).
    """

    def __init__(self, name: str, dim: int, backbone_config: LMConfig | RotorLMConfig):
        super().__init__()
        self.config = backbone_config
        self.dim = dim
        if name == "rotor":
            self.backbone = RotorBackbone(backbone_config)
            width = self.backbone.width
        else:
            self.backbone = build_backbone(name, backbone_config)
            width = backbone_config.n_embd
        self.embed = nn.Linear(dim + 1, width)
        self.head = nn.Linear(width, dim)

    def _features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.dim() != 3 or x.shape[-1] != self.dim + 1:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, T, D + 1) = (B, T, {self.dim + 1})")
        z, times = x[..., : self.dim], x[..., self.dim]
        norm = z.norm(dim=-1, keepdim=True)
        features = torch.cat((z / norm.clamp_min(1e-12), norm.clamp_min(1e-12).log()), dim=-1)
        return self.embed(features), times

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        h, times = self._features(x)
        prediction = F.normalize(self.head(self.backbone(h, times)), dim=-1)
        if y is None:
            return prediction, None
        if y.shape != prediction.shape:
            raise ValueError(f"y has shape {tuple(y.shape)}, expected {tuple(prediction.shape)}")
        loss = 1.0 - (prediction.float() * F.normalize(y.float(), dim=-1)).sum(-1).mean()
        return prediction, loss

    @torch.no_grad()
    def attention_maps(self, x: Tensor) -> list[Tensor]:
        """One ``(B, H, T, T)`` attention-weight tensor per layer, for plots."""
        h, times = self._features(x)
        return self.backbone.attention_maps(h, times)

    def plots(self, directory: Path) -> list[Path]:
        """The rotor backbone's ``model_rotor_positions.png``; nothing for the other backbones."""
        return self.backbone.plots(directory) if isinstance(self.backbone, RotorBackbone) else []

    def normalize_weights(self) -> None:
        """Keep the hypersphere backbones' weights unit-norm (no-op for pre-norm backbones)."""
        self.backbone.normalize_weights()

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """Decay on the matrices of pre-norm backbones; none on hypersphere backbones (nGPT) or vectors."""
        return decay_groups(self, weight_decay, decay_matrices=not self.backbone.sphere)
