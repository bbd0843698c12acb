"""Language models and sequence backbones: GPT, nGPT, RT-Transformer, isotropic RFA
(docs/concepts/rt-filter.md#baselines) and the RotorLM (:mod:`geoattn.models.rotor_lm`).

One table, :data:`LM_TABLE`: each ``--model`` name with its config class, its backbone builder and its
language model; the lm and filter tasks build their model tables from it. Every GPT-family config
extends the shared core :class:`LMConfig` with only its own model's fields, so ``--set model.KEY``
accepts exactly the keys of that model; the RotorLM has its own :class:`RotorLMConfig` (multivector
channels instead of a width). Adding a model is one module (its config, backbone builder and
:class:`LanguageModel` subclass, on :mod:`geoattn.models.lm_core`) plus one entry here. The
backbones ``(B, T, C) -> (B, T, C)`` are what the non-LM tasks use (the filter task regresses
directions, the nbody baseline is a bidirectional transformer over bodies).

| name (config) | residual stream | attention |
| --- | --- | --- |
| ``transformer`` (``TransformerConfig``) | pre-norm GPT, tied embeddings | softmax; RoPE, learned or ALiBi |
| ``rfa`` (``RFAConfig``) | pre-norm GPT | isotropic Robust Filter Attention (``RFAAttention``) |
| ``ngpt`` (``NGPTConfig``) | unit sphere (nGPT) | unit q, k, logit scale sqrt(D), RoPE |
| ``rt`` (``RTConfig``) | unit sphere, tangent correction, retraction | RT-Filter (``RTAttention``) |
| ``rotor`` (``RotorLMConfig``) | multivector channels + scalars | rotor attention, rotor positions |

The hypersphere models (``ngpt``, ``rt``) use nGPT's parameterisation
(docs/concepts/rt-filter.md#the-hypersphere-parameterisation): scales stored as init/scale, a
learned logit scale ``s_z``, weights renormalised along the embedding axis after every optimiser step
(:meth:`LanguageModel.normalize_weights`, called by the trainer) and no weight decay
(:meth:`LanguageModel.optim_groups`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from geoattn.core.errors import ConfigError
from geoattn.core.settings import settings_from
from geoattn.models.lm_core import POSITIONS, Backbone, LanguageModel, LMConfig
from geoattn.models.lm_ngpt import NGPTLM, NGPTConfig, ngpt_backbone
from geoattn.models.lm_rfa import RFAConfig, RFATransformerLM, rfa_backbone
from geoattn.models.lm_rt import RTConfig, RTTransformerLM, rt_backbone
from geoattn.models.lm_transformer import TransformerConfig, TransformerLM, transformer_backbone
from geoattn.models.rotor_lm import ROTOR_LM_DESCRIPTION, RotorBackbone, RotorLM, RotorLMConfig


@dataclass(frozen=True)
class LMModel:
    """One row of :data:`LM_TABLE`: a model's config class, backbone builder, language model and
    one-line description (what ``--list-settings`` prints).

    ``config`` has ``from_sizes(sizes, options, **fixed)`` and ``of(config)``; the backbone maps
    ``(B, T, backbone.width)`` to the same, the language model is a :class:`~geoattn.models.base.TaskModel`.
    """

    config: type[LMConfig] | type[RotorLMConfig]
    backbone: Callable[[Any], Backbone | RotorBackbone]
    lm: type[LanguageModel] | type[RotorLM]
    description: str


LM_TABLE: dict[str, LMModel] = {
    "transformer": LMModel(
        TransformerConfig,
        transformer_backbone,
        TransformerLM,
        "pre-norm GPT, RoPE + SwiGLU (nanoGPT with mlp=gelu, pos=learned)",
    ),
    "rt": LMModel(
        RTConfig,
        rt_backbone,
        RTTransformerLM,
        "RT-Transformer: RT-Filter attention, tangent correction + retraction on the sphere",
    ),
    "rfa": LMModel(
        RFAConfig, rfa_backbone, RFATransformerLM, "pre-norm GPT with isotropic Robust Filter Attention"
    ),
    "ngpt": LMModel(NGPTConfig, ngpt_backbone, NGPTLM, "nGPT: normalised Transformer on the unit sphere"),
    "rotor": LMModel(RotorLMConfig, RotorBackbone, RotorLM, ROTOR_LM_DESCRIPTION),
}
LM_MODELS = {name: row.description for name, row in LM_TABLE.items()}  # --model name -> what it is


def lm_model(name: str) -> LMModel:
    """The table row of model ``name``; ConfigError listing the valid names."""
    if name not in LM_TABLE:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(LM_TABLE)}")
    return LM_TABLE[name]


def config_class(name: str) -> type[LMConfig] | type[RotorLMConfig]:
    """The config dataclass of model ``name`` (its ``--set model.KEY`` keys are its fields)."""
    return lm_model(name).config


def lm_config(name: str, **values: Any) -> LMConfig | RotorLMConfig:
    """The config of model ``name`` from ``values``; ConfigError on a key the model does not take
    (naming its valid keys) or a bad value."""
    return settings_from(config_class(name), values, prefix="model")


def saved_config(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """The fields of model ``name`` in a saved config dict. A dict saved when one config held every
    model's fields also carries the others' (which that model never read): they are left out."""
    own = {f.name for f in fields(config_class(name))}
    return {k: v for k, v in values.items() if k in own}


def build_backbone(name: str, config: LMConfig | RotorLMConfig) -> Backbone | RotorBackbone:
    """The backbone of model ``name`` in :data:`LM_TABLE` (see the module docstring)."""
    row = lm_model(name)
    return row.backbone(row.config.of(config))


def build_lm(name: str, config: LMConfig | RotorLMConfig) -> LanguageModel | RotorLM:
    """The language model ``name`` in :data:`LM_TABLE`."""
    return lm_model(name).lm(config)


__all__ = [
    "LM_MODELS",
    "LM_TABLE",
    "LMModel",
    "POSITIONS",
    "Backbone",
    "LanguageModel",
    "LMConfig",
    "TransformerConfig",
    "RTConfig",
    "RFAConfig",
    "NGPTConfig",
    "TransformerLM",
    "RTTransformerLM",
    "RFATransformerLM",
    "NGPTLM",
    "RotorLMConfig",
    "RotorBackbone",
    "RotorLM",
    "build_backbone",
    "build_lm",
    "config_class",
    "lm_config",
    "saved_config",
]
