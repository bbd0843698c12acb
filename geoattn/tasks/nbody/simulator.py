"""The ``nbody`` task: GATr's n-body protocol (docs/tasks.md#nbody; Brehmer et al. 2023, §5.1).

A star and planets under Newtonian gravity: predict every body's position after a fixed time from
its mass, position and velocity. Five sets, as GATr's
``scripts/generate_nbody_dataset.py``: ``train`` (100,000 samples), ``val``, ``eval`` (5,000 each),
the E(3)-generalisation set ``e3_generalization`` (5,000; the usual random translation plus a fixed
+200 along x) and the object-generalisation set ``object_generalization`` (5,000; 5 planets instead
of 3). They are simulated here from fixed seeds with GATr's ``NBodySimulator`` rules
(:func:`simulate_systems`, see :class:`NBodyConfig`), or loaded from GATr's own files with
``NBodyConfig(data=DIR)`` (:func:`load_gatr_format`); :func:`save_gatr_format` writes ours in that
format, so both can be compared on the same samples.

A batch is ``x`` ``(B, n, 7)`` = [mass, position (3), velocity (3)] per body and ``y`` ``(B, n, 3)``,
the final positions.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geoattn.core.errors import ConfigError, DataError

SETS = ("train", "val", "eval", "e3_generalization", "object_generalization")
# the systems of the task and their default seeds: GATr's gravity, EGNN's charged particles (seed 43)
SYSTEMS = {"gravity": 0, "charged": 43}
ARRAYS = ("m", "x_initial", "v_initial", "x_final")
# GATr's generator also stores every sample's path; its training pipeline reads it from val only
TRAJECTORY_SETS = ("val",)
# the NBodyConfig field that sizes each set (``--set task.train_size=1000``)
SIZE_FIELDS = {
    "train": "train_size",
    "val": "val_size",
    "eval": "eval_size",
    "e3_generalization": "e3_size",
    "object_generalization": "object_size",
}
# samples per set when simulating and no size is set: GATr's (scripts/generate_nbody_dataset.py)
SIMULATED_SIZES = {
    "train": 100_000,
    "val": 5_000,
    "eval": 5_000,
    "e3_generalization": 5_000,
    "object_generalization": 5_000,
}


@dataclass
class NBodyConfig:
    """The n-body simulator and set sizes; the defaults are GATr's (``gatr/experiments/nbody/simulator.py``
    ``NBodySimulator()`` and ``scripts/generate_nbody_dataset.py``).

    Simulation, per sample (GATr's rules; only the random number streams differ): star mass
    log-uniform on ``star_mass_range``, ``n_planets`` planet masses log-uniform on
    ``planet_mass_range``; the star at rest at the origin, planets uniform in area on the annulus
    ``radius_range`` of the x-y plane, each on a circular orbit around the star (speed
    ``sqrt(G M / r)``, clockwise or anticlockwise with probability 1/2) plus Gaussian velocity noise
    ``vel_std`` on each of the three components; then the bodies in random order, a Haar-random
    rotation and a Gaussian translation (std ``shift_std`` per axis), and for the
    E(3)-generalisation set a further fixed ``e3_shift`` along x (GATr's ``ood_shift``); evolved for
    ``time`` in ``steps`` symplectic Euler steps (``v += dt a(x)``, then ``x += dt v``; no softening,
    the close encounters it would tame are what the drop rule removes); samples in which any body
    ends more than ``max_displacement`` from where it started are dropped. GATr draws
    ``round(1.1 N)`` candidates once and keeps the first N survivors (fewer if more than 10 % are
    dropped; with the defaults 0.2 % are with 3 planets, 0.6 % with 5); here candidates are drawn
    until N survive, which gives the same distribution and always N samples.

    Sizes: simulated sets have ``*_size`` samples (None: :data:`SIMULATED_SIZES`); sets loaded from
    ``data`` keep the first ``*_size`` samples of their file (None: all of them; more than the file
    holds is a DataError), as GATr's own ``subsample`` keeps a file's first samples.

    ``system = "charged"`` switches to EGNN's charged-particle benchmark (:mod:`.charged`): sets
    train / val / test from EGNN's simulator and seed, or EGNN's ``.npy`` files in ``data``; the gravity
    fields below are then unused, and ``particles``, ``vel_norm``, ``frame_in``, ``frame_out`` apply.

    Fields:
        system: gravity (GATr's star and planets) or charged (EGNN's charged particles); unset: the
            layout of the files in ``data`` (:mod:`.files`), else gravity.
        data: a directory with the system's files to load instead of simulating (``--data DIR``): GATr's
            ``{set}.npz`` (gravity) or EGNN's ``loc_*.npy`` … (charged), told apart by their names.
        seed: base seed (None: the system's own, 0 gravity, 43 charged as EGNN's small set); each
            gravity set has its own (``seed + its index in SETS``), charged sets share one stream.
        train_size, val_size, eval_size, e3_size, object_size: samples; --data: a file's first N (None: all).
        test_size: charged test samples (None: all 2,000); charged train_size None: EGNN's 3,000.
        n_planets: planets per system in train, val, eval and the E(3)-generalisation set.
        object_planets: planets per system in the object-generalisation set.
        star_mass_range: (low, high) of the star's log-uniform mass.
        planet_mass_range: (low, high) of each planet's log-uniform mass.
        radius_range: (low, high) of the planets' distance from the star (uniform in area).
        vel_std: std of the Gaussian noise on each component of a planet's initial velocity.
        shift_std: std per axis of the random translation of every system.
        e3_shift: fixed shift along x added to the E(3)-generalisation set (GATr's ood_shift).
        G: gravitational constant (GATr: 1).
        time: simulated time from the initial to the final positions.
        steps: symplectic Euler steps over ``time``.
        max_displacement: samples in which a body moves farther are dropped (GATr's outlier_threshold).
        particles: charged particles per system.
        vel_norm: charged initial speed of every particle.
        frame_in: charged input frame (EGNN's nbody_small: 30).
        frame_out: charged target frame (EGNN's nbody_small: 40).
    """

    system: str | None = None
    data: str | None = None
    seed: int | None = None
    train_size: int | None = None
    val_size: int | None = None
    eval_size: int | None = None
    e3_size: int | None = None
    object_size: int | None = None
    n_planets: int = 3
    object_planets: int = 5
    star_mass_range: tuple[float, float] = (1.0, 10.0)
    planet_mass_range: tuple[float, float] = (0.01, 0.1)
    radius_range: tuple[float, float] = (0.1, 1.0)
    vel_std: float = 0.01
    shift_std: float = 20.0
    e3_shift: float = 200.0
    G: float = 1.0
    time: float = 0.1
    steps: int = 100
    max_displacement: float = 2.0
    test_size: int | None = None
    particles: int = 5
    vel_norm: float = 0.5
    frame_in: int = 30
    frame_out: int = 40

    def __post_init__(self) -> None:
        if self.system is not None and self.system not in SYSTEMS:
            raise ConfigError(f"NBodyConfig.system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        if not 0 <= self.frame_in < self.frame_out:
            raise ConfigError(
                f"NBodyConfig.frame_in / frame_out must satisfy 0 ≤ frame_in < frame_out, "
                f"got {self.frame_in} / {self.frame_out}"
            )
        for name in ("star_mass_range", "planet_mass_range", "radius_range"):
            low, high = (float(v) for v in getattr(self, name))
            if not 0 < low <= high:
                raise ConfigError(
                    f"NBodyConfig.{name} must be (low, high) with 0 < low ≤ high, got {(low, high)}"
                )
            setattr(self, name, (low, high))
        for name in (*SIZE_FIELDS.values(), "test_size", "n_planets", "object_planets", "steps", "particles"):
            value = getattr(self, name)
            if value is None and name.endswith("_size"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"NBodyConfig.{name} must be a positive integer, got {value!r}")
        for name in ("vel_std", "shift_std", "e3_shift"):
            if getattr(self, name) < 0:
                raise ConfigError(f"NBodyConfig.{name} must be ≥ 0, got {getattr(self, name)}")
        for name in ("G", "time", "max_displacement", "vel_norm"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"NBodyConfig.{name} must be > 0, got {getattr(self, name)}")

    def set_size(self, name: str) -> int | None:
        """The samples asked of set ``name`` (None: all of a file, :data:`SIMULATED_SIZES` simulated)."""
        return self.test_size if name == "test" else getattr(self, SIZE_FIELDS[name])

    @property
    def base_seed(self) -> int:
        """``seed``, or the system's own when unset (gravity 0, charged 43 as EGNN's small set)."""
        return self.seed if self.seed is not None else SYSTEMS[self.system or "gravity"]


@dataclass
class NBodySet:
    """One set in GATr's layout: ``m`` ``(B, n)``, ``x_initial``, ``v_initial``, ``x_final`` ``(B, n, 3)``;
    optionally ``trajectories`` ``(B, n, steps + 1, 3)``, every position from initial to final."""

    m: Tensor
    x_initial: Tensor
    v_initial: Tensor
    x_final: Tensor
    trajectories: Tensor | None = None

    def __len__(self) -> int:
        return self.m.shape[0]

    def inputs(self) -> Tensor:
        """``(B, n, 7)``: mass, position, velocity per body."""
        return torch.cat((self.m[..., None], self.x_initial, self.v_initial), dim=-1)

    def subset(self, index: Tensor | slice) -> NBodySet:
        """The samples ``index`` (an index tensor or a slice), trajectories included."""
        paths = self.trajectories[index] if self.trajectories is not None else None
        return NBodySet(*(getattr(self, a)[index] for a in ARRAYS), trajectories=paths)

    def translated(self, shift: Tensor) -> NBodySet:
        """Every position moved by ``shift (3,)`` (initial and final; masses and velocities kept)."""
        shift = shift.to(self.x_initial)
        return NBodySet(self.m, self.x_initial + shift, self.v_initial, self.x_final + shift)

    def head(self, count: int) -> NBodySet:
        """The first ``count`` samples (GATr's ``subsample`` also keeps a file's first samples)."""
        return self.subset(slice(0, count))

    def content_hash(self) -> str:
        """SHA-256 of the arrays (names, shapes, float64 little-endian bytes): which data a run saw."""
        digest = hashlib.sha256()
        for a in ARRAYS:
            array = np.ascontiguousarray(getattr(self, a).detach().cpu().numpy(), dtype="<f8")
            digest.update(f"{a}{array.shape}".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()


# ------------------------------------------------------------------------------------------------
# Simulation


def accelerations(m: Tensor, x: Tensor, G: float = 1.0) -> Tensor:
    """Newtonian accelerations ``a_i = G Σ_{j≠i} m_j (x_j − x_i) / |x_j − x_i|³``.

    As GATr, a distance below 1e-9 counts as 1 (coincident bodies do not blow up). One pass per pair
    i < j, each giving both bodies their share: cheaper than the (B, n, n, 3) broadcast for the few
    bodies here. Shapes: m ``(B, n)``, x ``(B, n, 3)`` → ``(B, n, 3)``.
    """
    a = torch.zeros_like(x)
    for i, j in itertools.combinations(range(x.shape[1]), 2):
        d = x[:, j] - x[:, i]  # (B, 3)
        dist = d.norm(dim=-1, keepdim=True)
        pull = d / torch.where(dist < 1e-9, torch.ones_like(dist), dist) ** 3
        a[:, i] += m[:, j, None] * pull
        a[:, j] -= m[:, i, None] * pull
    return G * a


def symplectic_euler(
    m: Tensor, x: Tensor, v: Tensor, *, time: float, steps: int, G: float = 1.0, trajectory: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """GATr's integrator: ``steps`` steps of ``v ← v + dt a(x)``, then ``x ← x + dt v``, dt = time / steps.

    Symplectic, first order. Shapes: m ``(B, n)``, x, v ``(B, n, 3)`` → final ``x``, ``v`` ``(B, n, 3)``
    and, if ``trajectory``, every position ``(B, n, steps + 1, 3)`` (the initial one first), else None.
    """
    dt = time / steps
    path = [x] if trajectory else []
    for _ in range(steps):
        v = v + dt * accelerations(m, x, G)
        x = x + dt * v
        if trajectory:
            path.append(x)
    return x, v, torch.stack(path, dim=2) if trajectory else None


def random_rotations(n: int, generator: torch.Generator, dtype: torch.dtype = torch.float64) -> Tensor:
    """``(n, 3, 3)`` Haar-random rotations (QR of Gaussian matrices, signs fixed, det +1)."""
    q, r = torch.linalg.qr(torch.randn(n, 3, 3, generator=generator, dtype=dtype))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    flip = torch.linalg.det(q) < 0
    q[flip, :, 0] = -q[flip, :, 0]
    return q


def _log_uniform(shape: tuple[int, ...], bounds: tuple[float, float], generator: torch.Generator) -> Tensor:
    low, high = math.log(bounds[0]), math.log(bounds[1])
    return torch.exp(low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64))


def initial_conditions(
    count: int, n_planets: int, config: NBodyConfig, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Star frame, before the random E(3) motion: ``m (B, n)``, ``x, v (B, n, 3)``, star first."""
    star = _log_uniform((count, 1), config.star_mass_range, generator)
    m = torch.cat((star, _log_uniform((count, n_planets), config.planet_mass_range, generator)), dim=1)
    r_low, r_high = config.radius_range
    radius = torch.sqrt(r_low**2 + (r_high**2 - r_low**2) * torch.rand(count, n_planets, generator=generator))
    phase = 2 * math.pi * torch.rand(count, n_planets, generator=generator, dtype=torch.float64)
    position = torch.stack(
        (torch.cos(phase), torch.sin(phase), torch.zeros_like(phase)), -1
    )  # unit, (B, p, 3)
    spin = torch.where(torch.rand(count, n_planets, generator=generator) < 0.5, -1.0, 1.0).to(torch.float64)
    tangent = spin[..., None] * torch.stack((-position[..., 1], position[..., 0], position[..., 2]), -1)
    speed = torch.sqrt(config.G * star / radius.to(torch.float64))  # circular orbit around the star
    velocity = speed[..., None] * tangent
    velocity = velocity + config.vel_std * torch.randn(
        velocity.shape, generator=generator, dtype=torch.float64
    )
    zeros = torch.zeros(count, 1, 3, dtype=torch.float64)
    x = torch.cat((zeros, radius.to(torch.float64)[..., None] * position), dim=1)
    return m, x, torch.cat((zeros, velocity), dim=1)


def simulate_systems(
    count: int,
    n_planets: int,
    config: NBodyConfig,
    generator: torch.Generator,
    *,
    domain_shift: bool = False,
    trajectories: bool = False,
) -> NBodySet:
    """``count`` samples of the protocol (see :class:`NBodyConfig`), float64, vectorised over samples.

    ``domain_shift``: add ``config.e3_shift`` along x after the random translation (GATr's
    E(3)-generalisation set). ``trajectories``: keep every sample's path (``(count, n, steps + 1, 3)``).
    """
    chunks: list[NBodySet] = []
    kept = 0
    while kept < count:
        candidates = math.ceil(1.1 * (count - kept)) + 8  # < 1 % are dropped
        m, x, v = initial_conditions(candidates, n_planets, config, generator)
        order = torch.argsort(torch.rand(candidates, n_planets + 1, generator=generator), dim=1)
        m, x, v = (
            m.gather(1, order),
            x.gather(1, order[..., None].expand_as(x)),
            v.gather(1, order[..., None].expand_as(v)),
        )
        rotation = random_rotations(candidates, generator)
        shift = config.shift_std * torch.randn(candidates, 1, 3, generator=generator, dtype=torch.float64)
        if domain_shift:
            shift[..., 0] += config.e3_shift
        x = torch.einsum("bij,bnj->bni", rotation, x) + shift
        v = torch.einsum("bij,bnj->bni", rotation, v)
        x_final, _, path = symplectic_euler(
            m, x, v, time=config.time, steps=config.steps, G=config.G, trajectory=trajectories
        )
        keep = (x_final - x).norm(dim=-1).amax(1) <= config.max_displacement
        chunks.append(NBodySet(m, x, v, x_final, trajectories=path).subset(keep))
        kept += int(keep.sum())
    merged = NBodySet(
        *(torch.cat([getattr(c, a) for c in chunks]) for a in ARRAYS),
        trajectories=torch.cat([c.trajectories for c in chunks]) if trajectories else None,
    )
    return merged.head(count)


# ------------------------------------------------------------------------------------------------
# GATr's file format


def save_gatr_format(sets: dict[str, NBodySet], directory: str | Path) -> None:
    """Write ``{name}.npz`` per set as GATr's ``scripts/generate_nbody_dataset.py`` does: float64 arrays
    ``m, x_initial, v_initial, x_final`` and ``trajectories`` ``(B, n, steps + 1, 3)``.

    GATr's loader (``NBodyDataset``) reads the first four from every file and ``trajectories`` from
    val (``keep_trajectories`` for the val tag), so val must have them; other sets write them when
    they have them (the simulator keeps them for val only: for 100,000 training samples they would
    take 970 MB).
    """
    for name in TRAJECTORY_SETS:
        if name in sets and sets[name].trajectories is None:
            raise DataError(f"nbody: set {name!r} has no trajectories, which GATr's pipeline reads from it")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in sets.items():
        arrays = {a: getattr(data, a).cpu().numpy() for a in ARRAYS}
        if data.trajectories is not None:
            arrays["trajectories"] = data.trajectories.cpu().numpy()
        np.savez(directory / f"{name}.npz", **arrays)


# what NumPy raises on a truncated or corrupt .npy / .npz file
UNREADABLE = (ValueError, OSError, EOFError, zipfile.BadZipFile)
# the set whose samples may hold other bodies than the training set's (GATr's: 5 planets, not 3)
OTHER_BODIES = "object_generalization"


def check_finite(path: Path, arrays: dict[str, np.ndarray], what: str = "nbody data") -> None:
    """DataError naming ``path``, the array and its first sample with a NaN or infinite value."""
    for name, array in arrays.items():
        bad = ~np.isfinite(array)
        if bad.any():
            sample = int(np.argwhere(bad)[0][0])
            raise DataError(
                f"{what}: {str(path)!r} array {name} holds NaN or infinite values (sample {sample})"
            )


def load_gatr_format(directory: str | Path, names: tuple[str, ...] = SETS) -> dict[str, NBodySet]:
    """Read GATr's ``{name}.npz`` files (float64 tensors), checking every array's presence, shape and
    values (finite), and that every set but ``object_generalization`` has the training set's bodies.

    ``trajectories`` are read from val when the file has them (as GATr's pipeline), else left None.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"nbody data directory {str(directory)!r} does not exist")
    sets = {}
    for name in names:
        path = directory / f"{name}.npz"
        if not path.is_file():
            needed = ", ".join(f"{n}.npz" for n in names)
            raise DataError(f"nbody data: missing file {str(path)!r} (GATr's format needs {needed})")
        wanted = (*ARRAYS, "trajectories") if name in TRAJECTORY_SETS else ARRAYS
        try:
            with np.load(path, allow_pickle=False) as npz:
                stored = {a: np.asarray(npz[a]) for a in wanted if a in npz.files}
        except UNREADABLE as err:
            raise DataError(f"nbody data: {str(path)!r} is not a readable .npz file ({err})") from None
        missing = [a for a in ARRAYS if a not in stored]
        if missing:
            raise DataError(f"nbody data: {str(path)!r} lacks array(s) {', '.join(missing)}")
        arrays = {a: stored[a] for a in ARRAYS}
        paths = stored.get("trajectories")
        m = arrays["m"]
        if m.ndim != 2 or m.shape[0] == 0:
            raise DataError(
                f"nbody data: {str(path)!r} array m has shape {m.shape}, expected (B, n) with B ≥ 1"
            )
        for a in ARRAYS[1:]:
            if arrays[a].shape != (*m.shape, 3):
                raise DataError(
                    f"nbody data: {str(path)!r} array {a} has shape {arrays[a].shape}, "
                    f"expected {(*m.shape, 3)} (m has {m.shape})"
                )
        if paths is not None and (paths.ndim != 4 or paths.shape[:2] != m.shape or paths.shape[3] != 3):
            raise DataError(
                f"nbody data: {str(path)!r} array trajectories has shape {paths.shape}, "
                f"expected {(*m.shape, 'steps + 1', 3)}"
            )
        check_finite(path, arrays)
        first = next((s for n, s in sets.items() if n != OTHER_BODIES), None)
        if name != OTHER_BODIES and first is not None and first.m.shape[1] != m.shape[1]:
            raise DataError(
                f"nbody data: {str(path)!r} has {m.shape[1]} bodies per sample, {names[0]}.npz "
                f"{first.m.shape[1]} (every set but {OTHER_BODIES} has the training set's bodies)"
            )
        sets[name] = NBodySet(
            *(torch.from_numpy(arrays[a]).to(torch.float64) for a in ARRAYS),
            trajectories=torch.from_numpy(paths).to(torch.float64) if paths is not None else None,
        )
    return sets


def random_orthogonal(n: int, generator: torch.Generator, dtype: torch.dtype = torch.float64) -> Tensor:
    """``(n, 3, 3)`` Haar-random elements of O(3): rotations, half of them composed with a reflection."""
    q = random_rotations(n, generator, dtype)
    flip = torch.rand(n, generator=generator) < 0.5
    q[flip] = -q[flip]  # −R: a rotation times the point reflection, det −1
    return q
