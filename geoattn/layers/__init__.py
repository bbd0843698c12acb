"""Neural-network modules built on the kernels: attention layers and the blocks around them.

``transformer`` (pre-norm GPT) · ``sphere`` (nGPT hypersphere block) · ``rt_block`` (RT-Filter attention
and block) · ``robust_filter`` (isotropic RFA) · ``multivector`` (GA layers) · ``rotor_block`` (rotor
attention, rotor positions, the rotor block) · ``common`` (shared helpers).
"""

from geoattn.layers.multivector import (
    EquiLinear,
    GeometricMLP,
    GradeGate,
    GradeLayerNorm,
    GradePathProduct,
    MultivectorEmbedding,
)
from geoattn.layers.robust_filter import RFAAttention
from geoattn.layers.rotor_block import RotorAttention, RotorBlock, RotorPositionalEncoding
from geoattn.layers.rt_block import RTAttention, RTBlock
from geoattn.layers.sphere import NGPTAttention, NormalizedSwiGLU, SphereBlock
from geoattn.layers.transformer import Block, CausalSelfAttention, RMSNorm, SwiGLU

__all__ = [
    "RTAttention",
    "RTBlock",
    "RFAAttention",
    "RotorAttention",
    "RotorPositionalEncoding",
    "RotorBlock",
    "GradeLayerNorm",
    "EquiLinear",
    "GeometricMLP",
    "GradeGate",
    "GradePathProduct",
    "MultivectorEmbedding",
    "Block",
    "CausalSelfAttention",
    "NGPTAttention",
    "NormalizedSwiGLU",
    "RMSNorm",
    "SphereBlock",
    "SwiGLU",
]
