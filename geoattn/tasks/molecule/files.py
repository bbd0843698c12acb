"""The molecule files the task reads: one table of formats, one loader, and revised MD17's split files.

| format | told by | units in the file (converted to eV, eV/Å, Å) |
| --- | --- | --- |
| ``geoattn`` | ``.npz``, ``format="geoattn-molecule"`` (``geoattn data make molecule``) | eV, eV/Å, Å |
| ``rmd17`` | ``.npz``, ``nuclear_charges, coords, energies, forces`` (rMD17) | kcal/mol, kcal/mol/Å, Å |
| ``sgdml`` | ``.npz``, ``z, R, E, F`` (sGDML's; the original MD17) | ``e_unit``, ``r_unit`` (kcal/mol, Å) |
| ``extxyz`` | ``.xyz``, ``.extxyz`` (ASE's extended XYZ: MACE, NequIP, SchNetPack) | eV, eV/Å, Å |

Every file holds one molecule: the same atoms, in the same order, in every frame. Each reader checks
shapes, finiteness and atomic numbers and raises :class:`~geoattn.core.errors.DataError` in one line naming
the file. The energy conversions use ASE's constants (``ase.units.kcal / ase.units.mol``), and the
returned :class:`~geoattn.tasks.molecule.data.Trajectory`'s ``settings`` record the source format, its
units and the factors applied (the run's ``config.json`` keeps them in the task's meta).

Splits by index files follow revised MD17's layout: ``DIR/index_train_0N.csv`` and
``DIR/index_test_0N.csv``, one frame index (0-based) per line (:func:`index_splits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geoattn.core.errors import DataError
from geoattn.tasks.lm.datasets import sha256_of
from geoattn.tasks.molecule.data import Trajectory, load_trajectory, require

EXTXYZ_SUFFIXES = (".xyz", ".extxyz")


@dataclass(frozen=True)
class Keys:
    """Where an extended XYZ frame keeps its labels: ``energy`` in ``atoms.info`` (or the attached
    calculator's results), ``forces`` in ``atoms.arrays`` (or the calculator's)."""

    energy: str = "energy"
    forces: str = "forces"


@dataclass(frozen=True)
class MoleculeFormat:
    """One row of :data:`FORMATS`: a kind of file the task reads.

    suffixes: the file name endings it has.
    markers: ``.npz`` keys that tell it from the other ``.npz`` formats (any one of them); empty for
        a format told by its suffix alone.
    required: the keys it must hold (``.npz``).
    read: ``read(path, keys) -> Trajectory`` (energies eV, forces eV/Å, positions Å).
    description: what it is, for messages.
    """

    suffixes: tuple[str, ...]
    markers: frozenset[str]
    required: tuple[str, ...]
    read: Callable[[Path, Keys], Trajectory]
    description: str


# ------------------------------------------------------------------------------------- units ----
def energy_units() -> dict[str, float]:
    """eV per unit of each energy unit name sGDML writes (lower case)."""
    units = require("ase.units")
    kcal_mol, kj_mol = units.kcal / units.mol, units.kJ / units.mol
    return {"kcal/mol": kcal_mol, "kj/mol": kj_mol, "ev": 1.0, "ha": units.Hartree, "hartree": units.Hartree,
            "au": units.Hartree}  # fmt: skip


def length_units() -> dict[str, float]:
    """Å per unit of each length unit name sGDML writes (lower case)."""
    units = require("ase.units")
    return {"ang": 1.0, "angstrom": 1.0, "å": 1.0, "bohr": units.Bohr, "au": units.Bohr,
            "nm": 10.0, "pm": 0.01}  # fmt: skip


def _unit(path: Path, table: dict[str, float], name: str, key: str) -> float:
    factor = table.get(name.strip().lower())
    if factor is None:
        raise DataError(f"{path}: unknown {key} {name!r}; known: {', '.join(table)}")
    return factor


# ------------------------------------------------------------------------------------ checks ----
@dataclass(frozen=True)
class Labels:
    """What a file calls its arrays (for messages) and the factors to Å, eV and eV/Å."""

    numbers: str = "atomic numbers"
    positions: str = "positions"
    energies: str = "energies"
    forces: str = "forces"
    to_angstrom: float = 1.0
    to_ev: float = 1.0

    @property
    def to_ev_per_angstrom(self) -> float:
        """The factor from the file's force unit to eV/Å."""
        return self.to_ev / self.to_angstrom


