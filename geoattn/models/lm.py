"""Language models and sequence backbones: GPT, nGPT, RT-Transformer and isotropic RFA
(docs/concepts/rt-filter.md#baselines).

One config (``LMConfig``), one backbone per model name (``build_backbone``), and one language model
around it: token embedding → backbone ``(B, T, C) -> (B, T, C)`` → tied output head. The backbones are
what the non-LM tasks use (the filter task regresses directions, the nbody baseline is a bidirectional
transformer over bodies).

| name | residual stream | attention |
| --- | --- | --- |
| ``transformer`` | pre-norm GPT, tied embeddings | softmax, RoPE (or nanoGPT's learned positions) |
| ``rfa`` | pre-norm GPT | isotropic Robust Filter Attention (``RFAAttention``) |
| ``ngpt`` | unit sphere (nGPT) | unit q, k, logit scale sqrt(D), RoPE |
| ``rt`` | unit sphere, tangent correction + retraction | RT-Filter attention (``RTAttention``) |

The hypersphere models (``ngpt``, ``rt``) use nGPT's parameterisation
(docs/concepts/rt-filter.md#the-hypersphere-parameterisation): scales stored as
init/scale, a learned logit scale ``s_z``, weights renormalised along the embedding axis after every
optimiser step (:meth:`normalize_weights`, called by the trainer) and no weight decay
(:meth:`optim_groups`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.errors import ConfigError
from geoattn.layers.common import ScaledVector, check_input, normalize_
from geoattn.layers.robust_filter import RFAAttention
from geoattn.layers.rt_block import RTAttention, RTBlock
from geoattn.layers.sphere import STEPS, NGPTAttention, NormalizedSwiGLU, SphereBlock, to_sphere
from geoattn.layers.transformer import Block, CausalSelfAttention, make_mlp, make_norm
from geoattn.models.base import ModelSizes, TaskModel, decay_groups
from geoattn.settings import settings_from

POSITIONS = ("rope", "learned", "alibi", "none")
LM_MODELS = {  # --model name -> what it is
    "transformer": "pre-norm GPT, RoPE + SwiGLU (nanoGPT with mlp=gelu, pos=learned)",
    "rt": "RT-Transformer: RT-Filter attention, tangent correction + retraction on the sphere",
    "rfa": "pre-norm GPT with isotropic Robust Filter Attention",
    "ngpt": "nGPT: normalised Transformer on the unit sphere",
}


@dataclass
class LMConfig:
    """Every knob of the four models; defaults are nanoGPT's CPU recipe with RoPE and SwiGLU.

    Shared fields:
        vocab_size, block_size: vocabulary and training context (tinyshakespeare chars: 65, 64).
        n_layer, n_head, n_embd: depth, heads, width (``n_embd / n_head`` must be even).
        dropout: on attention weights and outputs of the SDPA attentions (transformer, ngpt) and on MLP
            outputs; the RT and RFA kernels have no attention dropout.
        mlp: ``"swiglu"`` (parameter-matched to 4× GELU), ``"gelu"`` (nanoGPT's 4× MLP; GPT and RFA
            only) or ``None`` (attention-only blocks, e.g. a pure filter).
        mlp_hidden: MLP width; None → 340 at C=128 for SwiGLU (≈ 8/3·C), 4·C for GELU.
        pos: ``"rope"`` (RT/RFA: rotation frequencies ω initialised to the RoPE spectrum), ``"learned"``
            (nanoGPT's absolute positions, ``transformer`` only, cannot run beyond ``block_size``),
            ``"alibi"`` (ALiBi's linear distance penalty, ``transformer`` only: the standard
            length-extrapolation baseline) or
            ``"none"`` (no rotation).
        rope_base: RoPE base of the spectrum ``base^(−2k/D)``.
        causal: causal attention (False for set-like inputs such as n-body).
        norm: ``"layernorm"`` (nanoGPT, bias-free) or ``"rmsnorm"``; pre-norm models only.

    The RT paper's changes, each switchable alone (None: the model's own choice, on for ``rt``, off
    for ``transformer``; ``rfa`` and ``ngpt`` ignore the first two):
        magnitude_precision: key magnitudes set the precision κ_j ∝ |k_j|² (False: unit keys). On a
            ``transformer``: RT-Filter's logit on the RoPE-rotated q, k, values raw
            (``CausalSelfAttention``).
        qkv_norm: ``rt``: the kernel normalises values too (False: raw values are averaged; q, k stay
            unit, the precision needs their directions). ``transformer``: q, k and v normalised
            after projection, with a learned logit scale.

    Hypersphere fields (``rt``; ``alpha_init`` and ``step`` also ``ngpt``, whose update is always nGPT's
    own ``o − h``, i.e. no tangent correction):
        tangent_correction: step along ``o − ⟨o,h⟩h`` (False: nGPT's ``o − h``); None: the model's
            own choice (rt's sphere block: True; every other block: False). On a pre-norm block
            (``transformer``, ``rfa``, ``rt`` with ``residual="prenorm"``) True removes the sublayer
            output's component along the residual state's direction before the residual step.
        residual: ``rt`` only: ``"sphere"`` (the RT block, default) or ``"prenorm"`` (RT-Filter
            attention inside the standard pre-norm GPT block: the transformer with RT attention, for
            the rt-predictions ablation).
        process_noise: σ_t² learned (False: σ_t² ≡ 0, no recency decay, the separable SDPA path).
        learn_omega: learn the rotation frequencies ω (else fixed at the RoPE spectrum).
        step: ``"retraction"`` or ``"geodesic"`` residual update on the sphere.
        alpha_init: initial per-channel step size α (nGPT: 0.05).
        rt_backend: ``rt_attention`` backend (``"auto"`` or ``"reference"``).
    """

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    mlp: str | None = "swiglu"
    mlp_hidden: int | None = None
    pos: str = "rope"
    rope_base: float = 10000.0
    causal: bool = True
    norm: str = "layernorm"
    magnitude_precision: bool | None = None
    qkv_norm: bool | None = None
    tangent_correction: bool | None = None
    residual: str = "sphere"
    process_noise: bool = True
    learn_omega: bool = False
    step: str = "retraction"
    alpha_init: float = 0.05
    rt_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"LMConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"LMConfig.n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ConfigError(
                f"LMConfig: head dimension n_embd/n_head = {self.n_embd // self.n_head} must be even "
                "(rotations act on coordinate pairs)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LMConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.mlp not in ("swiglu", "gelu", None):
            raise ConfigError(f"LMConfig.mlp must be 'swiglu', 'gelu' or None, got {self.mlp!r}")
        if self.mlp_hidden is not None and self.mlp_hidden <= 0:
            raise ConfigError(f"LMConfig.mlp_hidden must be positive or None, got {self.mlp_hidden}")
        if self.pos not in POSITIONS:
            raise ConfigError(f"LMConfig.pos must be one of {', '.join(POSITIONS)}, got {self.pos!r}")
        if self.rope_base <= 0:
            raise ConfigError(f"LMConfig.rope_base must be positive, got {self.rope_base}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"LMConfig.norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.step not in STEPS:
            raise ConfigError(f"LMConfig.step must be one of {STEPS}, got {self.step!r}")
        if self.alpha_init <= 0:
            raise ConfigError(f"LMConfig.alpha_init must be positive, got {self.alpha_init}")
        if self.residual not in ("sphere", "prenorm"):
            raise ConfigError(f"LMConfig.residual must be 'sphere' or 'prenorm', got {self.residual!r}")
        if self.rt_backend not in ("auto", "reference"):
            raise ConfigError(f"LMConfig.rt_backend must be 'auto' or 'reference', got {self.rt_backend!r}")

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None, **fixed: Any) -> LMConfig:
        """The config for a run: its sizes, then the user's ``model.*`` options, then ``fixed`` (what
        the task decides, e.g. ``vocab_size``); ConfigError on an unknown key or a bad value."""
        defaults = {
            "n_layer": sizes.n_layer,
            "n_head": sizes.n_head,
            "n_embd": sizes.n_embd,
            "block_size": sizes.block_size,
            "dropout": sizes.dropout,
        }
        return settings_from(cls, options, prefix="model", fixed=fixed, defaults=defaults)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        """Plain JSON-serialisable fields (saved next to every checkpoint)."""
        return asdict(self)


# ------------------------------------------------------------------------------------------------
# Backbones


class Backbone(nn.Module):
    """A stack of blocks: ``forward(x (B, T, C), positions (T,) | (B, T) | None) -> (B, T, C)``.

    Pre-norm backbones end with a final norm; hypersphere backbones project ``x`` onto the unit
    sphere first and return unit rows. ``pos="learned"`` adds nanoGPT's absolute position table.
    """

    def __init__(self, config: LMConfig, blocks: list[nn.Module], *, sphere: bool):
        super().__init__()
        self.config, self.sphere = config, sphere
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = None if sphere else make_norm(config.norm, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else None
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Hypersphere: N(0, 1/C) then unit rows (nGPT); pre-norm: nanoGPT's N(0, 0.02), c_proj / sqrt(2L)."""
        if self.sphere:
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=self.config.n_embd**-0.5)
            self.normalize_weights()
            return
        for name, p in self.named_parameters():
            if p.dim() == 2:
                last = name.endswith("c_proj.weight")
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer) if last else 0.02)

    def _prepare(self, x: Tensor, positions: Tensor | None) -> Tensor:
        check_input(x, self.config.n_embd)
        if self.wpe is not None:
            T = x.shape[1]
            if positions is not None:
                raise ValueError("pos='learned' indexes a position table; positions must be None")
            if T > self.config.block_size:
                raise ValueError(
                    f"pos='learned' has no embedding beyond block_size={self.config.block_size} (got T={T}); "
                    "use pos='rope' for length extrapolation"
                )
            x = x + self.wpe(torch.arange(T, device=x.device))
        return to_sphere(x) if self.sphere else x

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        x = self._prepare(x, positions)
        for block in self.blocks:
            x = block(x, positions)
        return x if self.ln_f is None else self.ln_f(x)

    @torch.no_grad()
    def normalize_weights(self) -> None:
        """Unit-norm weights along the embedding axis (call after each optimiser step); no-op if pre-norm."""
        if not self.sphere:
            return
        for block in self.blocks:
            for m in block.modules():
                if m is not block and hasattr(m, "normalize_weights"):
                    m.normalize_weights()

    @torch.no_grad()
    def attention_maps(self, x: Tensor, positions: Tensor | None = None) -> list[Tensor]:
        """Explicit attention weights, one ``(B, H, T, T)`` tensor per layer (reference paths)."""
        x = self._prepare(x, positions)
        maps = []
        for block in self.blocks:
            maps.append(block.attention_weights(x, positions))
            x = block(x, positions)
        return maps


