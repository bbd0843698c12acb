"""What every language model shares: the core config, the backbone container and the LM around it.

A model of the ``lm`` family is a config dataclass that extends :class:`LMConfig` with its own
fields, a function ``config -> Backbone`` and a :class:`LanguageModel` subclass; ``geoattn.models.lm``
lists them in one table. The backbone maps ``(B, T, C) -> (B, T, C)``; the language model is token
embedding → backbone → tied output head.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.core.errors import ConfigError
from geoattn.core.settings import settings_from
from geoattn.layers.common import ScaledVector, check_input, normalize_
from geoattn.layers.sphere import STEPS, NormalizedSwiGLU, to_sphere
from geoattn.layers.transformer import Block, make_mlp, make_norm
from geoattn.models.base import ModelSizes, TaskModel, decay_groups

POSITIONS = ("rope", "learned", "alibi", "none")
MLPS = ("swiglu", "gelu", None)
NORMS = ("layernorm", "rmsnorm")

C = TypeVar("C", bound="LMConfig")


@dataclass
class LMConfig:
    """The fields every language model has; defaults are nanoGPT's CPU recipe with RoPE and SwiGLU.

    Each model's config extends it (``TransformerConfig``, ``RTConfig``, ...); a bare ``LMConfig``
    given to a model takes that model's defaults for the rest (:meth:`of`).

    Fields:
        vocab_size, block_size: vocabulary and training context (tinyshakespeare chars: 65, 64).
        n_layer, n_head, n_embd: depth, heads, width (``n_embd / n_head`` must be even).
        dropout: on attention weights and outputs of the SDPA attentions (transformer, ngpt) and on MLP
            outputs; the RT and RFA kernels have no attention dropout.
        mlp: ``"swiglu"`` (parameter-matched to 4× GELU), ``"gelu"`` (nanoGPT's 4× MLP; pre-norm
            blocks only) or ``None`` (attention-only blocks, e.g. a pure filter).
        mlp_hidden: MLP width; None → 340 at C=128 for SwiGLU (≈ 8/3·C), 4·C for GELU.
        pos: ``"rope"`` (RT/RFA: rotation frequencies ω initialised to the RoPE spectrum), ``"learned"``
            (nanoGPT's absolute positions, ``transformer`` only, cannot run beyond ``block_size``),
            ``"alibi"`` (ALiBi's linear distance penalty, ``transformer`` only: the standard
            length-extrapolation baseline) or ``"none"`` (no rotation).
        rope_base: RoPE base of the spectrum ``base^(−2k/D)``.
        causal: causal attention (False for set-like inputs such as n-body).
        tangent_correction: step along ``o − ⟨o,h⟩h`` (False: nGPT's ``o − h``); None: the model's
            own choice (rt's sphere block: True; every other block: False). On a pre-norm block True
            removes the sublayer output's component along the residual state's direction before the
            residual step.
    """

    # the --model name of the config's model ("" for the core), and the values it accepts
    model: ClassVar[str] = ""
    positions: ClassVar[tuple[str, ...]] = POSITIONS
    mlps: ClassVar[tuple[str | None, ...]] = MLPS

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
    tangent_correction: bool | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}.{field} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"{name}.n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ConfigError(
                f"{name}: head dimension n_embd/n_head = {self.n_embd // self.n_head} must be even "
                "(rotations act on coordinate pairs)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{name}.dropout must be in [0, 1), got {self.dropout}")
        if self.mlp not in MLPS:
            raise ConfigError(f"{name}.mlp must be 'swiglu', 'gelu' or None, got {self.mlp!r}")
        if self.mlp not in self.mlps:
            raise ConfigError(
                f"{name}.mlp={self.mlp!r} is the nanoGPT recipe for pre-norm blocks ('transformer', "
                f"'rfa'); model {self.model!r} takes {' or '.join(map(repr, self.mlps))}"
            )
        if self.mlp_hidden is not None and self.mlp_hidden <= 0:
            raise ConfigError(f"{name}.mlp_hidden must be positive or None, got {self.mlp_hidden}")
        if self.pos not in POSITIONS:
            raise ConfigError(f"{name}.pos must be one of {', '.join(POSITIONS)}, got {self.pos!r}")
        if self.pos not in self.positions:
            raise ConfigError(
                f"{name}.pos={self.pos!r} is only available for model 'transformer', not {self.model!r}"
            )
        if self.rope_base <= 0:
            raise ConfigError(f"{name}.rope_base must be positive, got {self.rope_base}")

    @classmethod
    def from_sizes(cls: type[C], sizes: ModelSizes, options: dict[str, Any] | None = None, **fixed: Any) -> C:
        """The config for a run: its sizes, then the user's ``model.*`` options, then ``fixed`` (what
        the task decides, e.g. ``vocab_size``); ConfigError on an unknown key (naming this model's
        valid keys) or a bad value."""
        defaults = {
            "n_layer": sizes.n_layer,
            "n_head": sizes.n_head,
            "n_embd": sizes.n_embd,
            "block_size": sizes.block_size,
            "dropout": sizes.dropout,
        }
        return settings_from(cls, options, prefix="model", fixed=fixed, defaults=defaults)

    @classmethod
    def of(cls: type[C], config: LMConfig) -> C:
        """``config`` as this model's config: itself, or a bare :class:`LMConfig` completed with this
        model's defaults; ConfigError for another model's config."""
        if isinstance(config, cls):
            return config
        if type(config) is LMConfig:
            return cls(**asdict(config))
        raise ConfigError(
            f"model {cls.model!r} takes {cls.__name__} (or a bare LMConfig), not {type(config).__name__}"
        )

    @property
    def head_dim(self) -> int:
        """Channels per attention head, ``n_embd / n_head``."""
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        """Plain JSON-serialisable fields (saved next to every checkpoint)."""
        return asdict(self)


def check_norm(config: LMConfig, norm: str) -> None:
    """ConfigError unless ``norm`` (a pre-norm model's field) is one of :data:`NORMS`."""
    if norm not in NORMS:
        raise ConfigError(f"{type(config).__name__}.norm must be 'layernorm' or 'rmsnorm', got {norm!r}")


def check_sphere(config: LMConfig, step: str, alpha_init: float) -> None:
    """ConfigError unless the hypersphere fields ``step`` and ``alpha_init`` are valid."""
    name = type(config).__name__
    if step not in STEPS:
        raise ConfigError(f"{name}.step must be one of {STEPS}, got {step!r}")
    if alpha_init <= 0:
        raise ConfigError(f"{name}.alpha_init must be positive, got {alpha_init}")


def prenorm_blocks(config: LMConfig, norm: str, attention: Any) -> list[nn.Module]:
    """``n_layer`` pre-norm GPT blocks around ``attention()`` (a fresh attention module per call)."""
    c = config
    return [
        Block(
            attention(),
            make_mlp(c.mlp, c.n_embd, c.mlp_hidden, c.dropout),
            c.n_embd,
            norm,
            tangent_correction=bool(c.tangent_correction),
        )
        for _ in range(c.n_layer)
    ]


def sphere_mlp(config: LMConfig) -> nn.Module | None:
    """The normalised SwiGLU of a hypersphere block, or None (``mlp=None``)."""
    return NormalizedSwiGLU(config.n_embd, config.mlp_hidden, config.dropout) if config.mlp else None


# ------------------------------------------------------------------------------------------------
# Backbones


class Backbone(nn.Module):
    """A stack of blocks: ``forward(x (B, T, C), positions (T,) | (B, T) | None) -> (B, T, C)``.

    Pre-norm backbones (``norm`` given) end with a final norm; hypersphere backbones (``norm=None``)
    project ``x`` onto the unit sphere first and return unit rows. ``pos="learned"`` adds nanoGPT's
    absolute position table.
    """

    def __init__(self, config: LMConfig, blocks: list[nn.Module], *, norm: str | None):
        super().__init__()
        self.config, self.sphere = config, norm is None
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = None if norm is None else make_norm(norm, config.n_embd)
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

    @property
    def width(self) -> int:
        """Features per token in and out, ``n_embd``."""
        return self.config.n_embd

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        x = self._prepare(x, positions)
        for block in self.blocks:
            x = block(x, positions)
        return x if self.ln_f is None else self.ln_f(x)

    def plots(self, directory: Path) -> list[Path]:
        """The backbone's own figures of a trained model: none (the rotor backbone plots its positions)."""
        return []

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


# ------------------------------------------------------------------------------------------------
# Language models


class LanguageModel(TaskModel):
    """Token embedding → backbone → tied output head.

    ``forward(idx (B, T) long, targets (B, T) long | None) -> (logits (B, T, V), loss | None)``.
    Each model's subclass builds its backbone from its config; hypersphere models (a backbone without
    a final norm) keep unit-norm embedding rows and scale the cosine logits by a learned ``s_z`` (nGPT).
    """

    def __init__(self, config: LMConfig, backbone: Backbone):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.backbone = backbone
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
