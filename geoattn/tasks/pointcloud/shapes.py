"""Parametric 3D shapes for the ``pointcloud`` task: sixteen classes, random shape parameters, non-uniform
sampling, noise; generated here from seeds.

Ten classes are far apart (ellipsoid, torus, open cylinder, cone, box, helix, Möbius strip, saddle,
trefoil knot, dumbbell); six more each sit next to some of them, so that the set does not saturate
(PointNet read 98 % on aligned test clouds of the ten alone, after 22 s of training): a capsule
(cylinder, ellipsoid), a frustum (cone, cylinder), a square pyramid (cone), a bowl (saddle, cone), a
flat annulus (torus, Möbius strip) and a rounded box (ellipsoid, box).

Each class is a surface (or a tube around a curve) ``S(u, v; params)`` with ``(u, v) ∈ [0, 1]²`` and
random parameters per sample. Points are drawn with ``u = U^γ₁``, ``v = U^γ₂`` for exponents γ drawn per
cloud from ``[1/γ_max, γ_max]`` (and the parametrisations are not area-preserving), so the density over
the surface varies from cloud to cloud; then Gaussian noise. Every cloud is centred and scaled to unit
maximum radius, in the class's canonical pose (symmetry axis along z): "aligned" data.

Shapes are ``(P, 3)`` float64 tensors; everything draws from a ``torch.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

TWO_PI = 2 * math.pi


def _uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator, dtype=torch.float64))


def _tube(center: Tensor, tangent: Tensor, radius: float, v: Tensor) -> Tensor:
    """Points at angle ``2πv`` on circles of ``radius`` round a curve (``center``, ``tangent``: (P, 3))."""
    reference = torch.tensor([0.36, 0.48, 0.8], dtype=center.dtype).expand_as(tangent)
    n1 = torch.linalg.cross(tangent, reference)
    n1 = n1 / n1.norm(dim=-1, keepdim=True).clamp_min(1e-9)
    n2 = torch.linalg.cross(tangent / tangent.norm(dim=-1, keepdim=True).clamp_min(1e-9), n1)
    angle = TWO_PI * v[:, None]
    return center + radius * (torch.cos(angle) * n1 + torch.sin(angle) * n2)


def ellipsoid(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Ellipsoid with random semi-axes in [0.5, 1] (θ = πu, φ = 2πv: denser at the poles)."""
    a, b, c = (_uniform(g, 0.5, 1.0) for _ in range(3))
    theta, phi = math.pi * u, TWO_PI * v
    return torch.stack((a * torch.sin(theta) * torch.cos(phi), b * torch.sin(theta) * torch.sin(phi),
                        c * torch.cos(theta)), -1)  # fmt: skip


