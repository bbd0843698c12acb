"""RotorLM (issue #9): the seed's embedding parts reach the logits, causality, O(n) invariance of the
logits (with the positional bivectors rotated along), attention maps against the kernel, settings
errors, the lm and filter tasks, parameter matching, and a short training run with the rotor plot."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import SHAKESPEARE, random_o3_versor, tiny_lm_args

import geoattn.layers.rotor_block as rotor_block
from geoattn.cli import main
from geoattn.core.errors import ConfigError
from geoattn.models.base import ModelSizes
from geoattn.models.lm import LMConfig, TransformerLM
from geoattn.models.rotor_lm import RotorLM, RotorLMConfig
from geoattn.tasks.filter import FilterConfig, FilterTask
from geoattn.tasks.lm import LMTask

SMALL = dict(vocab_size=65, block_size=16, n_layer=2, channels=4, scalars=8, head_channels=2)
HEADS = {
    "cl3": ("rotation", "reflection", "projection", "frame"),
    "cl4": ("rotation", "reflection", "projection"),
    "pga": ("rotation", "reflection", "projection"),
}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one thread avoids OpenMP start-up and oversubscription on busy CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(algebra="cl3", dtype=torch.float32, **kw) -> RotorLM:
    torch.manual_seed(0)
    config = RotorLMConfig(**{**SMALL, "algebra": algebra, "head_types": HEADS[algebra], **kw})
    return RotorLM(config).to(dtype).eval()


def _ids(B=2, T=12, seed=1) -> torch.Tensor:
    return torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# The model


@pytest.mark.parametrize("part", ["scalar", "vector", "bivector", "scalars", "shared"])
def test_each_part_of_the_token_embedding_reaches_the_logits(part):
    """The seed's embed_token: scalar ("existence"), vector ("direction"), bivector ("relations")
    parts, the invariant scalar stream and the shared multivector each change the logits alone."""
    model = _model(dtype=torch.float64)
    idx = _ids()
    with torch.no_grad():
        before, _ = model(idx)
        if part == "shared":  # the multivector every token gets: its vector part
            model.embed.shared[:, 1:4] += torch.randn(model.config.channels, 3, dtype=torch.float64)
        else:
            table = getattr(model.embed, part).weight
            table[idx[0, 3]] += torch.randn(table.shape[1], dtype=table.dtype)
        after, _ = model(idx)
    assert float((after - before).abs().max()) > 1e-3


# (algebra, readout, aggregation of the rotation heads)
VARIANTS = [(a, r, "sum") for a in HEADS for r in ("invariant", "tied")]
VARIANTS += [("cl3", "invariant", "compose"), ("cl4", "tied", "compose"), ("pga", "invariant", "compose")]


@pytest.mark.parametrize("algebra, readout, aggregation", VARIANTS)
def test_forward_loss_causality_and_generate(algebra, readout, aggregation):
    model = _model(algebra, readout=readout, aggregation=aggregation)
    idx = _ids()
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 12, 65) and loss.shape == () and torch.isfinite(loss)
    assert model(idx)[1] is None
    changed = idx.clone()
    changed[:, 7:] = (idx[:, 7:] + 1) % 65
    with torch.no_grad():
        other, _ = model(changed)
    logits = logits.detach()
    torch.testing.assert_close(other[:, :7], logits[:, :7], rtol=0, atol=1e-5)
    assert float((other[:, 7:] - logits[:, 7:]).abs().max()) > 1e-4
    out = model.generate(idx[:, :3], 20, temperature=0.8, top_k=10)  # runs past block_size 16
    assert out.shape == (2, 23) and torch.equal(out[:, :3], idx[:, :3])


def _act(ga, g, coords, grade):
    """The versor action of ``g`` on ``coords`` ``(..., k)`` of one grade (blade order)."""
    index = list(ga.grade_indices[grade])
    mv = coords.new_zeros(*coords.shape[:-1], ga.dim)
    mv[..., index] = coords
    return (mv @ ga.versor_matrix(g).transpose(-1, -2))[..., index]


def _transformed(model, g, *, positions=True) -> RotorLM:
    """A copy of ``model`` with ``g`` applied to its embedding tables' vector and bivector parts, to the
    multivector all tokens share and, if ``positions``, to every positional bivector ``B_h``."""
    ga, C = model.algebra, model.config.channels
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for grade, table in ((1, moved.embed.vector), (2, moved.embed.bivector)):
            w = table.weight.unflatten(-1, (C, -1))
            table.weight.copy_(_act(ga, g, w, grade).flatten(-2))
        moved.embed.shared.copy_(moved.embed.shared @ ga.versor_matrix(g).T)
        if positions:
            for encoding in moved.stack.positional_encodings():
                encoding.bivectors.copy_(_act(ga, g, encoding.bivectors, 2))
    return moved


@pytest.mark.parametrize("algebra, readout, aggregation", VARIANTS)
def test_a_global_rotation_or_reflection_moves_the_stream_and_leaves_the_logits(
    algebra, readout, aggregation
):
    """Acting with g on all embeddings and positional bivectors acts with g on every block's output
    (scalars unchanged) and leaves the logits as they are: the model's frame is arbitrary."""
    model = _model(algebra, torch.float64, readout=readout, aggregation=aggregation)
    ga = model.algebra
    idx = _ids()
    with torch.no_grad():
        logits, _ = model(idx)
        x, s, positions = model.features(idx)
        y, ys = model.stack(x, s, positions)
        for n_vectors in (1, 2, 3):  # reflection, rotation, rotoreflection
            g = random_o3_versor(ga, n_vectors, torch.float64, seed=20 + n_vectors)
            moved = _transformed(model, g)
            mx, ms, _ = moved.features(idx)
            torch.testing.assert_close(mx, x @ ga.versor_matrix(g).T, rtol=0, atol=1e-10)
            my, mys = moved.stack(mx, ms, positions)
            # float64 rounding, relative to the stream's size. GradeLayerNorm divides a grade that is 0
            # in exact arithmetic (no token has a trivector part) by sqrt(1e-6): its rounding noise
            # grows 1000× per norm: errors reach 2e-9 of the largest entry (Cl(4)), not 1e-14.
            tol = 1e-8 * float(y.abs().max())
            torch.testing.assert_close(my, y @ ga.versor_matrix(g).T, rtol=0, atol=tol)
            torch.testing.assert_close(mys, ys, rtol=0, atol=1e-8 * float(ys.abs().max()))
            torch.testing.assert_close(moved(idx)[0], logits, rtol=0, atol=1e-8)


