"""The pointcloud task's networks: a Transformer on point tokens (not rotation-invariant) and the
RotorTransformer with an invariant readout (logits invariant under rotations, reflections and
translations by construction).

``forward(x (B, P, 3) points, y (B,) class labels | None) -> (logits (B, classes), cross-entropy | None)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.errors import ConfigError
from geoattn.models.base import TaskModel
from geoattn.models.lm import LMConfig, build_backbone
from geoattn.models.rotor_transformer import RotorTransformer, RotorTransformerConfig, center
from geoattn.tasks.pointcloud.graph import bending, knn, local_geometry, principal_axes


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
        return logits, cross_entropy(logits, y)

    def attention_maps(self, x: Tensor) -> list[Tensor]:
        return self.backbone.attention_maps(self.embed(center(x)))


@dataclass
class PointRotorConfig(RotorTransformerConfig):
    """The rotor model on points: a :class:`RotorTransformerConfig` (its ``model.*`` keys) and two more.

    Fields:
        neighbours: k of the local input features (0: the centred point and its radius only).
            The features: each point's kNN mean offset and local extents.
        readout: width of the readout MLP's hidden layer (0: a linear classifier).
        axes: also read each point's distances from the cloud's principal planes and the cloud's
            extents along its principal axes (:func:`~geoattn.tasks.pointcloud.graph.principal_axes`),
            6 more scalars.
        normals: also read each point's local surface normal as a vector channel (needs neighbours).
        bending: also read how the surface bends around each point (the eigenvalues of its
            neighbours' normals' scatter, :func:`~geoattn.tasks.pointcloud.graph.bending`), 3
            more scalars (needs neighbours).
        up: also read the up axis ``e_z`` as a vector channel (the same for every point). This breaks
            the symmetry on purpose: the logits stay invariant under rotations about z, reflections in
            planes through z and translations (the symmetry of the z/z protocol, whose clouds keep
            their heights), not under SO(3). For data with a known up direction; its z/SO(3) number
            shows what that costs when the direction is lost.
    """

    neighbours: int = 16
    readout: int = 128
    axes: bool = False
    normals: bool = False
    bending: bool = False
    up: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("neighbours", "readout"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"PointRotorConfig.{name} must be an integer ≥ 0, got {value!r}")
        for name in ("axes", "normals", "bending", "up"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"PointRotorConfig.{name} must be true or false, got {value!r}")
        for name in ("normals", "bending"):
            if getattr(self, name) and not self.neighbours:
                raise ConfigError(f"PointRotorConfig.{name} needs neighbours > 0 (it comes from the kNN)")


def point_inputs(config: PointRotorConfig) -> tuple[int, int]:
    """The rotor model's input widths (vector channels, scalars): the centred point and its radius;
    with neighbours also its neighbours' mean offset, the offset's length and the 3 local extents; with
    axes 6 more scalars; with normals and with up one more vector channel each; with bending 3 more
    scalars."""
    vectors, scalars = (2, 5) if config.neighbours else (1, 1)
    return vectors + config.normals + config.up, scalars + 6 * config.axes + 3 * config.bending


class PointRotor(TaskModel):
    """:class:`RotorTransformer` (Cl(3)) on points with an invariant readout.

    Token i: the centred point ``x_i`` and, with ``neighbours = k``, the offset of its k nearest
    neighbours' mean (and with ``normals`` the local surface normal, pointing outwards), as vector
    channels; their lengths and the neighbourhood's local extents
    (:func:`~geoattn.tasks.pointcloud.graph.local_geometry`) as scalars (with ``axes`` also the
    point's distances from the cloud's principal planes and the cloud's extents along its axes; with
    ``bending`` how the surface bends around it). Readout per point: the output scalars, the norms of
    the output multivector channels, and the Gram matrix of the output channels' vector parts together
    with their means over the cloud (``⟨a_ic, a_id⟩``, ``⟨a_ic, ā_d⟩``,
    ``⟨ā_c, ā_d⟩``: the invariants of the point's vectors relative to the cloud's); pooled by mean and max
    over points, then LayerNorm and an MLP. Every readout number is an O(3) invariant (norms and inner
    products of vectors that rotate and reflect together), so every logit is invariant under rotations,
    reflections and (by the centring) translations; with ``up``, under those that keep ``e_z``.
    """

    def __init__(self, config: PointRotorConfig, n_classes: int):
        super().__init__()
        self.config = config
        self.model = RotorTransformer(config)
        self.algebra = self.model.algebra
        C = config.out_channels
        self.register_buffer("pairs", torch.triu_indices(2 * C, 2 * C), persistent=False)
        features = 2 * (config.out_scalars + C + self.pairs.shape[1])  # mean and max of each
        self.norm = nn.LayerNorm(features)
        hidden = config.readout
        self.head = (
            nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, n_classes))
            if hidden
            else nn.Linear(features, n_classes)
        )

    def inputs(self, points: Tensor) -> tuple[Tensor, Tensor]:
        """Centred clouds ``(B, P, 3)`` → vector channels ``(B, P, V, dim)``, scalars ``(B, P, S)``
        (:func:`point_inputs`)."""
        scalars = [points.norm(dim=-1, keepdim=True)]  # the radius (B, P, 1)
        vectors = [points]
        if self.config.neighbours:
            index = knn(points, self.config.neighbours)
            local = local_geometry(points, index)
            vectors += [local.offset, local.normal] if self.config.normals else [local.offset]
            scalars += [local.offset.norm(dim=-1, keepdim=True), local.extents]  # (B, P, 1), (B, P, 3)
            if self.config.bending:
                scalars.append(bending(local.normal, index))  # (B, P, 3)
        if self.config.axes:
            distances, spread = principal_axes(points)
            scalars += [distances, spread[:, None].expand_as(distances)]  # (B, P, 3) each
        if self.config.up:
            vectors.append(points.new_tensor([0.0, 0.0, 1.0]).expand_as(points))  # e_z at every point
        return self.algebra.vector(torch.stack(vectors, 2)), torch.cat(scalars, -1)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_points(x)
        mv, scalars = self.model(*self.inputs(center(x)))  # (B, P, C, dim), (B, P, S)
        # blade-coefficient norms: versors act orthogonally on Cl(3), so they are invariant
        norms = (mv * mv).sum(-1).clamp_min(1e-12).sqrt()  # (B, P, C)
        vectors = self.algebra.vector_part(mv)  # (B, P, C, 3)
        both = torch.cat((vectors, vectors.mean(1, keepdim=True).expand_as(vectors)), 2)  # (B, P, 2C, 3)
        gram = (both @ both.transpose(-1, -2))[:, :, self.pairs[0], self.pairs[1]]  # (B, P, C(2C+1))
        features = torch.cat((scalars, norms, gram), -1)
        logits = self.head(self.norm(torch.cat((features.mean(1), features.amax(1)), -1)))
        return logits, cross_entropy(logits, y)


def check_points(x: Tensor) -> None:
    """ValueError unless ``x`` is a batch of clouds ``(B, P, 3)``."""
    if x.dim() != 3 or x.shape[-1] != 3:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, P, 3) points")


def cross_entropy(logits: Tensor, y: Tensor | None) -> Tensor | None:
    """Mean cross-entropy of ``logits`` ``(B, K)`` against labels ``y`` ``(B,)``; None without labels."""
    if y is None:
        return None
    if y.shape != logits.shape[:1]:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected ({logits.shape[0]},) class labels")
    return F.cross_entropy(logits.float(), y)