def checked_trajectory(
    path: Path,
    numbers: np.ndarray,
    positions: np.ndarray,
    energies: np.ndarray,
    forces: np.ndarray,
    source: dict,
    labels: Labels = Labels(),
    name: str | None = None,
) -> Trajectory:
    """A :class:`Trajectory` of the file's arrays in its units (``labels``: converted to Å, eV, eV/Å)
    after checking what the task needs: ``numbers`` ``(N,)`` integers 1..118, ``positions`` and
    ``forces`` ``(F, N, 3)``, ``energies`` ``(F,)`` (or ``(F, 1)``, as sGDML writes), F ≥ 1, all finite
    numbers; DataError naming ``path`` and the file's own name of the array."""
    numbers = np.asarray(numbers)
    if numbers.ndim != 1 or numbers.shape[0] == 0:
        raise DataError(f"{path}: {labels.numbers} have shape {numbers.shape}, expected (atoms,)")
    if not np.issubdtype(numbers.dtype, np.number) or (numbers != np.round(numbers)).any():
        raise DataError(f"{path}: {labels.numbers} must be integers, got {numbers[:5]}")
    numbers = numbers.astype(np.int64)
    if numbers.min() < 1 or numbers.max() > 118:
        raise DataError(f"{path}: {labels.numbers} must be 1..118, got {sorted(set(numbers.tolist()))}")
    arrays = {}
    for key, value, factor in (
        (labels.energies, energies, labels.to_ev),
        (labels.positions, positions, labels.to_angstrom),
        (labels.forces, forces, labels.to_ev_per_angstrom),
    ):
        try:
            arrays[key] = np.asarray(value, dtype=np.float64) * factor
        except (TypeError, ValueError):
            raise DataError(f"{path}: {key} are not numbers (dtype {np.asarray(value).dtype})") from None
    energies = arrays[labels.energies]
    if energies.ndim == 2 and energies.shape[1] == 1:
        energies = arrays[labels.energies] = energies[:, 0]
    if energies.ndim != 1 or energies.shape[0] == 0:
        raise DataError(
            f"{path}: {labels.energies} have shape {energies.shape}, expected (frames,) with frames ≥ 1"
        )
    n, frames = numbers.shape[0], energies.shape[0]
    for key in (labels.positions, labels.forces):
        if arrays[key].shape != (frames, n, 3):
            raise DataError(
                f"{path}: {key} have shape {arrays[key].shape}, expected (frames, atoms, 3) = "
                f"{(frames, n, 3)}"
            )
    for key, value in arrays.items():
        bad = ~np.isfinite(value.reshape(frames, -1)).all(axis=1)
        if bad.any():
            raise DataError(
                f"{path}: {key} of {int(bad.sum())} frame(s) are NaN or infinite "
                f"(first: frame {int(bad.argmax())})"
            )
    settings = {**source, "file": str(path), "sha256": sha256_of(path)}
    positions, forces = arrays[labels.positions], arrays[labels.forces]
    return Trajectory(name or path.stem, "", numbers, positions, energies, forces, settings)


def _npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            return {key: f[key] for key in f.files}
    except Exception as err:  # a truncated zip fails in many ways (BadZipFile, EOFError, ValueError)
        raise DataError(f"{path} is not a readable .npz file ({type(err).__name__}: {err})") from None


def _text(value: np.ndarray) -> str:
    return str(value.item() if value.shape == () else value.reshape(-1)[0])


# ----------------------------------------------------------------------------------- readers ----
def read_geoattn(path: Path, keys: Keys) -> Trajectory:
    """The file ``geoattn data make molecule`` writes (eV, eV/Å, Å)."""
    t = load_trajectory(path)
    source = {"format": "geoattn", "units": "eV, eV/Å, Å (no conversion)"}
    checked = checked_trajectory(
        path, t.atomic_numbers, t.positions, t.energies, t.forces, source, name=t.name
    )
    checked.smiles, checked.settings = t.smiles, {**t.settings, **checked.settings}
    return checked


def read_rmd17(path: Path, keys: Keys) -> Trajectory:
    """Revised MD17: ``nuclear_charges (N,)``, ``coords (F, N, 3)`` Å, ``energies (F,)`` kcal/mol,
    ``forces (F, N, 3)`` kcal/mol/Å."""
    f = _npz(path)
    to_ev = energy_units()["kcal/mol"]
    source = {
        "format": "rmd17",
        "units": "kcal/mol, kcal/mol/Å, Å",
        "conversion": f"energies and forces × {to_ev!r} eV per kcal/mol (ase.units.kcal / ase.units.mol)",
    }
    labels = Labels("nuclear_charges", "coords", "energies", "forces", to_ev=to_ev)
    return checked_trajectory(
        path, f["nuclear_charges"], f["coords"], f["energies"], f["forces"], source, labels
    )


