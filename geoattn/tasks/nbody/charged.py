"""EGNN's charged-particle n-body benchmark (Satorras et al. 2021, §5.1), the set the equivariant-network
field reports on (EGNN 0.0071, SEGNN 0.0043, CGENN 0.0039, Multivector Neurons 0.0035 test MSE).

Five particles with charges ±1 (probability 1/2 each) interact by Coulomb forces (like charges repel,
strength 1, every force component clipped to ±100), starting from Gaussian positions (std 1) and
random velocity directions of norm 0.5; ``length`` = 5,000 symplectic Euler steps of 0.001
(``v ← v + dt F(x)`` once at the start, then per step ``x ← x + dt v``, save every 100th state,
``v ← v + dt F(x)``), 49 frames kept (frame k is the state after 100 (k + 1) position updates), as EGNN's
``n_body_system/dataset/synthetic_sim.py`` (``ChargedParticlesSim``). The sets are those of its
``generate_dataset.py --num-train 10000 --seed 43 --sufix small``: one NumPy ``RandomState(43)`` stream
drawn trajectory after trajectory for 10,000 training, 2,000 validation and 2,000 test trajectories, with
exactly the draws EGNN's code makes per trajectory (charges, positions, velocities, and the two
observation-noise arrays it draws even at noise 0), so the same seed gives the same initial conditions.
The forces are summed in another order than EGNN's loop, so in the chaotic close encounters of about one
system in ten the trajectories part from the script's by more than rounding (up to order 1 at frame 40):
for numbers beside published ones, train and test on the files EGNN's own script writes. The task is
its ``dataset_nbody.py`` ``nbody_small``: the positions and velocities at frame 30 and the charges → the
positions at frame 40, the first 3,000 training trajectories; the metric is the MSE of the predicted
positions over the test set.

Files: :func:`save_egnn_format` writes, and :func:`load_egnn_format` reads, the ``.npy`` files of EGNN's
script (``loc_*``, ``vel_*`` ``(S, 49, 3, 5)``, ``edges_*`` ``(S, 5, 5)``, ``charges_*`` ``(S, 5, 1)``,
``*`` = ``train`` / ``valid`` / ``test`` + ``_charged5_initvel1small``), so a user can check numbers on
files written by the peer's own code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from geoattn.core.errors import DataError
from geoattn.tasks.nbody.simulator import UNREADABLE, NBodySet, check_finite

SETS = ("train", "val", "test")
FILE_TAGS = {"train": "train", "val": "valid", "test": "test"}  # EGNN names its validation files "valid"
ARRAYS = ("loc", "vel", "edges", "charges")
# generate_dataset.py --num-train 10000 (the "small" set): trajectories per set, drawn in this order
GENERATED = {"train": 10_000, "val": 2_000, "test": 2_000}
SEED = 43
# EGNN's main_nbody.py --max_training_samples
TRAIN_SAMPLES = 3_000

# ChargedParticlesSim's constants
DT = 0.001
MAX_FORCE = 0.1 / DT
BOX_SIZE = 5.0
LOC_STD = 1.0
LENGTH = 5_000
SAMPLE_FREQ = 100
CHARGE_TYPES = np.array([-1.0, 0.0, 1.0])
CHARGE_PROBABILITIES = (0.5, 0.0, 0.5)


def suffix(particles: int = 5) -> str:
    """EGNN's file suffix, e.g. ``_charged5_initvel1small``."""
    return f"_charged{particles}_initvel1small"


