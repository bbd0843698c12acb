"""Whole networks: the language models (a shared core config, one config per model, one table), the
RotorLM and the RotorTransformer."""

from geoattn.models.lm import (
    LM_TABLE,
    NGPTLM,
    LMConfig,
    NGPTConfig,
    RFAConfig,
    RFATransformerLM,
    RTConfig,
    RTTransformerLM,
    TransformerConfig,
    TransformerLM,
    build_backbone,
    build_lm,
    lm_config,
)
from geoattn.models.rotor_lm import RotorBackbone, RotorLM, RotorLMConfig
from geoattn.models.rotor_transformer import RotorTransformer, RotorTransformerConfig, center

__all__ = [
    "LMConfig",
    "TransformerConfig",
    "RTConfig",
    "RFAConfig",
    "NGPTConfig",
    "LM_TABLE",
    "lm_config",
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