def read_sgdml(path: Path, keys: Keys) -> Trajectory:
    """sGDML's files (the original MD17's too): ``z (N,)``, ``R (F, N, 3)``, ``E (F, 1)``, ``F (F, N,
    3)`` in ``e_unit`` and ``r_unit`` (default kcal/mol and Å); a periodic file (``lattice``) is refused."""
    f = _npz(path)
    if "lattice" in f:
        raise DataError(f"{path} is periodic (it has a 'lattice'); the task reads isolated molecules")
    e_unit = _text(f["e_unit"]) if "e_unit" in f else "kcal/mol"
    r_unit = _text(f["r_unit"]) if "r_unit" in f else "Ang"
    to_ev = _unit(path, energy_units(), e_unit, "e_unit")
    to_ang = _unit(path, length_units(), r_unit, "r_unit")
    source = {
        "format": "sgdml",
        "units": f"{e_unit}, {e_unit}/{r_unit}, {r_unit}",
        "conversion": f"energies × {to_ev!r} eV per {e_unit}, positions × {to_ang!r} Å per {r_unit}, "
        f"forces × {to_ev / to_ang!r} (ase.units)",
    }
    labels = Labels("z", "R", "E", "F", to_angstrom=to_ang, to_ev=to_ev)
    name = _text(f["name"]) if "name" in f else None
    return checked_trajectory(path, f["z"], f["R"], f["E"], f["F"], source, labels, name)


def read_extxyz(path: Path, keys: Keys) -> Trajectory:
    """ASE's extended XYZ (``ase.io.read(path, index=":")``): energies (eV) under ``keys.energy`` in each
    frame's ``info`` or its calculator's results, forces (eV/Å) under ``keys.forces`` in its ``arrays``
    or its calculator's."""
    ase_io = require("ase.io")
    try:
        frames = ase_io.read(path, index=":", format="extxyz")
    except Exception as err:  # ASE's parser fails in many ways on a truncated or foreign file
        raise DataError(f"{path} is not a readable extended XYZ file ({type(err).__name__}: {err})") from None
    if not frames:
        raise DataError(f"{path} holds no frames")
    numbers = frames[0].numbers
    energies, forces = [], []
    for i, atoms in enumerate(frames):
        if not np.array_equal(atoms.numbers, numbers):
            raise DataError(
                f"{path}: frame {i} has atoms {atoms.get_chemical_formula()} where frame 0 has "
                f"{frames[0].get_chemical_formula()} (in that order); the task reads one molecule per file"
            )
        if atoms.pbc.any():
            raise DataError(
                f"{path}: frame {i} is periodic (pbc={atoms.pbc.tolist()}); the task reads molecules"
            )
        energies.append(_label(path, i, atoms, keys.energy, atoms.info, "energy", "task.energy_key"))
        forces.append(_label(path, i, atoms, keys.forces, atoms.arrays, "forces", "task.forces_key"))
    source = {"format": "extxyz", "units": "eV, eV/Å, Å (no conversion)", "energy_key": keys.energy,
              "forces_key": keys.forces}  # fmt: skip
    positions = np.stack([atoms.positions for atoms in frames])
    labels = Labels(energies=repr(keys.energy), forces=repr(keys.forces))
    return checked_trajectory(path, numbers, positions, energies, forces, source, labels)


def _label(path: Path, i: int, atoms, key: str, table: dict, what: str, setting: str):
    """Frame ``i``'s label ``key``: from ``table`` (``info`` / ``arrays``), else the calculator's results."""
    if key in table:
        return table[key]
    results = atoms.calc.results if atoms.calc is not None else {}
    if key in results:
        return results[key]
    found = sorted((set(table) - {"numbers", "positions"}) | set(results))
    raise DataError(
        f"{path}: frame {i} has no {what} {key!r} (it has {', '.join(found) or 'no labels'}; set {setting})"
    )


FORMATS: dict[str, MoleculeFormat] = {
    "geoattn": MoleculeFormat(
        (".npz",), frozenset({"format"}), ("format", "version", "atomic_numbers", "positions", "energies",
        "forces"), read_geoattn, "geoattn's molecule file (geoattn data make molecule)",
    ),
    "rmd17": MoleculeFormat(
        (".npz",), frozenset({"nuclear_charges", "coords"}), ("nuclear_charges", "coords", "energies",
        "forces"), read_rmd17, "revised MD17",
    ),
    "sgdml": MoleculeFormat(
        (".npz",), frozenset({"z", "R"}), ("z", "R", "E", "F"), read_sgdml, "sGDML's / MD17's .npz",
    ),
    "extxyz": MoleculeFormat(EXTXYZ_SUFFIXES, frozenset(), (), read_extxyz, "extended XYZ"),
}  # fmt: skip