@dataclass
class ChargedTrajectories:
    """One set in EGNN's layout: ``loc``, ``vel`` ``(S, frames, 3, n)``, ``edges`` ``(S, n, n)`` (the
    products of the charges), ``charges`` ``(S, n, 1)``; float64."""

    loc: np.ndarray
    vel: np.ndarray
    edges: np.ndarray
    charges: np.ndarray

    def __len__(self) -> int:
        return self.loc.shape[0]

    def head(self, count: int) -> ChargedTrajectories:
        """The first ``count`` trajectories (EGNN's ``max_samples`` keeps a file's first ones)."""
        return ChargedTrajectories(*(getattr(self, a)[:count] for a in ARRAYS))

    def task_set(self, frame_in: int, frame_out: int) -> NBodySet:
        """The regression samples: ``m`` = charges ``(S, n)``, positions and velocities at ``frame_in``
        and positions at ``frame_out`` ``(S, n, 3)``, as an :class:`NBodySet`."""
        frames = self.loc.shape[1]
        if not 0 <= frame_in < frame_out < frames:
            raise DataError(
                f"nbody charged: frames {frame_in} → {frame_out} outside the trajectories' {frames} frames"
            )

        def at(array: np.ndarray, frame: int) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array[:, frame].transpose(0, 2, 1)))

        charges = torch.from_numpy(np.ascontiguousarray(self.charges[..., 0]))
        return NBodySet(charges, at(self.loc, frame_in), at(self.vel, frame_in), at(self.loc, frame_out))


