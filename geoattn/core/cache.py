"""The one cache folder of geoattn: downloads, computed data and native builds all live under it.

It sits at the bottom of the package (no geoattn imports) so that `geoattn.native` and the tasks both
resolve the folder here.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "GEOATTN_CACHE"


def cache_dir() -> Path:
    """``$GEOATTN_CACHE`` if set, else ``$XDG_CACHE_HOME/geoattn``, else ``~/.cache/geoattn``.

    A relative ``XDG_CACHE_HOME`` is ignored, as the XDG base-directory spec says.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "geoattn"
