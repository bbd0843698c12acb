"""Where tasks keep what they download or compute once: :func:`geoattn.core.cache.cache_dir`, the folder
the native builds share (resolved in one place)."""

from __future__ import annotations

from geoattn.core.cache import cache_dir

__all__ = ["cache_dir"]