def _sphere_mlp(config: LMConfig) -> nn.Module | None:
    if config.mlp == "gelu":
        raise ConfigError(
            "LMConfig.mlp='gelu' is the nanoGPT recipe for 'transformer'/'rfa'; use 'swiglu' or None"
        )
    return NormalizedSwiGLU(config.n_embd, config.mlp_hidden, config.dropout) if config.mlp else None


def _check_pos(name: str, config: LMConfig) -> None:
    if config.pos in ("learned", "alibi") and name != "transformer":
        raise ConfigError(
            f"LMConfig.pos={config.pos!r} is only available for model 'transformer', not {name!r}"
        )


def build_backbone(name: str, config: LMConfig) -> Backbone:
    """The backbone of model ``name`` in ``transformer | rt | rfa | ngpt`` (see the module docstring)."""
    if name not in LM_MODELS:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(LM_MODELS)}")
    _check_pos(name, config)
    c = config
    rope = c.pos == "rope"
    if name == "transformer":
        blocks = [
            Block(
                CausalSelfAttention(
                    c.n_embd,
                    c.n_head,
                    rope=rope,
                    rope_base=c.rope_base,
                    causal=c.causal,
                    dropout=c.dropout,
                    alibi=c.pos == "alibi",
                    magnitude_precision=bool(c.magnitude_precision),
                    qkv_norm=bool(c.qkv_norm),
                ),
                make_mlp(c.mlp, c.n_embd, c.mlp_hidden, c.dropout),
                c.n_embd,
                c.norm,
                tangent_correction=bool(c.tangent_correction),
            )
            for _ in range(c.n_layer)
        ]
        return Backbone(c, blocks, sphere=False)
    if name == "rfa":
        blocks = [
            Block(
                RFAAttention(c.n_embd, c.n_head, rotation=rope, rope_base=c.rope_base, causal=c.causal),
                make_mlp(c.mlp, c.n_embd, c.mlp_hidden, c.dropout),
                c.n_embd,
                c.norm,
                tangent_correction=bool(c.tangent_correction),
            )
            for _ in range(c.n_layer)
        ]
        return Backbone(c, blocks, sphere=False)
    if name == "ngpt":
        blocks = [
            SphereBlock(
                NGPTAttention(
                    c.n_embd, c.n_head, rope=rope, rope_base=c.rope_base, causal=c.causal, dropout=c.dropout
                ),
                _sphere_mlp(c),
                c.n_embd,
                alpha_init=c.alpha_init,
                tangent_correction=bool(c.tangent_correction),
                step=c.step,
            )
            for _ in range(c.n_layer)
        ]
        return Backbone(c, blocks, sphere=True)
    rt_attention_options = dict(
        causal=c.causal,
        magnitude_precision=c.magnitude_precision is not False,
        qkv_norm=c.qkv_norm is not False,
        process_noise=c.process_noise,
        rotation=rope,
        learn_omega=c.learn_omega,
        rope_base=c.rope_base,
        backend=c.rt_backend,
    )
    if c.residual == "prenorm":
        blocks = [
            Block(
                RTAttention(c.n_embd, c.n_head, **rt_attention_options),
                make_mlp(c.mlp, c.n_embd, c.mlp_hidden, c.dropout),
                c.n_embd,
                c.norm,
                tangent_correction=bool(c.tangent_correction),
            )
            for _ in range(c.n_layer)
        ]
        return Backbone(c, blocks, sphere=False)
    blocks = [
        RTBlock(
            c.n_embd,
            c.n_head,
            mlp=_sphere_mlp(c),
            alpha_init=c.alpha_init,
            tangent_correction=c.tangent_correction is not False,
            step=c.step,
            **rt_attention_options,
        )
        for _ in range(c.n_layer)
    ]
    return Backbone(c, blocks, sphere=True)


