"""The pointcloud task's files: ModelNet40's HDF5 distribution, ScanObjectNN's .h5 files and OFF meshes,
written here by h5py and by hand; the points kept (random, farthest-point sampling against a brute-force
version), the stratified validation cut, every kind of bad input as one-line DataError, sealed test
sets, and each format trained end to end through `geoattn train` and `geoattn experiment`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from geoattn.cli import main
from geoattn.core.errors import ConfigError, DataError
from geoattn.models.base import ModelSizes
from geoattn.tasks.pointcloud.data import (
    SCANOBJECTNN_CLASSES,
    Picking,
    farthest_points,
    normalise,
    read_clouds,
    read_off,
    sample_surface,
    stratified_split,
)
from geoattn.tasks.pointcloud.shapes import sample_clouds
from geoattn.tasks.pointcloud.task import PointCloudTask

NAMES = ("airplane", "bathtub", "bed")
PREFIX = "data/modelnet40_ply_hdf5_2048"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache folder per test for the OFF samples and the farthest-point picks (only theirs: the
    native kernels' builds stay in the shared cache)."""
    monkeypatch.setattr("geoattn.tasks.pointcloud.data.cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def clouds_of(labels: list[int], points: int, seed: int) -> np.ndarray:
    """Distinct generated shapes per label, float32 ``(N, points, 3)``, scaled off the unit radius."""
    return 2.5 * sample_clouds(
        torch.tensor(labels), points, torch.Generator().manual_seed(seed)
    ).numpy().astype(np.float32)


def write_h5(path: Path, data: np.ndarray, label: np.ndarray | None, **extra: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data)
        if label is not None:
            f.create_dataset("label", data=label)
        for key, value in extra.items():
            f.create_dataset(key, data=value)
    return path


def modelnet(folder: Path, *, points: int = 32, names: tuple[str, ...] = NAMES, test_labels=None) -> Path:
    """ModelNet40's HDF5 layout: two train files and one test file listed with the distribution's prefix,
    ``label (N, 1)`` uint8 as the distribution stores it."""
    folder.mkdir(parents=True, exist_ok=True)
    train = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [1, 2, 0, 1, 2, 0]]
    test = test_labels if test_labels is not None else [0, 1, 2, 2, 1, 0]
    for i, labels in enumerate(train):
        write_h5(
            folder / f"ply_data_train{i}.h5",
            clouds_of(labels, points, i),
            np.array(labels, np.uint8)[:, None],
        )
    write_h5(folder / "ply_data_test0.h5", clouds_of(test, points, 9), np.array(test, np.uint8)[:, None])
    (folder / "shape_names.txt").write_text("".join(f"{n}\n" for n in names))
    (folder / "train_files.txt").write_text(f"{PREFIX}/ply_data_train0.h5\n{PREFIX}/ply_data_train1.h5\n")
    (folder / "test_files.txt").write_text(f"{PREFIX}/ply_data_test0.h5\n")
    return folder


def scanobjectnn(folder: Path, *, points: int = 32, variant: str = "") -> Path:
    """ScanObjectNN's layout: ``label (N,)`` int and a background ``mask (N, P)``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, labels, seed in (("training", list(range(15)) * 2, 1), ("test", [3, 7, 14, 7], 2)):
        mask = np.where(np.arange(points) % 4 == 0, -1, 1)[None].repeat(len(labels), 0)
        data = clouds_of([k % 16 for k in labels], points, seed)
        write_h5(folder / f"{name}_objectdataset{variant}.h5", data, np.array(labels, np.int32), mask=mask)
    return folder


CUBE = """OFF
# a unit cube with quad faces
8 6 0
0 0 0
1 0 0
1 1 0
0 1 0
0 0 1
1 0 1
1 1 1
0 1 1
4 0 3 2 1
4 4 5 6 7
4 0 1 5 4
4 2 3 7 6
4 1 2 6 5
4 0 4 7 3
"""
# a tetrahedron with ModelNet's header quirk (the counts on the OFF line)
TETRA = "OFF4 4 0\n0 0 0\n2 0 0\n0 2 0\n0 0 2\n3 0 1 2\n3 0 1 3\n3 0 2 3\n3 1 2 3\n"


def off_folder(folder: Path, *, test_classes: tuple[str, ...] = ("cube", "tetra")) -> Path:
    """ModelNet40's raw layout: ``<class>/train/*.off``, ``<class>/test/*.off``."""
    for name, text in (("cube", CUBE), ("tetra", TETRA)):
        for split, count in (("train", 4), ("test", 2 if name in test_classes else 0)):
            (folder / name / split).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                (folder / name / split / f"{name}_{i:04d}.off").write_text(text)
    return folder


