"""Whole networks: the language models (one config family), the RotorLM and the RotorTransformer."""

from geoattn.models.lm import (
    NGPTLM,
    LMConfig,
    RFATransformerLM,
    RTTransformerLM,
    TransformerLM,
    build_backbone,
    build_lm,
)
from geoattn.models.rotor_lm import RotorBackbone, RotorLM, RotorLMConfig
from geoattn.models.rotor_transformer import RotorTransformer, RotorTransformerConfig, center

__all__ = [
    "LMConfig",
    "TransformerLM",
    "RTTransformerLM",
    "RFATransformerLM",
    "NGPTLM",
    "build_lm",
    "build_backbone",
    "RotorLM",
    "RotorLMConfig",
    "RotorBackbone",
    "RotorTransformer",
    "RotorTransformerConfig",
    "center",
]
