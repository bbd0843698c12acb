"""The series task's classifiers. Each reads the packed batch of :mod:`.data`, ``x (B, N, 2 + C)`` =
[time, mask, values] (padding rows masked), and every one receives the observation times:

* ``rt`` (:class:`SeriesRT`): RT-Filter attention with ``positions`` = the times, so its precision
  and transport depend on Δt; padding rows are zero (key magnitude 0, value 0).
* ``rt`` with ``model.times="index"``: positions 0, 1, …, n − 1, only the order (the Δt ablation).
* ``mtan`` (:class:`SeriesMTAN`): a learned sinusoidal embedding of t added to the input (mTAN),
  standard attention with a key mask.
* ``grud`` (:class:`SeriesGRUD`): GRU-D on the time grid, decaying input and state by the time since
  the last observation; read at each series' last observation.
* ``ncde`` (:class:`SeriesNCDE`): a Neural CDE on the path of (t, x), dropped points NaN and filled by
  torchcde's interpolation; read at each series' last observation.

``forward(x (B, N, 2 + C), y (B,) | None) -> (logits (B, classes), cross-entropy | None)``.

A channel may be unobserved at a row (NaN in ``x``: irregular data where each channel has its own
times): ``rt`` and ``mtan`` then also embed the missing-channel indicator (built when the task's data
has such rows, ``partial``), ``grud`` decays each channel by its own time since observation and ``ncde``
interpolates each channel between its own observations.

:data:`TABLE` is the task's model table: each ``--model`` name's config, build, recipe, description.

Every model is invariant to padding: appending padding rows to a batch leaves each series' logits
unchanged (tests/test_series.py). ``grud`` and ``ncde`` step along a time grid (``model.grid``):
``"unit"``, the integer grid 0 … T − 1 of the original samples (times that are sample indices, the
default for ``.ts`` files and bundled sets), or ``"rows"``, each series' own observation times (any
real times, the default for tables).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn.core.errors import ConfigError
from geoattn.core.extras import require
from geoattn.core.settings import settings_from
from geoattn.layers.common import check_heads, merge_heads, split_heads
from geoattn.layers.sphere import to_sphere
from geoattn.layers.transformer import make_mlp, make_norm
from geoattn.models.base import ModelSizes, TaskModel, decay_groups
from geoattn.models.lm_rt import RTConfig, rt_backbone
from geoattn.tasks.base import ModelRow, Recipe
from geoattn.tasks.series.data import EXTRA, unpack

TIMES = ("actual", "index")
INTERPOLATIONS = ("linear", "hermite")
SOLVERS = ("rk4", "midpoint", "euler")
GRIDS = ("unit", "rows")


def _cross_entropy(logits: Tensor, y: Tensor | None) -> Tensor | None:
    if y is None:
        return None
    if y.shape != logits.shape[:1]:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected ({logits.shape[0]},) class labels")
    return F.cross_entropy(logits.float(), y)


def masked_mean(h: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``h (B, N, F)`` over the rows where ``mask (B, N)`` is set: ``(B, F)``."""
    weight = mask.to(h.dtype)[..., None]
    return (h * weight).sum(1) / weight.sum(1).clamp_min(1.0)


def _grid_choice(config: Any) -> None:
    if config.grid not in GRIDS:
        raise ConfigError(f"model.grid must be one of {', '.join(GRIDS)}, got {config.grid!r}")


def missing_embedding(channels: int, n_embd: int, partial: bool) -> nn.Linear | None:
    """The bias-free embedding of the missing-channel indicator, for data where a row may lack some
    channels (``partial``), so "not observed" differs from "observed as 0"; None otherwise."""
    return nn.Linear(channels, n_embd, bias=False) if partial else None


def embed_observations(
    embed: nn.Linear, missing: nn.Linear | None, values: Tensor, observed: Tensor
) -> Tensor:
    """``embed(values) (+ missing(1 − observed))``: ``values (B, N, C)`` (0 where unobserved) and
    ``observed (B, N, C)`` bool → ``(B, N, n_embd)``."""
    h = embed(values)
    return h if missing is None else h + missing((~observed).to(values.dtype))


