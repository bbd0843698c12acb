"""The RT kernel, block and model under `torch.compile` (issue #13): whole graphs (``fullgraph=True``,
so no value is read back to choose a path), and the compiled model computing what the eager one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from geoattn import native
from geoattn.algebra.rotation import rope_frequencies, rotate_pairs
from geoattn.attention.rt import chunked, rt_attention
from geoattn.layers.rt_block import RTBlock
from geoattn.models.lm import LMConfig, build_lm
from geoattn.training.compiling import CompileChoice, CompiledModel, eager_step_seconds, weight_normalizer

F64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _kernel_inputs(n=24, h=2, d=8, dtype=F64):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, d, generator=g, dtype=dtype) for _ in range(3))
    k = k * (0.5 + 2 * torch.rand(2, h, n, 1, generator=g, dtype=dtype))
    params = dict(
        mu_r=torch.tensor([0.05, 0.3], dtype=dtype),
        sigma_t2=torch.tensor([0.1, 0.02], dtype=dtype),
        eta_t2=torch.tensor([1.0, 0.5], dtype=dtype),
        beta=torch.tensor([2.0, 0.7], dtype=dtype),
    )
    return (q, k, v), params, rope_frequencies(d, h).to(dtype)


@pytest.mark.parametrize("times", ["default", "irregular"])
def test_rt_attention_compiles_as_one_graph(times, monkeypatch):
    """The chunked path traces whole (the dispatch reads static facts only), and the compiled graph's
    values and gradients are the eager ones. (The native kernel, which the default times would take
    on the CPU, is switched off here; `tests/test_native.py` compiles it.)"""
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(chunked, "CHUNK", 10)
    qkv, params, omega = _kernel_inputs()
    params = {name: p.requires_grad_() for name, p in params.items()}
    positions = None if times == "default" else torch.cumsum(torch.rand(24, dtype=F64) + 0.1, 0)

    def attend(q, k, v):
        return rt_attention(q, k, v, **params, omega=omega, positions=positions)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in qkv]
    out, out_c = attend(*leaves), compiled(*leaves)
    torch.testing.assert_close(out_c, out, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out)
    trainable = [*leaves, *params.values()]
    grads = torch.autograd.grad((out * weights).sum(), trainable)
    grads_c = torch.autograd.grad((out_c * weights).sum(), trainable)
    for g, g_c in zip(grads, grads_c):
        torch.testing.assert_close(g_c, g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("process_noise", [True, False])
def test_rt_block_compiles_as_one_graph(process_noise):
    torch.manual_seed(0)
    block = RTBlock(16, 2, process_noise=process_noise, learn_omega=True).double()
    h = F.normalize(torch.randn(2, 12, 16, dtype=F64), dim=-1)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out, out_c = block(h), compiled(h)
    torch.testing.assert_close(out_c, out, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), list(block.parameters()))
    grads_c = torch.autograd.grad(out_c.square().sum(), list(block.parameters()))
    for g, g_c in zip(grads, grads_c):
        torch.testing.assert_close(g_c, g, rtol=1e-10, atol=1e-12)


def test_compiled_rotation_is_the_eager_one():
    """`rotate_pairs` traced (its whole-row form) gives the eager values bit for bit (the same products
    and sums) and the same gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 8, generator=g, dtype=F64, requires_grad=True)
    angle = torch.randn(1, 2, 5, 4, generator=g, dtype=F64, requires_grad=True)
    out = rotate_pairs(x, angle)
    out_c = torch.compile(rotate_pairs, fullgraph=True, backend="aot_eager")(x, angle)
    assert torch.equal(out_c, out)
    w = torch.randn(out.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((out * w).sum(), (x, angle))
    grads_c = torch.autograd.grad((out_c * w).sum(), (x, angle))
    for g_c, g_e in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g_e, rtol=1e-14, atol=1e-14)


@pytest.mark.slow
def test_compiled_rt_model_trains_like_the_eager_model():
    """What the trainer's ``--compile`` runs (inductor): the same losses over a few AdamW steps; and
    a graph that torch's autograd cache keeps (with its custom autograd Functions and outside
    autocast), so that a later process loads it instead of tracing it again."""
    counters.clear()
    config = LMConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 65, (2, 4, 16), generator=g) for _ in range(3)]
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_lm("rt", config)
        step_model = CompiledModel(model) if compiled else model
        normalize_weights = weight_normalizer(model, compiled)
        optimizer = torch.optim.AdamW(model.optim_groups(0.0), lr=1e-2)
        losses[compiled] = []
        for x, y in batches:
            _, loss = step_model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            normalize_weights()
            losses[compiled].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-4, atol=1e-4)
    cache = counters["aot_autograd"]
    assert cache["autograd_cache_bypass"] == 0, dict(cache)
    assert cache["autograd_cache_miss"] + cache["autograd_cache_hit"] >= 1, dict(cache)


