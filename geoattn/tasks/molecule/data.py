"""MD17-style molecular dynamics data built here: RDKit geometry → Langevin MD with GFN2-xTB forces.

MD17 itself cannot be downloaded on these machines, so :func:`build_trajectory` makes the same kind of
data: a 3D geometry from the molecule's SMILES (RDKit ETKDG embedding + MMFF relaxation), Maxwell–
Boltzmann velocities at the target temperature, Langevin dynamics (ASE) with GFN2-xTB energies and
forces (tblite), an equilibration phase that is thrown away, then one frame every ``stride`` steps (so
consecutive frames are decorrelated, "well separated"), each with the energy and forces of its
positions.

File format (``MOLECULE_FORMAT`` = version 1), one ``.npz`` (written with ``numpy.savez``, no pickles):

| key | dtype, shape | meaning |
| --- | --- | --- |
| ``format`` | str | ``"geoattn-molecule"`` |
| ``version`` | int64 | 1 |
| ``name``, ``smiles`` | str | the molecule |
| ``atomic_numbers`` | int64 ``(N,)`` | Z per atom (RDKit order, hydrogens last) |
| ``positions`` | float64 ``(F, N, 3)`` | Å |
| ``energies`` | float64 ``(F,)`` | eV (GFN2-xTB total energy) |
| ``forces`` | float64 ``(F, N, 3)`` | eV/Å, ``−∂E/∂x`` |
| ``settings`` | str | JSON of the :class:`TrajectorySettings` that made the file, plus package versions |

A fixed ``seed`` gives the same file bit for bit on the same machine: the MD runs tblite with one
OpenMP thread (:func:`one_openmp_thread`), because its SCF sums in OpenMP ``critical`` sections, in
whatever order the threads arrive (measured: on a busy machine two builds with two threads differed
within 10 MD steps, and MD amplifies any difference).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from geoattn.core import extras
from geoattn.core.errors import ConfigError, DataError

MOLECULE_FORMAT = "geoattn-molecule"
MOLECULE_VERSION = 1
EXTRA = "molecules"

# MD17's molecules (malonaldehyde as MD17's enol form, the proton-transfer isomer) and water for tests
MOLECULES = {
    "aspirin": "CC(=O)OC1=CC=CC=C1C(=O)O",
    "ethanol": "CCO",
    "malonaldehyde": r"O=C/C=C\O",
    "uracil": "O=C1NC=CC(=O)N1",
    "toluene": "Cc1ccccc1",
    "naphthalene": "c1ccc2ccccc2c1",
    "salicylic_acid": "O=C(O)c1ccccc1O",
    "water": "O",
}


def require(module: str) -> ModuleType:
    """``import module`` of the ``molecules`` extra, or a one-line ConfigError saying how to install it."""
    return extras.require(module, extra=EXTRA, purpose="the molecule task")


def molecule_name(name: str) -> str:
    """The registry key of ``name`` (case, spaces and hyphens ignored: ``"Salicylic acid"`` works)."""
    key = name.strip().lower().replace(" ", "_").replace("-", "_")
    if key not in MOLECULES:
        raise ConfigError(f"unknown molecule {name!r}; known: {', '.join(MOLECULES)}")
    return key


@dataclass
class TrajectorySettings:
    """How :func:`build_trajectory` makes a data set.

    Fields:
        name: a key of ``MOLECULES`` (MD17's seven, and water for tests).
        frames: configurations stored (rMD17's protocol needs ≥ 2000: 1000 train, 1000 val, rest test).
        stride: MD steps between stored frames (decorrelation; 10 steps = 5 fs at the default step).
        equilibration: MD steps run and discarded before the first frame.
        temperature: Langevin thermostat temperature (K); MD17 sampled at 500 K.
        timestep: the MD step (fs).
        friction: Langevin friction (1/fs).
        method: tblite's Hamiltonian (``GFN2-xTB``).
        seed: seeds the RDKit embedding, the initial velocities and the Langevin noise.
    """

    name: str = "aspirin"
    frames: int = 2500
    stride: int = 10
    equilibration: int = 1000
    temperature: float = 500.0
    timestep: float = 0.5
    friction: float = 0.01
    method: str = "GFN2-xTB"
    seed: int = 0

    def __post_init__(self) -> None:
        self.name = molecule_name(self.name)
        for field in ("frames", "stride"):
            if getattr(self, field) < 1:
                raise ConfigError(f"TrajectorySettings.{field} must be ≥ 1, got {getattr(self, field)}")
        if self.equilibration < 0:
            raise ConfigError(f"TrajectorySettings.equilibration must be ≥ 0, got {self.equilibration}")
        if self.temperature <= 0 or self.timestep <= 0 or self.friction < 0:
            raise ConfigError(
                "TrajectorySettings: temperature and timestep must be > 0 and friction ≥ 0, got "
                f"{self.temperature}, {self.timestep}, {self.friction}"
            )

    def filename(self) -> str:
        """The cache file name: every setting that changes the data is in it."""
        return (
            f"{self.name}-{self.method.lower()}-{self.temperature:g}K-dt{self.timestep:g}-fr{self.friction:g}"
            f"-eq{self.equilibration}-s{self.stride}-n{self.frames}-seed{self.seed}-v{MOLECULE_VERSION}.npz"
        )


@dataclass
class Trajectory:
    """A molecule's configurations with their energies and forces (the file's arrays, float64).

    ``atomic_numbers`` ``(N,)``, ``positions`` ``(F, N, 3)`` Å, ``energies`` ``(F,)`` eV, ``forces``
    ``(F, N, 3)`` eV/Å; ``settings`` the JSON-able dict that made it.
    """

    name: str
    smiles: str
    atomic_numbers: np.ndarray
    positions: np.ndarray
    energies: np.ndarray
    forces: np.ndarray
    settings: dict

    def __post_init__(self) -> None:
        n = self.atomic_numbers.shape[0]
        frames = self.energies.shape[0]
        for key, value in (("positions", self.positions), ("forces", self.forces)):
            if value.shape != (frames, n, 3):
                raise DataError(f"molecule data: {key} has shape {value.shape}, expected {(frames, n, 3)}")

    def __len__(self) -> int:
        return self.energies.shape[0]


def initial_geometry(smiles: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Atomic numbers ``(N,)`` and an MMFF-relaxed 3D geometry ``(N, 3)`` Å of ``smiles`` (with hydrogens)."""
    chem = require("rdkit.Chem")
    all_chem = require("rdkit.Chem.AllChem")
    mol = chem.AddHs(chem.MolFromSmiles(smiles))
    if all_chem.EmbedMolecule(mol, randomSeed=seed) != 0:
        raise DataError(f"RDKit could not embed {smiles!r} in 3D (seed {seed})")
    if mol.GetNumAtoms() > 1:
        all_chem.MMFFOptimizeMolecule(mol)
    z = np.array([atom.GetAtomicNum() for atom in mol.GetAtoms()], dtype=np.int64)
    return z, np.asarray(mol.GetConformer().GetPositions(), dtype=np.float64)


@contextlib.contextmanager
def one_openmp_thread() -> Iterator[None]:
    """Run the block with one OpenMP thread in the GNU OpenMP runtime (tblite's on Linux), then restore
    the previous count. The setting is the calling thread's, so other threads are unaffected; where no
    libgomp is found (another platform's runtime) the block runs unchanged."""
    gomp = None
    # by soname first: that is the instance already loaded (torch's or the system's, as tblite found it)
    for name in ("libgomp.so.1", ctypes.util.find_library("gomp")):
        try:
            gomp = ctypes.CDLL(name) if name else None
        except OSError:
            continue
        if gomp is not None:
            break
    if gomp is None:
        yield
        return
    before = gomp.omp_get_max_threads()
    gomp.omp_set_num_threads(1)
    try:
        yield
    finally:
        gomp.omp_set_num_threads(before)


def build_trajectory(settings: TrajectorySettings, *, progress: bool = True) -> Trajectory:
    """Run the MD of ``settings`` and return its frames (see the module docstring)."""
    ase = require("ase")
    require("tblite")
    md_langevin = require("ase.md.langevin")
    velocity = require("ase.md.velocitydistribution")
    constraints = require("ase.constraints")
    tblite_ase = require("tblite.ase")
    from tqdm.auto import tqdm

    smiles = MOLECULES[settings.name]
    z, positions = initial_geometry(smiles, settings.seed)
    atoms = ase.Atoms(numbers=z, positions=positions)
    atoms.calc = tblite_ase.TBLite(method=settings.method, verbosity=0)
    rng = np.random.RandomState(settings.seed)
    # ASE ≥ 3.29 renamed MaxwellBoltzmannDistribution (same draw); older releases have only the old name
    thermalize = getattr(velocity, "thermalize_momenta", None) or velocity.MaxwellBoltzmannDistribution
    thermalize(atoms, temperature_K=settings.temperature, rng=rng)
    fs = ase.units.fs
    # the centre of mass is held by a constraint (ASE's fixcm=True samples NVT only approximately)
    atoms.set_constraint(constraints.FixCom())
    dynamics = md_langevin.Langevin(
        atoms,
        timestep=settings.timestep * fs,
        temperature_K=settings.temperature,
        friction=settings.friction / fs,
        fixcm=False,
        rng=rng,
    )
    n, frames = len(z), settings.frames
    out_positions = np.empty((frames, n, 3))
    out_energies = np.empty(frames)
    out_forces = np.empty((frames, n, 3))
    total = settings.equilibration + frames * settings.stride
    bar = tqdm(total=total, desc=f"MD {settings.name}", unit="step", disable=not progress)
    with bar, one_openmp_thread():  # a deterministic SCF (module docstring)
        if settings.equilibration:
            dynamics.run(settings.equilibration)
            bar.update(settings.equilibration)
        for i in range(frames):
            dynamics.run(settings.stride)
            out_positions[i] = atoms.get_positions()
            out_energies[i] = atoms.get_potential_energy()
            out_forces[i] = atoms.get_forces()
            bar.update(settings.stride)
    record = dataclasses.asdict(settings)
    record["versions"] = {m: _version(m) for m in ("ase", "tblite", "rdkit", "numpy")}
    return Trajectory(settings.name, smiles, z, out_positions, out_energies, out_forces, record)


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a missing version only weakens the record
        return "unknown"


def save_trajectory(trajectory: Trajectory, path: str | Path) -> Path:
    """Write ``trajectory`` in the version-1 format (module docstring); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        format=np.array(MOLECULE_FORMAT),
        version=np.array(MOLECULE_VERSION, dtype=np.int64),
        name=np.array(trajectory.name),
        smiles=np.array(trajectory.smiles),
        atomic_numbers=trajectory.atomic_numbers.astype(np.int64),
        positions=trajectory.positions.astype(np.float64),
        energies=trajectory.energies.astype(np.float64),
        forces=trajectory.forces.astype(np.float64),
        settings=np.array(json.dumps(trajectory.settings, sort_keys=True)),
    )
    tmp.replace(path)  # never leave a half-written file under the final name
    return path


def load_trajectory(path: str | Path) -> Trajectory:
    """Read a file written by :func:`save_trajectory`; DataError if it is missing or not version 1."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"molecule data file {path} does not exist (make it with: geoattn data make molecule)"
        )
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {key: f[key] for key in f.files}
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is not a readable .npz file: {err}") from None
    if str(arrays.get("format", "")) != MOLECULE_FORMAT:
        raise DataError(f"{path} is not a geoattn molecule file (no format={MOLECULE_FORMAT!r} key)")
    if int(arrays["version"]) != MOLECULE_VERSION:
        raise DataError(
            f"{path} has format version {int(arrays['version'])}, this geoattn reads {MOLECULE_VERSION}"
        )
    return Trajectory(
        name=str(arrays["name"]),
        smiles=str(arrays["smiles"]),
        atomic_numbers=arrays["atomic_numbers"],
        positions=arrays["positions"],
        energies=arrays["energies"],
        forces=arrays["forces"],
        settings=json.loads(str(arrays["settings"])),
    )