def _positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{type(config).__name__}.{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------------------------------
# rt


@dataclass
class SeriesRTConfig(RTConfig):
    """:class:`~geoattn.models.lm_rt.RTConfig` (non-causal, key magnitudes on) plus the times it sees.

    Fields:
        times: ``"actual"``: positions are the observation times (original sample indices), so the
            precision ``κ_ij`` and the transport ``R(Δt_ij)`` see the gaps left by dropping;
            ``"index"``: positions ``0 … n − 1`` (the Δt ablation: only the order remains).
    """

    model: ClassVar[str] = "rt"
    times: str = "actual"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.times not in TIMES:
            raise ConfigError(f"model.times must be one of {', '.join(TIMES)}, got {self.times!r}")


# what the task fixes: the classifier attends both ways, and padding is excluded through zero key
# magnitudes, which the precision κ ∝ m² needs to see
RT_FIXED = {"vocab_size": 1, "causal": False, "magnitude_precision": True}


class SeriesRT(TaskModel):
    """RT-Transformer encoder over the observations, masked mean pooling, LayerNorm, linear classifier.

    Tokens: ``Linear(values)`` onto the unit sphere; times enter only as the RT blocks' ``positions``
    ``(B, N)`` (``times="actual"``) or as ``0 … N − 1`` (``"index"``).

    Padding, exactly: ``rt_attention`` takes no mask, so padding rows are set to zero before every
    block. Their keys and values are then 0 (the projections have no bias): a zero value adds nothing
    to any output, and a zero key has ``log m² = log(tiny)`` (float32: −87.3), i.e. a logit ≈ 87 below
    that of a unit-magnitude key at the same lag, so its weight ``e^{−87}`` relative to the valid keys
    vanishes in float32 (it changes the softmax normaliser by less than its rounding unless every valid
    logit of a query falls 70 nats below its own key's magnitude term). The padded rows' own outputs
    are discarded by the masked pooling.
    """

    def __init__(self, config: SeriesRTConfig, channels: int, n_classes: int, partial: bool = False):
        super().__init__()
        self.config = config
        self.embed = nn.Linear(channels, config.n_embd)
        self.embed_missing = missing_embedding(channels, config.n_embd, partial)
        self.backbone = rt_backbone(config)
        self.norm = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, n_classes)

    def _inputs(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        times, mask, values, observed = unpack(x)
        positions = times if self.config.times == "actual" else None  # None: 0 … N − 1
        h = embed_observations(self.embed, self.embed_missing, values, observed)
        return (to_sphere(h) if self.backbone.sphere else h), positions, mask

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Token states ``(B, N, C)`` (padding rows 0) and the mask ``(B, N)``."""
        h, positions, mask = self._inputs(x)
        keep = mask.to(h.dtype)[..., None]
        for block in self.backbone.blocks:
            h = block(h * keep, positions)
        if self.backbone.ln_f is not None:
            h = self.backbone.ln_f(h)
        return h * keep, mask

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        h, mask = self.encode(x)
        logits = self.head(self.norm(masked_mean(h, mask)))
        return logits, _cross_entropy(logits, y)

    @torch.no_grad()
    def attention_maps(self, x: Tensor) -> list[Tensor]:
        """One ``(B, H, N, N)`` RT attention-weight tensor per layer (reference kernel), for plots."""
        h, positions, mask = self._inputs(x)
        keep = mask.to(h.dtype)[..., None]
        maps = []
        for block in self.backbone.blocks:
            maps.append(block.attention_weights(h * keep, positions))
            h = block(h * keep, positions)
        return maps

    def normalize_weights(self) -> None:
        """The hypersphere blocks' unit-norm weights (nGPT); nothing for pre-norm blocks."""
        self.backbone.normalize_weights()

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """No decay on hypersphere backbones (their weights are renormalised instead), as the lm task."""
        return decay_groups(self, weight_decay, decay_matrices=not self.backbone.sphere)


# --------------------------------------------------------------------------------------------------
# mtan


@dataclass
class MTANConfig:
    """A pre-norm Transformer encoder with mTAN's continuous time embedding (Shukla & Marlin 2021).

    Fields:
        n_layer, n_head, n_embd: depth, heads, width.
        mlp: ``"swiglu"`` or ``"gelu"`` MLP sublayer.
        dropout: on attention weights and sublayer outputs.
    """

    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    mlp: str = "swiglu"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "n_layer", "n_head", "n_embd")
        if self.n_embd % self.n_head:
            raise ConfigError(f"MTANConfig.n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ConfigError(f"MTANConfig.mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"MTANConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None) -> MTANConfig:
        """Depth, heads, width and dropout from the run's sizes, then the ``model.*`` options."""
        defaults = {"n_layer": sizes.n_layer, "n_head": sizes.n_head, "n_embd": sizes.n_embd}
        return settings_from(cls, options, prefix="model", defaults={**defaults, "dropout": sizes.dropout})

    def to_dict(self) -> dict:
        """Plain JSON-serialisable fields."""
        return asdict(self)


class TimeEmbedding(nn.Module):
    """mTAN's learned time embedding: ``t (B, N)`` → ``(B, N, width)`` = ``[ω₀ t + α₀, sin(ω_k t + α_k)]``.

    ``t`` is divided by ``time_scale`` (the set's longest series) first, so it lies in [0, 1]; the
    frequencies start log-spaced from half a cycle to ``time_scale / 2`` cycles over that range (the
    slowest trend to the sampling's Nyquist rate) with random phases, and are learned.
    """

    def __init__(self, width: int, time_scale: float):
        super().__init__()
        if width < 2:
            raise ValueError(f"TimeEmbedding needs width ≥ 2, got {width}")
        self.time_scale = float(time_scale)
        self.linear = nn.Linear(1, 1)
        self.periodic = nn.Linear(1, width - 1)
        with torch.no_grad():
            cycles = torch.logspace(math.log10(0.5), math.log10(max(self.time_scale / 2, 1.0)), width - 1)
            self.periodic.weight.copy_(2 * math.pi * cycles[:, None])
            self.periodic.bias.uniform_(0.0, 2 * math.pi)

    def forward(self, t: Tensor) -> Tensor:
        t = (t / self.time_scale)[..., None]
        return torch.cat((self.linear(t), torch.sin(self.periodic(t))), dim=-1)


class MaskedSelfAttention(nn.Module):
    """Bidirectional multi-head softmax attention (SDPA) that ignores masked keys.

    ``forward(x (B, N, C), mask (B, N) bool) -> (B, N, C)``; no biases, no positions (time comes in
    through the embedding).
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        check_heads(n_embd, n_head)
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q, k, v = (split_heads(t, self.n_head) for t in self.c_attn(x).chunk(3, dim=-1))  # (B, H, N, D)
        keys = mask[:, None, None, :]  # (B, 1, 1, N): True where a key may be attended
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keys, dropout_p=self.dropout if self.training else 0.0
        )
        return self.c_proj(merge_heads(y))


class MaskedBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x), mask)``, then ``x + mlp(norm(x))``; ``(B, N, C) → (B, N, C)``."""

    def __init__(self, config: MTANConfig):
        super().__init__()
        c = config
        self.ln_1, self.ln_2 = make_norm("layernorm", c.n_embd), make_norm("layernorm", c.n_embd)
        self.attn = MaskedSelfAttention(c.n_embd, c.n_head, c.dropout)
        self.mlp = make_mlp(c.mlp, c.n_embd, None, c.dropout)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), mask))
        return x + self.mlp(self.ln_2(x))


