"""The pointcloud task: the shapes, the rotation protocols, the rotor model's invariant logits, and a
short training run that must fit."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_one_batch
from torch import Tensor

from geoattn.core.errors import ConfigError
from geoattn.models.base import ModelSizes
from geoattn.tasks import task_class
from geoattn.tasks.nbody.simulator import random_orthogonal
from geoattn.tasks.pointcloud.networks import azimuthal_power, point_inputs
from geoattn.tasks.pointcloud.shapes import CLASSES, sample_clouds
from geoattn.tasks.pointcloud.task import PointCloudConfig, PointCloudTask, rotate, rotations

SMALL = {"points": 32, "train_size": 200, "val_size": 20, "test_size": 40}
SIZES = ModelSizes(n_layer=2, n_head=2, n_embd=32)


def test_shapes_reproducible_and_normalised():
    assert len(CLASSES) >= 8 and task_class("pointcloud") is PointCloudTask
    labels = torch.arange(len(CLASSES))
    clouds = sample_clouds(labels, 64, torch.Generator().manual_seed(0))
    again = sample_clouds(labels, 64, torch.Generator().manual_seed(0))
    assert torch.equal(clouds, again) and clouds.shape == (len(CLASSES), 64, 3)
    radius = clouds.norm(dim=-1).max(1).values
    assert ((radius > 0.9) & (radius < 1.2)).all()  # unit radius plus noise
    assert (clouds.mean(1).norm(dim=-1) < 0.1).all()
    # two clouds of one class differ in shape parameters and in sampling density
    pair = sample_clouds(torch.tensor([1, 1]), 64, torch.Generator().manual_seed(1))
    assert (pair[0] - pair[1]).abs().max() > 0.1


def test_protocol_rotations():
    g = torch.Generator().manual_seed(0)
    z = rotations("z", 8, g)
    assert torch.allclose(z[:, 2], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).expand(8, 3))
    so3 = rotations("so3", 8, g)
    assert torch.allclose(torch.linalg.det(so3), torch.ones(8, dtype=torch.float64))
    assert torch.equal(rotations("aligned", 2, g), torch.eye(3, dtype=torch.float64).expand(2, 3, 3))
    task = PointCloudTask(PointCloudConfig(**SMALL, train_rotation="z", test_rotation="SO(3)"))
    assert task.config.protocol == "z/SO(3)"
    x, y = task.get_batch("train", 16, torch.Generator().manual_seed(0))
    assert x.shape == (16, 32, 3) and x.dtype == torch.float32 and y.dtype == torch.long
    # z rotations keep every point's height: the training clouds' z coordinates are the aligned ones'
    clouds, labels = task.dataset("train")
    pick = torch.randint(clouds.shape[0], (16,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(labels[pick], y)
    torch.testing.assert_close(x[..., 2], clouds[pick][..., 2].float())
    with pytest.raises(ConfigError, match="train_rotation"):
        PointCloudConfig(train_rotation="x")


@pytest.mark.parametrize(
    "options",
    [{}, {"normals": True}, {"axes": True}, {"bending": True}, {"normals": True, "axes": True},
     {"neighbours": 0}, {"scales": [4, 24]}, {"neighbours": 0, "scales": [6]}],  # fmt: skip
)
def test_rotor_logits_invariant_under_e3(options):
    """Every input option keeps the logits invariant under rotations, reflections and translations."""
    task = PointCloudTask(PointCloudConfig(**SMALL))
    torch.manual_seed(0)
    model = task._build("rotor", SIZES, options).double().eval()
    x, _ = task.evaluation_set("val")
    x = x[:8]
    g = torch.Generator().manual_seed(2)
    q = random_orthogonal(8, g)  # rotations, half with a reflection
    moved = rotate(x, q) + 3.0 * torch.randn(8, 1, 3, generator=g, dtype=torch.float64)
    logits, _ = model(x)
    assert (model(moved)[0] - logits).abs().max() <= 1e-8
    assert logits.std(0).max() > 1e-3  # different clouds, different logits: not a constant
    if options:
        return
    transformer = task._build("transformer", SIZES, {}).double().eval()
    assert (transformer(moved)[0] - transformer(x)[0]).abs().max() > 1e-3  # the baseline is not invariant


def test_local_messages_keep_the_logits_invariant_and_change_them():
    """`LocalMessages` (with its zero-started output map made random): the logits stay invariant under
    rotations, reflections and translations in float64, and differ from the model without them."""
    task = PointCloudTask(PointCloudConfig(**SMALL))
    torch.manual_seed(0)
    model = task._build("rotor", SIZES, {"normals": True, "local": 2, "local_k": 5}).double().eval()
    assert len(model.local) == 2
    x, _ = task.evaluation_set("val")
    x = x[:8]
    before, _ = model(x)
    for layer in model.local:
        for p in layer.out.parameters():
            torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(2)
    moved = rotate(x, random_orthogonal(8, g)) + 3.0 * torch.randn(8, 1, 3, generator=g, dtype=torch.float64)
    logits, _ = model(x)
    assert (model(moved)[0] - logits).abs().max() <= 1e-8
    assert (logits - before).abs().max() > 1e-3  # the messages reach the logits
    with pytest.raises(ConfigError, match="local = 9"):
        task._build("rotor", SIZES, {"local": 9})


@pytest.mark.parametrize(
    "extra",
    [{}, {"harmonics": 4}, {"heights": True}, {"heights": True, "normals": False, "neighbours": 0},
     {"heights": True, "scales": [6, 24]}],  # fmt: skip
)
def test_rotor_with_the_up_axis_is_invariant_only_about_z(extra):
    """``up`` adds e_z as an input: the logits keep their invariance under rotations about z,
    reflections in planes through z and translations, and lose it under general rotations; with the
    azimuthal harmonics of the outputs read as well, and with the heights as scalar inputs."""
    task = PointCloudTask(PointCloudConfig(**SMALL))
    torch.manual_seed(0)
    options = {"normals": True, "up": True, **extra}
    model = task._build("rotor", SIZES, options).double().eval()
    x, _ = task.evaluation_set("val")
    x = x[:8]
    g = torch.Generator().manual_seed(3)
    about_z = rotations("z", 8, g)
    about_z[::2, :, 0] *= -1  # half with a reflection in a plane through z (x ↦ −x, then about z)
    assert torch.allclose(about_z[:, 2], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).expand(8, 3))
    shift = 3.0 * torch.randn(8, 1, 3, generator=g, dtype=torch.float64)
    logits, _ = model(x)
    assert (model(rotate(x, about_z) + shift)[0] - logits).abs().max() <= 1e-8
    assert (model(rotate(x, rotations("so3", 8, g)))[0] - logits).abs().max() > 1e-3


def test_azimuthal_power_tells_four_faces_from_a_ring():
    """|mean û^m|²: four horizontal directions 90° apart (a square pyramid's face normals) give 1 at
    m = 4 and 0 at m = 1..3; 64 evenly spread ones (a cone's) give 0 at every m ≤ 4; heights and
    lengths do not count; one turn about z and one reflection change nothing."""
    def directions(angles: Tensor, z: float) -> Tensor:
        r = 0.5 + torch.arange(len(angles), dtype=torch.float64) % 3  # lengths vary
        return torch.stack([r * torch.cos(angles), r * torch.sin(angles), torch.full_like(r, z)], -1)

    square = directions(0.3 + torch.arange(16, dtype=torch.float64) * torch.pi / 2, 0.7)
    ring = directions(torch.arange(64, dtype=torch.float64) * 2 * torch.pi / 64, 0.7)
    power = azimuthal_power(torch.stack([square.repeat(4, 1), ring], 1)[None], 4).view(2, 4)
    assert torch.allclose(power[0], torch.tensor([0, 0, 0, 1.0], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(power[1], torch.zeros(4, dtype=torch.float64), atol=1e-12)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, 10, 3, 3, generator=g, dtype=torch.float64)
    turn = rotations("z", 1, g)[0]
    turn[:, 0] *= -1  # with a reflection in a plane through z
    assert torch.allclose(azimuthal_power(v @ turn.T, 4), azimuthal_power(v, 4), atol=1e-12)
    with pytest.raises(ConfigError, match="harmonics needs up"):
        PointCloudTask(PointCloudConfig(**SMALL))._build("rotor", SIZES, {"harmonics": 4})


def test_heights_are_the_vertical_invariants_of_the_inputs():
    """``heights`` appends, per point, its height and its distance from the z axis, then the vertical
    components of its offset and normal: the scalars a point has under the up model's symmetry."""
    task = PointCloudTask(PointCloudConfig(**SMALL))
    model = task._build("rotor", SIZES, {"normals": True, "up": True, "heights": True})
    x, _ = task.evaluation_set("val")
    points = x[:4] - x[:4].mean(1, keepdim=True)
    mv, scalars = model.inputs(points)
    assert scalars.shape[-1] == point_inputs(model.config)[1] == 5 + 4
    vectors = model.algebra.vector_part(mv)  # (B, P, 4, 3): x, offset, normal, e_z
    torch.testing.assert_close(scalars[..., 5], points[..., 2])
    torch.testing.assert_close(scalars[..., 6], points[..., :2].norm(dim=-1))
    torch.testing.assert_close(scalars[..., 7:], vectors[..., 1:3, 2])
    with pytest.raises(ConfigError, match="heights needs up"):
        task._build("rotor", SIZES, {"heights": True})


def test_rotor_fits_a_batch():
    """Trainability end to end: 40 AdamW steps on one batch of 32 rotated clouds: loss 2.5 → ~1.05."""
    task = PointCloudTask(PointCloudConfig(**SMALL, train_rotation="so3"))
    torch.manual_seed(0)
    model = task._build("rotor", ModelSizes(n_layer=1, n_head=2, n_embd=32), {})
    x, y = task.get_batch("train", 32, torch.Generator().manual_seed(0))
    losses = fit_one_batch(model, x, y, 40)
    assert losses[-1] < 0.6 * losses[0], losses


def test_each_extra_scale_is_one_more_neighbourhood_read_from_the_nearest_points():
    """``scales``: one vector channel and 4 scalars per extra neighbourhood size; its offset is the mean
    of the k nearest points minus the point, in the units `local_geometry` gives it (so the smallest
    scale's differs from the recipe's 16 neighbours'); a size below 3 is an error naming the key."""
    from geoattn.tasks.pointcloud.graph import knn, local_geometry

    task = PointCloudTask(PointCloudConfig(**SMALL))
    plain = task._build("rotor", SIZES, {"normals": True})
    model = task._build("rotor", SIZES, {"normals": True, "scales": [4, 24]})
    assert point_inputs(model.config) == tuple(a + b for a, b in zip(point_inputs(plain.config), (2, 8)))
    x, _ = task.evaluation_set("val")
    points = x[:4] - x[:4].mean(1, keepdim=True)
    vectors, scalars = model.double().inputs(points)
    assert vectors.shape[2] == model.config.in_channels and scalars.shape[-1] == model.config.in_scalars
    four = local_geometry(points, knn(points, 4))
    torch.testing.assert_close(model.algebra.vector_part(vectors[:, :, 3]), four.offset)
    assert (four.offset - local_geometry(points, knn(points, 16)).offset).abs().max() > 1e-2
    for bad in ([2], ["6"], 1.5):
        with pytest.raises(ConfigError, match="scales"):
            task._build("rotor", SIZES, {"scales": bad})


@pytest.mark.parametrize("name", ["normals", "bending"])
def test_local_inputs_need_neighbours(name):
    task = PointCloudTask(PointCloudConfig(**SMALL))
    with pytest.raises(ConfigError, match=f"{name} needs neighbours"):
        task._build("rotor", SIZES, {name: True, "neighbours": 0})


def test_the_rotor_recipe_has_block_gains_and_old_cells_pin_them_off():
    """`--task pointcloud --model rotor` trains `pointcloud-layer-scale-invariant`'s chosen cell (block
    gains from 0.1 at its validated 8e-3); an option set to "default" is taken out of the merged
    options, so the cells of experiments from before the gains train the model without them (no
    BranchScale) with the options, hence the run directories, they had; a later layer sets it again."""
    from geoattn.experiments import load_spec
    from geoattn.training.recipes import build_config
    from geoattn.training.trainer import run_model, run_task

    config = build_config({"task": "pointcloud", "model": "rotor"})
    cells = {c.name: c for c in load_spec("pointcloud-layer-scale-invariant").cells}
    chosen = cells["rotor + layer scale 0.1"].fields
    assert config.model_options["layer_scale"] == chosen["model_options"]["layer_scale"] == 0.1
    assert config.lr == chosen["lr"] == 8e-3
    off = {"model_options": {"layer_scale": "default"}}
    pinned = build_config({"task": "pointcloud", "model": "rotor", **off})
    assert pinned.model_options == {"head_types": ["frame"] * 4, "normals": True}

    def gains(c) -> int:  # the BranchScale parameters of the built model
        return sum("_scale." in name for name, _ in run_model(run_task(c), c).named_parameters())

    small = {"n_layer": 1, "n_embd": 32, "task_options": SMALL}
    assert gains(build_config({"task": "pointcloud", "model": "rotor", **small})) > 0
    assert gains(build_config({"task": "pointcloud", "model": "rotor", **small, **off})) == 0
    again = build_config(
        {"task": "pointcloud", "model": "rotor", "model_options": {"layer_scale": "default"}},
        {"model_options": {"layer_scale": 0.5}},
    )
    assert again.model_options["layer_scale"] == 0.5  # a later layer sets it again


def test_eval_reads_a_trained_run_on_another_draw_of_the_clouds(tmp_path, capsys):
    """`geoattn eval --set task.seed=... task.test_size=...` evaluates the stored model on clouds no run
    has seen (another seed, another size), said in its header; without --set it reads the run's own
    split; a --set outside task.* is one line and exit code 2."""
    import json

    from geoattn.cli import main
    from geoattn.training.evaluate import load_run

    out = tmp_path / "run"
    sizes = ["--set", "task.points=32", "--set", "task.train_size=64", "--set", "task.val_size=16"]
    tiny = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--batch-size", "8", "--no-plots"]
    flags = ["--max-iters", "2", "--eval-interval", "2", "--eval-iters", "1", *tiny, *sizes]
    argv = ["train", "--task", "pointcloud", "--model", "pointnet", "--out", str(out), *flags]
    assert main([*argv, "--set", "task.test_size=32"]) == 0
    capsys.readouterr()

    def header(*extra: str) -> str:
        assert main(["eval", "--out", str(out), *extra]) == 0
        return capsys.readouterr().out.splitlines()[0]

    assert "other data" not in header()
    other = header("--set", "task.seed=5", "--set", "task.test_size=48")
    assert "on other data: task.seed=5 task.test_size=48" in other
    run = load_run(out, task_options={"seed": 5, "test_size": 48})
    clouds, _ = run.task.evaluation_set("test", "z")
    own, _ = load_run(out).task.evaluation_set("test", "z")
    assert clouds.shape[0] == 48 and own.shape[0] == 32
    assert (clouds[:32] - own).abs().max() > 0.1  # another draw, not the run's clouds
    saved = json.loads((out / "config.json").read_text())["train"]["task_options"]
    assert saved["test_size"] == 32  # the run's own record is untouched
    assert main(["eval", "--out", str(out), "--set", "model.readout=0"]) == 2
    assert "task.* keys only" in capsys.readouterr().err