def initial_conditions(
    rng: np.random.RandomState, particles: int, vel_norm: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One trajectory's charges ``(n, 1)``, positions and velocities ``(3, n)``, drawn from ``rng`` as
    ``ChargedParticlesSim.sample_trajectory`` draws them (a position beyond the box of ±5 is reflected
    back into it with its velocity component turned inwards, as EGNN's ``_clamp``)."""
    charges = rng.choice(CHARGE_TYPES, size=(particles, 1), p=CHARGE_PROBABILITIES)
    loc = rng.randn(3, particles) * LOC_STD * (particles / 5) ** (1 / 3)
    vel = rng.randn(3, particles)
    vel = vel * vel_norm / np.sqrt((vel**2).sum(axis=0, keepdims=True))
    over, under = loc > BOX_SIZE, loc < -BOX_SIZE
    loc[over] = 2 * BOX_SIZE - loc[over]
    vel[over] = -np.abs(vel[over])
    loc[under] = -2 * BOX_SIZE - loc[under]
    vel[under] = np.abs(vel[under])
    return charges, loc, vel


def forces(loc: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Clipped Coulomb forces ``F_i = Σ_{j≠i} q_i q_j (x_i − x_j) / |x_i − x_j|³`` of positions
    ``(S, n, 3)`` with charge products ``edges`` ``(S, n, n)`` → ``(S, n, 3)``; the squared distances as
    EGNN computes them (``|x_i|² + |x_j|² − 2 x_i·x_j``), so the two agree to rounding."""
    norms = (loc**2).sum(-1)
    dist2 = norms[:, :, None] + norms[:, None, :] - 2 * np.einsum("snk,smk->snm", loc, loc)
    n = loc.shape[1]
    eye = np.eye(n, dtype=bool)
    dist2[:, eye] = 1.0  # the diagonal carries no force; keep it finite before the power
    size = edges / dist2**1.5
    size[:, eye] = 0.0
    force = np.einsum("snm,snmk->snk", size, loc[:, :, None, :] - loc[:, None, :, :])
    return np.clip(force, -MAX_FORCE, MAX_FORCE)


def integrate(
    loc: np.ndarray, vel: np.ndarray, edges: np.ndarray, steps: int = LENGTH
) -> tuple[np.ndarray, np.ndarray]:
    """EGNN's integrator, vectorised over trajectories: ``loc``, ``vel`` ``(S, n, 3)`` initial states →
    the saved frames ``(S, steps // SAMPLE_FREQ − 1, 3, n)`` of positions and velocities (EGNN's layout)."""
    frames = steps // SAMPLE_FREQ - 1
    count, n, _ = loc.shape
    loc_out = np.zeros((count, frames, 3, n))
    vel_out = np.zeros((count, frames, 3, n))
    x, v = loc.copy(), vel.copy()
    v += DT * forces(x, edges)
    for i in range(1, steps):
        x += DT * v
        if i % SAMPLE_FREQ == 0 and i // SAMPLE_FREQ - 1 < frames:
            loc_out[:, i // SAMPLE_FREQ - 1] = x.transpose(0, 2, 1)
            vel_out[:, i // SAMPLE_FREQ - 1] = v.transpose(0, 2, 1)
        v += DT * forces(x, edges)
    return loc_out, vel_out


def simulate(
    sizes: dict[str, int] | None = None,
    *,
    seed: int = SEED,
    particles: int = 5,
    vel_norm: float = 0.5,
    keep: dict[str, int] | None = None,
    steps: int = LENGTH,
) -> dict[str, ChargedTrajectories]:
    """EGNN's three sets from one ``RandomState(seed)`` stream (see the module docstring).

    ``sizes``: trajectories generated per set (default :data:`GENERATED`); ``keep``: how many of each
    set's first trajectories to integrate and return (default all): the random draws of the others are
    still made, so the validation and test sets are the same whatever the training set keeps.
    """
    sizes = dict(GENERATED if sizes is None else sizes)
    keep = keep or {}
    rng = np.random.RandomState(seed)
    frames = steps // SAMPLE_FREQ - 1
    out = {}
    for name in SETS:
        kept = min(keep.get(name, sizes[name]), sizes[name])
        charges = np.zeros((kept, particles, 1))
        loc = np.zeros((kept, particles, 3))
        vel = np.zeros((kept, particles, 3))
        for index in range(sizes[name]):
            q, x, v = initial_conditions(rng, particles, vel_norm)
            # the observation noise EGNN adds (×0 in its sets) still consumes the stream
            rng.randn(frames, 3, particles)
            rng.randn(frames, 3, particles)
            if index < kept:
                charges[index], loc[index], vel[index] = q, x.T, v.T
        edges = charges @ charges.transpose(0, 2, 1)
        loc_out, vel_out = integrate(loc, vel, edges, steps)
        out[name] = ChargedTrajectories(loc_out, vel_out, edges, charges)
    return out


def egnn_file_names(names: tuple[str, ...] = SETS, particles: int = 5) -> dict[tuple[str, str], str]:
    """``{(set, array): file name}`` of EGNN's files, e.g. ``loc_valid_charged5_initvel1small.npy``."""
    return {(n, a): f"{a}_{FILE_TAGS[n]}{suffix(particles)}.npy" for n in names for a in ARRAYS}


def peer_run_problem(checkout: Path, marker: str, data: Path, out: Path, force: bool) -> str | None:
    """What stops a peer's n-body runner (benchmarks/*_nbody.py), as one line, or None: ``checkout``
    lacks the peer's ``marker`` file, a file of EGNN's layout is missing from ``data``, or
    ``out/metrics.json`` exists and ``force`` is off (a finished run is never overwritten silently)."""
    if not (checkout / marker).is_file():
        return f"{checkout} has no {marker} (a checkout of the peer's repository is needed)"
    missing = [f for f in egnn_file_names().values() if not (data / f).is_file()]
    if missing:
        return f"{data / missing[0]} is missing (EGNN's layout, e.g. geoattn data make nbody-charged)"
    if (out / "metrics.json").exists() and not force:
        return f"{out / 'metrics.json'} exists (--force overwrites)"
    return None


def egnn_paths(directory: str | Path, names: tuple[str, ...] = SETS, particles: int = 5) -> dict:
    """``{(set, array): path}`` of EGNN's files for ``names`` in ``directory``; DataError if any exists."""
    directory = Path(directory)
    paths = {key: directory / name for key, name in egnn_file_names(names, particles).items()}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing:
        raise DataError(f"nbody charged: {existing[0]} exists; choose an empty directory")
    return paths


def save_egnn_format(
    sets: dict[str, ChargedTrajectories], directory: str | Path, particles: int = 5
) -> list[Path]:
    """Write each set as EGNN's four ``.npy`` files into ``directory``; refuses to overwrite files."""
    directory = Path(directory)
    paths = egnn_paths(directory, tuple(sets), particles)
    directory.mkdir(parents=True, exist_ok=True)
    for (name, a), path in paths.items():
        np.save(path, getattr(sets[name], a))
    return list(paths.values())


def load_egnn_format(directory: str | Path, particles: int = 5) -> dict[str, ChargedTrajectories]:
    """Read EGNN's ``.npy`` files (see the module docstring), checking every file's presence and shape."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"nbody charged data directory {str(directory)!r} does not exist")
    files = egnn_file_names(SETS, particles)
    out = {}
    for name in SETS:
        arrays = {}
        for a in ARRAYS:
            path = directory / files[name, a]
            if not path.is_file():
                raise DataError(
                    f"nbody charged data: missing file {str(path)!r} (EGNN's generate_dataset.py)"
                )
            try:
                arrays[a] = np.load(path, allow_pickle=False).astype(np.float64, copy=False)
            except UNREADABLE as err:
                raise DataError(
                    f"nbody charged data: {str(path)!r} is not a readable NumPy array file ({err})"
                ) from None
        loc = arrays["loc"]
        count = loc.shape[0] if loc.ndim else 0
        if loc.ndim and not count:
            raise DataError(
                f"nbody charged data: {files[name, 'loc']} holds no trajectories (shape {loc.shape})"
            )
        expected = {
            "loc": (count, None, 3, particles),
            "vel": loc.shape,
            "edges": (count, particles, particles),
            "charges": (count, particles, 1),
        }
        for a, shape in expected.items():
            got = arrays[a].shape
            if (
                len(got) != len(shape)
                or any(e is not None and e != g for e, g in zip(shape, got))
                or not count
            ):
                want = tuple("frames" if e is None else e for e in shape)
                raise DataError(f"nbody charged data: {files[name, a]} has shape {got}, expected {want}")
        for a in ARRAYS:
            check_finite(directory / files[name, a], {a: arrays[a]}, "nbody charged data")
        out[name] = ChargedTrajectories(**arrays)
    return out


def add_make_charged(kinds) -> None:
    """Add ``geoattn data make nbody-charged``: EGNN's charged-particle files into ``--out``."""
    p = kinds.add_parser(
        "nbody-charged",
        help="EGNN's charged-particle n-body files (its generate_dataset.py, small set)",
        description="Simulate EGNN's charged-particle sets (seed 43: 10,000 / 2,000 / 2,000 trajectories, "
        "49 frames) and write them as EGNN's generate_dataset.py does (loc_/vel_/edges_/charges_*.npy, "
        "suffix _charged5_initvel1small), readable by `--task nbody --data DIR` "
        "and by EGNN's own main_nbody.py. Existing files are never overwritten.",
    )
    p.add_argument("--out", required=True, help="directory to write the twelve .npy files into")
    p.add_argument("--seed", type=int, default=SEED, help=f"the NumPy stream's seed (default {SEED})")
    p.add_argument(
        "--train",
        type=int,
        default=GENERATED["train"],
        help="training trajectories to write (default 10,000 as EGNN; the task reads the first 3,000; "
        "the validation and test sets do not depend on it)",
    )
    p.set_defaults(func=cmd_make_charged)


def cmd_make_charged(args) -> int:
    """Simulate and write the files; print the directory."""
    import time

    if args.train < 1:
        raise DataError(f"--train must be ≥ 1, got {args.train}")
    egnn_paths(args.out)  # before minutes of simulation: nothing a user wrote is overwritten
    start = time.perf_counter()
    sets = simulate(seed=args.seed, keep={"train": args.train})
    sets["train"] = sets["train"].head(args.train)
    save_egnn_format(sets, args.out)
    sizes = ", ".join(f"{name} {len(s):,}" for name, s in sets.items())
    print(f"wrote {args.out}: {sizes} trajectories ({time.perf_counter() - start:.0f} s)")
    return 0
