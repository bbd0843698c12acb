"""The pointcloud task's peers, written here from their papers' equations, scaled down to this task:

* ``pointnet``: PointNet (Qi et al. 2017) without its input and feature transform nets: a shared
  per-point MLP, max pooling over points, an MLP classifier. Not rotation-invariant.
* ``dgcnn``: DGCNN (Wang et al. 2019): EdgeConv layers on a kNN graph rebuilt in every layer's
  feature space, the layers' outputs concatenated and embedded, max + mean pooling over points, an MLP
  classifier. Not rotation-invariant.
* ``vn``: VN-DGCNN (Deng et al. 2021, "Vector Neurons"): the same network on lists of 3D vectors per
  point, ``V ∈ R^{C×3}``, built from VN-Linear, VN-BatchNorm and VN-LeakyReLU (learned directions),
  mean pooling over neighbours, and the invariant layer (products with a learned equivariant frame).
  Its logits are invariant under rotations *and* reflections (O(3)): the first layer's edge features
  are ``[x_j − x_i, x_i]``, as in the authors' VN-DGCNN classifier (their code adds the cross product
  ``x_j × x_i`` only to VN-PointNet; their VN-DGCNN is O(3)-invariant too, as
  ``tests/test_pointcloud_vnn_peer.py`` checks).

Every model: ``forward(x (B, P, 3) points, y (B,) labels | None) -> (logits (B, classes), loss | None)``,
translation-invariant by centring. All three use BatchNorm (as their papers), so they are trained in
``train()`` mode and evaluated in ``eval()`` mode (the trainer does both).

An edge layer's first linear map of ``[f_j − f_i, f_i]`` is ``W₁ f_j + (W₂ − W₁) f_i``: it is computed
per point and then gathered over the k neighbours (the same numbers, k times fewer products).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.core.errors import ConfigError
from geoattn.core.settings import settings_from
from geoattn.models.base import ModelSizes, TaskModel
from geoattn.models.rotor_transformer import center
from geoattn.tasks.pointcloud.graph import gather, knn
from geoattn.tasks.pointcloud.networks import check_points, cross_entropy

EPS = 1e-6
LEAKY_SLOPE = 0.2  # DGCNN's and VN's LeakyReLU slope


def _widths(width: int, n_layer: int) -> list[int]:
    """Per-layer widths ``width · (1, 1, 2, 4, 8, ...)``: DGCNN's 64, 64, 128, 256 at ``width = 64``."""
    return [width * 2 ** max(0, layer - 1) for layer in range(n_layer)]


class ChannelNorm(nn.Module):
    """BatchNorm over the last dimension of ``(..., C)`` (every leading index is a sample)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.reshape(-1, x.shape[-1])).reshape(x.shape)


class ClassifierHead(nn.Sequential):
    """``Linear → BN → LeakyReLU → Dropout`` twice, then a linear map to the classes: ``(B, F) → (B, K)``."""

    def __init__(self, features: int, hidden: int, n_classes: int, dropout: float):
        layers: list[nn.Module] = []
        for width in (2 * hidden, hidden):
            layers += [nn.Linear(features, width, bias=False), ChannelNorm(width),
                       nn.LeakyReLU(LEAKY_SLOPE), nn.Dropout(dropout)]  # fmt: skip
            features = width
        super().__init__(*layers, nn.Linear(features, n_classes))


# ---------------------------------------------------------------- PointNet and DGCNN -------------
@dataclass
class PointNetConfig:
    """PointNet (vanilla: no transform nets), scaled down.

    Fields:
        width: the shared MLP's first width (from --n-embd).
            Its layers are width · (1, 1, 2, 4, ...).
        n_layer: layers of the shared per-point MLP (from --n-layer).
        dropout: dropout in the classifier (from --dropout; PointNet: 0.3).
    """

    width: int = 64
    n_layer: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(self, "width", "n_layer")
        _check_dropout(self)

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None) -> PointNetConfig:
        """``width`` = ``n_embd``, ``n_layer``, ``dropout`` from the run's sizes, then ``model.*``."""
        defaults = {"width": sizes.n_embd, "n_layer": sizes.n_layer, "dropout": sizes.dropout}
        return settings_from(cls, options, prefix="model", defaults=defaults)


