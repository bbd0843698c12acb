"""A Clifford message-passing network for n-body systems (CGENN's kind, Ruhe et al. 2023): EGNN's
edge-wise inductive bias with multivector features, where the rotor model attends over bodies.

Every body carries multivector channels ``h_i`` ``(C, 8)`` in Cl(3) and invariant scalars ``s_i`` ``(S)``;
every ordered pair j ≠ i its relative position and velocity as vectors and their invariants. A layer
forms a message per pair from both bodies and the pair's geometry, mixes it with a geometric product
(:class:`GeometricMLP`: the products are what lets a message combine ``x_ij`` with what the bodies
carry, e.g. a cross product as a bivector), averages the messages over j and updates the body:

    m_ij, t_ij = L_a(h_i, s_i) + L_b(h_j, s_j) + L_g([x_ij, v_ij], u_ij)   (B, n, n − 1, C, 8), (…, S)
    m_ij, t_ij ← (m_ij, t_ij) + GeometricMLP(norm(m_ij), t_ij)
    h_i, s_i  ← (h_i, s_i) + L_u([h_i, mean_j m_ij], [s_i, mean_j t_ij])
    h_i, s_i  ← (h_i, s_i) + GeometricMLP(norm(h_i), s_i)

with ``u_ij = (|x_ij|², x_ij · v_ij, |v_ij|², c_i c_j)`` (``c`` the charge or mass) and ``L`` grade-wise
equivariant linear maps (:class:`EquiLinear`; ``L_a + L_b + L_g`` is one linear map of the
concatenated pair, applied per body where it can be). The read-out is the vector part of one output
channel plus ``φ_i v_i`` (EGNN's ``egnn_vel``: most of a body's motion is its velocity), added to the
position. Every part is O(3)-equivariant (versor-equivariant layers, invariant gates) and every input
translation-invariant: E(3)-equivariant, tested with random rotations, reflections and shifts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.algebra.layout import blade_major_grad
from geoattn.algebra.named import named_algebra
from geoattn.core.errors import ConfigError
from geoattn.core.settings import settings_from
from geoattn.layers.multivector import EquiLinear, GeometricMLP, GradeLayerNorm
from geoattn.models.base import ModelSizes, TaskModel
from geoattn.tasks.nbody.bodies import centroid, check_inputs, other_bodies, pair_invariants, position_mse


@dataclass
class CliffordGNNConfig:
    """Shape of a :class:`NBodyCliffordGNN`.

    From a run's flags: ``--n-layer`` message layers and ``channels = scalars = n_embd // 8`` (as the
    rotor model reads ``--n-embd``); ``--set model.KEY=VALUE`` overrides any field.

    Fields:
        n_layer: message-passing layers.
        channels: multivector channels per body and per message.
        scalars: invariant scalar channels per body and per message.
        mlp_ratio: hidden multivector channels of each geometric MLP / channels.
        velocity_output: add ``φ_i v_i`` to the prediction (``φ_i`` an invariant output scalar).
        signed_charges: read each body's charge (or mass) ``c_i`` itself as a scalar; False: its square,
            so the model is invariant under flipping every charge, as the dynamics are (the forces go
            with ``c_i c_j``, which the pairs read either way; a mass, positive, loses nothing).
        paths: the geometric MLPs' products with a learned weight per grade path (CGENN's).
        gate: the geometric MLPs' gate: ``scalar`` (GELU of the scalar part) | ``grades`` (a sigmoid
            per grade of invariants, CGENN's MVSiLU).
    """

    n_layer: int = 4
    channels: int = 16
    scalars: int = 16
    mlp_ratio: int = 2
    velocity_output: bool = True
    signed_charges: bool = True
    paths: bool = False
    gate: str = "scalar"

    def __post_init__(self) -> None:
        for name in ("n_layer", "channels", "scalars", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"CliffordGNNConfig.{name} must be a positive integer, got {value!r}")
        if self.gate not in GeometricMLP.GATES:
            gates = ", ".join(GeometricMLP.GATES)
            raise ConfigError(f"CliffordGNNConfig.gate must be one of {gates}, got {self.gate!r}")

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None) -> CliffordGNNConfig:
        """``n_layer`` and ``channels = scalars = n_embd // 8`` (at least 2) from the run's sizes, then
        the ``model.*`` options."""
        width = max(2, sizes.n_embd // 8)
        defaults = {"n_layer": sizes.n_layer, "channels": width, "scalars": width}
        return settings_from(cls, options, prefix="model", defaults=defaults)


class CliffordMessageLayer(nn.Module):
    """One message-passing layer (the module docstring's four lines) in the algebra ``ga`` (Cl(3)).

    forward(h ``(B, n, C, 8)``, s ``(B, n, S)``, geometry ``(B, n, n, 2, 8)``, invariants ``(B, n, n, 4)``
    (every ordered pair; the self-pairs are not read) → (h, s) of the same shapes.
    """

    GEOMETRY_CHANNELS = 2
    INVARIANTS = 4

    def __init__(self, config: CliffordGNNConfig, ga: CliffordAlgebra):
        super().__init__()
        C, S, hidden = config.channels, config.scalars, config.mlp_ratio * config.channels
        self.receiver = EquiLinear(ga, C, C, S, S)
        self.sender = EquiLinear(ga, C, C, S, S, bias=False)
        self.geometry = EquiLinear(ga, self.GEOMETRY_CHANNELS, C, self.INVARIANTS, S, bias=False)
        self.message_norm = GradeLayerNorm(ga, per_grade=False)
        self.message_scalar_norm = nn.LayerNorm(S)
        mlp = {"hidden": hidden, "paths": config.paths, "gate": config.gate}
        self.message_mlp = GeometricMLP(ga, C, S, **mlp)
        self.update = EquiLinear(ga, 2 * C, C, 2 * S, S)
        self.node_norm = GradeLayerNorm(ga, per_grade=False)
        self.node_scalar_norm = nn.LayerNorm(S)
        self.node_mlp = GeometricMLP(ga, C, S, **mlp)

    def forward(self, h: Tensor, s: Tensor, geometry: Tensor, invariants: Tensor) -> tuple[Tensor, Tensor]:
        n = h.shape[1]
        # the ordered pairs j ≠ i only: a self-pair's message would be averaged with weight 0
        others = other_bodies(n, h.device)  # (n, n − 1)
        receivers = torch.arange(n, device=h.device)[:, None]
        a, a_s = self.receiver(h, s)
        b, b_s = self.sender(h, s)
        # their gradients are sums over the pairs, stored in the default order: turned once for the GEMMs
        a, b = blade_major_grad(a), blade_major_grad(b)
        g, g_s = self.geometry(geometry[:, receivers, others], invariants[:, receivers, others])
        m = a[:, :, None] + b[:, others] + g  # (B, n, n − 1, C, 8): receiver i, sender j
        t = a_s[:, :, None] + b_s[:, others] + g_s
        dm, dt = self.message_mlp(self.message_norm(m), self.message_scalar_norm(t))
        m, t = m + dm, t + dt
        # the channels side by side in the blade-by-blade order, which `update` reads without a copy
        hm = torch.cat((h.movedim(-1, 0), m.mean(2).movedim(-1, 0)), -1).movedim(0, -1)
        dh, ds = self.update(hm, torch.cat((s, t.mean(2)), -1))
        h, s = h + dh, s + ds
        dh, ds = self.node_mlp(self.node_norm(h), self.node_scalar_norm(s))
        return h + dh, s + ds


def pair_geometry(ga: CliffordAlgebra, c: Tensor, x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A message layer's pair inputs from the bodies' charges (or masses) ``c`` ``(B, n, 1)``, positions
    ``x`` and velocities ``v`` ``(B, n, 3)``: ``x_ij`` and ``v_ij`` as vectors ``(B, n, n, 2, dim)`` and
    ``u_ij = (|x_ij|², x_ij · v_ij, |v_ij|², c_i c_j)`` ``(B, n, n, 4)``."""
    dx, dv, invariants = pair_invariants(x, v)
    geometry = ga.vector(torch.stack((dx, dv), 3))
    return geometry, torch.cat((invariants, c[:, :, None] * c[:, None, :]), -1)


class NBodyCliffordGNN(TaskModel):
    """Clifford message passing over the bodies (module docstring), E(3)-equivariant.

    Inputs per body: the vectors position − centroid and velocity as two Cl(3) channels, the charge (or
    mass) and the speed as scalars. ``forward(x (B, n, 7) = [scalar, position, velocity], y | None)`` →
    (final positions ``(B, n, 3)``, MSE loss | None).
    """

    def __init__(self, config: CliffordGNNConfig):
        super().__init__()
        self.config = config
        self.algebra = ga = named_algebra("cl3")
        C, S = config.channels, config.scalars
        self.read_in = EquiLinear(ga, 2, C, 2, S)
        self.layers = nn.ModuleList(CliffordMessageLayer(config, ga) for _ in range(config.n_layer))
        self.out_norm = GradeLayerNorm(ga, per_grade=False)
        self.read_out = EquiLinear(ga, C, 1, S, int(config.velocity_output))
        # the prediction starts at "nothing moves" (EGNN starts so too, with its coordinate gates at
        # gain 0.001): a random read-out starts with errors 100× the static baseline's
        for p in self.read_out.parameters():
            nn.init.zeros_(p)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_inputs(x)
        c, position, velocity = x[..., :1], x[..., 1:4], x[..., 4:7]
        ga = self.algebra
        h = ga.vector(torch.stack((position - centroid(position), velocity), 2))  # (B, n, 2, 8)
        s = torch.cat((c if self.config.signed_charges else c * c, velocity.norm(dim=-1, keepdim=True)), -1)
        h, s = self.read_in(h, s)
        geometry, invariants = pair_geometry(ga, c, position, velocity)
        for layer in self.layers:
            h, s = layer(h, s, geometry, invariants)
        out, phi = self.read_out(self.out_norm(h), s)
        prediction = position + ga.vector_part(out[:, :, 0])
        if phi is not None:
            prediction = prediction + phi * velocity
        return prediction, position_mse(prediction, y)
