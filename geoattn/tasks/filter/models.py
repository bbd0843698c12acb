"""The filter task's network (a sequence backbone wrapped as a causal direction estimator) and its
model table: every backbone of ``geoattn.models.lm.LM_TABLE`` as a row."""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.models.base import ModelSizes, TaskModel, decay_groups
from geoattn.models.lm import LM_TABLE, LMConfig, RotorLMConfig, build_backbone
from geoattn.tasks.base import ModelRow


class FilterModel(TaskModel):
    """A sequence backbone as a causal direction estimator.

    Tokens enter as ``[ẑ, log|z|]`` (direction and log-magnitude, ``D + 1`` features) through a
    Linear to width C: the magnitude is kept as a feature because the hypersphere backbones
    (``rt``, ``ngpt``) project their input onto the unit sphere, where a raw magnitude would be lost;
    the RT layers can then map it into their key norms ``|k|`` (their confidence). The backbone runs
    causally with ``positions`` = the observation times; a Linear maps back to ``D`` and the output
    is normalised. ``forward(x (B, T, D + 1), y (B, T, D) | None) -> (prediction (B, T, D), loss)``,
    loss = mean(1 − cos(prediction, y)). The backbone's ``width`` is its features per token
    (``n_embd``; the rotor backbone's invariant features, with rotor positions at the times).
    """

    def __init__(self, name: str, dim: int, backbone_config: LMConfig | RotorLMConfig):
        super().__init__()
        self.config = backbone_config
        self.dim = dim
        self.backbone = build_backbone(name, backbone_config)
        width = self.backbone.width
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
        """The backbone's figures (the rotor backbone's ``model_rotor_positions.png``)."""
        return self.backbone.plots(directory)

    def normalize_weights(self) -> None:
        """Keep the hypersphere backbones' weights unit-norm (no-op for pre-norm backbones)."""
        self.backbone.normalize_weights()

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """Decay on the matrices of pre-norm backbones; none on hypersphere backbones (nGPT) or vectors."""
        return decay_groups(self, weight_decay, decay_matrices=not self.backbone.sphere)


def build(name: str, task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    """A causal :class:`FilterModel` around the backbone ``name`` with the run's ``sizes`` and
    ``model.*`` ``options`` (``task``: a ``FilterTask``; its sequence length is the context)."""
    # causal: the estimates are filters (for the configs that have the switch: the row's fixed fields)
    fixed = {"vocab_size": 1, "block_size": task.config.seq_len, "causal": True}
    fixed = {key: value for key, value in fixed.items() if key in FILTER_TABLE[name].fixed}
    return FilterModel(name, task.config.dim, LM_TABLE[name].config.from_sizes(sizes, options, **fixed))


def filter_row(name: str) -> ModelRow:
    """The row of ``LM_TABLE[name]`` in the filter task. The task fixes ``causal`` where the config
    has that switch (the RotorLM's attention is always causal and has none)."""
    model = LM_TABLE[name]
    switches = tuple({"causal"} & {f.name for f in fields(model.config)})
    return ModelRow(
        model.config, partial(build, name), model.description, fixed=("vocab_size", "block_size", *switches)
    )


FILTER_TABLE: dict[str, ModelRow] = {name: filter_row(name) for name in LM_TABLE}
