"""``geoattn data make molecule``: build (or find in the cache) an MD17-style data file (:mod:`.data`)."""

from __future__ import annotations

import argparse
import dataclasses

from geoattn.core.settings import describe_settings
from geoattn.tasks.molecule.data import MOLECULES, TrajectorySettings, make_trajectory

DESCRIPTION = (
    "Build an MD17-style file: RDKit geometry, Langevin MD with GFN2-xTB energies and forces, one frame "
    "every --stride steps after --equilibration, cached under the data cache (geoattn data list shows "
    "where). Prints the file's path. Needs the 'molecules' extra."
)


def add_make_molecule(kinds: argparse._SubParsersAction) -> None:
    """Add ``geoattn data make molecule``: one flag per :class:`TrajectorySettings` field."""
    p = kinds.add_parser("molecule", help="Langevin MD with GFN2-xTB forces", description=DESCRIPTION)
    defaults = TrajectorySettings()
    rows = describe_settings(TrajectorySettings, prefix="")
    for field, (_, _, default_text, text) in zip(dataclasses.fields(TrajectorySettings), rows):
        if field.name == "name":
            text = f"one of {', '.join(MOLECULES)}"
        p.add_argument(
            f"--{field.name}",
            type=type(getattr(defaults, field.name)),
            default=getattr(defaults, field.name),
            help=f"{text} (default {default_text})",
        )
    p.add_argument("--force", action="store_true", help="build again even if cached")
    p.set_defaults(func=cmd_make_molecule)


def cmd_make_molecule(args: argparse.Namespace) -> int:
    """Build the file of the flags' settings (unless cached or ``--force``) and print its path."""
    names = [f.name for f in dataclasses.fields(TrajectorySettings)]
    settings = TrajectorySettings(**{name: getattr(args, name) for name in names})
    print(make_trajectory(settings, force=args.force))
    return 0
