"""The pointcloud task's peers (PointNet, DGCNN, VN-DGCNN): VN's O(3) invariance in float64, the
baselines' lack of it, the protocols' rotations, every model's shapes, and their option errors."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_one_batch

from geoattn.core.errors import ConfigError
from geoattn.models.base import ModelSizes
from geoattn.tasks.nbody.simulator import random_orthogonal, random_rotations
from geoattn.tasks.pointcloud.graph import bending, gather, knn, local_geometry, principal_axes
from geoattn.tasks.pointcloud.peers import VNEdgeConv, VNInvariant, VNLinearLeakyReLU
from geoattn.tasks.pointcloud.shapes import CLASSES
from geoattn.tasks.pointcloud.task import PointCloudConfig, PointCloudTask, rotate

SMALL = {"points": 24, "train_size": 64, "val_size": 16, "test_size": 16}
SIZES = ModelSizes(n_layer=2, n_head=2, n_embd=16)
OPTIONS = {"rotor": {}, "transformer": {}, "pointnet": {}, "dgcnn": {"k": 6}, "vn": {"k": 6}}


def _task(**kw) -> PointCloudTask:
    return PointCloudTask(PointCloudConfig(**{**SMALL, **kw}))


def _trained_statistics(model: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    """Train-mode forwards that set BatchNorm's running statistics to the batch's (cumulative average),
    so that eval mode normalises as training does instead of by the identity."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(x)
    return model.eval()


def test_every_model_has_the_shapes_and_a_loss():
    task = _task()
    assert set(OPTIONS) == set(task.models)
    x, y = task.get_batch("train", 5, torch.Generator().manual_seed(0))
    for name, options in OPTIONS.items():
        torch.manual_seed(0)
        model = task.build_model(name, SIZES, options)
        logits, loss = model(x, y)
        assert logits.shape == (5, len(CLASSES)), name
        assert loss.shape == () and torch.isfinite(loss), name
        assert model(x)[1] is None
        with pytest.raises(ValueError, match=r"expected \(B, P, 3\)"):
            model(x[..., :2])


def test_vn_logits_invariant_under_o3_in_float64():
    """VN-DGCNN is invariant under rotations *and* reflections (its first edge features are
    [x_j − x_i, x_i], no cross product), and under translations (centring). The rotor model's
    invariance is tested in test_pointcloud_task.py."""
    task = _task()
    torch.manual_seed(0)
    model = task.build_model("vn", SIZES, OPTIONS["vn"]).double()
    x, _ = task.evaluation_set("val")
    x = x[:8]
    model = _trained_statistics(model, x)
    g = torch.Generator().manual_seed(1)
    q = random_orthogonal(8, g)  # half of them with a reflection
    assert (torch.linalg.det(q) < 0).any() and (torch.linalg.det(q) > 0).any()
    moved = rotate(x, q) + 5.0 * torch.randn(8, 1, 3, generator=g, dtype=torch.float64)
    logits, _ = model(x)
    assert (model(moved)[0] - logits).abs().max() <= 1e-10 * logits.abs().max()
    assert logits.std(0).max() > 1e-3  # different clouds, different logits


def test_vn_layers_are_equivariant_in_float64():
    """Each VN layer commutes with O(3) acting on the vector dimension of ``(B, N, 3, C)`` features."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    v = torch.randn(2, 12, 3, 4, generator=g, dtype=torch.float64)
    q = random_orthogonal(1, g)[0]

    def act(t: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ij,...jc->...ic", q, t)

    for layer in (VNLinearLeakyReLU(4, 5), VNEdgeConv(4, 5, k=4)):
        layer = layer.double()
        layer.train()
        layer(v)  # running statistics
        layer.eval()
        torch.testing.assert_close(layer(act(v)), act(layer(v)), atol=1e-12, rtol=1e-10)
    invariant = VNInvariant(4).double().eval()
    torch.testing.assert_close(invariant(act(v)), invariant(v), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["transformer", "pointnet", "dgcnn"])
def test_baselines_are_not_invariant(name):
    """The non-invariant baselines' logits move under rotations (they learn orientation from data)."""
    task = _task()
    torch.manual_seed(0)
    model = task.build_model(name, SIZES, OPTIONS[name]).double()
    x, _ = task.evaluation_set("val")
    model = _trained_statistics(model, x[:8])
    turned = rotate(x[:8], random_rotations(8, torch.Generator().manual_seed(3)))
    assert (model(turned)[0] - model(x[:8])[0]).abs().max() > 1e-3


