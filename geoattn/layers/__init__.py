"""Neural-network modules built on the kernels: RT layers, transformer baselines, GA layers."""

from geoattn.layers.multivector import EquiLinear, GeometricMLP, GradeLayerNorm, MultivectorEmbedding
from geoattn.layers.rotor import RotorAttention, RotorPositionalEncoding
from geoattn.layers.rt import RFAAttention, RTAttention, RTBlock
from geoattn.layers.transformer import (
    Block,
    CausalSelfAttention,
    NGPTAttention,
    NormalizedSwiGLU,
    RMSNorm,
    SphereBlock,
    SwiGLU,
)

__all__ = [
    "RTAttention",
    "RTBlock",
    "RFAAttention",
    "RotorAttention",
    "RotorPositionalEncoding",
    "GradeLayerNorm",
    "EquiLinear",
    "GeometricMLP",
    "MultivectorEmbedding",
    "Block",
    "CausalSelfAttention",
    "NGPTAttention",
    "NormalizedSwiGLU",
    "RMSNorm",
    "SphereBlock",
    "SwiGLU",
]
