"""``rt``: the RT-Transformer, RT-Filter attention with tangent correction and retraction on the sphere.

``residual="prenorm"`` puts the same attention inside the standard pre-norm GPT block instead (the
transformer with RT attention, for the rt-predictions ablation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from geoattn.core.errors import ConfigError
from geoattn.layers.rt_block import RTAttention, RTBlock
from geoattn.models.lm_core import (
    Backbone,
    LanguageModel,
    LMConfig,
    check_norm,
    check_sphere,
    prenorm_blocks,
    sphere_mlp,
)

RESIDUALS = ("sphere", "prenorm")
RT_BACKENDS = ("auto", "reference")


@dataclass
class RTConfig(LMConfig):
    """:class:`LMConfig` plus the RT paper's changes, each switchable alone, and the sphere's fields.

    Fields:
        magnitude_precision: key magnitudes set the precision κ_j ∝ |k_j|² (False: unit keys); None: on.
        qkv_norm: the kernel normalises values too (False: raw values are averaged; q, k stay unit,
            the precision needs their directions); None: on.
        residual: ``"sphere"`` (the RT block, default) or ``"prenorm"`` (RT-Filter attention inside
            the standard pre-norm GPT block).
        norm: ``"layernorm"`` or ``"rmsnorm"`` of the pre-norm blocks (``residual="prenorm"``).
        process_noise: σ_t² learned (False: σ_t² ≡ 0, no recency decay, the separable SDPA path).
        learn_omega: learn the rotation frequencies ω (else fixed at the RoPE spectrum).
        step: ``"retraction"`` or ``"geodesic"`` residual update on the sphere.
        alpha_init: initial per-channel step size α (nGPT: 0.05).
        rt_backend: ``rt_attention`` backend (``"auto"`` or ``"reference"``).
    """

    model: ClassVar[str] = "rt"
    positions: ClassVar[tuple[str, ...]] = ("rope", "none")

    magnitude_precision: bool | None = None
    qkv_norm: bool | None = None
    residual: str = "sphere"
    norm: str = "layernorm"
    process_noise: bool = True
    learn_omega: bool = False
    step: str = "retraction"
    alpha_init: float = 0.05
    rt_backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_norm(self, self.norm)
        check_sphere(self, self.step, self.alpha_init)
        if self.residual not in RESIDUALS:
            raise ConfigError(f"RTConfig.residual must be 'sphere' or 'prenorm', got {self.residual!r}")
        if self.rt_backend not in RT_BACKENDS:
            raise ConfigError(f"RTConfig.rt_backend must be 'auto' or 'reference', got {self.rt_backend!r}")
        if self.mlp == "gelu" and self.residual == "sphere":
            raise ConfigError(
                "RTConfig.mlp='gelu' is the nanoGPT recipe for pre-norm blocks (residual='prenorm'); "
                "use 'swiglu' or None"
            )


def rt_backbone(config: RTConfig) -> Backbone:
    """RT blocks on the sphere, or pre-norm GPT blocks around ``RTAttention`` (``residual="prenorm"``)."""
    c = config
    attention_options = dict(
        causal=c.causal,
        magnitude_precision=c.magnitude_precision is not False,
        qkv_norm=c.qkv_norm is not False,
        process_noise=c.process_noise,
        rotation=c.pos == "rope",
        learn_omega=c.learn_omega,
        rope_base=c.rope_base,
        backend=c.rt_backend,
    )
    if c.residual == "prenorm":

        def attention() -> RTAttention:
            return RTAttention(c.n_embd, c.n_head, **attention_options)

        return Backbone(c, prenorm_blocks(c, c.norm, attention), norm=c.norm)
    blocks = [
        RTBlock(
            c.n_embd,
            c.n_head,
            mlp=sphere_mlp(c),
            alpha_init=c.alpha_init,
            tangent_correction=c.tangent_correction is not False,
            step=c.step,
            **attention_options,
        )
        for _ in range(c.n_layer)
    ]
    return Backbone(c, blocks, norm=None)


class RTTransformerLM(LanguageModel):
    """The RT-Transformer: RT blocks (RT-Filter attention + tangent correction + retraction), nGPT-style."""

    def __init__(self, config: LMConfig):
        config = RTConfig.of(config)
        super().__init__(config, rt_backbone(config))