PICK = Picking(points=16, sampling="random", seed=0)


# ------------------------------------------------------------------ the three layouts -------------------
def test_modelnet_h5_reads_the_listed_files_with_their_labels(tmp_path):
    """Files listed under the distribution's prefix are found in the folder; every cloud keeps 16 of its
    points, in the generated shapes' frame (centred, unit radius); labels as stored; the same points are
    kept again on a second read."""
    folder = modelnet(tmp_path / "mn")
    read = read_clouds(folder, PICK)
    assert read.layout == "modelnet40-h5" and read.classes == NAMES
    x, y = read.sets["train"]
    assert x.shape == (16, 16, 3) and x.dtype == torch.float32
    with h5py.File(folder / "ply_data_train0.h5") as f, h5py.File(folder / "ply_data_train1.h5") as g:
        raw = np.concatenate([f["data"][()], g["data"][()]])
        stored = np.concatenate([f["label"][()], g["label"][()]])[:, 0]
    assert torch.equal(y, torch.from_numpy(stored.astype(np.int64)))
    torch.testing.assert_close(x.mean(1), torch.zeros(16, 3), atol=1e-6, rtol=0)
    torch.testing.assert_close(x.norm(dim=-1).amax(1), torch.ones(16))
    assert raw.shape == (16, 32, 3)
    assert torch.equal(read_clouds(folder, PICK).sets["train"][0], x)
    assert read.sets["test"][0].shape == (6, 16, 3)


def test_every_kept_point_is_a_point_of_its_cloud(tmp_path):
    """With all points kept, a read cloud is its file's cloud permuted, centred and scaled."""
    folder = modelnet(tmp_path / "mn", points=20)
    x, _ = read_clouds(folder, Picking(points=20, sampling="random", seed=3)).sets["test"]
    with h5py.File(folder / "ply_data_test0.h5") as f:
        raw = normalise(torch.from_numpy(f["data"][()]))
    order = lambda c: c[torch.argsort(c[:, 0])]  # noqa: E731
    for a, b in zip(x, raw):
        torch.testing.assert_close(order(a), order(b))


def test_scanobjectnn_folder_or_training_file(tmp_path):
    folder = scanobjectnn(tmp_path / "so", variant="_augmentedrot_scale75")
    read = read_clouds(folder, PICK)
    assert read.layout == "scanobjectnn" and read.classes == SCANOBJECTNN_CLASSES
    assert read.sets["train"][0].shape == (30, 16, 3) and read.sets["test"][1].tolist() == [3, 7, 14, 7]
    file = read_clouds(folder / "training_objectdataset_augmentedrot_scale75.h5", PICK)
    assert torch.equal(file.sets["train"][0], read.sets["train"][0])
    scanobjectnn(folder)  # a second variant beside the first: which one is meant must be said
    with pytest.raises(DataError, match="2 ScanObjectNN variants"):
        read_clouds(folder, PICK)


def test_off_meshes_are_sampled_by_area_once_and_cached(tmp_path, monkeypatch, cache):
    """Classes are the sorted folder names; each mesh sampled on its surface (a cube's points on its
    faces); the samples are cached: a second read opens no mesh; the quirky header reads."""
    folder = off_folder(tmp_path / "off")
    read = read_clouds(folder, PICK)
    assert read.layout == "off" and read.classes == ("cube", "tetra")
    x, y = read.sets["train"]
    assert x.shape == (8, 16, 3) and y.tolist() == [0] * 4 + [1] * 4
    assert list(cache.glob("pointcloud/off-*.pt"))
    monkeypatch.setattr("geoattn.tasks.pointcloud.data.read_off", lambda path: pytest.fail("read again"))
    assert torch.equal(read_clouds(folder, PICK).sets["train"][0], x)
    vertices, triangles = read_off(folder / "tetra" / "train" / "tetra_0000.off")
    assert vertices.shape == (4, 3) and triangles.shape == (4, 3)


