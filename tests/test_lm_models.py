"""The language models and backbones of ``geoattn.models.lm`` (docs/concepts/rt-filter.md#baselines)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import SHAKESPEARE as DATA

from geoattn.layers.common import merge_heads, split_heads
from geoattn.layers.rt_block import RTAttention
from geoattn.models.lm import (
    LM_TABLE,
    LMConfig,
    LMModel,
    RTConfig,
    TransformerConfig,
    build_backbone,
    build_lm,
    lm_config,
    saved_config,
)
from geoattn.models.lm_core import Backbone, LanguageModel, prenorm_blocks

# the GPT family on the shared LMConfig core (the RotorLM's row: tests/test_rotor_lm.py)
MODELS = [name for name, row in LM_TABLE.items() if issubclass(row.config, LMConfig)]
SMALL = dict(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
VARIANTS = [(name, {}) for name in MODELS] + [("transformer", {"mlp": "gelu", "pos": "learned"})]
IDS = [name + ("-nanogpt" if kw else "") for name, kw in VARIANTS]


def _model(name, **kw):
    torch.manual_seed(0)
    return build_lm(name, lm_config(name, **{**SMALL, **kw})).eval()


@pytest.mark.parametrize("name, kw", VARIANTS, ids=IDS)
def test_parameter_count_at_the_nanogpt_recipe(name, kw):
    """Every variant is ≈ 0.80 M parameters at 4 layers × 4 heads × 128, vocab 65, ctx 64."""
    model = build_lm(name, lm_config(name, vocab_size=65, block_size=64, **kw))
    assert 0.78e6 < model.num_params() < 0.82e6
    assert model.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, kw", VARIANTS, ids=IDS)
def test_forward_loss_and_causality(name, kw):
    model = _model(name, **kw)
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 65) and loss.shape == ()
    assert model(idx)[1] is None
    # an untrained model is near the uniform loss ln 65
    assert abs(loss.item() - math.log(65)) < 1.5
    changed = idx.clone()
    changed[:, 9:] = (idx[:, 9:] + 1) % 65
    other = model(changed)[0]
    torch.testing.assert_close(other[:, :9], logits[:, :9])
    assert (other[:, 9:] - logits[:, 9:]).abs().max() > 1e-4


@pytest.mark.parametrize("name, kw", VARIANTS, ids=IDS)
def test_generate_and_attention_maps(name, kw):
    model = _model(name, **kw)
    idx = torch.randint(0, 65, (3, 5))
    out = model.generate(idx, 20, temperature=0.8, top_k=10)  # runs past block_size: the context is cropped
    assert out.shape == (3, 25) and out.dtype == torch.long
    assert ((out >= 0) & (out < 65)).all()
    torch.testing.assert_close(out[:, :5], idx)
    maps = model.attention_maps(idx)
    assert len(maps) == SMALL["n_layer"]
    for m in maps:
        assert m.shape == (3, SMALL["n_head"], 5, 5)
        torch.testing.assert_close(m.sum(-1), torch.ones(3, SMALL["n_head"], 5))
        assert (m.triu(1) == 0).all()


@pytest.mark.parametrize("name", ["transformer", "ngpt"])
def test_attention_maps_show_what_the_sdpa_path_computes(name):
    attn = _model(name).backbone.blocks[0].attn
    x = torch.randn(2, 9, 32)
    v = split_heads(attn.c_attn(x).split(32, dim=-1)[2], SMALL["n_head"])  # (B, H, T, D)
    expected = attn.c_proj(merge_heads(attn.attention_weights(x) @ v))
    torch.testing.assert_close(attn(x), expected)


@pytest.mark.parametrize("name", MODELS)
def test_length_extrapolation_runs_beyond_block_size(name):
    model = _model(name)
    for factor in (2, 4, 8):
        idx = torch.randint(0, 65, (1, factor * SMALL["block_size"]))
        logits, loss = model(idx, idx)
        assert logits.shape == (1, idx.shape[1], 65) and torch.isfinite(loss)


def test_learned_positions_refuse_to_extrapolate():
    model = _model("transformer", pos="learned")
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 32, dtype=torch.long))


@pytest.mark.parametrize("name", MODELS)
def test_backbone_contract(name):
    """``backbone(x (B, T, C), positions) -> (B, T, C)``; non-causal backbones see the whole set."""
    torch.manual_seed(0)
    backbone = build_backbone(name, LMConfig(**{**SMALL, "causal": False}))
    x = torch.randn(2, 7, 32)
    positions = torch.cumsum(torch.rand(2, 7), dim=-1)  # float times, per batch element
    y = backbone(x, positions)
    assert y.shape == x.shape and torch.isfinite(y).all()
    if name in ("rt", "ngpt"):
        torch.testing.assert_close(y.norm(dim=-1), torch.ones(2, 7), atol=1e-5, rtol=0)
    x2 = x.clone()
    x2[:, -1] = torch.randn(2, 32)
    assert (backbone(x2, positions)[:, 0] - y[:, 0]).abs().max() > 1e-5  # bidirectional
    with pytest.raises(ValueError, match="positions"):
        backbone(x, torch.arange(6.0))
    with pytest.raises(ValueError, match=r"expected \(B, T, 32\)"):
        backbone(torch.randn(2, 7, 16))


@pytest.mark.parametrize("name", MODELS)
def test_zero_inputs_stay_finite(name):
    torch.manual_seed(0)
    backbone = build_backbone(name, LMConfig(**SMALL))
    x = torch.zeros(2, 5, 32, requires_grad=True)
    y = backbone(x)
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in backbone.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", MODELS)
def test_optim_groups_and_weight_normalisation(name):
    model = _model(name)
    groups = model.optim_groups(0.1)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each parameter exactly once
    decayed = [p for g in groups if g["weight_decay"] > 0 for p in g["params"]]
    sphere = name in ("rt", "ngpt")
    if not sphere:
        assert decayed and all(p.dim() >= 2 for p in decayed)
        before = [p.clone() for p in model.parameters()]
        model.normalize_weights()  # pre-norm models: nothing to renormalise
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return
    assert not decayed  # nGPT: no weight decay, weights are renormalised instead
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.normalize_weights()
    torch.testing.assert_close(model.wte.weight.norm(dim=1), torch.ones(65))
    attn = model.backbone.blocks[0].attn
    torch.testing.assert_close(attn.c_attn.weight.norm(dim=1), torch.ones(3 * 32))  # rows over C_in
    torch.testing.assert_close(attn.c_proj.weight.norm(dim=0), torch.ones(32))  # columns over C_out


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("n_head", 3, "multiple of n_head"),
        ("n_embd", 36, "head dimension"),  # 36 / 4 = 9, odd
        ("mlp", "relu", "mlp"),
        ("pos", "xpos", "pos"),
        ("step", "exp", "step"),
        ("dropout", 1.0, "dropout"),
        ("vocab_size", 0, "vocab_size"),
        ("alpha_init", 0.0, "alpha_init"),
    ],
)
def test_config_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        RTConfig(**{"n_head": 4, field: value})


def test_model_names_and_model_specific_options():
    with pytest.raises(ValueError, match="valid names: transformer, rt, rfa, ngpt"):
        build_lm("gpt", LMConfig(**SMALL))
    with pytest.raises(ValueError, match="valid names"):
        build_backbone("gpt", LMConfig(**SMALL))
    with pytest.raises(ValueError, match="pos='learned'"):
        build_lm("rt", LMConfig(**{**SMALL, "pos": "learned"}))
    with pytest.raises(ValueError, match="mlp='gelu'"):
        build_lm("ngpt", LMConfig(**{**SMALL, "mlp": "gelu"}))
    with pytest.raises(ValueError, match="idx"):
        _model("transformer")(torch.zeros(16, dtype=torch.long))


def test_rt_switches_reach_the_layers():
    cfg = RTConfig(
        **SMALL,
        magnitude_precision=False,
        qkv_norm=False,
        tangent_correction=False,
        process_noise=False,
        learn_omega=True,
        step="geodesic",
        mlp=None,
    )
    block = build_lm("rt", cfg).backbone.blocks[0]
    attn = block.attn
    assert (attn.magnitude_precision, attn.qkv_norm, attn.process_noise) == (False, False, False)
    assert (block.tangent_correction, block.step, block.mlp) == (False, "geodesic", None)
    assert isinstance(attn.omega, torch.nn.Parameter)


# ------------------------------------------------------------------------------------------------
# Training: a few hundred steps must beat what an untrained or unigram model can reach.

# Untrained ≈ ln 65 = 4.17, a unigram model ≈ 3.3; bigram statistics alone ≈ 2.5.
THRESHOLD = 2.6
STEPS = 300


def _train(name: str, steps: int, lr: float) -> float:
    text = DATA.read_text()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    ctx, batch = 64, 16
    g = torch.Generator().manual_seed(0)

    def get(source):
        ix = torch.randint(len(source) - ctx - 1, (batch,), generator=g)
        return torch.stack([source[i : i + ctx] for i in ix]), torch.stack(
            [source[i + 1 : i + 1 + ctx] for i in ix]
        )

    torch.manual_seed(0)
    model = build_lm(name, LMConfig(vocab_size=len(chars), block_size=ctx, n_layer=2, n_head=2, n_embd=64))
    sphere = model.sphere
    opt = torch.optim.AdamW(model.optim_groups(0.0 if sphere else 0.1), lr=lr, betas=(0.9, 0.99))
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 30)
        loss = model(*get(train))[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sphere:
            model.normalize_weights()
    model.eval()
    with torch.no_grad():
        return sum(model(*get(val))[1].item() for _ in range(8)) / 8


@pytest.fixture
def one_thread():
    """Tiny models train faster on one thread, and far faster on a loaded machine (no spinning barriers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name, lr", [("transformer", 3e-3), ("rt", 6e-3)])
def test_short_training_run_learns_tinyshakespeare(name, lr, one_thread):
    assert _train(name, STEPS, lr) < THRESHOLD


def test_alibi_penalises_distance_and_runs_beyond_the_training_context():
    torch.manual_seed(0)
    model = build_lm(
        "transformer", LMConfig(vocab_size=65, block_size=16, n_layer=1, n_head=4, n_embd=32, pos="alibi")
    )
    idx = torch.randint(65, (2, 64))  # 4x the training context: ALiBi has no position table
    logits, _ = model(idx)
    assert logits.shape == (2, 64, 65) and torch.isfinite(logits).all()
    attn = model.backbone.blocks[0].attn
    weights = attn.attention_weights(model.backbone.blocks[0].ln_1(model.wte(idx[:, :8])))  # (B, H, 8, 8)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 8)) and (weights.triu(1) == 0).all()
    # the SDPA path equals the explicit weights (the bias is the same in both)
    x = model.backbone.blocks[0].ln_1(model.wte(idx[:, :8]))
    q, k, v = attn._qkv(x, None)
    explicit = attn.c_proj(merge_heads(weights @ v))
    torch.testing.assert_close(attn(x), explicit, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="pos='alibi' is only available for model 'transformer'"):
        build_lm("rt", LMConfig(pos="alibi"))


def test_rt_predictions_one_at_a_time_on_the_prenorm_transformer():
    """The ablation models: RT attention inside the pre-norm block, and the tangent correction on a
    Euclidean residual stream (the sublayer output loses its component along the state)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32)
    rt_prenorm = build_lm(
        "rt", RTConfig(**cfg, residual="prenorm", process_noise=False, tangent_correction=False)
    )
    assert not rt_prenorm.sphere and isinstance(rt_prenorm.backbone.blocks[0].attn, RTAttention)
    idx = torch.randint(65, (2, 16))
    _, loss = rt_prenorm(idx, idx)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in rt_prenorm.parameters() if p.grad is not None)
    corrected = build_lm("transformer", LMConfig(**cfg, tangent_correction=True))
    block = corrected.backbone.blocks[0]
    x = torch.randn(2, 16, 32)
    o = torch.randn(2, 16, 32)
    step = block._step(x, o) - x
    assert (step * F.normalize(x, dim=-1)).sum(-1).abs().max() < 1e-5  # orthogonal to the state
    assert not build_lm("transformer", LMConfig(**cfg)).backbone.blocks[0].tangent_correction  # default off
    assert build_lm("rt", LMConfig(**cfg)).backbone.blocks[0].tangent_correction  # rt's default on
    with pytest.raises(ValueError, match="residual must be"):
        RTConfig(residual="euclid")


@pytest.mark.parametrize("option", ["magnitude_precision", "qkv_norm"])
def test_rt_ingredients_switch_alone_on_the_transformer(option):
    """``magnitude_precision`` and ``qkv_norm`` on the pre-norm transformer: only the attention's
    logit (and, for qkv_norm, the values) change; the fast path matches the explicit formula."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32)
    plain = build_lm("transformer", LMConfig(**cfg))
    assert not plain.backbone.blocks[0].attn.rt_logit
    model = build_lm("transformer", TransformerConfig(**cfg, **{option: True}))
    extra = set(model.state_dict()) - set(plain.state_dict())
    assert extra == {"backbone.blocks.0.attn.log_eta_t2", "backbone.blocks.0.attn.log_beta"}
    assert set(plain.state_dict()) <= set(model.state_dict())
    attn = model.backbone.blocks[0].attn
    with torch.no_grad():
        attn.log_eta_t2.copy_(torch.tensor([0.3, -0.2]))
        attn.log_beta.copy_(torch.tensor([1.0, 1.5]))
    x = torch.randn(2, 9, 32)
    q, k, v = attn._qkv(x, None)  # (B, H, T, D), RoPE applied
    eta2, beta = attn.log_eta_t2.exp().view(1, 2, 1, 1), attn.log_beta.exp().view(1, 2, 1, 1)
    m2 = 2 * k.pow(2).sum(-1) if option == "magnitude_precision" else torch.ones(k.shape[:-1])
    kappa = (m2 / eta2.squeeze(-1)).unsqueeze(-2)  # (B, H, 1, T): per key
    cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    logits = kappa.log() + beta * kappa * (cos - 1)
    weights = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    torch.testing.assert_close(attn.attention_weights(x), weights, atol=1e-5, rtol=1e-4)
    values = F.normalize(v, dim=-1) if option == "qkv_norm" else v
    torch.testing.assert_close(attn(x), attn.c_proj(merge_heads(weights @ values)), atol=1e-5, rtol=1e-4)
    before = attn(x)
    with torch.no_grad():
        attn.c_attn.weight[64:] *= 3  # the value rows
    torch.testing.assert_close(attn(x), before if option == "qkv_norm" else 3 * before)
    with pytest.raises(ValueError, match="alibi"):
        build_lm("transformer", TransformerConfig(**cfg, pos="alibi", **{option: True}))
    rt = build_lm("rt", LMConfig(**cfg)).backbone.blocks[0].attn
    assert rt.magnitude_precision and rt.qkv_norm  # rt's own choice: on


def test_each_model_takes_its_own_keys():
    """A key of another model is an error naming the valid keys of this one; a bare LMConfig takes
    the model's defaults; another model's config is refused."""
    with pytest.raises(
        ValueError, match=r"unknown model setting\(s\) residual \(TransformerConfig\); valid: .*qkv_norm"
    ):
        lm_config("transformer", residual="prenorm")
    with pytest.raises(ValueError, match=r"norm \(NGPTConfig\); valid: alpha_init"):
        lm_config("ngpt", norm="rmsnorm")
    assert type(build_lm("rt", LMConfig(**SMALL)).config) is RTConfig
    with pytest.raises(ValueError, match=r"'rt' takes RTConfig \(or a bare LMConfig\), not Transformer"):
        build_lm("rt", TransformerConfig(**SMALL))


def test_a_config_saved_with_every_models_fields_loads():
    """A config dict saved when one config held all four models' fields keeps the model's own."""
    every = {
        **SMALL,
        "norm": "layernorm",
        "magnitude_precision": None,
        "residual": "sphere",
        "step": "retraction",
    }
    assert saved_config("ngpt", every) == {**SMALL, "step": "retraction"}
    assert set(saved_config("transformer", every)) == {*SMALL, "norm", "magnitude_precision"}


def test_a_new_model_is_one_table_entry(monkeypatch):
    """A model registered with one entry (config, backbone builder, language model) builds through
    lm_config, build_lm and build_backbone."""
    from geoattn.layers.robust_filter import RFAAttention

    def build(config):
        return Backbone(
            config, prenorm_blocks(config, "rmsnorm", lambda: RFAAttention(32, 2)), norm="rmsnorm"
        )

    class PlainLM(LanguageModel):
        def __init__(self, config):
            super().__init__(config, build(config))

    monkeypatch.setitem(LM_TABLE, "plain", LMModel(LMConfig, build, PlainLM, "pre-norm RFA with RMSNorm"))
    model = build_lm("plain", lm_config("plain", **SMALL))
    logits, _ = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, 65)
    assert isinstance(build_backbone("plain", LMConfig(**SMALL)), Backbone)