class SeriesMTAN(TaskModel):
    """mTAN-style Transformer: ``Linear(values) + TimeEmbedding(t)``, masked pre-norm blocks, final
    norm, masked mean pooling, linear classifier. mTAN's time embedding in a standard encoder, not
    mTAN's attention to reference time points."""

    def __init__(
        self, config: MTANConfig, channels: int, n_classes: int, time_scale: float, partial: bool = False
    ):
        super().__init__()
        self.config = config
        self.embed = nn.Linear(channels, config.n_embd)
        self.embed_missing = missing_embedding(channels, config.n_embd, partial)
        self.time = TimeEmbedding(config.n_embd, time_scale)
        self.blocks = nn.ModuleList(MaskedBlock(config) for _ in range(config.n_layer))
        self.ln_f = make_norm("layernorm", config.n_embd)
        self.head = nn.Linear(config.n_embd, n_classes)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        times, mask, values, observed = unpack(x)
        h = embed_observations(self.embed, self.embed_missing, values, observed) + self.time(times)
        for block in self.blocks:
            h = block(h, mask)
        logits = self.head(masked_mean(self.ln_f(h), mask))
        return logits, _cross_entropy(logits, y)


# --------------------------------------------------------------------------------------------------
# The time grid of grud and ncde


@dataclass
class Grid:
    """A batch on a time grid of ``T`` steps: ``values (B, T, C)`` (NaN where a channel was not
    observed), ``observed (B, T, C)`` bool, the steps' times ``times (B, T)`` and each series' last
    step with an observation ``last (B,)``."""

    values: Tensor
    observed: Tensor
    times: Tensor
    last: Tensor