def test_surface_sampling_is_uniform_by_area():
    """A cube's points lie on its faces, about equally many on each; of two triangles with areas 1 and 3,
    the larger gets three quarters of the points."""
    vertices, triangles = (torch.from_numpy(a) for a in read_off_text(CUBE))
    points = sample_surface(vertices, triangles, 6000, torch.Generator().manual_seed(0))
    on_face = (points.abs() < 1e-9) | ((points - 1).abs() < 1e-9)
    assert on_face.any(-1).all() and ((points >= -1e-9) & (points <= 1 + 1e-9)).all()
    axis = on_face.float().argmax(-1)  # the coordinate at 0 or 1: the point's face, with its side
    face = 2 * axis + (points.gather(1, axis[:, None])[:, 0] > 0.5).long()
    counts = torch.bincount(face, minlength=6).double()
    assert (counts / 1000 - 1).abs().max() < 0.12  # 6000 points on 6 equal faces (std about 3 %)
    vertices = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 2, 0], [3, 0, 0], [3, 6, 0]], dtype=torch.float64)
    triangles = torch.tensor([[0, 1, 2], [1, 3, 4]])  # areas 1 (x ≤ 1) and 6 (x ≥ 1)
    points = sample_surface(vertices, triangles, 7000, torch.Generator().manual_seed(1))
    assert abs(float((points[:, 0] > 1).double().mean()) - 6 / 7) < 0.02


def read_off_text(text: str) -> tuple[np.ndarray, np.ndarray]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mesh.off"
        path.write_text(text)
        return read_off(path)


# ------------------------------------------------------------------ points, split -----------------------
def brute_force_fps(cloud: torch.Tensor, k: int, first: int) -> list[int]:
    """Farthest-point sampling from its definition: each next point maximises the distance to the
    nearest picked one, recomputed from every pair."""
    picked = [first]
    for _ in range(k - 1):
        distance = torch.cdist(cloud, cloud[picked]).amin(1)
        picked.append(int(distance.argmax()))
    return picked


