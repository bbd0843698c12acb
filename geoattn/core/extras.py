"""Optional dependencies: one place that imports an extra's package or says which extra to install.

``require("transformers", extra="hf", purpose="geoattn.hf")`` returns the module, or raises a
:class:`~geoattn.core.errors.ConfigError` whose one line names the extra (``pip install 'geoattn[hf]'``),
which the command line prints without a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from geoattn.core.errors import ConfigError

EXTRAS = {  # extra -> what it brings
    "hf": "Hugging Face transformers and tokenizers (geoattn.hf, geoattn export)",
    "docs": "MkDocs, mkdocstrings (make docs)",
    "tensorboard": "TensorBoard event files (--logger tensorboard)",
    "molecules": "tblite, ASE, RDKit, MACE, SchNetPack (geoattn data make molecule, geoattn bench molecule)",
    "series": "sktime (bundled sets, the .ts reader), torchcde (the ncde model), pyarrow (Parquet tables)",
    "pointclouds": "h5py (the pointcloud task's ModelNet40 and ScanObjectNN HDF5 files)",
}


def require(module: str, *, extra: str, purpose: str) -> ModuleType:
    """``import module``; ConfigError naming ``geoattn[extra]`` when it is not installed.

    Args:
        module: the importable name (``"transformers"``, ``"tensorboard"``).
        extra: the pyproject extra that installs it (a key of :data:`EXTRAS`).
        purpose: what needs it, for the message (``"geoattn export"``).
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing(module, extra, purpose) from None


def check_installed(module: str, *, extra: str, purpose: str) -> None:
    """:func:`require` without the import: the same ConfigError when ``module`` is not installed, for
    callers that may not need to import it (a cache hit) and should not pay for the import."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
        found = False
    if not found:
        raise _missing(module, extra, purpose)


def _missing(module: str, extra: str, purpose: str) -> ConfigError:
    return ConfigError(f"{purpose} needs the optional package {module!r}: pip install 'geoattn[{extra}]'")