def to_grid(x: Tensor, grid: str = "unit", *, min_length: int = 1) -> Grid:
    """The packed observations of ``x (B, N, 2 + C)`` on a time grid (at least ``min_length`` steps).

    ``grid="unit"``: the integer grid ``0 … T − 1``, ``T`` = the largest observed time + 1, so padding
    rows never change it; ValueError unless every observed time is a non-negative integer (an original
    sample index). ``grid="rows"``: each series' own rows (any real times; padding rows, unobserved,
    at the series' last time).
    """
    times, mask, values, observed = unpack(x)
    rows = mask & observed.any(-1)  # a row with at least one channel observed
    if not bool(rows.any()):
        raise ValueError("x has no observed rows (mask x[..., 1] is 0 everywhere)")
    missing = values.masked_fill(~observed, math.nan)
    b, n, c = values.shape
    if grid == "rows":
        if n < min_length:
            pad = min_length - n
            missing = torch.cat((missing, missing.new_full((b, pad, c), math.nan)), 1)
            observed = torch.cat((observed, observed.new_zeros(b, pad, c)), 1)
            rows = torch.cat((rows, rows.new_zeros(b, pad)), 1)
            times = torch.cat((times, times.new_zeros(b, pad)), 1)
        latest = torch.where(rows, times, -math.inf).cummax(1).values
        steps = torch.arange(rows.shape[1], device=x.device)
        last = torch.where(rows, steps, -1).max(1).values
        return Grid(missing, observed, torch.where(rows, times, latest), last)
    if grid != "unit":
        raise ValueError(f"grid must be one of {', '.join(GRIDS)}, got {grid!r}")
    observed_times = times[rows]
    if bool((observed_times < 0).any()) or not torch.equal(observed_times, observed_times.round()):
        raise ValueError(
            "model.grid='unit' needs integer times ≥ 0 (original sample indices) on observed rows; "
            "model.grid='rows' takes any times"
        )
    length = max(int(observed_times.max()) + 1, min_length)
    index = torch.where(rows, times, 0).long()
    values_grid = values.new_full((b, length + 1, c), math.nan)
    seen = torch.zeros(b, length + 1, c, dtype=torch.bool, device=x.device)
    # padding goes to the spare column `length`, dropped afterwards
    slot = torch.where(rows, index, length)[..., None].expand(-1, -1, c)
    values_grid.scatter_(1, slot, missing)
    seen.scatter_(1, slot, observed & rows[..., None])
    last = torch.where(rows, index, -1).max(1).values
    steps = torch.arange(length, device=x.device, dtype=x.dtype).expand(b, -1)
    return Grid(values_grid[:, :length], seen[:, :length], steps, last)


def fill_linear(grid: Grid) -> Tensor:
    """``grid.values (B, T, C)`` with every NaN filled as torchcde's ``linear_interpolation_coeffs``
    fills missing values, per channel (linear in the grid's times between the channel's neighbouring
    observations, its first observation before it, its last after it; 0, the training mean, for a
    channel a series never observes).

    The same numbers as torchcde's (tests/test_series.py), vectorised: torchcde walks each channel of
    each series in Python, which cost 0.28 s on a batch of 32 JapaneseVowels series, five times the
    CDE solve itself.
    """
    b, length, c = grid.values.shape
    steps = torch.arange(length, device=grid.values.device)[None, :, None]
    big = length  # beyond any index
    seen = grid.observed
    before = torch.where(seen, steps, -1).cummax(1).values  # latest observation ≤ g, or −1
    after = torch.where(seen, steps, big).flip(1).cummin(1).values.flip(1)  # first ≥ g, or T
    first = torch.where(seen, steps, big).min(1, keepdim=True).values
    final = torch.where(seen, steps, -1).max(1, keepdim=True).values
    before = torch.where(before < 0, first, before).clamp(0, length - 1)
    after = torch.where(after >= big, final, after).clamp(0, length - 1)
    values = torch.nan_to_num(grid.values, nan=0.0)
    lo, hi = values.gather(1, before), values.gather(1, after)
    times = grid.times[..., None].expand(-1, -1, c).to(values.dtype)
    t_lo, t_hi = times.gather(1, before), times.gather(1, after)
    span = t_hi - t_lo
    ratio = torch.where(span > 0, (times - t_lo) / torch.where(span > 0, span, 1.0), 0.0)
    filled = lo + ratio * (hi - lo)
    return filled * seen.any(1, keepdim=True).to(values.dtype)


