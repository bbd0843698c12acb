"""The one switch of the attention kernels' value checks (``GEOATTN_DEBUG=1``).

A check of a tensor's values (a parameter's sign, a declared structure) reads it, which on a GPU
synchronises the device and inside a compiled graph breaks it: every kernel runs such checks only
where `value_checks` says so. Shape and type checks always run.
"""

from __future__ import annotations

import os

import torch

DEBUG_ENV = "GEOATTN_DEBUG"


def value_checks() -> bool:
    """Whether the value checks run: ``GEOATTN_DEBUG=1`` and not inside a compiled graph."""
    if torch.compiler.is_compiling():
        return False
    return os.environ.get(DEBUG_ENV, "0").strip().lower() in ("1", "true", "yes")