class PointNet(TaskModel):
    """PointNet: ``h_i = MLP(x_i)`` per point (Linear → BN → ReLU), ``g = max_i h_i``, logits =
    ``MLP(g)`` (see :class:`PointNetConfig`)."""

    def __init__(self, config: PointNetConfig, n_classes: int):
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        features = 3
        for width in _widths(config.width, config.n_layer):
            layers += [nn.Linear(features, width, bias=False), ChannelNorm(width), nn.ReLU()]
            features = width
        self.shared = nn.Sequential(*layers)
        self.head = ClassifierHead(features, config.width, n_classes, config.dropout)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_points(x)
        logits = self.head(self.shared(center(x)).amax(1))  # (B, P, F) → (B, F) → (B, K)
        return logits, cross_entropy(logits, y)


@dataclass
class DGCNNConfig:
    """DGCNN, scaled down.

    Fields:
        width: the first EdgeConv's width (from --n-embd).
            The layers are width · (1, 1, 2, 4, ...); their concatenation is embedded at its own
            width and pooled by max and mean.
        n_layer: EdgeConv layers (from --n-layer; DGCNN: 4).
        k: neighbours per point (DGCNN: 20 of 1,024 points; 10 of the task's 64).
        dropout: dropout in the classifier (from --dropout; DGCNN: 0.5).
    """

    width: int = 32
    n_layer: int = 4
    k: int = 10
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(self, "width", "n_layer", "k")
        _check_dropout(self)

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None) -> DGCNNConfig:
        """``width`` = ``n_embd``, ``n_layer``, ``dropout`` from the run's sizes, then ``model.*``."""
        defaults = {"width": sizes.n_embd, "n_layer": sizes.n_layer, "dropout": sizes.dropout}
        return settings_from(cls, options, prefix="model", defaults=defaults)


class EdgeConv(nn.Module):
    """``h_i = max_{j ∈ kNN(i)} LeakyReLU(BN(W [f_j − f_i, f_i]))``: ``(B, N, F)`` → ``(B, N, F')``;
    the kNN graph is built on ``f`` itself (the dynamic graph)."""

    def __init__(self, features: int, width: int, k: int):
        super().__init__()
        self.k = k
        self.neighbour = nn.Linear(features, width, bias=False)  # W₁ (on f_j)
        self.centre = nn.Linear(features, width, bias=False)  # W₂ − W₁ (on f_i)
        self.norm = ChannelNorm(width)

    def forward(self, f: Tensor) -> Tensor:
        index = knn(f, self.k)
        edges = gather(self.neighbour(f), index) + self.centre(f)[:, :, None]  # (B, N, k, F')
        return F.leaky_relu(self.norm(edges), LEAKY_SLOPE).amax(2)


class DGCNN(TaskModel):
    """DGCNN (see :class:`DGCNNConfig`): EdgeConvs, concatenation, a per-point embedding (Linear → BN →
    LeakyReLU), max + mean pooling, the classifier."""

    def __init__(self, config: DGCNNConfig, n_classes: int):
        super().__init__()
        self.config = config
        widths = _widths(config.width, config.n_layer)
        self.convs = nn.ModuleList(
            EdgeConv(features, width, config.k) for features, width in zip([3, *widths], widths)
        )
        features = sum(widths)
        self.embed = nn.Sequential(nn.Linear(features, features, bias=False), ChannelNorm(features),
                                   nn.LeakyReLU(LEAKY_SLOPE))  # fmt: skip
        self.head = ClassifierHead(2 * features, config.width * 2, n_classes, config.dropout)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_points(x)
        f, outs = center(x), []
        for conv in self.convs:
            f = conv(f)
            outs.append(f)
        h = self.embed(torch.cat(outs, -1))  # (B, N, F)
        logits = self.head(torch.cat((h.amax(1), h.mean(1)), -1))
        return logits, cross_entropy(logits, y)