# --------------------------------------------------------------------------------------------------
# grud


@dataclass
class GRUDConfig:
    """GRU-D (Che et al. 2018).

    Fields:
        hidden: GRU state size.
        dropout: on the final state before the classifier.
        grid: the steps of the recurrence: ``"unit"`` (the integer sample grid 0 … T − 1) or ``"rows"``
            (each series' observation times); the task sets it from its data's times unless given.
    """

    hidden: int = 64
    dropout: float = 0.0
    grid: str = "unit"

    def __post_init__(self) -> None:
        _positive(self, "hidden")
        _grid_choice(self)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GRUDConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None) -> GRUDConfig:
        """``hidden`` = the run's ``n_embd``, then the ``model.*`` options."""
        return settings_from(cls, options, prefix="model", defaults={"hidden": sizes.n_embd})

    def to_dict(self) -> dict:
        """Plain JSON-serialisable fields."""
        return asdict(self)


class SeriesGRUD(TaskModel):
    """GRU-D over the time grid ``0 … T − 1``, classified from the state at each series' last observation.

    Per grid step ``g`` (``model.grid``), with ``m_g`` the observation mask (per channel), ``δ_g`` the
    time since the channel's previous observation (before its first observation, the time since 0) and
    ``x'_g`` that observation (the empirical mean ``x̄ = 0`` before any: the values are normalised
    with the training mean)::

        γ_x = exp(−max(0, w_x ⊙ δ_g + b_x)),    γ_h = exp(−max(0, W_h δ_g + b_h))
        x̂_g = m_g ⊙ x_g + (1 − m_g) ⊙ (γ_x ⊙ x'_g + (1 − γ_x) ⊙ x̄)
        h ← GRUCell([x̂_g, m_g], γ_h ⊙ h)

    (``w_x`` diagonal, ``W_h`` full, as the GRU-D paper.)
    """

    def __init__(self, config: GRUDConfig, channels: int, n_classes: int, partial: bool = False):
        super().__init__()
        self.config = config
        self.channels = channels  # `partial` needs nothing more: GRU-D reads the mask per channel
        self.decay_x = nn.Parameter(torch.zeros(2, channels))  # rows: w_x, b_x
        self.decay_h = nn.Linear(channels, config.hidden)
        self.cell = nn.GRUCell(2 * channels, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.hidden, n_classes)
        with torch.no_grad():
            self.decay_x[0].fill_(0.1)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        grid = to_grid(x, self.config.grid)
        b, length, c = grid.values.shape
        m = grid.observed.to(x.dtype)  # (B, T, C)
        times = grid.times[..., None].expand(-1, -1, c)  # (B, T, C)
        # time of each channel's latest observation strictly before each step (0 before the first)
        seen_at = torch.where(grid.observed, times, 0.0).cummax(1).values  # at or before
        before = torch.cat((seen_at.new_zeros(b, 1, c), seen_at[:, :-1]), 1)
        delta = times - before  # (B, T, C)
        # each channel's last observed value strictly before each step: forward fill, shifted; x̄ = 0
        # before any
        filled = torch.nan_to_num(grid.values, nan=0.0)
        steps = torch.arange(length, device=x.device)[None, :, None]
        last_index = torch.where(grid.observed, steps, 0).cummax(1).values
        carried = filled.gather(1, last_index)
        carried = carried * grid.observed.cumsum(1).clamp_max(1).to(x.dtype)
        previous = torch.cat((carried.new_zeros(b, 1, c), carried[:, :-1]), 1)
        gamma_x = torch.exp(-F.relu(self.decay_x[0] * delta + self.decay_x[1]))
        x_hat = m * filled + (1 - m) * gamma_x * previous
        gamma_h = torch.exp(-F.relu(self.decay_h(delta)))  # (B, T, H)
        inputs = torch.cat((x_hat, m), -1)
        h = x.new_zeros(b, self.config.hidden)
        states = []
        for g in range(length):
            h = self.cell(inputs[:, g], gamma_h[:, g] * h)
            states.append(h)
        final = torch.stack(states, 1)[torch.arange(b, device=x.device), grid.last]
        logits = self.head(self.drop(final))
        return logits, _cross_entropy(logits, y)


