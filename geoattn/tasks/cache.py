"""Where tasks keep what they download or compute once: ``$XDG_CACHE_HOME/geoattn``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/geoattn``, or ``~/.cache/geoattn`` when the variable is unset or empty."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "geoattn"
