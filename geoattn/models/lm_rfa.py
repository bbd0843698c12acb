"""``rfa``: the pre-norm GPT with isotropic Robust Filter Attention (docs/concepts/rt-filter.md#baselines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from geoattn.layers.robust_filter import RFAAttention
from geoattn.models.lm_core import Backbone, LanguageModel, LMConfig, check_norm, prenorm_blocks


@dataclass
class RFAConfig(LMConfig):
    """:class:`LMConfig` plus ``norm`` (``"layernorm"`` or ``"rmsnorm"``) of its pre-norm blocks."""

    model: ClassVar[str] = "rfa"
    positions: ClassVar[tuple[str, ...]] = ("rope", "none")

    norm: str = "layernorm"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_norm(self, self.norm)


def rfa_backbone(config: RFAConfig) -> Backbone:
    """Pre-norm GPT blocks around ``RFAAttention`` (rotation frequencies at the RoPE spectrum, or none)."""
    c = config

    def attention() -> RFAAttention:
        return RFAAttention(
            c.n_embd, c.n_head, rotation=c.pos == "rope", rope_base=c.rope_base, causal=c.causal
        )

    return Backbone(c, prenorm_blocks(c, c.norm, attention), norm=c.norm)


class RFATransformerLM(LanguageModel):
    """Pre-norm GPT with isotropic Robust Filter Attention (docs/concepts/rt-filter.md#baselines)."""

    def __init__(self, config: LMConfig):
        config = RFAConfig.of(config)
        super().__init__(config, rfa_backbone(config))