# --------------------------------------------------------------------------------------------------
# ncde


@dataclass
class NCDEConfig:
    """A Neural CDE (Kidger et al. 2020) through ``torchcde``.

    Fields:
        hidden: state size of ``z``.
        vf_hidden: hidden width of the vector field's MLP.
        interpolation: ``"hermite"`` (cubic Hermite with backward differences: C¹, so a fixed-step
            solver sees no kinks at the knots) or ``"linear"``.
        solver: fixed-step ``torchdiffeq`` method, ``"rk4"``, ``"midpoint"`` or ``"euler"``.
        step: solver step in grid units (1 = one original sample, or one row with ``grid="rows"``).
        grid: the path's knots: ``"unit"`` (the integer sample grid) or ``"rows"`` (each series'
            observation times, time a channel of the path); the task sets it from its data's times.
    """

    hidden: int = 32
    vf_hidden: int = 64
    interpolation: str = "hermite"
    solver: str = "rk4"
    step: float = 1.0
    grid: str = "unit"

    def __post_init__(self) -> None:
        _positive(self, "hidden", "vf_hidden")
        _grid_choice(self)
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(
                f"model.interpolation must be 'hermite' or 'linear', got {self.interpolation!r}"
            )
        if self.solver not in SOLVERS:
            raise ConfigError(f"model.solver must be one of {', '.join(SOLVERS)}, got {self.solver!r}")
        if not self.step > 0:
            raise ConfigError(f"model.step must be positive, got {self.step}")

    @classmethod
    def from_sizes(cls, sizes: ModelSizes, options: dict[str, Any] | None = None) -> NCDEConfig:
        """``hidden`` = the run's ``n_embd``, then the ``model.*`` options."""
        return settings_from(cls, options, prefix="model", defaults={"hidden": sizes.n_embd})

    def to_dict(self) -> dict:
        """Plain JSON-serialisable fields."""
        return asdict(self)


class VectorField(nn.Module):
    """``f(t, z)``: ``z (B, H)`` → ``(B, H, C + 1)``, an MLP ending in tanh (Kidger et al.'s choice)."""

    def __init__(self, hidden: int, vf_hidden: int, path_channels: int):
        super().__init__()
        self.hidden, self.path_channels = hidden, path_channels
        self.net = nn.Sequential(
            nn.Linear(hidden, vf_hidden), nn.ReLU(), nn.Linear(vf_hidden, hidden * path_channels), nn.Tanh()
        )

    def forward(self, t: Tensor, z: Tensor) -> Tensor:
        return self.net(z).view(*z.shape[:-1], self.hidden, self.path_channels)


def _torchcde() -> Any:
    return require("torchcde", extra=EXTRA, purpose="the series task's ncde model")