# ---------------------------------------------------------------- Vector Neurons -----------------
# A point's vector list V ∈ R^{C×3} is stored channels-last, as a (..., 3, C) tensor: VN-Linear is then
# one matmul and a rotation acts on dimension -2.
class VNLinear(nn.Module):
    """VN-Linear: ``V' = W V`` on vector lists ``(..., 3, C)`` → ``(..., 3, C')`` (no bias: a bias
    vector would break equivariance)."""

    def __init__(self, channels: int, out_channels: int):
        super().__init__()
        self.map = nn.Linear(channels, out_channels, bias=False)

    def forward(self, v: Tensor) -> Tensor:
        return self.map(v)


class VNBatchNorm(nn.Module):
    """VN-BatchNorm: BatchNorm of each channel's norm, the direction kept: ``v ↦ v · BN(|v|) / |v|``
    on ``(..., 3, C)`` (every leading index is a sample)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = ChannelNorm(channels)

    def forward(self, v: Tensor) -> Tensor:
        length = ((v * v).sum(-2) + EPS).sqrt()  # (..., C); linalg.norm over dim -2 is slow on CPU
        return v * (self.norm(length) / length)[..., None, :]


def vn_leaky_relu(q: Tensor, k: Tensor, slope: float = LEAKY_SLOPE) -> Tensor:
    """VN-LeakyReLU of features ``q`` with directions ``k`` (both ``(..., 3, C)``): where ``⟨q, k⟩ < 0``
    the component of ``q`` along ``k`` is removed (VN-ReLU), then ``slope · q + (1 − slope) · that``;
    in one expression, ``q − (1 − slope) · min(⟨q, k⟩, 0) / |k|² · k``."""
    dot = (q * k).sum(-2, keepdim=True)  # (..., 1, C)
    return q - ((1 - slope) * dot.clamp(max=0) / ((k * k).sum(-2, keepdim=True) + EPS)) * k


class VNLinearLeakyReLU(nn.Module):
    """``VN-LeakyReLU(VN-BatchNorm(W V); U V)``: features ``(..., 3, C)`` → ``(..., 3, C')``; the
    direction ``U V`` is learned from the same input."""

    def __init__(self, channels: int, out_channels: int):
        super().__init__()
        self.feature = VNLinear(channels, out_channels)
        self.direction = VNLinear(channels, out_channels)
        self.norm = VNBatchNorm(out_channels)

    def forward(self, v: Tensor) -> Tensor:
        return vn_leaky_relu(self.norm(self.feature(v)), self.direction(v))


class VNEdgeConv(nn.Module):
    """VN-EdgeConv: ``V'_i = mean_{j ∈ kNN(i)} VN-LeakyReLU(VN-BN(W [V_j − V_i, V_i]); U [V_j − V_i, V_i])``;
    ``(B, N, 3, C)`` → ``(B, N, 3, C')``, the kNN graph by the (invariant) distance between the points'
    vector lists."""

    def __init__(self, channels: int, out_channels: int, k: int):
        super().__init__()
        self.k = k
        # [W₁ | U₁] on V_j and [W₂ − W₁ | U₂ − U₁] on V_i, features and directions side by side
        self.neighbour = VNLinear(channels, 2 * out_channels)
        self.centre = VNLinear(channels, 2 * out_channels)
        self.norm = VNBatchNorm(out_channels)

    def forward(self, v: Tensor) -> Tensor:
        index = knn(v.flatten(2), self.k)
        edges = gather(self.neighbour(v), index) + self.centre(v)[:, :, None]  # (B, N, k, 3, 2C')
        q, k = edges.chunk(2, dim=-1)
        return vn_leaky_relu(self.norm(q), k).mean(2)


@dataclass
class VNConfig:
    """VN-DGCNN, scaled down.

    Fields:
        channels: vector channels of the first VN-EdgeConv (from --n-embd: n_embd // 3).
            A layer then holds about as many numbers as DGCNN's at the same --n-embd (VN: 64 // 3 =
            21); the layers are channels · (1, 1, 2, 4, ...).
        n_layer: VN-EdgeConv layers (from --n-layer; VN-DGCNN: 4).
        k: neighbours per point (VN-DGCNN: 20 of 1,024 points; 10 of the task's 64).
        dropout: dropout in the classifier (from --dropout; VN-DGCNN: 0.5).
    """

    channels: int = 21
    n_layer: int = 4
    k: int = 10
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_positive(self, "channels", "n_layer", "k")
        _check_dropout(self)

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None) -> VNConfig:
        """``channels`` = ``n_embd // 3``, ``n_layer``, ``dropout`` from the run's sizes, then ``model.*``."""
        defaults = {"channels": max(1, sizes.n_embd // 3), "n_layer": sizes.n_layer, "dropout": sizes.dropout}
        return settings_from(cls, options, prefix="model", defaults=defaults)


class VNInvariant(nn.Module):
    """The VN invariant layer: a frame ``T_i ∈ R^{3×3}`` (three equivariant vectors) from ``V_i`` by VN
    layers, then ``V_i T_iᵀ``: ``(..., 3, C)`` → ``(..., 3, C)`` invariant numbers. Under ``V ↦ V Rᵀ``
    (any R in O(3), rows of V rotated), ``T ↦ T Rᵀ`` and ``V Tᵀ ↦ V Rᵀ R Tᵀ = V Tᵀ``."""

    def __init__(self, channels: int):
        super().__init__()
        half = max(channels // 2, 3)
        self.frame = nn.Sequential(VNLinearLeakyReLU(channels, half), VNLinear(half, 3))

    def forward(self, v: Tensor) -> Tensor:
        return torch.einsum("...dc,...df->...fc", v, self.frame(v))  # ⟨v_c, t_f⟩


class VNDGCNN(TaskModel):
    """VN-DGCNN (see the module docstring and :class:`VNConfig`): VN-EdgeConvs on ``[x_j − x_i, x_i]``
    and then on the features, their concatenation embedded by a VN layer, each point's features joined
    with the cloud's mean and made invariant (:class:`VNInvariant`), max + mean pooling over points (of
    invariant numbers), the classifier."""

    def __init__(self, config: VNConfig, n_classes: int):
        super().__init__()
        self.config = config
        widths = _widths(config.channels, config.n_layer)
        self.convs = nn.ModuleList(VNEdgeConv(c, width, config.k) for c, width in zip([1, *widths], widths))
        channels = sum(widths)
        self.embed = VNLinearLeakyReLU(channels, channels)
        self.invariant = VNInvariant(2 * channels)
        self.head = ClassifierHead(2 * 2 * channels * 3, 2 * config.channels * 3, n_classes, config.dropout)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_points(x)
        v, outs = center(x)[..., None], []  # (B, N, 3, 1)
        for conv in self.convs:
            v = conv(v)
            outs.append(v)
        v = self.embed(torch.cat(outs, -1))  # (B, N, 3, C)
        v = torch.cat((v, v.mean(1, keepdim=True).expand_as(v)), -1)  # (B, N, 3, 2C)
        h = self.invariant(v).flatten(2)  # (B, N, 6C) invariant
        logits = self.head(torch.cat((h.amax(1), h.mean(1)), -1))
        return logits, cross_entropy(logits, y)


def _check_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{type(config).__name__}.{name} must be a positive integer, got {value!r}")


def _check_dropout(config: Any) -> None:
    if not 0 <= config.dropout < 1:
        raise ConfigError(f"{type(config).__name__}.dropout must be in [0, 1), got {config.dropout!r}")
