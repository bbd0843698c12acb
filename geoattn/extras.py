"""Optional dependencies: one place that imports an extra's package or says which extra to install.

``require("transformers", extra="hf", purpose="geoattn.hf")`` returns the module, or raises a
:class:`~geoattn.errors.ConfigError` whose one line names the extra (``pip install 'geoattn[hf]'``),
which the command line prints without a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from geoattn.errors import ConfigError

EXTRAS = {  # extra -> what it brings
    "hf": "Hugging Face transformers and tokenizers (geoattn.hf, geoattn export)",
    "docs": "MkDocs, mkdocstrings (make docs)",
    "tensorboard": "TensorBoard event files (--logger tensorboard)",
    "molecules": "tblite, ASE, RDKit, MACE, SchNetPack (geoattn data make molecule, geoattn bench molecule)",
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
        raise ConfigError(
            f"{purpose} needs the optional package {module!r}: pip install 'geoattn[{extra}]'"
        ) from None