class SeriesNCDE(TaskModel):
    """Neural CDE ``dz = f(z) dX`` driven by the path ``X`` of ``(t / time_scale, values)``.

    As torchcde's README: the batch is put on the time grid ``0 … T − 1`` with the dropped observations
    (and everything after a series' end) NaN and time as a channel; the NaNs are filled by linear
    interpolation between observations (constant before the first and after the last: torchcde's rule,
    computed by :func:`fill_linear`), the coefficients of the interpolation (``model.interpolation``)
    come from torchcde, ``z_0 = Linear(X(0))``, and the state at each series' last observation goes to a
    linear classifier. Nothing after a series' last observation reaches that state (the Hermite spline
    with backward differences is causal), so padding does not change it.
    """

    def __init__(
        self, config: NCDEConfig, channels: int, n_classes: int, time_scale: float, partial: bool = False
    ):
        super().__init__()
        _torchcde()  # the one-line install hint at build time, not at the first forward
        self.config = config
        self.time_scale = float(time_scale)
        path_channels = channels + 1
        self.initial = nn.Linear(path_channels, config.hidden)
        self.field = VectorField(config.hidden, config.vf_hidden, path_channels)
        self.head = nn.Linear(config.hidden, n_classes)

    def path(self, x: Tensor, *, fill: bool = True) -> tuple[Tensor, Tensor]:
        """The torchcde control ``(B, T, 1 + C)`` = [t / time_scale, values] on the grid, the dropped
        values filled by :func:`fill_linear` (``fill=False``: left NaN, as torchcde takes them), and
        each series' last observed index ``(B,)``."""
        grid = to_grid(x, self.config.grid, min_length=2)
        t = grid.times.to(x.dtype) / self.time_scale
        values = fill_linear(grid) if fill else grid.values
        return torch.cat((t[..., None], values), -1), grid.last

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        cde, c = _torchcde(), self.config
        path, last = self.path(x)
        if c.interpolation == "hermite":
            control = cde.CubicSpline(cde.hermite_cubic_coefficients_with_backward_differences(path))
        else:
            control = cde.LinearInterpolation(cde.linear_interpolation_coeffs(path))
        z0 = self.initial(control.evaluate(control.interval[0]))
        z = cde.cdeint(
            X=control,
            func=self.field,
            z0=z0,
            t=control.grid_points,
            adjoint=False,
            method=c.solver,
            options={"step_size": c.step},
        )  # (B, T, H)
        logits = self.head(z[torch.arange(z.shape[0], device=z.device), last])
        return logits, _cross_entropy(logits, y)


# --------------------------------------------------------------------------------------------------
# The model table


def _build_rt(task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    config = SeriesRTConfig.from_sizes(sizes, options, **RT_FIXED, block_size=task.longest)
    return SeriesRT(config, task.channels, len(task.classes), task.partial)


def _build_mtan(task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    config = MTANConfig.from_sizes(sizes, options)
    return SeriesMTAN(config, task.channels, len(task.classes), task.time_scale, task.partial)


def _build_grud(task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    config = GRUDConfig.from_sizes(sizes, {"grid": task.grid, **options})
    return SeriesGRUD(config, task.channels, len(task.classes), task.partial)


def _build_ncde(task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    config = NCDEConfig.from_sizes(sizes, {"grid": task.grid, **options})
    return SeriesNCDE(config, task.channels, len(task.classes), task.time_scale, task.partial)


# the training budget every model's recipe shares: evaluation only at the end (the splits are small;
# JapaneseVowels: 216 training series, so ~60 passes)
_BUDGET = {
    "max_iters": 400,
    "batch_size": 32,
    "warmup_iters": 20,
    "weight_decay": 0.01,
    "eval_interval": 400,
    "eval_iters": 4,
}

# --model name -> row; the learning rates chosen on JapaneseVowels' validation split by
# experiments/series-lr.toml
TABLE: dict[str, ModelRow] = {
    "rt": ModelRow(
        SeriesRTConfig,
        _build_rt,
        "RT-Transformer encoder at the observation times (model.times=index: positions 0..n-1)",
        Recipe({**_BUDGET, "lr": 1e-2, "n_layer": 2, "n_head": 2, "n_embd": 32}),
        fixed=(*RT_FIXED, "block_size"),
    ),
    "mtan": ModelRow(
        MTANConfig,
        _build_mtan,
        "Transformer with mTAN's learned sinusoidal time embedding, masked attention",
        Recipe({**_BUDGET, "lr": 1e-3, "n_layer": 2, "n_head": 2, "n_embd": 32}),
    ),
    "grud": ModelRow(
        GRUDConfig,
        _build_grud,
        "GRU-D: input and hidden-state decay by the time since the last observation",
        Recipe({**_BUDGET, "lr": 1e-2, "n_embd": 64}),
    ),
    "ncde": ModelRow(
        NCDEConfig,
        _build_ncde,
        "Neural CDE (torchcde) on the interpolated path of (t, x)",
        Recipe({**_BUDGET, "lr": 1e-3, "n_embd": 32}),
    ),
}