# ------------------------------------------------------------------------------------------------
# Language models


class LanguageModel(TaskModel):
    """Token embedding → backbone → tied output head.

    ``forward(idx (B, T) long, targets (B, T) long | None) -> (logits (B, T, V), loss | None)``.
    Subclasses fix the backbone name; hypersphere models (``sphere = True``) keep unit-norm embedding
    rows and scale the cosine logits by a learned ``s_z`` (nGPT).
    """

    model_name: str = "transformer"

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.backbone = build_backbone(self.model_name, config)
        self.sphere = self.backbone.sphere
        self.s_z = ScaledVector(config.vocab_size, 1.0, config.n_embd**-0.5) if self.sphere else None
        self._init_weights()  # the backbone initialises its own blocks

    @torch.no_grad()
    def _init_weights(self) -> None:
        if self.sphere:
            nn.init.normal_(self.wte.weight, std=self.config.n_embd**-0.5)
            normalize_(self.wte.weight, dim=1)
        else:
            nn.init.normal_(self.wte.weight, std=0.02)

    def _logits(self, h: Tensor) -> Tensor:
        logits = h @ self.wte.weight.t()  # (B, T, V)
        return logits if self.s_z is None else logits * self.s_z()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(f"idx has shape {tuple(idx.shape)}, expected (B, T)")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {tuple(idx.shape)}")
        logits = self._logits(self.backbone(self.wte(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``, feeding at most block_size."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat((idx, torch.multinomial(logits.softmax(-1), 1)), dim=1)
        return idx

    @torch.no_grad()
    def attention_maps(self, idx: Tensor) -> list[Tensor]:
        """One ``(B, H, T, T)`` attention-weight tensor per layer, for plots."""
        return self.backbone.attention_maps(self.wte(idx))

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: matrices decay, vectors (norms, scales, filter parameters) do not.

        Hypersphere models put everything in the no-decay group: their weights are renormalised
        instead (nGPT).
        """
        return decay_groups(self, weight_decay, decay_matrices=not self.sphere)

    @torch.no_grad()
    def normalize_weights(self) -> None:
        """Hypersphere models: every weight matrix back to unit norm along the embedding axis (after
        each optimiser step); pre-norm models: nothing."""
        if self.sphere:
            normalize_(self.wte.weight, dim=1)
            self.backbone.normalize_weights()


class TransformerLM(LanguageModel):
    """Pre-norm GPT, tied embeddings; RoPE + SwiGLU by default, ``mlp="gelu", pos="learned"`` is nanoGPT."""

    model_name = "transformer"


class RFATransformerLM(LanguageModel):
    """Pre-norm GPT with isotropic Robust Filter Attention (docs/concepts/rt-filter.md#baselines)."""

    model_name = "rfa"


class NGPTLM(LanguageModel):
    """nGPT: unit residual stream, unit q and k with per-dimension scale s_qk, no precision term."""

    model_name = "ngpt"


class RTTransformerLM(LanguageModel):
    """The RT-Transformer: RT blocks (RT-Filter attention + tangent correction + retraction), nGPT-style."""

    model_name = "rt"


_LM_CLASSES: dict[str, type[LanguageModel]] = {
    "transformer": TransformerLM,
    "rt": RTTransformerLM,
    "rfa": RFATransformerLM,
    "ngpt": NGPTLM,
}


def build_lm(name: str, config: LMConfig) -> LanguageModel:
    """The language model ``name`` in ``transformer | rt | rfa | ngpt``."""
    if name not in _LM_CLASSES:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(LM_MODELS)}")
    return _LM_CLASSES[name](config)
