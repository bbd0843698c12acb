"""Point clouds read from files (``--task pointcloud --data PATH``), in one of three layouts, told by the
files in the folder (:data:`LAYOUTS`):

* ``modelnet40-h5``: the PointNet HDF5 distribution of ModelNet40: ``ply_data_train*.h5`` /
  ``ply_data_test*.h5`` with ``data (N, P, 3)`` and ``label (N, 1)``, ``shape_names.txt`` (one class
  a line), and ``train_files.txt`` / ``test_files.txt`` listing the h5 files (with the distribution's
  prefix, e.g. ``data/modelnet40_ply_hdf5_2048/``: read relative to the folder, else by file name).
* ``scanobjectnn``: ScanObjectNN's ``training_objectdataset*.h5`` / ``test_objectdataset*.h5`` with
  ``data (N, P, 3)``, ``label (N,)`` in its 15 classes (:data:`SCANOBJECTNN_CLASSES`) and maybe
  ``mask (N, P)`` (background points; the benchmark classifies the clouds with them, as here). PATH is
  a folder holding one variant, or one variant's training file (its test file is its twin).
* ``off``: ModelNet40's raw layout, ``PATH/<class>/train/*.off`` and ``PATH/<class>/test/*.off``
  meshes, each sampled uniformly by area once (:data:`SURFACE_POINTS` points) and cached.

Each cloud keeps ``points`` of its points, picked at random or by farthest-point sampling
(:func:`farthest_points`, cached), then is centred and scaled to unit maximum radius (as the generated
shapes are). Anything malformed is a one-line :class:`~geoattn.core.errors.DataError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from geoattn.core.cache import cache_dir
from geoattn.core.errors import DataError
from geoattn.core.extras import require

SPLITS_READ = ("train", "test")
SAMPLINGS = ("random", "fps")
SURFACE_POINTS = 2048  # points sampled on each OFF mesh, as many as the HDF5 distribution's clouds
# ScanObjectNN's classes in the order of its labels
SCANOBJECTNN_CLASSES = ("bag", "bin", "box", "cabinet", "chair", "desk", "display", "door", "shelf",
                        "table", "bed", "pillow", "sink", "sofa", "toilet")  # fmt: skip
CACHE_VERSION = 1


@dataclass
class PointSets:
    """Clouds read from ``path``: ``layout`` (a :data:`LAYOUTS` name), the class names, and per split
    (train, test) ``(clouds (N, points, 3) float32, labels (N,) long)``."""

    path: Path
    layout: str
    classes: tuple[str, ...]
    sets: dict[str, tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Picking:
    """How each cloud keeps ``points`` of its points: ``sampling`` random or fps, from ``seed``."""

    points: int
    sampling: str
    seed: int


# ------------------------------------------------------------------ picking points ---------------------
def farthest_points(clouds: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """Farthest-point sampling: indices ``(N, k)`` into clouds ``(N, P, 3)``. The first point is drawn
    from ``generator``; each next one is the point farthest from those picked (ties: the lowest index)."""
    N, P, _ = clouds.shape
    if not 1 <= k <= P:
        raise ValueError(f"k = {k} points from clouds of {P}")
    rows = torch.arange(N)
    index = torch.empty(N, k, dtype=torch.long)
    index[:, 0] = torch.randint(P, (N,), generator=generator)
    nearest = torch.full((N, P), float("inf"), dtype=clouds.dtype)  # squared distance to the picked set
    for i in range(1, k):
        last = clouds[rows, index[:, i - 1]]  # (N, 3)
        nearest = torch.minimum(nearest, (clouds - last[:, None]).square().sum(-1))
        index[:, i] = nearest.argmax(-1)
    return index


def pick_points(clouds: Tensor, picking: Picking, where: str) -> Tensor:
    """``picking.points`` points of every cloud ``(N, P, 3)`` → ``(N, points, 3)``; DataError naming
    ``where`` when the clouds have fewer points."""
    N, P, _ = clouds.shape
    if P < picking.points:
        raise DataError(f"{where}: its clouds have {P} points, fewer than task.points={picking.points}")
    generator = torch.Generator().manual_seed(picking.seed)
    if picking.sampling == "fps":
        index = farthest_points(clouds, picking.points, generator)
    else:
        index = torch.rand(N, P, generator=generator).argsort(-1)[:, : picking.points]
    return torch.gather(clouds, 1, index[..., None].expand(-1, -1, 3))


def normalise(clouds: Tensor) -> Tensor:
    """Clouds ``(N, P, 3)`` centred and scaled to unit maximum radius (the generated shapes' frame)."""
    centred = clouds - clouds.mean(1, keepdim=True)
    return centred / centred.norm(dim=-1).amax(1).clamp_min(1e-12)[:, None, None]


def _cached(key: dict[str, Any], make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``make()`` stored in the cache folder under ``key`` (the files' sizes and times, the settings):
    computed once per key."""
    digest = hashlib.sha256(json.dumps({**key, "v": CACHE_VERSION}, sort_keys=True).encode()).hexdigest()
    path = cache_dir() / "pointcloud" / f"{key['kind']}-{digest[:16]}.pt"
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError):
            pass  # unreadable (damaged, or written by another torch): made again below
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{digest[16:24]}.partial")
    torch.save(value, partial)
    partial.replace(path)
    return value


def _stamp(files: list[Path]) -> list[list[Any]]:
    """What identifies the files' contents for the cache: path, size and modification time of each."""
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _picked(clouds: Tensor, picking: Picking, where: str, files: list[Path]) -> Tensor:
    """:func:`pick_points` then :func:`normalise`; farthest-point picks are cached (they cost
    ``points`` passes over every cloud)."""
    if picking.sampling != "fps":
        return normalise(pick_points(clouds, picking, where))
    key = {"kind": "fps", "files": _stamp(files), "where": where, "picking": vars(picking)}
    return _cached(key, lambda: {"clouds": normalise(pick_points(clouds, picking, where))})["clouds"]


# ------------------------------------------------------------------ checks --------------------------------
def _checked_clouds(data: Any, where: str, key: str = "data") -> Tensor:
    """``data`` as float32 clouds ``(N, P, 3)``; DataError naming ``where`` on a wrong shape, no cloud or a
    non-finite coordinate."""
    array = np.asarray(data)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise DataError(f"{where}: {key!r} has shape {array.shape}, expected (N, P, 3) points")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise DataError(f"{where}: {key!r} holds no clouds (shape {array.shape})")
    if not np.issubdtype(array.dtype, np.number):
        raise DataError(f"{where}: {key!r} has dtype {array.dtype}, expected numbers")
    bad = ~np.isfinite(array).all(axis=(1, 2))
    if bad.any():
        raise DataError(f"{where}: {key!r} has NaN or infinite coordinates in cloud {int(bad.argmax())}")
    return torch.from_numpy(array.astype(np.float32))


def _checked_labels(label: Any, n: int, classes: tuple[str, ...], where: str, names: str) -> Tensor:
    """``label`` ``(n,)`` or ``(n, 1)`` as long class indices; DataError naming ``where`` on a wrong
    shape, a NaN or fractional label, or one outside the ``len(classes)`` classes of ``names``."""
    array = np.asarray(label)
    if array.shape not in ((n,), (n, 1)):
        raise DataError(
            f"{where}: 'label' has shape {array.shape}, expected ({n},) or ({n}, 1) for its {n} clouds"
        )
    array = array.reshape(n)
    if not np.issubdtype(array.dtype, np.number):
        raise DataError(f"{where}: 'label' has dtype {array.dtype}, expected class indices")
    if not np.isfinite(array).all() or (array != np.round(array)).any():
        raise DataError(f"{where}: 'label' holds NaN or non-integer values, expected class indices")
    outside = (array < 0) | (array >= len(classes))
    if outside.any():
        raise DataError(
            f"{where}: label {array[outside][0]:g} is outside the {len(classes)} classes of {names} "
            f"(0..{len(classes) - 1})"
        )
    return torch.from_numpy(array.astype(np.int64))


def _check_sets(sets: dict[str, tuple[Tensor, Tensor]], classes: tuple[str, ...], path: Path) -> None:
    """Every class has a training example (a class the model never sees cannot be learned)."""
    seen = torch.bincount(sets["train"][1], minlength=len(classes))
    missing = [classes[i] for i in (seen == 0).nonzero().flatten().tolist()]
    if len(missing) == 1:
        raise DataError(f"{path}: class {missing[0]} has no training example")
    if missing:
        names = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise DataError(
            f"{path}: {len(missing)} of its {len(classes)} classes have no training example ({names})"
        )


# ------------------------------------------------------------------ HDF5 ----------------------------------
def _h5(path: Path) -> dict[str, np.ndarray]:
    """The datasets of an HDF5 file (``data``, ``label`` and, where present, ``mask``)."""
    h5py = require(
        "h5py", extra="pointclouds", purpose="reading HDF5 point clouds (--task pointcloud --data)"
    )
    try:
        with h5py.File(path, "r") as f:
            keys = list(f.keys())
            for key in ("data", "label"):
                if key not in f:
                    raise DataError(f"{path} has no {key!r} dataset (it has {', '.join(keys) or 'none'})")
            return {key: f[key][()] for key in ("data", "label", "mask") if key in f}
    except OSError as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{path} is not a readable HDF5 file ({reason})") from None


def _read_h5_split(
    files: list[Path], classes: tuple[str, ...], names: str, picking: Picking
) -> tuple[Tensor, Tensor]:
    """Clouds and labels of the h5 ``files`` of one split, each file's clouds picked to ``points``."""
    clouds, labels = [], []
    for file in files:
        raw = _h5(file)
        data = _checked_clouds(raw["data"], str(file))
        labels.append(_checked_labels(raw["label"], data.shape[0], classes, str(file), names))
        if "mask" in raw and np.shape(raw["mask"]) != tuple(data.shape[:2]):
            raise DataError(
                f"{file}: 'mask' has shape {np.shape(raw['mask'])}, expected {tuple(data.shape[:2])}"
            )
        clouds.append(_picked(data, picking, str(file), [file]))
    return torch.cat(clouds), torch.cat(labels)


def _listed(folder: Path, split: str) -> list[Path]:
    """The h5 files of ``split`` in a ModelNet40 folder: those ``<split>_files.txt`` lists (relative to the
    folder, else by file name: the distribution lists them under ``data/modelnet40_ply_hdf5_2048/``), or
    else every ``ply_data_<split>*.h5``."""
    listing = folder / f"{split}_files.txt"
    if not listing.is_file():
        files = sorted(folder.glob(f"ply_data_{split}*.h5"))
        if not files:
            raise DataError(f"{folder} has neither {listing.name} nor ply_data_{split}*.h5: no {split} split")
        return files
    files = []
    for line in listing.read_text().split():
        for candidate in (folder / line, folder / Path(line).name):
            if candidate.is_file():
                files.append(candidate)
                break
        else:
            raise DataError(f"{listing} lists {line}, which is not in {folder}")
    if not files:
        raise DataError(f"{listing} lists no files: no {split} split")
    return files


def _classes_file(folder: Path) -> tuple[str, ...]:
    path = folder / "shape_names.txt"
    if not path.is_file():
        raise DataError(f"{folder} has no shape_names.txt (the class names, one a line)")
    classes = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not classes:
        raise DataError(f"{path} names no classes")
    return classes


def read_modelnet_h5(folder: Path, picking: Picking) -> PointSets:
    """ModelNet40's HDF5 distribution in ``folder`` (see the module docstring)."""
    classes = _classes_file(folder)
    sets = {s: _read_h5_split(_listed(folder, s), classes, "shape_names.txt", picking) for s in SPLITS_READ}
    return PointSets(folder, "modelnet40-h5", classes, sets)


def _scanobjectnn_files(path: Path) -> dict[str, Path]:
    """The training and test file of one ScanObjectNN variant: ``path`` itself (a training file) or the
    one training file in the folder ``path``, and its test twin."""
    if path.is_file():
        train = path
    else:
        found = sorted(path.glob("training_objectdataset*.h5"))
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise DataError(
                f"{path} holds {len(found)} ScanObjectNN variants ({names}): give --data one training file"
            )
        train = found[0]
    test = train.with_name("test_" + train.name.removeprefix("training_"))
    if not test.is_file():
        raise DataError(f"{train} has no test twin {test.name} beside it: no test split")
    return {"train": train, "test": test}


def read_scanobjectnn(path: Path, picking: Picking) -> PointSets:
    """One ScanObjectNN variant (a folder holding one, or its training file)."""
    files = _scanobjectnn_files(path)
    names = "ScanObjectNN"
    sets = {s: _read_h5_split([files[s]], SCANOBJECTNN_CLASSES, names, picking) for s in SPLITS_READ}
    return PointSets(path, "scanobjectnn", SCANOBJECTNN_CLASSES, sets)


# ------------------------------------------------------------------ OFF meshes ---------------------------
def read_off(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """An OFF mesh: vertices ``(V, 3)`` float64 and triangles ``(T, 3)`` (polygons split into fans).
    Accepts ModelNet's header quirk (the counts on the ``OFF`` line); DataError naming the file and
    what is wrong otherwise."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not a readable OFF file ({err})") from None
    lines = [ln.split("#", 1)[0].split() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines or not lines[0][0].startswith("OFF"):
        raise DataError(f"{path} is not an OFF file (its first line is not 'OFF')")
    head = [lines[0][0][3:]] + lines[0][1:] if lines[0][0] != "OFF" else lines[0][1:]
    head = [t for t in head if t]
    rest = lines[1:]
    if not head:
        head, rest = (rest[0], rest[1:]) if rest else ([], [])
    try:
        n_vertices, n_faces = int(head[0]), int(head[1])
    except (IndexError, ValueError):
        raise DataError(f"{path}: no vertex and face counts after 'OFF'") from None
    if len(rest) < n_vertices + n_faces:
        raise DataError(
            f"{path}: {n_vertices} vertices and {n_faces} faces announced, {len(rest)} lines follow"
        )
    try:
        vertices = np.array([[float(t) for t in ln[:3]] for ln in rest[:n_vertices]], dtype=np.float64)
        face_lines = rest[n_vertices : n_vertices + n_faces]
        faces = [[int(t) for t in ln[1 : 1 + int(ln[0])]] for ln in face_lines]
    except ValueError as err:
        raise DataError(f"{path}: a vertex or face line is not numbers ({err})") from None
    if vertices.shape != (n_vertices, 3) or not np.isfinite(vertices).all():
        raise DataError(f"{path}: a vertex line has fewer than 3 coordinates or a non-finite one")
    short = [i for i, (f, ln) in enumerate(zip(faces, face_lines)) if len(f) != int(ln[0])]
    if short:
        raise DataError(
            f"{path}: face {short[0]} lists fewer vertices than its count {face_lines[short[0]][0]}"
        )
    triangles = [(f[0], f[i], f[i + 1]) for f in faces if len(f) >= 3 for i in range(1, len(f) - 1)]
    if any(len(f) < 3 for f in faces) or not triangles:
        raise DataError(f"{path}: a face has fewer than 3 vertices, or the mesh has no face")
    tri = np.array(triangles, dtype=np.int64)
    if tri.min() < 0 or tri.max() >= n_vertices:
        bad = int(tri.max() if tri.max() >= n_vertices else tri.min())
        raise DataError(f"{path}: a face names vertex {bad}, the mesh has {n_vertices}")
    return vertices, tri


def sample_surface(vertices: Tensor, triangles: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """``n`` points uniform by area on a triangle mesh: ``vertices (V, 3)``, ``triangles (T, 3)`` →
    ``(n, 3)``. A triangle is drawn by its area, a point in it by ``√r₁`` barycentric weights."""
    a, b, c = (vertices[triangles[:, i]] for i in range(3))  # (T, 3) each
    area = torch.linalg.cross(b - a, c - a).norm(dim=-1)
    if not float(area.sum()) > 0:
        raise ValueError("the mesh has no area")
    pick = torch.multinomial(area, n, replacement=True, generator=generator)
    r1, r2 = torch.rand(2, n, 1, generator=generator, dtype=vertices.dtype)
    s = r1.sqrt()
    return (1 - s) * a[pick] + s * (1 - r2) * b[pick] + s * r2 * c[pick]


def _off_files(folder: Path) -> tuple[tuple[str, ...], dict[str, list[tuple[Path, int]]]]:
    """Class names (sorted folder names) and, per split, ``(file, label)`` of every ``.off`` mesh."""
    classes = tuple(sorted(d.name for d in folder.iterdir() if any((d / s).is_dir() for s in SPLITS_READ)))
    files = {s: [(f, k) for k, c in enumerate(classes) for f in sorted((folder / c / s).glob("*.off"))]
             for s in SPLITS_READ}  # fmt: skip
    for split, listed in files.items():
        if not listed:
            raise DataError(f"{folder} has no <class>/{split}/*.off mesh: an empty {split} split")
    return classes, files


def read_off_folder(folder: Path, picking: Picking) -> PointSets:
    """ModelNet40's raw layout of OFF meshes in ``folder``: each mesh sampled by area once (cached)."""
    classes, files = _off_files(folder)
    count = max(SURFACE_POINTS, picking.points)
    every = [f for split in SPLITS_READ for f, _ in files[split]]
    key = {"kind": "off", "files": _stamp(every), "points": count, "seed": picking.seed}

    def sample() -> dict[str, Any]:
        generator = torch.Generator().manual_seed(picking.seed)
        out = {}
        for split in SPLITS_READ:
            clouds = []
            for file, _ in files[split]:
                vertices, triangles = (torch.from_numpy(a) for a in read_off(file))
                try:
                    clouds.append(sample_surface(vertices, triangles, count, generator).float())
                except ValueError as err:
                    raise DataError(f"{file}: {err}") from None
            out[split] = torch.stack(clouds)
        return out

    surface = _cached(key, sample)
    sets = {}
    for split in SPLITS_READ:
        labels = torch.tensor([k for _, k in files[split]], dtype=torch.long)
        where = f"{folder}/*/{split}"
        sets[split] = (_picked(surface[split], picking, where, [f for f, _ in files[split]]), labels)
    return PointSets(folder, "off", classes, sets)


# ------------------------------------------------------------------ the layouts --------------------------
@dataclass(frozen=True)
class Layout:
    """One layout of point-cloud files: how to tell it (``finds(path)``), how to read it, what it is."""

    name: str
    description: str
    finds: Callable[[Path], bool]
    read: Callable[[Path, Picking], PointSets]


def _is_modelnet(path: Path) -> bool:
    return path.is_dir() and ((path / "train_files.txt").is_file() or any(path.glob("ply_data_train*.h5")))


def _is_scanobjectnn(path: Path) -> bool:
    pattern = re.compile(r"training_objectdataset.*\.h5")
    return (
        bool(pattern.fullmatch(path.name)) if path.is_file() else any(path.glob("training_objectdataset*.h5"))
    )


def _is_off(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*/train/*.off"))


LAYOUTS: tuple[Layout, ...] = (
    Layout("modelnet40-h5", "ModelNet40 HDF5 (ply_data_train*.h5 or train_files.txt, shape_names.txt)",
           _is_modelnet, read_modelnet_h5),
    Layout("scanobjectnn", "ScanObjectNN (training_objectdataset*.h5 and test_objectdataset*.h5)",
           _is_scanobjectnn, read_scanobjectnn),
    Layout("off", "OFF meshes (<class>/train/*.off, <class>/test/*.off)", _is_off, read_off_folder),
)  # fmt: skip


def layout_of(path: Path) -> Layout:
    """The layout of ``path`` (the first whose files are there); DataError naming the three otherwise."""
    if not path.exists():
        raise DataError(f"--data {path} does not exist")
    for layout in LAYOUTS:
        if layout.finds(path):
            return layout
    known = "; ".join(layout.description for layout in LAYOUTS)
    raise DataError(f"{path} is none of the pointcloud layouts: {known}")


def read_clouds(path: str | Path, picking: Picking) -> PointSets:
    """The train and test clouds at ``path`` (a folder in one of :data:`LAYOUTS`, or a ScanObjectNN
    training file), ``picking.points`` points each, centred at unit radius; every class trained."""
    path = Path(path)
    data = layout_of(path).read(path, picking)
    _check_sets(data.sets, data.classes, path)
    return data


def stratified_split(labels: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Indices ``(train, val)`` of ``labels (N,)``: per class, a seeded ``round(fraction · n_c)`` of its
    examples go to validation (at most ``n_c − 1``: every class keeps a training example)."""
    generator = torch.Generator().manual_seed(seed)
    train, val = [], []
    for k in labels.unique().tolist():
        members = (labels == k).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_val = min(round(fraction * len(members)), len(members) - 1)
        val.append(members[:n_val])
        train.append(members[n_val:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values
