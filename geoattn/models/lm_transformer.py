"""``transformer``: the pre-norm GPT (nanoGPT with RoPE and SwiGLU by default), tied embeddings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from geoattn.layers.transformer import CausalSelfAttention
from geoattn.models.lm_core import Backbone, LanguageModel, LMConfig, check_norm, prenorm_blocks


@dataclass
class TransformerConfig(LMConfig):
    """:class:`LMConfig` plus the pre-norm GPT's own fields.

    Fields:
        norm: ``"layernorm"`` (nanoGPT, bias-free) or ``"rmsnorm"``.
        magnitude_precision: RT-Filter's logit on the RoPE-rotated q, k (key magnitudes set the
            precision), values raw (``CausalSelfAttention``); None or False: softmax attention.
        qkv_norm: q, k and v normalised after projection, with a learned logit scale.
    """

    model: ClassVar[str] = "transformer"

    norm: str = "layernorm"
    magnitude_precision: bool | None = None
    qkv_norm: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_norm(self, self.norm)


def transformer_backbone(config: TransformerConfig) -> Backbone:
    """Pre-norm GPT blocks with softmax attention (RoPE, learned positions, ALiBi or none)."""
    c = config

    def attention() -> CausalSelfAttention:
        return CausalSelfAttention(
            c.n_embd,
            c.n_head,
            rope=c.pos == "rope",
            rope_base=c.rope_base,
            causal=c.causal,
            dropout=c.dropout,
            alibi=c.pos == "alibi",
            magnitude_precision=bool(c.magnitude_precision),
            qkv_norm=bool(c.qkv_norm),
        )

    return Backbone(c, prenorm_blocks(c, c.norm, attention), norm=c.norm)


class TransformerLM(LanguageModel):
    """Pre-norm GPT, tied embeddings; RoPE + SwiGLU by default, ``mlp="gelu", pos="learned"`` is nanoGPT."""

    def __init__(self, config: LMConfig):
        config = TransformerConfig.of(config)
        super().__init__(config, transformer_backbone(config))