def test_compose_and_sum_are_different_models_with_the_same_parameters():
    idx = _ids()
    with torch.no_grad():
        summed, composed = _model(aggregation="sum")(idx)[0], _model(aggregation="compose")(idx)[0]
    assert float((summed - composed).abs().max()) > 1e-3


def test_the_positional_planes_fix_a_frame_and_without_them_the_embeddings_alone_can_turn():
    g = random_o3_versor(_model().algebra, 2, torch.float64, seed=3)
    idx = _ids()
    with torch.no_grad():
        model = _model(dtype=torch.float64)
        turned = _transformed(model, g, positions=False)
        assert float((turned(idx)[0] - model(idx)[0]).abs().max()) > 1e-4
        model = _model(dtype=torch.float64, pos="none")
        torch.testing.assert_close(_transformed(model, g, positions=False)(idx)[0], model(idx)[0])


def test_attention_maps_are_the_kernels_weights(monkeypatch):
    """Each head's map equals what rotor_attention computes: its output on one-hot scalar values is α
    (every head type keeps a value's scalar part)."""
    model = _model(dtype=torch.float64)
    idx = _ids(T=10)
    maps = model.attention_maps(idx)
    assert len(maps) == 2 and all(m.shape == (2, 4, 10, 10) for m in maps)
    kernel, seen = rotor_block.rotor_attention, []

    def spy(q, k, v, **kwargs):
        onehot = torch.zeros(*q.shape[:3], q.shape[2], q.shape[-1], dtype=q.dtype)
        onehot[:, :, range(q.shape[2]), range(q.shape[2]), 0] = 1.0  # value j: channel j = 1
        seen.append(kernel(q, k, onehot, **kwargs)[..., 0])  # (B, H_type, i, j) = α_ij
        return kernel(q, k, v, **kwargs)

    monkeypatch.setattr(rotor_block, "rotor_attention", spy)
    with torch.no_grad():
        model(idx)
    first = model.stack.blocks[0].attn
    torch.testing.assert_close(torch.cat(seen[: len(first.groups)], 1)[:, first.order], maps[0])
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(2, 4, 10, dtype=torch.float64))