def file_format(path: Path) -> str:
    """The key of ``FORMATS`` that reads ``path``: by its suffix, then (``.npz``) by its keys;
    DataError when none does or the file lacks one of its format's keys."""
    suffix = path.suffix.lower()
    rows = {name: row for name, row in FORMATS.items() if suffix in row.suffixes}
    if not rows:
        suffixes = sorted({s for row in FORMATS.values() for s in row.suffixes})
        raise DataError(
            f"{path}: the molecule task reads {', '.join(suffixes)} files, not {suffix or 'no suffix'!r}"
        )
    if not any(row.markers for row in rows.values()):
        return next(iter(rows))
    try:
        with np.load(path, allow_pickle=False) as f:
            files = set(f.files)
    except Exception as err:
        raise DataError(f"{path} is not a readable .npz file ({type(err).__name__}: {err})") from None
    for name, row in rows.items():
        if row.markers & files:
            missing = [k for k in row.required if k not in files]
            if missing:
                raise DataError(
                    f"{path} looks like {row.description} but has no {', '.join(map(repr, missing))} "
                    f"(it has {', '.join(sorted(files))})"
                )
            return name
    expected = "; ".join(f"{row.description}: {', '.join(row.required)}" for row in rows.values())
    raise DataError(f"{path} has keys {', '.join(sorted(files))}; expected one of ({expected})")


def read_molecule_file(path: str | Path, keys: Keys = Keys()) -> Trajectory:
    """The frames of any file in :data:`FORMATS` (energies eV, forces eV/Å, positions Å); DataError
    in one line for a missing, unknown or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"molecule data file {path} does not exist (make one with: geoattn data make molecule)"
        )
    return FORMATS[file_format(path)].read(path, keys)


# ----------------------------------------------------------------------------------- splits ----
def index_file(splits_dir: Path, part: str, number: int) -> Path:
    """revised MD17's ``index_{part}_0N.csv`` in ``splits_dir``."""
    return Path(splits_dir) / f"index_{part}_{number:02d}.csv"


def read_index_file(path: Path, frames: int, data: Path | str) -> np.ndarray:
    """The frame indices of ``path`` (one integer per line) ``(K,)``; DataError for a missing or empty
    file, a line that is not an integer, a repeated index or one past the end of ``data``'s ``frames``."""
    if not path.is_file():
        raise DataError(f"split file {path} does not exist (task.splits_dir holds index_train_0N.csv files)")
    values = []
    for line_number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text:
            continue
        try:
            values.append(int(text))
        except ValueError:
            raise DataError(f"{path}: line {line_number} is {text!r}, not a frame index") from None
    indices = np.array(values, dtype=np.int64)
    if indices.size == 0:
        raise DataError(f"{path} lists no frames")
    outside = (indices < 0) | (indices >= frames)
    if outside.any():
        raise DataError(
            f"{path}: index {int(indices[outside][0])} is outside {data}'s {frames} frames (0..{frames - 1})"
        )
    if np.unique(indices).size != indices.size:
        raise DataError(f"{path} lists a frame more than once")
    return indices


def index_splits(
    splits_dir: Path,
    number: int,
    frames: int,
    data: Path | str,
    *,
    n_train: int | None,
    n_val: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """Train / val / test frame indices from revised MD17's split files: test is ``index_test_0N.csv``;
    ``n_val`` frames drawn (``seed``) out of ``index_train_0N.csv`` are val, its other frames (or
    ``n_train`` of them) train. DataError when train and test share a frame or a split is empty."""
    train_file, test_file = index_file(splits_dir, "train", number), index_file(splits_dir, "test", number)
    pool = read_index_file(train_file, frames, data)
    test = read_index_file(test_file, frames, data)
    shared = np.intersect1d(pool, test)
    if shared.size:
        raise DataError(
            f"{train_file} and {test_file} share {shared.size} frame(s) (first: {int(shared[0])})"
        )
    order = np.random.default_rng(seed).permutation(pool)
    rest = order[n_val:]
    if n_train is not None and n_train > rest.size:
        raise DataError(
            f"{train_file} has {pool.size} frames: n_val={n_val} leaves {rest.size}, "
            f"fewer than n_train={n_train}"
        )
    train = rest[:n_train] if n_train is not None else rest
    if train.size == 0:
        raise DataError(f"{train_file} has {pool.size} frames: n_val={n_val} leaves none to train on")
    return {"train": np.sort(train), "val": np.sort(order[:n_val]), "test": np.sort(test)}