def cached_trajectory_path(settings: TrajectorySettings) -> Path:
    """Where the data of ``settings`` lives in the cache (``<cache>/molecules/<filename>``)."""
    from geoattn.tasks.lm.datasets import cache_dir

    return cache_dir() / "molecules" / settings.filename()


def make_trajectory(settings: TrajectorySettings, *, force: bool = False, progress: bool = True) -> Path:
    """The cached file of ``settings``, built first if missing (or if ``force``)."""
    path = cached_trajectory_path(settings)
    if force or not path.exists():
        save_trajectory(build_trajectory(settings, progress=progress), path)
    return path


def split_indices(frames: int, n_train: int, n_val: int, seed: int) -> dict[str, np.ndarray]:
    """rMD17-style random split of ``frames`` configurations: ``n_train``, ``n_val``, the rest test.

    DataError if fewer than ``n_train + n_val + 1`` frames exist.
    """
    if n_train < 1 or n_val < 1:
        raise ConfigError(f"n_train and n_val must be ≥ 1, got {n_train}, {n_val}")
    if frames < n_train + n_val + 1:
        raise DataError(
            f"the molecule file has {frames} frames; n_train={n_train} + n_val={n_val} leave no test frames"
        )
    order = np.random.default_rng(seed).permutation(frames)
    return {
        "train": np.sort(order[:n_train]),
        "val": np.sort(order[n_train : n_train + n_val]),
        "test": np.sort(order[n_train + n_val :]),
    }
