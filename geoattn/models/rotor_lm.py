"""`RotorLM`: the rotor seed's own architecture for token sequences (docs/concepts/rotors.md).

The seed draws it as: ``embed_token`` gives each token a scalar ("existence"), a vector ("direction")
and a bivector ("relations") part; rotor attention blocks with grade-wise normalisation; per-grade
aggregation of the heads; rotors as positional encodings. Here, per token ``t``:

    tables[t] → (scalar (C,), vector (C, n), bivector (C, n(n−1)/2), invariant scalars (S,))
              → MultivectorEmbedding (+ one learned multivector shared by all tokens)
              → x (C, dim) multivector channels, s (S,) scalars
    n_layer × RotorLMBlock: x, s += RotorAttention(GradeLayerNorm(x), LayerNorm(s))   (causal,
                                          rotor PE R_h(t) = exp(t B_h / 2) on q and k, head types per
                                          head, rotation heads summing or composing their rotors,
                                          per-grade head gains)
                            x, s += GeometricMLP(GradeLayerNorm(x), LayerNorm(s))
    GradeLayerNorm → invariants (per channel ⟨x⟩₀ and |⟨x⟩_k| for k = 1..n, and s) → logits

Readout ``"invariant"``: LayerNorm → Linear(invariants → vocab). ``"tied"``: the invariant inner
product of the final state with each token's own embedding, ``Σ_c ⟨x̃_c E_tc⟩₀ + ⟨s, E^s_t⟩``
(GATr's inner product; nanoGPT's tied head in the algebra).

What is invariant: every layer is equivariant under the algebra's versors g (O(n) in Cl(n)) acting on
all multivector channels *including the positional-encoding bivectors* ``B_h ↦ g B_h g⁻¹``, and the
readout uses invariants only. So a global rotation or reflection of the embedding tables' vector and
bivector parts and of the shared multivector, together with every ``B_h``, leaves the logits unchanged
(tested): the model's frame is arbitrary. The learned planes ``B_h`` pick directions, so rotating the
embeddings alone does change the logits, as RoPE's fixed pairs do; with ``pos="none"`` the embeddings
alone can be rotated.

Sizes (:meth:`RotorLMConfig.from_sizes`): ``n_embd`` is read as numbers per token in multivector
channels, ``channels = n_embd / dim`` (16 in Cl(3) at n_embd 128), ``n_head`` heads with
``channels / n_head`` channels each, and an invariant scalar stream as wide as ``n_embd``
(``scalars = n_embd``). The geometric MLP has ``3 · channels`` hidden multivector channels and
``4 · scalars`` hidden scalars (GPT's ratio), which puts the recipe (4 layers, 4 heads, n_embd 128,
vocab 65, ctx 64) at 785,172 parameters against TransformerLM's 793,856 (−1.1 %).

The same stack reads continuous features for the filter task (:class:`RotorBackbone`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.algebra.layout import blade_major, blade_major_grad
from geoattn.algebra.named import ALGEBRAS, algebra_signature, named_algebra
from geoattn.attention.rotor.heads import DEFAULT_HEAD_CYCLE, check_head_types, default_head_types
from geoattn.core.errors import ConfigError
from geoattn.core.settings import settings_from
from geoattn.layers.common import check_input, default_positions
from geoattn.layers.multivector import GeometricMLP, GradeLayerNorm, MultivectorEmbedding
from geoattn.layers.rotor_block import RotorAttention
from geoattn.models.base import ModelSizes, TaskModel
from geoattn.models.lm_core import LanguageModel

ATTENTION_INPUT_GAIN = 2.0  # initial gain of each block's attention input norm (see RotorLMBlock)
ROTOR_LM_DESCRIPTION = "RotorLM: multivector tokens, causal rotor attention with rotor positions (seed 004)"


def algebra_dim(name: str) -> int:
    """``2ⁿ``, the numbers per multivector channel of the algebra setting ``name``."""
    return 2 ** sum(algebra_signature(name, "RotorLMConfig.algebra"))


@dataclass
class RotorLMConfig:
    """Shape and options of a :class:`RotorLM` (``--set model.KEY=VALUE``).

    Fields:
        vocab_size, block_size: vocabulary and training context (set by the task).
        algebra: ``"cl3"`` (Cl(3), default), ``"cl4"`` (Cl(4): bivectors with two rotation planes, so
            two positional frequencies per head) or ``"pga"`` (Cl(3,0,1), GATr's algebra).
        n_layer: blocks.
        channels: multivector channels C (from_sizes: n_embd / 2ⁿ).
        scalars: invariant scalar channels S (from_sizes: n_embd).
        head_types: a registered head type per head (frame: Cl(3) only); a list, or a comma string.
        head_channels: multivector channels per head (q, k and v).
        aggregation: how rotation heads aggregate their values: ``"sum"`` (``Σ_j α_ij R_ij v_j R̃_ij``) or
            ``"compose"`` (one mean rotor per query, ``R̄_i (Σ_j α_ij v_j) R̄_i~``,
            docs/concepts/rotors.md#compose; needs a rotation head); the other head types always sum.
        inverse: key → query rotors in rotation heads.
        mlp_ratio: hidden multivector channels of the geometric MLP per channel.
        mlp_scalars: hidden invariant scalars of the MLP (None: 4 · scalars, as a GPT MLP).
        pos: ``"rotor"`` (learned rotor positional encoding ``exp(t B_h / 2)`` per head and layer on
            q and k; RoPE in 2D) or ``"none"``.
        norm: ``"per_grade"`` (the seed's grade-wise normalisation) or ``"joint"`` (one norm over all
            grades, GATr's).
        readout: ``"invariant"`` (Linear on invariant features) or ``"tied"`` (inner product with the
            token embeddings).
        dropout: whole multivector channels and scalars of each branch's output.
    """

    vocab_size: int = 65
    block_size: int = 64
    algebra: str = "cl3"
    n_layer: int = 4
    channels: int = 16
    scalars: int = 128
    head_types: tuple[str, ...] = DEFAULT_HEAD_CYCLE
    head_channels: int = 4
    aggregation: str = "sum"
    inverse: bool = False
    mlp_ratio: int = 3
    mlp_scalars: int | None = None
    pos: str = "rotor"
    norm: str = "per_grade"
    readout: str = "invariant"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        algebra_dim(self.algebra)
        for name in ("vocab_size", "block_size", "n_layer", "channels", "head_channels", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"RotorLMConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.scalars, int) or self.scalars < 0:
            raise ConfigError(f"RotorLMConfig.scalars must be an integer ≥ 0, got {self.scalars!r}")
        if self.mlp_scalars is not None and (not isinstance(self.mlp_scalars, int) or self.mlp_scalars < 1):
            raise ConfigError(
                f"RotorLMConfig.mlp_scalars must be a positive integer or None, got {self.mlp_scalars!r}"
            )
        self.head_types = check_head_types(
            "RotorLMConfig.head_types",
            self.head_types,
            ALGEBRAS[self.algebra],
            self.head_channels,
            algebra=f"algebra={self.algebra!r}",
            aggregation=self.aggregation,
        )
        for name, valid in (
            ("pos", ("rotor", "none")),
            ("norm", ("per_grade", "joint")),
            ("readout", ("invariant", "tied")),
        ):
            if getattr(self, name) not in valid:
                raise ConfigError(f"RotorLMConfig.{name} must be one of {valid}, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"RotorLMConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_sizes(
        cls, sizes: ModelSizes, options: dict[str, Any] | None = None, **fixed: Any
    ) -> RotorLMConfig:
        """The config for a run (``--n-layer --n-head --n-embd --block-size --dropout``).

        ``n_embd`` counts numbers per token in multivector channels: ``channels = n_embd / dim``
        (``dim = 2ⁿ`` of ``model.algebra``: 8 in Cl(3), 16 in Cl(4) and PGA), a ConfigError if it does
        not divide (unless ``model.channels`` is set); ``n_head`` heads cycling through
        ``DEFAULT_HEAD_CYCLE`` (rotation, rotation, reflection, projection) with ``channels / n_head``
        channels each; ``scalars = n_embd`` invariant scalars. Then the user's ``model.*`` options,
        then ``fixed`` (the task's).
        """
        options = dict(options or {})
        dim = algebra_dim(options.get("algebra", "cl3"))
        if "channels" in options:
            channels = options["channels"]
        elif sizes.n_embd % dim:
            raise ConfigError(
                f"n_embd={sizes.n_embd} is not divisible into multivector channels of {dim} numbers "
                f"(algebra {options.get('algebra', 'cl3')!r}); use a multiple of {dim} or set model.channels"
            )
        else:
            channels = sizes.n_embd // dim
        if "head_channels" not in options and (not isinstance(channels, int) or channels % sizes.n_head):
            raise ConfigError(
                f"{channels} multivector channels are not divisible into n_head={sizes.n_head} heads; "
                "change --n-head or --n-embd, or set model.head_channels"
            )
        defaults = {
            "n_layer": sizes.n_layer,
            "channels": channels,
            "scalars": sizes.n_embd,
            "head_types": default_head_types(sizes.n_head),
            "head_channels": max(1, channels // sizes.n_head) if isinstance(channels, int) else 1,
            "block_size": sizes.block_size,
            "dropout": sizes.dropout,
        }
        return settings_from(cls, options, prefix="model", fixed=fixed, defaults=defaults)

    @classmethod
    def of(cls, config: Any) -> RotorLMConfig:
        """``config`` itself (the table's contract, :func:`geoattn.models.lm.build_backbone`); a
        ConfigError for another model's config, which has no multivector channels to read."""
        if isinstance(config, cls):
            return config
        raise ConfigError(f"model 'rotor' takes RotorLMConfig, not {type(config).__name__}")

    def make_algebra(self) -> CliffordAlgebra:
        return named_algebra(self.algebra)


# ------------------------------------------------------------------------------------------------
# Pieces


class GradeParts(nn.Module):
    """The seed's ``embed_token``: any input → scalar, vector and bivector parts → multivector channels.

    ``source(width)`` makes the module that maps the input to ``width`` numbers (``nn.Embedding`` for
    token ids, ``nn.Linear`` for features); one source per part: scalar ``(C,)``, vector ``(C, n)``,
    bivector ``(C, n(n−1)/2)``, invariant scalars ``(S,)``. A :class:`MultivectorEmbedding` puts the
    parts into their blades (and mixes channels per grade).

    ``shared``: add one learned multivector per channel to every input, ``(C, dim)`` on the scalar,
    vector and bivector blades (an ``nn.Linear`` source has it already as its bias; token tables do not).
    It gives all tokens a common direction, which is what the rotor positional encoding turns: without
    it attention by position alone needs every token's own vector to learn the same component (measured
    on the LM recipe: after 300 steps the attention stayed near uniform and the val loss at the bigram
    level, 2.475; with it 2.398).

    forward(inputs ``(B, T)`` ids or ``(B, T, F)``) → (x ``(B, T, C, dim)``, s ``(B, T, S)`` | None).
    """

    def __init__(
        self, algebra: CliffordAlgebra, channels: int, scalars: int, source, *, shared: bool = False
    ):
        super().__init__()
        self.algebra, self.channels = algebra, channels
        self.n_bivectors = len(algebra.bivector_indices)
        C = channels
        self.scalar = source(C)
        self.vector = source(C * algebra.n)
        self.bivector = source(C * self.n_bivectors)
        self.scalars = source(scalars) if scalars else None
        self.embed = MultivectorEmbedding(algebra, C, scalars=C, vectors=C, bivectors=C)
        if shared:
            blades = [*algebra.vector_indices, *algebra.bivector_indices]
            init = torch.zeros(C, algebra.dim)
            init[:, blades] = torch.randn(C, len(blades))  # as large as a token's own parts
            self.shared = nn.Parameter(init)
        else:
            self.shared = None

    def parts(self, inputs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(scalar (..., C), vector (..., C, n), bivector (..., C, n(n−1)/2))`` of ``inputs``."""
        C = self.channels
        vector = self.vector(inputs).unflatten(-1, (C, self.algebra.n))
        return self.scalar(inputs), vector, self.bivector(inputs).unflatten(-1, (C, self.n_bivectors))

    def forward(self, inputs: Tensor) -> tuple[Tensor, Tensor | None]:
        x = self.embed(*self.parts(inputs))
        if self.shared is not None:
            x = x + self.shared.to(x.dtype)
        return x, (self.scalars(inputs) if self.scalars is not None else None)


class ChannelDropout(nn.Module):
    """Dropout of whole multivector channels (a per-channel scalar mask keeps equivariance) and of scalars."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor, s: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if not self.training or self.p == 0.0:
            return x, s
        keep = torch.ones_like(x[..., :1])
        return x * F.dropout(keep, self.p), (F.dropout(s, self.p) if s is not None else None)


class RotorLMBlock(nn.Module):
    """Pre-norm causal block: ``x, s += RotorAttention(norm(x), norm(s), positions)``, then the same with
    a :class:`GeometricMLP`. ``forward(x (B, T, C, dim), s (B, T, S) | None, positions (T,) | (B, T))``
    → same shapes.

    The attention's input norm starts with gain :data:`ATTENTION_INPUT_GAIN` (learned from there): q
    and k scale with it, so the logits start 4× larger than at unit gain. At unit gain they are O(1)
    (``Σ_c ⟨q̃_c k_c⟩₀ / sqrt(C·dim)`` of unit-scale grades) and attention stayed near uniform early
    in training (LM recipe, 300 steps: val 2.398 at gain 1, 2.356 at gain 2).
    """

    def __init__(self, algebra: CliffordAlgebra, config: RotorLMConfig):
        super().__init__()
        c = config
        C, S = c.channels, c.scalars
        per_grade = c.norm == "per_grade"
        self.norm1, self.norm2 = (
            GradeLayerNorm(algebra, per_grade=per_grade),
            GradeLayerNorm(algebra, per_grade=per_grade),
        )
        with torch.no_grad():
            self.norm1.gain.fill_(ATTENTION_INPUT_GAIN)
        self.snorm1 = nn.LayerNorm(S) if S else None
        self.snorm2 = nn.LayerNorm(S) if S else None
        self.attn = RotorAttention(
            algebra,
            C,
            c.head_types,
            c.head_channels,
            scalars=S,
            causal=True,
            inverse=c.inverse,
            positional_encoding=c.pos == "rotor",
            aggregation=c.aggregation,
        )
        self.mlp = GeometricMLP(
            algebra, C, S, hidden=c.mlp_ratio * C, hidden_scalars=(c.mlp_scalars or 4 * S) if S else None
        )
        self.drop = ChannelDropout(c.dropout)

    def _normed(self, x: Tensor, s: Tensor | None, norm: nn.Module, snorm: nn.Module | None):
        return norm(x), (snorm(s) if snorm is not None else None)

    def forward(self, x: Tensor, s: Tensor | None, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        xn, sn = self._normed(x, s, self.norm1, self.snorm1)
        dx, ds = self.drop(*self.attn(xn, sn, None, positions))
        x, s = x + dx, (s + ds if s is not None else None)
        dx, ds = self.drop(*self.mlp(*self._normed(x, s, self.norm2, self.snorm2)))
        return x + dx, (s + ds if s is not None else None)

    @torch.no_grad()
    def attention_weights(self, x: Tensor, s: Tensor | None, positions: Tensor) -> Tensor:
        """The softmax weights ``(B, H, T, T)`` of this block's attention (docs/concepts/rotors.md#the-rotor:
        ``softmax_j(Σ_c ⟨reverse(q_ic) k_jc⟩₀ / sqrt(C · dim))``, j ≤ i), from its q and k after the
        rotor positional encoding."""
        attn = self.attn
        xn, sn = self._normed(x, s, self.norm1, self.snorm1)
        T, H, Ch = x.shape[1], len(attn.head_types), attn.head_channels
        [(q, k, _)] = attn.project(xn, sn, positions, [list(range(H))])  # each (B, H, T, Ch, dim)
        metric = attn.algebra.invariant_metric.to(x)
        logits = torch.einsum("bhica,bhjca->bhij", q * metric, k) / math.sqrt(Ch * attn.algebra.dim)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        return logits.masked_fill(~causal, float("-inf")).softmax(-1)


class RotorStack(nn.Module):
    """``n_layer`` :class:`RotorLMBlock` s and a final norm; :meth:`invariants` reads the result out.

    forward(x ``(B, T, C, dim)``, s ``(B, T, S)`` | None, positions ``(T,)`` | ``(B, T)``) → normalised
    (x, s) of the same shapes.
    """

    def __init__(self, algebra: CliffordAlgebra, config: RotorLMConfig):
        super().__init__()
        self.algebra, self.config = algebra, config
        self.blocks = nn.ModuleList(RotorLMBlock(algebra, config) for _ in range(config.n_layer))
        self.norm = GradeLayerNorm(algebra, per_grade=config.norm == "per_grade")
        self.snorm = nn.LayerNorm(config.scalars) if config.scalars else None
        onehot = F.one_hot(algebra.blade_grades, algebra.n + 1).float()
        self.register_buffer("grade_onehot", onehot, persistent=False)
        self.register_buffer("metric", algebra.invariant_metric.float(), persistent=False)

    @property
    def n_invariants(self) -> int:
        """Invariant features per token: ``C · (n + 1) + S``."""
        return self.config.channels * (self.algebra.n + 1) + self.config.scalars

    def forward(self, x: Tensor, s: Tensor | None, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        x = blade_major(x)  # the blocks' channel maps read and write it without copies
        for block in self.blocks:
            x, s = block(x, s, positions)
        # the read-outs' gradients come back in the default order: turned once here, not in every block
        return blade_major_grad(self.norm(x)), (self.snorm(s) if s is not None else None)

    def invariants(self, x: Tensor, s: Tensor | None) -> Tensor:
        """``(B, T, C·(n+1) + S)``: per channel the scalar part ``⟨x⟩₀`` and the invariant norm of each
        grade k ≥ 1 (``sqrt(|⟨x̃_k x_k⟩₀| + 1e-6)``; signed grade-n parts flip under reflections, their
        norms do not), then the scalars."""
        sq = ((x * x * self.metric.to(x.dtype)) @ self.grade_onehot.to(x.dtype))[..., 1:]  # (B, T, C, n)
        feats = torch.cat([x[..., :1], (sq.abs() + 1e-6).sqrt()], -1).flatten(-2)
        return feats if s is None else torch.cat([feats, s], -1)

    @torch.no_grad()
    def attention_maps(self, x: Tensor, s: Tensor | None, positions: Tensor) -> list[Tensor]:
        maps = []
        for block in self.blocks:
            maps.append(block.attention_weights(x, s, positions))
            x, s = block(x, s, positions)
        return maps

    def positional_encodings(self) -> list:
        """Each block's :class:`RotorPositionalEncoding` (empty with ``pos="none"``)."""
        return [b.attn.positional for b in self.blocks if b.attn.positional is not None]

    def plots(self, directory: Path) -> list[Path]:
        """``model_rotor_positions.png`` over ``block_size`` positions (:func:`plot_rotor_positions`);
        nothing with ``pos="none"``."""
        encodings = self.positional_encodings()
        if not encodings:
            return []
        path = Path(directory) / "model_rotor_positions.png"
        return [plot_rotor_positions(self.algebra, encodings, self.config.block_size, path)]


# ------------------------------------------------------------------------------------------------
# Models


class RotorBackbone(nn.Module):
    """The rotor stack on continuous features, for tasks whose tokens are not ids (the filter task).

    ``forward(h (B, T, width), positions (T,) | (B, T) | None) -> (B, T, width)``: Linear maps of ``h``
    give the scalar / vector / bivector parts (:class:`GradeParts`), the :class:`RotorStack` runs with
    the rotor positional encoding at ``positions`` (default ``arange(T)``; float times are fine), and
    the output is its invariant features, ``width = C·(n+1) + S`` wide. The input has no geometric
    meaning in the algebra (e.g. the filter's 8-dimensional directions), so only the stack is
    equivariant, not the map from ``h``. Offers the backbone interface of ``models.lm.Backbone``
    (``sphere``, ``normalize_weights``, ``attention_maps``).
    """

    sphere = False

    def __init__(self, config: RotorLMConfig):
        super().__init__()
        self.config = config
        self.algebra = config.make_algebra()
        self.stack = RotorStack(self.algebra, config)
        self.width = self.stack.n_invariants
        self.embed = GradeParts(
            self.algebra, config.channels, config.scalars, lambda k: nn.Linear(self.width, k)
        )

    def _prepare(self, h: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
        check_input(h, self.width, "h")
        return *self.embed(h), default_positions(h, positions)

    def forward(self, h: Tensor, positions: Tensor | None = None) -> Tensor:
        x, s, positions = self._prepare(h, positions)
        return self.stack.invariants(*self.stack(x, s, positions))

    def normalize_weights(self) -> None:
        """Nothing to renormalise (pre-norm)."""

    @torch.no_grad()
    def attention_maps(self, h: Tensor, positions: Tensor | None = None) -> list[Tensor]:
        """One ``(B, H, T, T)`` attention-weight tensor per layer, for plots."""
        return self.stack.attention_maps(*self._prepare(h, positions))

    def plots(self, directory: Path) -> list[Path]:
        """``model_rotor_positions.png`` (positions in the task's time unit)."""
        return self.stack.plots(directory)


class RotorLM(TaskModel):
    """The rotor language model (see the module docstring).

    ``forward(idx (B, T) long, targets (B, T) long | None) -> (logits (B, T, V), loss | None)``.
    """

    generate = LanguageModel.generate  # crops to block_size and samples: nothing rotor-specific

    def __init__(self, config: RotorLMConfig):
        super().__init__()
        self.config = config
        self.algebra = config.make_algebra()
        V = config.vocab_size
        self.embed = GradeParts(
            self.algebra, config.channels, config.scalars, lambda k: nn.Embedding(V, k), shared=True
        )
        self.stack = RotorStack(self.algebra, config)
        if config.readout == "invariant":
            self.ln_out = nn.LayerNorm(self.stack.n_invariants)
            self.head = nn.Linear(self.stack.n_invariants, V, bias=False)
        else:
            self.logit_scale = nn.Parameter(torch.tensor(1.0 / math.sqrt(self.stack.n_invariants)))
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for table in (self.embed.scalar, self.embed.vector, self.embed.bivector, self.embed.scalars):
            if table is not None:
                nn.init.normal_(table.weight, std=1.0)
        if self.config.readout == "invariant":
            nn.init.normal_(self.head.weight, std=0.02)

    def features(self, idx: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """``idx (B, T)`` → x ``(B, T, C, dim)``, s ``(B, T, S)`` | None, positions ``(T,)``."""
        if idx.dim() != 2:
            raise ValueError(f"idx has shape {tuple(idx.shape)}, expected (B, T)")
        x, s = self.embed(idx)
        return x, s, torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32)

    def _logits(self, x: Tensor, s: Tensor | None) -> Tensor:
        if self.config.readout == "invariant":
            return self.head(self.ln_out(self.stack.invariants(x, s)))
        ids = torch.arange(self.config.vocab_size, device=x.device)
        ex, es = self.embed(ids)  # (V, C, dim), (V, S)
        logits = torch.einsum("btca,vca->btv", x * self.stack.metric.to(x.dtype), ex)
        if s is not None:
            logits = logits + s @ es.t()
        return logits * self.logit_scale

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {tuple(idx.shape)}")
        x, s, positions = self.features(idx)
        logits = self._logits(*self.stack(x, s, positions))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def attention_maps(self, idx: Tensor) -> list[Tensor]:
        """One ``(B, H, T, T)`` attention-weight tensor per layer, for plots."""
        return self.stack.attention_maps(*self.features(idx))

    def plots(self, directory: Path) -> list[Path]:
        """``model_rotor_positions.png``: the learned rotor positions (:meth:`RotorStack.plots`)."""
        return self.stack.plots(directory)


# ------------------------------------------------------------------------------------------------
# The rotor positions plot (issue #9 item 3)


@torch.no_grad()
def positional_trajectories(algebra: CliffordAlgebra, encoding, length: int) -> dict[str, Tensor]:
    """What one layer's rotor positional encoding does along a sequence (float64, CPU).

    Returns ``bivectors`` ``(H, n(n−1)/2)``: the learned ``B_h`` (blade order of ``algebra``);
    ``angles`` ``(H, ⌊p/2⌋)``: the rotation angles per token of ``R_h(1) = exp(B_h/2)`` in its invariant
    planes (one in 3D: ``|B_h|``; two in Cl(4)), from the eigenvalues of its action on Euclidean vectors;
    ``trajectory`` ``(H, length, p)``: the Euclidean coordinates of ``R_h(t) u R̃_h(t)`` for
    ``t = 0..length−1`` and the fixed unit vector ``u = (1, ..., 1)/√p`` (the seed's "interest
    trajectory": where position t turns a direction); ``cosine`` ``(H, length)``: ``⟨u, u(t)⟩``.
    """
    positions = torch.arange(length, dtype=torch.float64)
    rotors = encoding.rotors(positions, torch.float64)[0].cpu()  # (H, T, dim)
    action = algebra.versor_matrix(rotors)  # (H, T, dim, dim)
    euclid = list(algebra.vector_indices)[algebra.r :]  # vector blades that are not null (PGA's e0)
    block = action[..., euclid, :][..., :, euclid]  # (H, T, p, p): the rotation of Euclidean vectors
    u = torch.full((len(euclid),), len(euclid) ** -0.5, dtype=torch.float64)
    trajectory = block @ u
    eig = torch.linalg.eigvals(block[:, 1] if length > 1 else block[:, 0])  # R(1): the angle per token
    angles = torch.where(eig.imag > 1e-9, eig.angle().abs(), torch.zeros_like(eig.real))
    angles = angles.sort(-1, descending=True).values[:, : max(1, len(euclid) // 2)]
    return {
        "bivectors": encoding.bivectors.detach().double().cpu(),
        "angles": angles,
        "trajectory": trajectory,
        "cosine": trajectory @ u,
    }


def plot_rotor_positions(algebra: CliffordAlgebra, encodings: list, length: int, path: Path) -> Path:
    """One row per layer: (a) each head's learned PE bivector ``B_h`` (its plane, by blade) and angle per
    token; (b) the trajectory of a fixed unit direction under ``R_h(t)``, t = 0..length−1 (first three
    Euclidean coordinates); (c) ``⟨u, R_h(t) u R̃_h(t)⟩`` against t (how far position t turns it).
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    names = [algebra.blade_names[i] for i in algebra.bivector_indices]
    fig = Figure(figsize=(15, 3.6 * len(encodings)))
    for row, encoding in enumerate(encodings):
        data = positional_trajectories(algebra, encoding, length)
        ax_b = fig.add_subplot(len(encodings), 3, 3 * row + 1)
        ax_t = fig.add_subplot(len(encodings), 3, 3 * row + 2, projection="3d")
        ax_c = fig.add_subplot(len(encodings), 3, 3 * row + 3)
        H = data["bivectors"].shape[0]
        width = 0.8 / H
        for h in range(H):
            angles = ", ".join(f"{a:.3f}" for a in data["angles"][h].tolist())
            label = f"head {h}: {angles} rad/token"
            x = (torch.arange(len(names)) + (h - (H - 1) / 2) * width).numpy()
            ax_b.bar(x, data["bivectors"][h].numpy(), width, label=label)
            xyz = data["trajectory"][h, :, :3].numpy()
            (line,) = ax_t.plot(*xyz.T, lw=1.2)
            ax_t.scatter(*xyz[:1].T, color=line.get_color(), s=18)
            ax_c.plot(data["cosine"][h].numpy(), label=f"head {h}")
        ax_b.set_xticks(range(len(names)), names)
        ax_b.set(
            title=f"layer {row}: positional bivector B_h (plane) and angle per token", ylabel="component"
        )
        ax_b.legend(fontsize=7)
        first3 = ", first 3 coordinates" if algebra.p > 3 else ""
        ax_t.set(title=f"layer {row}: u(t) = R_h(t) u R̃_h(t), t = 0..{length - 1} (dot: t = 0){first3}")
        ax_c.set(title=f"layer {row}: how far position t turns u", xlabel="position t", ylabel="⟨u, u(t)⟩")
        ax_c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path