def test_farthest_points_agree_with_brute_force():
    clouds = torch.randn(5, 50, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    index = farthest_points(clouds, 12, torch.Generator().manual_seed(1))
    assert index.shape == (5, 12)
    for cloud, row in zip(clouds, index):
        assert row.tolist() == brute_force_fps(cloud, 12, int(row[0]))
        assert len(set(row.tolist())) == 12
    first = torch.randint(50, (5,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(index[:, 0], first)  # the first point is the generator's draw


def test_fps_picks_are_read_through_the_task_and_cached(tmp_path, cache):
    folder = modelnet(tmp_path / "mn")
    read = read_clouds(folder, Picking(points=8, sampling="fps", seed=0))
    assert read.sets["train"][0].shape == (16, 8, 3) and list(cache.glob("pointcloud/fps-*.pt"))
    with h5py.File(folder / "ply_data_test0.h5") as f:
        raw = torch.from_numpy(f["data"][()])
    index = farthest_points(raw, 8, torch.Generator().manual_seed(0))  # each file's picks from the seed
    expected = normalise(torch.gather(raw, 1, index[..., None].expand(-1, -1, 3)))
    torch.testing.assert_close(read.sets["test"][0], expected)


def test_validation_is_a_seeded_stratified_cut_of_train():
    labels = torch.tensor([0] * 20 + [1] * 10 + [2] * 2 + [3])
    train, val = stratified_split(labels, 0.2, seed=0)
    assert sorted(train.tolist() + val.tolist()) == list(range(len(labels)))
    assert torch.bincount(labels[val], minlength=4).tolist() == [
        4,
        2,
        0,
        0,
    ]  # round(0.4) = 0: class 2 keeps both
    again, other = stratified_split(labels, 0.2, seed=0), stratified_split(labels, 0.2, seed=1)
    assert torch.equal(again[1], val) and not torch.equal(other[1], val)


def test_the_task_cuts_validation_and_runs_the_protocols_on_read_clouds(tmp_path):
    task = PointCloudTask.from_options(
        {"points": 16, "val_fraction": 0.25}, data=str(modelnet(tmp_path / "mn")), block_size=1
    )
    assert task.classes == NAMES and task.n_classes == 3
    assert (
        len(task.dataset("train")[1]) + len(task.dataset("val")[1]) == 16 and len(task.dataset("val")[1]) == 4
    )
    x, y = task.get_batch("train", 8, torch.Generator().manual_seed(0))
    assert x.shape == (8, 16, 3) and x.dtype == torch.float32 and int(y.max()) < 3
    clouds, labels = task.dataset("train")
    pick = torch.randint(clouds.shape[0], (8,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(x[..., 2], clouds[pick][..., 2])  # z rotations keep the heights
    model = task.build_model("rotor", ModelSizes(n_layer=1, n_head=2, n_embd=16), {"neighbours": 8})
    assert model(x)[0].shape == (8, 3)
    meta = task.meta()
    assert meta["classes"] == list(NAMES) and meta["layout"] == "modelnet40-h5"
    assert set(meta["sets"]) == {"train", "val", "test"}


def test_sealed_test_sets_are_never_read(tmp_path, monkeypatch):
    task = PointCloudTask.from_options({"points": 16}, data=str(modelnet(tmp_path / "mn")), block_size=1)
    model = task.build_model("pointnet", ModelSizes(n_layer=1, n_embd=8), {})
    assert "test_accuracy" in task.final_metrics(model, torch.device("cpu"))
    task.sealed = frozenset(task.test_sets)
    original = task.evaluation_set

    def guarded(split, kind=None):
        if split == "test":
            raise AssertionError("a sealed test set was read")
        return original(split, kind)

    monkeypatch.setattr(task, "evaluation_set", guarded)
    monkeypatch.setattr(task, "_rotated", {})
    final = task.final_metrics(model, torch.device("cpu"))
    assert set(final) == {"val_accuracy_full"}
    rows = task.evaluation(model, torch.device("cpu"), dict, over="none")
    assert not any("test" in row.metric for row in rows)


def test_settings_of_the_other_source_are_refused():
    folder = "/nonexistent"
    with pytest.raises(ConfigError, match="task.noise applies only to the generated shapes"):
        PointCloudTask.from_options({"noise": 0.1}, data=folder, block_size=1)
    with pytest.raises(ConfigError, match="task.sampling applies only to clouds read"):
        PointCloudTask.from_options({"sampling": "fps"}, block_size=1)
    with pytest.raises(ConfigError, match="task.sampling must be one of"):
        PointCloudTask.from_options({"sampling": "grid"}, data=folder, block_size=1)


def test_the_rotor_recipe_reads_no_normals_without_neighbours():
    """`model.neighbours=0` turns the recipe's normals off (they come from the kNN); the user's own
    normals with no neighbours stay theirs, and the model's check names the conflict."""
    from geoattn.training.recipes import build_config
    from geoattn.training.trainer import run_model, run_task

    small = {
        "task": "pointcloud",
        "model": "rotor",
        "n_layer": 1,
        "n_embd": 16,
        "task_options": {"points": 16},
    }
    config = build_config({**small, "model_options": {"neighbours": 0}})
    assert config.model_options["normals"] is False and config.model_options["layer_scale"] == 0.1
    assert build_config(small).model_options["normals"] is True
    run_model(run_task(config), config)
    both = build_config({**small, "model_options": {"neighbours": 0, "normals": True}})
    with pytest.raises(ConfigError, match="normals needs neighbours"):
        run_model(run_task(both), both)


def test_missing_h5py_is_a_one_line_hint(tmp_path, monkeypatch):
    folder = modelnet(tmp_path / "mn")
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(ConfigError, match=r"pip install 'geoattn\[pointclouds\]'"):
        read_clouds(folder, PICK)


# ------------------------------------------------------------------ bad input ----------------------------
def _truncated(folder: Path) -> None:
    path = folder / "ply_data_train1.h5"
    path.write_bytes(path.read_bytes()[:300])


def _missing_label(folder: Path) -> None:
    write_h5(folder / "ply_data_train1.h5", clouds_of([0, 1], 32, 0), None)


def _two_channels(folder: Path) -> None:
    write_h5(folder / "ply_data_test0.h5", clouds_of([0, 1], 32, 0)[..., :2], np.array([[0], [1]], np.uint8))


def _label_out_of_range(folder: Path) -> None:
    write_h5(folder / "ply_data_train1.h5", clouds_of([0, 1], 32, 0), np.array([[0], [7]], np.uint8))


def _nan_label(folder: Path) -> None:
    write_h5(folder / "ply_data_train1.h5", clouds_of([0, 1], 32, 0), np.array([[0.0], [np.nan]]))


def _nan_point(folder: Path) -> None:
    data = clouds_of([0, 1], 32, 0)
    data[1, 5, 2] = np.nan
    write_h5(folder / "ply_data_train1.h5", data, np.array([[0], [1]], np.uint8))


def _class_without_training(folder: Path) -> None:
    (folder / "shape_names.txt").write_text("airplane\nbathtub\nbed\nbench\n")


def _empty_split(folder: Path) -> None:
    write_h5(folder / "ply_data_test0.h5", np.zeros((0, 32, 3), np.float32), np.zeros((0, 1), np.uint8))


def _empty_listing(folder: Path) -> None:
    (folder / "test_files.txt").write_text("\n")


def _missing_listed(folder: Path) -> None:
    (folder / "ply_data_train1.h5").unlink()


def _few_points(folder: Path) -> None:
    write_h5(folder / "ply_data_test0.h5", clouds_of([0, 1], 8, 0), np.array([[0], [1]], np.uint8))


def _no_shape_names(folder: Path) -> None:
    (folder / "shape_names.txt").unlink()


@pytest.mark.parametrize(
    "breaks, message",
    [
        (_truncated, r"ply_data_train1.h5 is not a readable HDF5 file"),
        (_missing_label, r"ply_data_train1.h5 has no 'label' dataset \(it has data\)"),
        (_two_channels, r"ply_data_test0.h5: 'data' has shape \(2, 32, 2\), expected \(N, P, 3\)"),
        (_label_out_of_range, r"ply_data_train1.h5: label 7 is outside the 3 classes of shape_names.txt"),
        (_nan_label, r"ply_data_train1.h5: 'label' holds NaN"),
        (_nan_point, r"ply_data_train1.h5: 'data' has NaN or infinite coordinates in cloud 1"),
        (_class_without_training, r"class bench has no training example"),
        (_empty_split, r"ply_data_test0.h5: 'data' holds no clouds"),
        (_empty_listing, r"test_files.txt lists no files"),
        (
            _missing_listed,
            r"train_files.txt lists data/modelnet40_ply_hdf5_2048/ply_data_train1.h5, which is not",
        ),
        (_few_points, r"ply_data_test0.h5: its clouds have 8 points, fewer than task.points=16"),
        (_no_shape_names, r"has no shape_names.txt"),
    ],
)
def test_broken_modelnet_files_are_one_line(tmp_path, breaks, message):
    folder = modelnet(tmp_path / "mn")
    breaks(folder)
    with pytest.raises(DataError, match=message) as err:
        read_clouds(folder, PICK)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("PLY\n3 1 0\n", "its first line is not 'OFF'"),
        ("OFF\n4 4\n0 0 0\n1 0 0\n", "4 vertices and 4 faces announced, 2 lines follow"),
        ("OFF\n3 1 0\n0 0 0\n1 0 x\n0 1 0\n3 0 1 2\n", "not numbers"),
        ("OFF\n3 1 0\n0 0 0\n1 0 0\n0 1 0\n3 0 1 5\n", "a face names vertex 5, the mesh has 3"),
        ("OFF\n3 1 0\n0 0 0\n1 0 0\n0 1 0\n4 0 1 2\n", "face 0 lists fewer vertices than its count 4"),
        ("OFF\n3 1 0\n0 0 0\n1 0 0\n2 0 0\n3 0 1 2\n", "the mesh has no area"),
        ("OFF\n", "no vertex and face counts"),
    ],
)
def test_a_malformed_off_mesh_is_one_line(tmp_path, text, message):
    folder = off_folder(tmp_path / "off")
    bad = folder / "tetra" / "train" / "tetra_0002.off"
    bad.write_text(text)
    with pytest.raises(DataError, match=message) as err:
        read_clouds(folder, PICK)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)


def test_broken_folders_are_one_line(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_clouds(tmp_path / "nothing", PICK)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(
        DataError, match="none of the pointcloud layouts: ModelNet40 HDF5.*ScanObjectNN.*OFF meshes"
    ):
        read_clouds(tmp_path / "other", PICK)
    with pytest.raises(DataError, match="empty test split"):
        read_clouds(off_folder(tmp_path / "off", test_classes=()), PICK)
    with pytest.raises(DataError, match="class tetra has no training example"):
        folder = off_folder(tmp_path / "off2")
        for f in (folder / "tetra" / "train").glob("*.off"):
            f.unlink()
        read_clouds(folder, PICK)
    folder = scanobjectnn(tmp_path / "so")
    (folder / "test_objectdataset.h5").unlink()
    with pytest.raises(DataError, match="no test twin test_objectdataset.h5"):
        read_clouds(folder, PICK)


# ------------------------------------------------------------------ end to end ----------------------------
FORMATS = {"modelnet40-h5": modelnet, "scanobjectnn": scanobjectnn, "off": off_folder}
# the fixtures have 2 to 6 training clouds per class: half of them validate
TINY = ["--max-iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--n-layer", "1", "--n-embd", "16",
        "--batch-size", "4", "--no-plots", "--set", "task.points=16",
        "--set", "task.val_fraction=0.5"]  # fmt: skip


@pytest.mark.parametrize("layout", FORMATS)
def test_geoattn_train_reads_each_format(tmp_path, layout, capsys):
    data = FORMATS[layout](tmp_path / "data")
    out = tmp_path / "run"
    argv = ["train", "--task", "pointcloud", "--model", "pointnet", "--data", str(data), "--out", str(out)]
    assert main([*argv, *TINY]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["task"]["layout"] == layout and config["task"]["classes"][0] != "ellipsoid"
    final = json.loads((out / "summary.json").read_text())["final"]
    assert 0 <= final["test_accuracy"] <= 1 and 0 <= final["val_accuracy_full"] <= 1


def test_geoattn_train_refuses_broken_data_in_one_line_and_writes_nothing(tmp_path, capsys):
    data = modelnet(tmp_path / "data")
    _label_out_of_range(data)
    out = tmp_path / "run"
    argv = ["train", "--task", "pointcloud", "--model", "pointnet", "--data", str(data), "--out", str(out)]
    assert main([*argv, *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert "label 7 is outside the 3 classes" in err and len(err.splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())
    assert main([*argv[:-4], "--data", str(tmp_path), "--out", str(out), *TINY]) == 2
    assert "none of the pointcloud layouts" in capsys.readouterr().err


EXPERIMENT = """
description = "pointcloud on read files"
seeds = [1]
metrics = ["val_accuracy_full"]
evaluate = false

[base]
task = "pointcloud"
data = "{data}"
model = "pointnet"
max_iters = 3
eval_interval = 3
eval_iters = 1
n_layer = 1
n_embd = 16
batch_size = 4
plots = false
task_options = {{ points = 16, val_fraction = 0.5 }}

[[cells]]
name = "pointnet"
"""


@pytest.mark.parametrize("layout", FORMATS)
def test_geoattn_experiment_reads_each_format(tmp_path, monkeypatch, layout, capsys):
    data = FORMATS[layout](tmp_path / "data")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "tiny.toml").write_text(EXPERIMENT.format(data=data))
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "tiny"]) == 0
    assert ": done" in capsys.readouterr().out
    configs = list((tmp_path / "runs").rglob("config.json"))
    assert len(configs) == 1 and json.loads(configs[0].read_text())["task"]["layout"] == layout
    assert "val_accuracy_full" in (tmp_path / "results" / "tiny.md").read_text()