def test_so3_augmentation_rotates_training_and_validation_clouds():
    """``train_rotation=so3``: every training cloud is its aligned cloud turned by its own rotation (the
    same distances between points, other coordinates); validation clouds take the training kind, test
    clouds ``test_rotation``."""
    aligned = _task(train_rotation="aligned", test_rotation="aligned")
    turned = _task(train_rotation="so3", test_rotation="aligned")
    x0, y0 = aligned.get_batch("train", 16, torch.Generator().manual_seed(0))
    x1, y1 = turned.get_batch("train", 16, torch.Generator().manual_seed(0))
    assert torch.equal(y0, y1)
    clouds, labels = aligned.dataset("train")
    pick = torch.randint(clouds.shape[0], (16,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(x0, clouds[pick].float())  # aligned: untouched
    torch.testing.assert_close(torch.cdist(x1, x1), torch.cdist(x0, x0), atol=1e-5, rtol=1e-5)
    assert (x1 - x0).abs().amax(dim=(1, 2)).min() > 0.1  # every cloud moved
    # the rotation that maps each aligned cloud onto its training cloud is proper (Kabsch)
    u, _, vh = torch.linalg.svd(x1.double().transpose(1, 2) @ x0.double())
    assert (torch.linalg.det(u @ vh) > 0).all()
    # a fresh rotation per draw: the same cloud twice is turned two ways
    again, _ = turned.get_batch("train", 16, torch.Generator().manual_seed(1))
    assert not torch.equal(again, x1)
    assert turned.rotation_kind("val") == "so3" and turned.rotation_kind("test") == "aligned"
    val, _ = turned.evaluation_set("val")
    assert not torch.allclose(val, turned.dataset("val")[0])
    test, _ = turned.evaluation_set("test")
    assert torch.equal(test, turned.dataset("test")[0])


def test_final_metrics_report_every_protocol():
    task = _task()
    torch.manual_seed(0)
    model = task.build_model("pointnet", SIZES)
    metrics = task.final_metrics(model, torch.device("cpu"))
    assert set(metrics) == {"val_accuracy_full", "test_accuracy", "test_accuracy_aligned",
                            "test_accuracy_z", "test_accuracy_so3"}  # fmt: skip
    assert all(0 <= v <= 1 for v in metrics.values())


@pytest.mark.parametrize("name", ["pointnet", "dgcnn", "vn"])
def test_bad_model_options_are_one_line_errors(name):
    task = _task()
    with pytest.raises(ConfigError, match="unknown model setting") as err:
        task.build_model(name, SIZES, {"kk": 3})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="positive integer"):
        task.build_model(name, SIZES, {"n_layer": 0})
    with pytest.raises(ConfigError, match="dropout"):
        task.build_model(name, SIZES, {"dropout": 1.5})
    with pytest.raises(ConfigError, match="supports models"):
        task.build_model("vector_neurons", SIZES)


def test_knn_and_gather():
    points = torch.tensor([[[0.0, 0, 0], [1, 0, 0], [3, 0, 0], [3.5, 0, 0]]])
    index = knn(points, 2)
    assert index.tolist() == [[[0, 1], [1, 0], [2, 3], [3, 2]]]  # itself first, then the nearest
    assert torch.equal(gather(points, index)[0, 2, 1], points[0, 3])
    with pytest.raises(ValueError, match="k = 5 neighbours but the clouds have 4 points"):
        knn(points, 5)


def test_local_geometry_tells_planes_and_lines_and_turns_with_the_cloud():
    """The rotor model's local inputs: a plane's neighbourhoods have one zero extent, a line's two; the
    mean offsets turn with the cloud, the extents do not (float64)."""
    g = torch.Generator().manual_seed(4)
    plane = torch.cat((torch.rand(1, 40, 2, generator=g, dtype=torch.float64), torch.zeros(1, 40, 1)), -1)
    line = torch.rand(1, 40, 1, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 3.0])
    for cloud, flat in ((plane, 1), (line, 2)):
        cloud = cloud - cloud.mean(1, keepdim=True)
        extents = local_geometry(cloud, knn(cloud, 8)).extents
        assert extents[..., :flat].abs().max() < 1e-6 and extents[..., flat:].min() > 1e-3
    cloud = torch.randn(2, 30, 3, generator=g, dtype=torch.float64)
    q = random_orthogonal(2, g)
    offset, extents, normal = local_geometry(cloud, knn(cloud, 8))
    turned_offset, turned_extents, turned_normal = local_geometry(rotate(cloud, q), knn(rotate(cloud, q), 8))
    torch.testing.assert_close(
        bending(turned_normal, knn(rotate(cloud, q), 8)), bending(normal, knn(cloud, 8)), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(turned_offset, rotate(offset, q), atol=1e-12, rtol=0)
    torch.testing.assert_close(turned_extents, extents, atol=1e-12, rtol=0)
    torch.testing.assert_close(turned_normal, rotate(normal, q), atol=1e-9, rtol=0)  # signs follow too


def test_normals_are_the_surface_normals_pointing_outwards():
    """On a noiseless sphere the local normal is the radial direction (float64)."""
    g = torch.Generator().manual_seed(5)
    sphere = torch.randn(1, 400, 3, generator=g, dtype=torch.float64)
    sphere = sphere / sphere.norm(dim=-1, keepdim=True)
    normal = local_geometry(sphere, knn(sphere, 12)).normal
    torch.testing.assert_close(normal.norm(dim=-1), torch.ones(1, 400, dtype=torch.float64))
    assert ((normal * sphere).sum(-1) > 0.95).all()  # outwards, and nearly radial


def test_bending_tells_planes_from_cylinders_and_spheres():
    """The normals' scatter: one non-zero eigenvalue on a plane, two on a cylinder (the larger two
    clearly apart from the least), three comparable ones on a small sphere (float64)."""
    g = torch.Generator().manual_seed(7)
    u, v = torch.rand(2, 1, 300, generator=g, dtype=torch.float64)
    plane = torch.stack((u - 0.5, v - 0.5, torch.full_like(u, 0.3)), -1)
    angle = 2 * torch.pi * u
    cylinder = torch.stack((0.2 * torch.cos(angle), 0.2 * torch.sin(angle), v - 0.5), -1)
    sphere = torch.randn(1, 300, 3, generator=g, dtype=torch.float64)
    sphere = 0.2 * sphere / sphere.norm(dim=-1, keepdim=True)
    bend = {name: bending(local_geometry(c, knn(c, 12)).normal, knn(c, 12)).median(1).values[0]
            for name, c in (("plane", plane), ("cylinder", cylinder), ("sphere", sphere))}  # fmt: skip
    flat = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(bend["plane"], flat, atol=1e-9, rtol=0)
    assert bend["cylinder"][0] < 0.005 and bend["cylinder"][1] > 0.03
    assert bend["sphere"][0] > 0.01


def test_principal_axes_are_invariant_and_measure_the_cloud():
    """A box-shaped cloud: distances from its principal planes are the absolute coordinates in its own
    frame, and both outputs are unchanged by rotations and reflections (float64)."""
    g = torch.Generator().manual_seed(6)
    cloud = (torch.rand(2, 200, 3, generator=g, dtype=torch.float64) - 0.5) * torch.tensor([1.0, 2.0, 4.0])
    cloud = cloud - cloud.mean(1, keepdim=True)
    distances, spread = principal_axes(cloud)
    assert spread.shape == (2, 3) and (spread.diff(dim=-1) > 0).all()  # ascending, one per axis
    torch.testing.assert_close(distances, cloud.abs(), atol=0.1, rtol=0)  # the axes are nearly x, y, z
    q = random_orthogonal(2, g)
    turned = principal_axes(rotate(cloud, q))
    torch.testing.assert_close(turned[0], distances, atol=1e-9, rtol=0)
    torch.testing.assert_close(turned[1], spread, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["pointnet", "dgcnn", "vn"])
def test_peers_fit_a_batch(name):
    """Trainability: 30 AdamW steps on one batch of 32 SO(3)-rotated clouds at least halve the loss."""
    task = _task(train_rotation="so3")
    torch.manual_seed(0)
    model = task.build_model(name, SIZES, OPTIONS[name])
    x, y = task.get_batch("train", 32, torch.Generator().manual_seed(0))
    losses = fit_one_batch(model, x, y, 30)
    assert losses[-1] < 0.5 * losses[0], losses
