"""Neighbourhoods in point clouds, shared by the pointcloud task's networks: k nearest neighbours,
gathering over them, and the equivariant / invariant local features the rotor model reads."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def knn(features: Tensor, k: int) -> Tensor:
    """Indices ``(B, N, k)`` of each point's ``k`` nearest points (itself included) by Euclidean
    distance between ``features`` ``(B, N, F)``."""
    if k > features.shape[1]:
        raise ValueError(f"k = {k} neighbours but the clouds have {features.shape[1]} points")
    distance = torch.cdist(features, features)  # (B, N, N)
    return distance.topk(k, dim=-1, largest=False).indices


def gather(features: Tensor, index: Tensor) -> Tensor:
    """``features[b, index[b, i, j]]``: ``(B, N, *F)`` and ``(B, N, k)`` → ``(B, N, k, *F)``."""
    B, N, k = index.shape
    flat = features.reshape(B * N, *features.shape[2:])
    offset = (torch.arange(B, device=index.device) * N)[:, None, None]
    return flat[(index + offset).reshape(-1)].reshape(B, N, k, *features.shape[2:])


class Neighbourhoods(NamedTuple):
    """Each point's neighbourhood in a centred cloud, from :func:`local_geometry`."""

    offset: Tensor  # (B, N, 3) the neighbours' mean minus the point, in units of the cloud's local extent
    extents: Tensor  # (B, N, 3) square roots of the neighbours' covariance eigenvalues, ascending, same units
    normal: Tensor  # (B, N, 3) unit normal of the local surface, pointing away from the cloud's centre


def local_geometry(points: Tensor, index: Tensor) -> Neighbourhoods:
    """Each point's neighbourhood (``index`` ``(B, N, k)``, from :func:`knn`, itself included) in
    centred clouds ``(B, N, 3)``: the offset of the neighbours' mean (equivariant under O(3)); the square
    roots of the neighbours' covariance eigenvalues (invariant: the local extents along the
    neighbourhood's principal axes, which tell planes, lines and blobs apart), both divided by the
    cloud's mean local extent (so that the spacing of the points does not set them); and the local
    surface normal, the covariance's least axis with its sign chosen so that it points away from the
    cloud's centre (``⟨n_i, x_i⟩ ≥ 0``), which makes it equivariant under rotations and reflections."""
    neighbours = gather(points, index)  # (B, N, k, 3)
    mean = neighbours.mean(2)
    spread = neighbours - mean[:, :, None]
    covariance = spread.transpose(-1, -2) @ spread / index.shape[-1]  # (B, N, 3, 3)
    eigenvalues, axes = torch.linalg.eigh(covariance)
    extents = eigenvalues.clamp_min(0).sqrt()
    scale = extents.sum(-1).mean(1)[:, None, None].clamp_min(1e-9)
    normal = axes[..., 0]  # (B, N, 3): the eigenvector of the least eigenvalue
    normal = torch.where((normal * points).sum(-1, keepdim=True) < 0, -normal, normal)
    return Neighbourhoods((mean - points) / scale, extents / scale, normal)


def bending(normal: Tensor, index: Tensor) -> Tensor:
    """How the surface bends around each point: the eigenvalues ``(B, N, 3)``, ascending (sum 1), of
    ``Σ_j n_j n_jᵀ / k`` over the neighbours' normals (``normal`` ``(B, N, 3)`` from
    :func:`local_geometry`, ``index`` ``(B, N, k)``). Invariant, and blind to the normals' signs:
    ``(0, 0, 1)`` on a plane, one more non-zero where the surface curves one way (a cylinder, a cone),
    two where it curves both ways (a sphere) or folds (an edge or a corner of a box or a pyramid)."""
    normals = gather(normal, index)  # (B, N, k, 3)
    return torch.linalg.eigvalsh(normals.transpose(-1, -2) @ normals / index.shape[-1]).clamp_min(0)


def principal_axes(points: Tensor) -> tuple[Tensor, Tensor]:
    """The cloud's own axes, as invariants of centred clouds ``(B, N, 3)``: each point's distances from
    the cloud's three principal planes ``|x_i · e_k|`` ``(B, N, 3)`` and the cloud's extents along its
    principal axes ``sqrt(λ_k)`` ``(B, 3)``, ascending. The eigenvectors ``e_k`` of the cloud's covariance
    rotate with the cloud and are defined up to sign, which the absolute value removes, so both are
    invariant under rotations and reflections; where two extents are equal (a shape symmetric about an
    axis) the distances within that plane are arbitrary, and the network has to learn to discount them."""
    covariance = points.transpose(-1, -2) @ points / points.shape[1]  # (B, 3, 3)
    eigenvalues, axes = torch.linalg.eigh(covariance)
    return (points @ axes).abs(), eigenvalues.clamp_min(0).sqrt()