def torus(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Torus with random major radius in [0.6, 1] and tube radius in [0.15, 0.35]."""
    big, small = _uniform(g, 0.6, 1.0), _uniform(g, 0.15, 0.35)
    ring = big + small * torch.cos(TWO_PI * v)
    return torch.stack((ring * torch.cos(TWO_PI * u), ring * torch.sin(TWO_PI * u),
                        small * torch.sin(TWO_PI * v)), -1)  # fmt: skip


def cylinder(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Open cylinder (no caps) along z, random radius and height."""
    radius, height = _uniform(g, 0.3, 0.6), _uniform(g, 1.0, 2.0)
    return torch.stack(
        (radius * torch.cos(TWO_PI * u), radius * torch.sin(TWO_PI * u), height * (v - 0.5)), -1
    )


def cone(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Cone surface along z, apex up, random base radius and height."""
    radius, height = _uniform(g, 0.4, 0.8), _uniform(g, 0.8, 1.6)
    r = radius * (1 - v)
    return torch.stack((r * torch.cos(TWO_PI * u), r * torch.sin(TWO_PI * u), height * (v - 0.5)), -1)


def box(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """The surface of a box: a face per point (by area), ``(u, v)`` on that face."""
    half = torch.tensor([_uniform(g, 0.3, 1.0) for _ in range(3)], dtype=torch.float64)
    areas = torch.stack([half[1] * half[2], half[0] * half[2], half[0] * half[1]]).repeat(2)
    face = torch.multinomial(areas, u.shape[0], replacement=True, generator=g)  # (P,) in 0..5
    axis, sign = face % 3, torch.where(face < 3, 1.0, -1.0).to(torch.float64)
    points = torch.empty(u.shape[0], 3, dtype=torch.float64)
    for k in range(3):
        a, b = (k + 1) % 3, (k + 2) % 3
        on = axis == k
        points[on, k] = sign[on] * half[k]
        points[on, a] = (2 * u[on] - 1) * half[a]
        points[on, b] = (2 * v[on] - 1) * half[b]
    return points


def helix(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Tube around a helix along z: 2–4 turns, random radius, height, tube radius, handedness."""
    turns, radius, height = _uniform(g, 2.0, 4.0), _uniform(g, 0.4, 0.8), _uniform(g, 1.0, 2.0)
    tube = _uniform(g, 0.05, 0.12)
    hand = 1.0 if _uniform(g, 0, 1) < 0.5 else -1.0  # either handedness: the class is not chiral
    t = TWO_PI * turns * u
    center = torch.stack((radius * torch.cos(t), hand * radius * torch.sin(t), height * (u - 0.5)), -1)
    tangent = torch.stack((-radius * torch.sin(t), hand * radius * torch.cos(t),
                           torch.full_like(t, height / (TWO_PI * turns))), -1)  # fmt: skip
    return _tube(center, tangent, tube, v)


def mobius(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Möbius strip of random width around the unit circle."""
    width = _uniform(g, 0.3, 0.6)
    t, w = TWO_PI * u, width * (2 * v - 1)
    ring = 1 + w / 2 * torch.cos(t / 2)
    return torch.stack((ring * torch.cos(t), ring * torch.sin(t), w / 2 * torch.sin(t / 2)), -1)


def saddle(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Hyperbolic-paraboloid patch z = c (x² − y²) over [−1, 1]², random curvature c."""
    curvature = _uniform(g, 0.4, 0.9)
    x, y = 2 * u - 1, 2 * v - 1
    return torch.stack((x, y, curvature * (x * x - y * y)), -1)


def trefoil(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Tube of random radius around a trefoil knot."""
    tube = _uniform(g, 0.1, 0.25)
    t = TWO_PI * u
    center = torch.stack((torch.sin(t) + 2 * torch.sin(2 * t), torch.cos(t) - 2 * torch.cos(2 * t),
                          -torch.sin(3 * t)), -1)  # fmt: skip
    tangent = torch.stack((torch.cos(t) + 4 * torch.cos(2 * t), -torch.sin(t) + 4 * torch.sin(2 * t),
                           -3 * torch.cos(3 * t)), -1)  # fmt: skip
    return _tube(center, tangent, tube, v)


def dumbbell(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Two spheres on the z axis (the first half of the points on one, the rest on the other)."""
    radius, gap = _uniform(g, 0.3, 0.5), _uniform(g, 0.8, 1.4)
    theta, phi = math.pi * u, TWO_PI * v
    side = torch.where(torch.arange(u.shape[0]) % 2 == 0, 1.0, -1.0).to(torch.float64)
    ring = radius * torch.sin(theta)
    return torch.stack(
        (ring * torch.cos(phi), ring * torch.sin(phi), radius * torch.cos(theta) + side * gap / 2), -1
    )


def capsule(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Cylinder with hemispherical caps along z; ``v`` runs along the profile (pole to pole) by arc
    length, ``u`` around z."""
    radius, half = _uniform(g, 0.3, 0.6), _uniform(g, 0.2, 0.8)
    cap = math.pi * radius / 2  # arc length of each cap's profile
    s = v * (2 * cap + 2 * half)
    top = s - cap - 2 * half  # > 0 on the upper cap
    angle = torch.where(s < cap, s / radius - math.pi / 2, top.clamp_min(0) / radius)  # latitude
    rho = torch.where((s >= cap) & (top <= 0), torch.full_like(s, radius), radius * torch.cos(angle))
    z = torch.where(s < cap, radius * torch.sin(angle) - half,
                    torch.where(top > 0, radius * torch.sin(angle) + half, s - cap - half))  # fmt: skip
    return torch.stack((rho * torch.cos(TWO_PI * u), rho * torch.sin(TWO_PI * u), z), -1)


def frustum(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Truncated cone (lateral surface) along z: base radius in [0.5, 0.8], top radius 0.3–0.7 of it."""
    radius, ratio, height = _uniform(g, 0.5, 0.8), _uniform(g, 0.3, 0.7), _uniform(g, 0.8, 1.6)
    r = radius * (1 - (1 - ratio) * v)
    return torch.stack((r * torch.cos(TWO_PI * u), r * torch.sin(TWO_PI * u), height * (v - 0.5)), -1)


def pyramid(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Square pyramid (the four lateral faces) along z: the cone with a square cross-section."""
    half, height = _uniform(g, 0.4, 0.8), _uniform(g, 0.8, 1.6)
    side = torch.floor(4 * u).clamp(max=3)
    t = 2 * (4 * u - side) - 1  # position along the side, in [−1, 1]
    corner = torch.stack((torch.ones_like(t), t), -1) * half  # the side x = half, then turned
    angle = side * (math.pi / 2)
    c, s = torch.cos(angle), torch.sin(angle)
    x, y = c * corner[:, 0] - s * corner[:, 1], s * corner[:, 0] + c * corner[:, 1]
    return torch.stack(((1 - v) * x, (1 - v) * y, height * (v - 0.5)), -1)


def bowl(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Paraboloid patch z = c r² over the unit disc, random curvature c (the saddle's range)."""
    curvature = _uniform(g, 0.4, 0.9)
    r, phi = v, TWO_PI * u
    return torch.stack((r * torch.cos(phi), r * torch.sin(phi), curvature * r * r), -1)


def annulus(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Flat ring in the x-y plane, outer radius 1, random inner radius in [0.3, 0.7]."""
    inner = _uniform(g, 0.3, 0.7)
    r, phi = inner + (1 - inner) * v, TWO_PI * u
    return torch.stack((r * torch.cos(phi), r * torch.sin(phi), torch.zeros_like(r)), -1)


def rounded_box(u: Tensor, v: Tensor, g: torch.Generator) -> Tensor:
    """Superellipsoid ``|x/a|^p + |y/b|^p + |z/c|^p = 1`` with p in [2.5, 5] (ellipsoid at 2, box as
    p → ∞) and the box's semi-axes."""
    a, b, c = (_uniform(g, 0.3, 1.0) for _ in range(3))
    e = 2 / _uniform(g, 2.5, 5.0)
    theta, phi = math.pi * u, TWO_PI * v

    def power(w: Tensor) -> Tensor:
        return torch.sign(w) * w.abs() ** e

    ring = power(torch.sin(theta))
    return torch.stack(
        (a * ring * power(torch.cos(phi)), b * ring * power(torch.sin(phi)), c * power(torch.cos(theta))), -1
    )


SHAPES: dict[str, Callable[[Tensor, Tensor, torch.Generator], Tensor]] = {
    "ellipsoid": ellipsoid,
    "torus": torus,
    "cylinder": cylinder,
    "cone": cone,
    "box": box,
    "helix": helix,
    "mobius": mobius,
    "saddle": saddle,
    "trefoil": trefoil,
    "dumbbell": dumbbell,
    "capsule": capsule,
    "frustum": frustum,
    "pyramid": pyramid,
    "bowl": bowl,
    "annulus": annulus,
    "rounded_box": rounded_box,
}
CLASSES = tuple(SHAPES)


def sample_shape(
    label: int, n_points: int, generator: torch.Generator, *, noise: float = 0.02, skew: float = 2.0
) -> Tensor:
    """One aligned cloud ``(n_points, 3)`` of class ``CLASSES[label]`` (see the module docstring).

    ``skew`` = γ_max ≥ 1 (1: parameters uniform); ``noise``: Gaussian std after scaling to unit radius.
    """
    gammas = [math.exp(_uniform(generator, -math.log(skew), math.log(skew))) for _ in range(2)]
    u = torch.rand(n_points, generator=generator, dtype=torch.float64) ** gammas[0]
    v = torch.rand(n_points, generator=generator, dtype=torch.float64) ** gammas[1]
    points = SHAPES[CLASSES[label]](u, v, generator)
    points = points - points.mean(0)
    points = points / points.norm(dim=-1).max()
    return points + noise * torch.randn(points.shape, generator=generator, dtype=torch.float64)


def sample_clouds(
    labels: Tensor, n_points: int, generator: torch.Generator, *, noise: float = 0.02, skew: float = 2.0
) -> Tensor:
    """Aligned clouds ``(len(labels), n_points, 3)`` float64 of the given class labels."""
    return torch.stack([sample_shape(int(k), n_points, generator, noise=noise, skew=skew) for k in labels])