@pytest.mark.parametrize("model", ["rt", "ngpt", "transformer"])
def test_the_compiled_weight_normalizer_is_the_eager_one(model):
    """`weight_normalizer(model, True)`: the renormalisation as one compiled graph, each model with
    its own (so the models of one process do not share a recompile limit), the same unit rows and
    columns as ``model.normalize_weights``."""
    config = LMConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_lm(model, config))
    with torch.no_grad():  # off the sphere, and differently per matrix
        for a, b in zip(*(m.parameters() for m in models)):
            scale = torch.rand(a.shape, generator=torch.Generator().manual_seed(a.numel())) + 0.5
            a.mul_(scale), b.mul_(scale)
    counters.clear()
    compiled, eager = weight_normalizer(models[0], True), weight_normalizer(models[1], False)
    compiled(), eager()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    if model != "transformer":  # a pre-norm model has nothing to renormalise, nothing to compile
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        norms = models[0].wte.weight.norm(dim=1)
        torch.testing.assert_close(norms, torch.ones_like(norms))


@pytest.mark.parametrize("causal", [True, False])
def test_custom_operators_agree_with_their_fake_implementations(causal):
    """`torch.library.opcheck` on the native path's operator: the shapes, strides and autograd
    registration that compiled graphs rely on are those the kernel produces (a mismatch fails only
    under inductor, at run time)."""
    if not native.available():
        pytest.skip("no C++ toolchain here: the native kernel cannot be built")
    g = torch.Generator().manual_seed(0)
    h, n, d = 2, 9, 4
    qkv = torch.randn(2, n, 3, h, d, generator=g, dtype=F64, requires_grad=True)
    metric = (0.5 + torch.rand(h, d, generator=g, dtype=F64)).requires_grad_()
    turns = torch.randn(h, n, d // 2, 2, generator=g, dtype=F64)
    params = [(0.1 + torch.rand(h, generator=g, dtype=F64)).requires_grad_() for _ in range(4)]
    for m, t in ((metric, turns), (None, None)):
        args = (qkv, m, t, params, 1.3, True, causal)
        torch.library.opcheck(torch.ops.geoattn.rt_qkv.default, args)


def test_the_default_compiles_winning_models_when_the_run_wins_the_compile_back():
    """``--compile`` unset: off for models whose compiled step measured no faster (without measuring
    anything), on for the lm task's rt and ngpt when steps x saving x the measured eager step exceed
    the compile's cost; an explicit value wins. Each choice says why (config.json's ``compiled``)."""
    from geoattn.tasks.filter import FilterTask
    from geoattn.tasks.lm import LMTask
    from geoattn.training.compiling import COMPILE_COST_S, COMPILE_SAVING
    from geoattn.training.config import TrainConfig
    from geoattn.training.trainer import Trainer

    lm, filt = LMTask.__new__(LMTask), FilterTask.__new__(FilterTask)  # the classes decide, not the data
    step = 0.08  # seconds per eager step
    wins_at = COMPILE_COST_S / (COMPILE_SAVING * step)  # steps from which compiling pays

    def choice(model, max_iters, measure=lambda: step, name="lm", compile=None):
        config = TrainConfig(task=name, model=model, max_iters=max_iters, compile=compile)
        return Trainer.compiled(config, filt if name == "filter" else lm, measure)

    def unmeasured():
        raise AssertionError("measured a step where the rule needs none")

    long, short = int(wins_at) + 1, int(wins_at) - 1
    assert choice("rt", long).on
    assert f"> {COMPILE_COST_S:.0f} s to compile" in choice("ngpt", long).why
    assert not choice("rt", short).on
    for name, model in (("lm", "rotor"), ("lm", "transformer"), ("filter", "rt")):
        off = choice(model, long, unmeasured, name)
        assert not off.on and "no faster" in off.why
    assert choice("rt", long, unmeasured, compile=False) == CompileChoice(False, "--compile false")
    assert choice("rotor", 10, unmeasured, compile=True).on


def test_the_eager_step_measurement_leaves_the_run_as_it_was():
    """Measuring the eager step leaves the gradients, the random state and so the first step alone."""
    torch.manual_seed(0)
    model = build_lm("rt", LMConfig(block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1))
    x = torch.randint(0, 65, (2, 8))
    state = torch.get_rng_state()
    assert eager_step_seconds(model, lambda: (x, x)) > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow  # inductor's compile of one block: ~20 s of CPU
def test_compiled_blocks_give_the_eager_loss_and_gradients():
    """The trainer's ``--compile`` (inductor, regional): one rt step's loss to 1e-5 and every
    parameter's gradient to 1e-4 (float32: fused kernels sum in another order), one traced graph
    that both layers reuse, and the model called outside the step (evaluation) eager."""
    config = LMConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)
    x, y = (torch.randint(0, 65, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2))
    results = []
    counters.clear()
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_lm("rt", config)
        step_model = CompiledModel(model) if compiled else model
        _, loss = step_model(x, y)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert len(step_model.blocks) == 2
    (loss, grads), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
    for g, g_c in zip(grads, grads_c):
        torch.testing.assert_close(g_c, g, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    with torch.no_grad():  # the model called directly (evaluation) runs eagerly: nothing recompiles
        model.eval()(torch.randint(0, 65, (3, 5)))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