def test_the_rotor_positions_plot(tmp_path):
    model = _model("cl4")
    (path,) = model.plots(tmp_path)
    assert path.name == "model_rotor_positions.png" and path.read_bytes()[:8] == PNG
    assert _model(pos="none").plots(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# Settings


@pytest.mark.parametrize(
    "options, fragments",
    [
        ({"aggregation": "mean"}, ["aggregation", "'mean'"]),
        ({"aggregation": "compose", "head_types": ["projection"] * 4}, ["aggregation", "'rotation' heads"]),
        ({"algebra": "cl4", "head_types": ["frame", "rotation"]}, ["head_types", "frame", "cl4"]),
        ({"algebra": "cl5"}, ["algebra", "cl5"]),
        ({"readout": "linear"}, ["readout"]),
        ({"head_types": ["rotation", "spiral"]}, ["head_types", "spiral"]),
    ],
)
def test_bad_settings_name_the_setting(options, fragments):
    with pytest.raises(ValueError) as err:
        RotorLMConfig.from_sizes(ModelSizes(), options, vocab_size=65)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_widths_must_divide_into_multivector_channels():
    with pytest.raises(ConfigError, match="n_embd=100 is not divisible into multivector channels of 8"):
        RotorLMConfig.from_sizes(ModelSizes(n_embd=100), {}, vocab_size=65)
    with pytest.raises(ConfigError, match="16 numbers"):  # Cl(4): 16 numbers per channel
        RotorLMConfig.from_sizes(ModelSizes(n_embd=136), {"algebra": "cl4"}, vocab_size=65)
    with pytest.raises(ConfigError, match="n_head=3"):
        RotorLMConfig.from_sizes(ModelSizes(n_head=3), {}, vocab_size=65)
    config = RotorLMConfig.from_sizes(ModelSizes(n_embd=100), {"channels": 12}, vocab_size=65)
    assert config.channels == 12 and config.scalars == 100


def test_from_sizes_maps_the_run():
    config = RotorLMConfig.from_sizes(
        ModelSizes(n_layer=3, n_head=2, n_embd=64, dropout=0.1), {}, vocab_size=5
    )
    assert (config.n_layer, config.channels, config.head_channels, config.scalars) == (3, 8, 4, 64)
    assert config.head_types == ("rotation", "rotation") and config.dropout == 0.1  # DEFAULT_HEAD_CYCLE
    assert RotorLMConfig.from_sizes(ModelSizes(), {"algebra": "pga"}, vocab_size=5).channels == 8


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--set", "model.aggregation=mean"], ["aggregation", "'mean'"]),
        (["--set", "model.algebra=pga", "--set", "model.head_types=frame,rotation"], ["frame", "pga"]),
        (["--set", 'model.head_types=["rotation", "spin"]'], ["head_types", "spin"]),
        (["--n-embd", "36"], ["n_embd=36", "multivector channels"]),
    ],
)
def test_bad_settings_on_the_command_line(tmp_path, capsys, flags, fragments):
    argv = ["train", *tiny_lm_args(1, 1), "--model", "rotor", *flags, "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("geoattn train: error: ")
    assert all(fragment in lines[0] for fragment in fragments), lines[0]


def test_parameter_count_matches_the_transformer_at_the_recipe():
    """4 layers, 4 heads, n_embd 128, vocab 65, ctx 64: within ±10 % of TransformerLM (0.79 M)."""
    rotor = RotorLM(RotorLMConfig.from_sizes(ModelSizes(), {}, vocab_size=65, block_size=64))
    transformer = TransformerLM(LMConfig(vocab_size=65, block_size=64))
    ratio = rotor.num_params() / transformer.num_params()
    assert 0.9 <= ratio <= 1.1, (rotor.num_params(), transformer.num_params())


# ------------------------------------------------------------------------------------------------
# Tasks and training


def test_a_short_training_run_learns_and_writes_the_rotor_plot(tmp_path):
    """``geoattn train --task lm --model rotor``: 100 steps of a 1-layer model reach a loss an untrained
    model cannot (ln 65 = 4.17 nats/char; unigram statistics alone: 3.31), plots included."""
    flags = [f for f in tiny_lm_args(100, 100) if f != "--no-plots"]
    flags += ["--model", "rotor", "--batch-size", "16", "--eval-iters", "4", "--warmup-iters", "10"]
    assert main(["train", *flags, "--lr", "1e-2", "--min-lr", "1e-3", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_loss"] < 3.0, summary["val_loss"]
    assert {"model_rotor_positions.png", "attention.png"} <= set(summary["plots"])
    assert (tmp_path / "model_rotor_positions.png").read_bytes()[:8] == PNG


def test_a_resumed_run_continues_exactly(tmp_path):
    """Checkpoint and resume (dropout on, so the RNG state counts too) give the one long run's losses."""
    text = tmp_path / "text.txt"  # a short corpus: the final full-split loss takes no time
    text.write_text(SHAKESPEARE.read_text()[:20000])
    flags = [*tiny_lm_args(8, 4), "--model", "rotor", "--lr-decay-iters", "8", "--dropout", "0.1"]
    flags += ["--data", str(text)]
    assert main(["train", *flags, "--out", str(tmp_path / "full")]) == 0
    assert main(["train", *flags, "--max-iters", "4", "--out", str(tmp_path / "part")]) == 0
    assert main(["train", *flags, "--out", str(tmp_path / "part"), "--resume"]) == 0
    keys = ("iter", "train_loss", "val_loss", "lr")
    full, part = (
        [{k: json.loads(line)[k] for k in keys} for line in (tmp_path / run / "metrics.jsonl").open()]
        for run in ("full", "part")
    )
    assert part == full


def test_a_run_loads_with_the_head_types_it_was_trained_with(tmp_path):
    """A run's config.json keeps its head types; loading it rebuilds them even where the default
    cycle has changed since (simulated: the saved cycle edited to another order)."""
    from geoattn.training.evaluate import load_run

    text = tmp_path / "text.txt"
    text.write_text(SHAKESPEARE.read_text()[:5000])
    flags = [*tiny_lm_args(2, 2), "--model", "rotor", "--data", str(text)]
    assert main(["train", *flags, "--out", str(tmp_path / "run")]) == 0
    path = tmp_path / "run" / "config.json"
    saved = json.loads(path.read_text())
    assert saved["train"]["model_options"] == {} and saved["model"]["head_types"] == ["rotation", "rotation"]
    saved["model"]["head_types"] = ["reflection", "rotation"]
    path.write_text(json.dumps(saved))
    assert load_run(tmp_path / "run").model.config.head_types == ("reflection", "rotation")


def test_the_lm_and_filter_tasks_build_rotor_models():
    sizes = dict(n_layer=1, n_head=2, n_embd=16)
    lm = LMTask(None, block_size=8, vocab="abc").build_model("rotor", ModelSizes(**sizes))
    assert isinstance(lm, RotorLM) and lm.config.vocab_size == 3
    options = {"aggregation": "compose"}
    composed = LMTask(None, block_size=8, vocab="abc").build_model("rotor", ModelSizes(**sizes), options)
    assert composed.stack.blocks[0].attn.aggregation == "compose"
    task = FilterTask(FilterConfig(val_size=8))
    model = task.build_model("rotor", ModelSizes(**sizes))
    x, y = task.get_batch("val", 2, torch.Generator().manual_seed(0))
    x, y = x[:, :12], y[:, :12]
    prediction, loss = model(x, y)
    assert prediction.shape == y.shape and torch.isfinite(loss)
    loss.backward()
    future = x.clone()
    future[:, 7:, :8] = 3 * torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        changed, _ = model(future, y)
    torch.testing.assert_close(changed[:, :7], prediction.detach()[:, :7], rtol=0, atol=1e-5)
    assert [m.shape for m in model.attention_maps(x)] == [(2, 2, 12, 12)]


def test_the_filter_task_trains_a_rotor_model_from_the_command_line(tmp_path, capsys):
    argv = ["train", "--task", "filter", "--model", "rotor", "--n-layer", "1", "--n-head", "2"]
    argv += ["--n-embd", "16", "--block-size", "12", "--batch-size", "4", "--max-iters", "2"]
    argv += ["--eval-interval", "2", "--eval-iters", "1", "--set", "task.val_size=8", "--out", str(tmp_path)]
    argv += ["--set", "task.n_particles=50"]
    assert main(argv) == 0
    assert (tmp_path / "model_rotor_positions.png").read_bytes()[:8] == PNG


def test_the_compiled_model_equals_the_eager_one():
    """``--compile`` (inductor) of RotorLM: the same loss and gradients as eager. Inductor once generated
    a backward for the heads that corrupted the heap; the heads now run outside the caller's graph."""
    model = _model(n_layer=1).train()
    ids, targets = _ids(seed=2), _ids(seed=3)
    results = []
    for step in (model, torch.compile(model)):
        model.zero_grad()
        _, loss = step(ids, targets)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_e, grads_e), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for ge, gc in zip(grads_e, grads_c):
        torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-5)


def test_every_channel_map_gets_its_gradient_blade_by_blade():
    """The stream is stored blade by blade, and so is every gradient the RotorLM's `EquiLinear`s receive
    (`blade_major_grad` where the invariant read-out and the heads hand theirs back in the default
    order), so their backward GEMMs read each blade's matrix without a copy; the values are the same
    as without the turns."""
    from geoattn.algebra.layout import is_blade_major
    from geoattn.layers.multivector import EquiLinear

    torch.manual_seed(0)
    # float64: the small model's gradients reach 1e4 where a grade's norm is near 0, and float32's
    # rounding, which differs between the memory orders' kernels, would be amplified as much
    model = RotorLM(RotorLMConfig(**SMALL)).double()
    idx = torch.randint(65, (3, 16))
    layouts = []

    def watch(module, args, output):
        output[0].register_hook(lambda g: layouts.append(is_blade_major(g)))

    hooks = [m.register_forward_hook(watch) for m in model.modules() if isinstance(m, EquiLinear)]
    _, loss = model(idx, idx)
    loss.backward()
    for h in hooks:
        h.remove()
    assert len(layouts) == 4 * SMALL["n_layer"] and all(layouts), layouts
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    identity = pytest.MonkeyPatch()
    for module in ("geoattn.models.rotor_lm", "geoattn.layers.rotor_block"):
        identity.setattr(f"{module}.blade_major_grad", lambda x: x)
    try:
        model(idx, idx)[1].backward()
    finally:
        identity.undo()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-9)
