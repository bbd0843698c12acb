"""Neighbourhoods in point clouds, shared by the pointcloud task's networks: k nearest neighbours,
gathering over them, and the equivariant / invariant local features the rotor model reads."""

from __future__ import annotations

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


def local_geometry(points: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Each point's neighbourhood (``index`` ``(B, N, k)``, from :func:`knn`, itself included) in
    centred clouds ``(B, N, 3)``: the offset of the neighbours' mean ``(B, N, 3)`` (equivariant under
    O(3)) and the square roots of the neighbours' covariance eigenvalues ``(B, N, 3)``, ascending
    (invariant: the local extents along the neighbourhood's principal axes, which tell planes, lines
    and blobs apart), both divided by the cloud's mean local extent (so that the spacing of the points
    does not set them)."""
    neighbours = gather(points, index)  # (B, N, k, 3)
    mean = neighbours.mean(2)
    spread = neighbours - mean[:, :, None]
    covariance = spread.transpose(-1, -2) @ spread / index.shape[-1]  # (B, N, 3, 3)
    extents = torch.linalg.eigvalsh(covariance).clamp_min(0).sqrt()
    scale = extents.sum(-1).mean(1)[:, None, None].clamp_min(1e-9)
    return (mean - points) / scale, extents / scale
