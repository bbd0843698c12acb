"""The n-body task's file layouts, one row each, told apart by the files in a folder: GATr's
``{set}.npz`` (the gravity system, :func:`~.simulator.load_gatr_format`) and EGNN's ``.npy`` arrays
(the charged system, :func:`~.charged.load_egnn_format`).

``task.system`` need not be set when ``--data DIR`` holds one layout: :func:`system_of` reads it from
the folder. A user's ``task.system`` that the folder contradicts, a folder of neither layout or of both
(with no ``task.system``), or EGNN's files for another particle count are one :class:`DataError` line
naming both layouts and the option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from geoattn.core.errors import DataError
from geoattn.tasks.nbody import charged
from geoattn.tasks.nbody.simulator import SETS


@dataclass(frozen=True)
class Layout:
    """One file layout of the task: whose files (``owner``), their names (``names``, as a user reads
    them) and ``pattern``, the file names that are this layout's (any one of them marks a folder)."""

    owner: str
    names: str
    pattern: re.Pattern[str]

    def holds(self, paths: list[Path]) -> list[Path]:
        """The files of ``paths`` that are this layout's."""
        return [p for p in paths if self.pattern.fullmatch(p.name)]


# EGNN's file names for any particle count: loc_train_charged5_initvel1small.npy -> 5 (group 3)
_EGNN_NAME = re.compile(
    rf"({'|'.join(charged.ARRAYS)})_({'|'.join(charged.FILE_TAGS.values())})_charged(\d+)_initvel1small\.npy"
)

# task.system -> the layout of its files
LAYOUTS: dict[str, Layout] = {
    "gravity": Layout(
        "GATr's gravity files", ", ".join(f"{s}.npz" for s in SETS), re.compile(rf"({'|'.join(SETS)})\.npz")
    ),
    "charged": Layout(
        "EGNN's charged files",
        "{loc,vel,edges,charges}_{train,valid,test}_charged5_initvel1small.npy",
        _EGNN_NAME,
    ),
}


def _both() -> str:
    return " nor ".join(
        f"{layout.owner} ({layout.names}; task.system={system})" for system, layout in LAYOUTS.items()
    )


def system_of(directory: str | Path, system: str | None = None, particles: int = 5) -> str:
    """The system whose files ``directory`` holds: ``system`` (the user's ``task.system``, None when
    unset) checked against the folder's layout, or read from it; DataError (one line) when the folder
    does not exist, holds neither layout, holds both and ``system`` is unset, contradicts ``system``,
    or holds EGNN's files for another particle count than ``particles``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"nbody data directory {str(directory)!r} does not exist")
    paths = sorted(p for p in directory.iterdir() if p.is_file())
    found = {name: layout.holds(paths) for name, layout in LAYOUTS.items()}
    present = [name for name, files in found.items() if files]
    if not present:
        raise DataError(f"nbody data: {directory} holds neither {_both()}")
    if system is None and len(present) > 1:
        raise DataError(
            f"nbody data: {directory} holds both {' and '.join(LAYOUTS[n].owner for n in present)}: "
            f"set task.system to {' or '.join(present)}"
        )
    if system is not None and system not in present:
        (other,) = present
        raise DataError(
            f"nbody data: {directory} holds {LAYOUTS[other].owner} ({found[other][0].name}), but "
            f"task.system={system} reads {LAYOUTS[system].owner} ({LAYOUTS[system].names}): "
            f"set task.system={other} or leave it unset"
        )
    system = system or present[0]
    if system == "charged":
        counts = sorted({int(_EGNN_NAME.fullmatch(p.name).group(3)) for p in found["charged"]})
        if particles not in counts:
            raise DataError(
                f"nbody data: {directory} holds EGNN's files for {', '.join(map(str, counts))} particles "
                f"({found['charged'][0].name}), task.particles={particles}: set task.particles={counts[0]}"
            )
    return system
