"""``ngpt``: the normalised Transformer on the unit sphere (nGPT), with RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from geoattn.layers.sphere import NGPTAttention, SphereBlock
from geoattn.models.lm_core import Backbone, LanguageModel, LMConfig, check_sphere, sphere_mlp


@dataclass
class NGPTConfig(LMConfig):
    """:class:`LMConfig` plus nGPT's hypersphere fields (its update is nGPT's own ``o − h`` unless
    ``tangent_correction``).

    Fields:
        step: ``"retraction"`` or ``"geodesic"`` residual update on the sphere.
        alpha_init: initial per-channel step size α (nGPT: 0.05).
    """

    model: ClassVar[str] = "ngpt"
    positions: ClassVar[tuple[str, ...]] = ("rope", "none")
    mlps: ClassVar[tuple[str | None, ...]] = ("swiglu", None)

    step: str = "retraction"
    alpha_init: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sphere(self, self.step, self.alpha_init)


def ngpt_backbone(config: NGPTConfig) -> Backbone:
    """Sphere blocks around ``NGPTAttention`` (unit q, k, logit scale sqrt(D), RoPE)."""
    c = config
    blocks = [
        SphereBlock(
            NGPTAttention(
                c.n_embd,
                c.n_head,
                rope=c.pos == "rope",
                rope_base=c.rope_base,
                causal=c.causal,
                dropout=c.dropout,
            ),
            sphere_mlp(c),
            c.n_embd,
            alpha_init=c.alpha_init,
            tangent_correction=bool(c.tangent_correction),
            step=c.step,
        )
        for _ in range(c.n_layer)
    ]
    return Backbone(c, blocks, norm=None)


class NGPTLM(LanguageModel):
    """nGPT: unit residual stream, unit q and k with per-dimension scale s_qk, no precision term."""

    def __init__(self, config: LMConfig):
        config = NGPTConfig.of(config)
        super().__init__(config, ngpt_backbone(config))
