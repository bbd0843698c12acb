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

from geoattn.core.errors import ConfigError
from geoattn.layers.multivector import EquiLinear, GradeLayerNorm
from geoattn.models.base import TaskModel
from geoattn.models.lm import LMConfig, build_backbone
from geoattn.models.rotor_transformer import RotorTransformer, RotorTransformerConfig, center
from geoattn.tasks.pointcloud.graph import bending, gather, knn, local_geometry, principal_axes


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
        heights: with ``up``, also read each point's invariants under the up model's symmetry as scalars:
            its height above the cloud's centre and its distance from the vertical axis through it
            (with neighbours also the vertical component of its neighbours' mean offset, with normals
            that of its normal), where the network would otherwise have to build them from ``e_z`` in
            its products; PointNet reads them from the raw coordinates.
        harmonics: with ``up``, also read each output channel's azimuthal harmonics about e_z: for the
            orders m = 1..``harmonics``, ``|mean_i û_i^m|²`` with ``û_i`` the unit horizontal direction of
            point i's vector as a complex number (:func:`azimuthal_power`; 0: none). Invariant under the
            up model's symmetry; where the mean-pooled Gram matrix sees only second moments (a square
            pyramid's four face normals and a cone's ring of them have the same), m = 4 tells them apart.
        local: before each of the first ``local`` blocks, a :class:`LocalMessages` layer over each
            point's ``local_k`` nearest points (DGCNN's EdgeConv made equivariant; 0: none).
        local_k: neighbours of the local messages (DGCNN's k = 10).
        scales: more neighbourhood sizes read beside ``neighbours`` (e.g. ``[6, 32]``), each as one more
            vector channel (its neighbours' mean offset) and 4 more scalars (the offset's length and the
            3 local extents, :func:`~geoattn.tasks.pointcloud.graph.local_geometry`): a tube's small
            radius or a face's flatness shows in a few neighbours, a shape's bends in many.
    """

    neighbours: int = 16
    readout: int = 128
    axes: bool = False
    normals: bool = False
    bending: bool = False
    up: bool = False
    heights: bool = False
    harmonics: int = 0
    local: int = 0
    local_k: int = 10
    scales: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        scales = self.scales if isinstance(self.scales, (list, tuple)) else (self.scales,)
        if any(not isinstance(k, int) or isinstance(k, bool) or k < 3 for k in scales):
            raise ConfigError(f"PointRotorConfig.scales must be neighbourhood sizes ≥ 3, got {self.scales!r}")
        self.scales = tuple(scales)
        for name in ("neighbours", "readout", "harmonics", "local", "local_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"PointRotorConfig.{name} must be an integer ≥ 0, got {value!r}")
        for name in ("axes", "normals", "bending", "up", "heights"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"PointRotorConfig.{name} must be true or false, got {value!r}")
        for name in ("normals", "bending"):
            if getattr(self, name) and not self.neighbours:
                raise ConfigError(f"PointRotorConfig.{name} needs neighbours > 0 (it comes from the kNN)")
        if self.heights and not self.up:
            raise ConfigError("PointRotorConfig.heights needs up = true (the heights are along e_z)")
        if self.harmonics and not self.up:
            raise ConfigError("PointRotorConfig.harmonics needs up = true (the harmonics are about e_z)")
        if self.local > self.n_layer:
            raise ConfigError(f"PointRotorConfig.local = {self.local}: more than its {self.n_layer} blocks")
        if self.local and self.local_k < 2:
            raise ConfigError(f"PointRotorConfig.local_k must be ≥ 2 with local messages, got {self.local_k}")


class LocalMessages(nn.Module):
    """DGCNN's EdgeConv made O(3)-equivariant, between two rotor blocks: each point gathers messages
    from its k nearest points (in space, fixed per cloud) and adds their aggregate to its channels.

    Multivectors: a linear map of ``[x_i, mean_j x_j]`` (an equivariant linear edge message
    ``L(x_i, x_j − x_i)`` averaged over j is exactly this, computed per point instead of per edge).
    Scalars, EdgeConv's max: ``max_j GELU(t_i + u(s_j) + w(|p_j − p_i|_c))`` with ``t_i`` from
    ``s_i`` and the scalar grades of ``[x_i, mean_j x_j]``, ``p = P x`` an equivariant linear map to
    ``PROBES`` channels (the edge lengths cost k·PROBES multivectors per point, not k·C), ``|·|_c`` the
    per-channel blade-coefficient norms (invariant), u and w linear. An output :class:`EquiLinear`,
    zero at the start, maps both onto the point's channels (the layer starts as the identity).

    forward(x ``(B, N, C, dim)``, s ``(B, N, S)``, index ``(B, N, k)``, mean ``(B, N, N)``: the
    neighbour-averaging matrix of ``index``, :func:`neighbour_mean`) → the same shapes.
    """

    PROBES = 4

    def __init__(self, algebra, channels: int, scalars: int):
        super().__init__()
        C, S = channels, scalars
        self.norm = GradeLayerNorm(algebra, per_grade=False)
        self.snorm = nn.LayerNorm(S)
        self.point = EquiLinear(algebra, 2 * C, C, S, S)
        self.probe = EquiLinear(algebra, C, self.PROBES, bias=False)
        self.neighbour = nn.Linear(S, S, bias=False)
        self.size = nn.Linear(self.PROBES, S, bias=False)
        self.out = EquiLinear(algebra, C, C, S, S)
        for p in self.out.parameters():
            nn.init.zeros_(p)

    def forward(self, x: Tensor, s: Tensor, index: Tensor, mean: Tensor) -> tuple[Tensor, Tensor]:
        xn, sn = self.norm(x), self.snorm(s)
        p, _ = self.probe(xn)  # (B, N, PROBES, dim)
        size = (gather(p, index) - p[:, :, None]).square().sum(-1).clamp_min(1e-12).sqrt()  # (B, N, k, P)
        x_mean = (mean @ xn.flatten(2)).view_as(xn)  # mean_j x_j, one GEMM (a gather's backward is slow)
        m, t = self.point(torch.cat((xn, x_mean), -2), sn)  # (B, N, C, dim), (B, N, S)
        t = t[:, :, None] + gather(self.neighbour(sn), index) + self.size(size)  # (B, N, k, S)
        dx, ds = self.out(m, F.gelu(t).amax(2))
        return x + dx, s + ds


def neighbour_mean(index: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """``(B, n, n)`` with ``1/k`` at ``[b, i, index[b, i, j]]``: ``M @ f`` averages each point's neighbours'
    features (``index (B, n, k)`` from :func:`knn`). Dense, n² per cloud: meant for small clouds (the
    task's 64 points), where one GEMM beats a gather whose backward scatters."""
    B, _, k = index.shape
    mean = torch.zeros(B, n, n, dtype=dtype, device=index.device)
    return mean.scatter_(2, index, 1.0 / k)


def point_inputs(config: PointRotorConfig) -> tuple[int, int]:
    """The rotor model's input widths (vector channels, scalars): the centred point and its radius;
    with neighbours also its neighbours' mean offset, the offset's length and the 3 local extents; with
    axes 6 more scalars; with normals and with up one more vector channel each; with bending 3 more
    scalars; with heights 2 more, and one more each with neighbours and with normals; per extra scale one
    vector channel and 4 scalars."""
    vectors, scalars = (2, 5) if config.neighbours else (1, 1)
    vectors, scalars = vectors + len(config.scales), scalars + 4 * len(config.scales)
    heights = (2 + bool(config.neighbours) + config.normals) if config.heights else 0
    return vectors + config.normals + config.up, scalars + 6 * config.axes + 3 * config.bending + heights


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
        self.local = nn.ModuleList(
            LocalMessages(self.algebra, config.channels, config.scalars) for _ in range(config.local)
        )
        C = config.out_channels
        self.register_buffer("pairs", torch.triu_indices(2 * C, 2 * C), persistent=False)
        features = 2 * (config.out_scalars + C + self.pairs.shape[1])  # mean and max of each
        features += C * config.harmonics  # one azimuthal power per channel and order
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
        sizes = (self.config.neighbours, *self.config.scales)
        if max(sizes):
            nearest = knn(points, max(sizes))  # (B, P, k_max), nearest first: each scale a prefix
        if self.config.neighbours:
            index = nearest[..., : self.config.neighbours]
            local = local_geometry(points, index)
            vectors += [local.offset, local.normal] if self.config.normals else [local.offset]
            scalars += [local.offset.norm(dim=-1, keepdim=True), local.extents]  # (B, P, 1), (B, P, 3)
            if self.config.bending:
                scalars.append(bending(local.normal, index))  # (B, P, 3)
        local_vectors = vectors[1:]  # the offset and the normal, where read
        for k in self.config.scales:
            other = local_geometry(points, nearest[..., :k])
            vectors.append(other.offset)
            scalars += [other.offset.norm(dim=-1, keepdim=True), other.extents]
        if self.config.axes:
            distances, spread = principal_axes(points)
            scalars += [distances, spread[:, None].expand_as(distances)]  # (B, P, 3) each
        if self.config.up:
            vectors.append(points.new_tensor([0.0, 0.0, 1.0]).expand_as(points))  # e_z at every point
        if self.config.heights:  # ⟨v, e_z⟩ of the vector inputs, and the distance from the z axis
            scalars += [points[..., 2:], points[..., :2].norm(dim=-1, keepdim=True)]
            scalars += [v[..., 2:] for v in local_vectors]
        return self.algebra.vector(torch.stack(vectors, 2)), torch.cat(scalars, -1)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_points(x)
        points = center(x)
        before_block = None
        if self.config.local:
            index = knn(points, self.config.local_k)  # (B, P, k)
            mean = neighbour_mean(index, points.shape[1], points.dtype)  # (B, P, P)

            def before_block(layer: int, h: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
                return self.local[layer](h, s, index, mean) if layer < len(self.local) else (h, s)

        mv, scalars = self.model(*self.inputs(points), before_block=before_block)  # (B, P, C, dim), (B, P, S)
        # blade-coefficient norms: versors act orthogonally on Cl(3), so they are invariant
        norms = (mv * mv).sum(-1).clamp_min(1e-12).sqrt()  # (B, P, C)
        vectors = self.algebra.vector_part(mv)  # (B, P, C, 3)
        both = torch.cat((vectors, vectors.mean(1, keepdim=True).expand_as(vectors)), 2)  # (B, P, 2C, 3)
        gram = (both @ both.transpose(-1, -2))[:, :, self.pairs[0], self.pairs[1]]  # (B, P, C(2C+1))
        features = torch.cat((scalars, norms, gram), -1)
        pooled = [features.mean(1), features.amax(1)]
        if self.config.harmonics:
            pooled.append(azimuthal_power(vectors, self.config.harmonics))
        logits = self.head(self.norm(torch.cat(pooled, -1)))
        return logits, cross_entropy(logits, y)


def azimuthal_power(vectors: Tensor, orders: int) -> Tensor:
    """The azimuthal power spectrum about e_z of each channel's vectors over the points of a cloud:
    ``vectors (B, P, C, 3)`` → ``(B, C · orders)``, ``|mean_i û_i^m|²`` for m = 1..orders (channel-major),
    with ``û_i = (x_i + i y_i) / |x_i + i y_i|`` the unit horizontal direction as a complex number.

    A rotation by θ about z multiplies ``û_i^m`` by ``e^{imθ}`` and a reflection in a plane through z
    conjugates it (up to such a turn), so every number is invariant under both; each lies in [0, 1]: 1
    where the directions repeat with period 2π/m (the four faces of a square pyramid at m = 4), near 0
    where they spread evenly (a cone's normals)."""
    x, y = vectors[..., 0], vectors[..., 1]
    r = (x * x + y * y).clamp_min(1e-12).sqrt()
    u = torch.complex(x / r, y / r)  # (B, P, C)
    power, out = u, []
    for _ in range(orders):
        out.append(power.mean(1).abs().square())  # (B, C)
        power = power * u
    return torch.stack(out, -1).flatten(1)


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
