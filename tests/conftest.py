"""Shared test configuration: where the tinyshakespeare corpus lies.

The corpus is not part of the repository: it lies in ``shared/data`` next to the checkout (as in
CI). ``GEOATTN_CORPUS`` points elsewhere if needed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHAKESPEARE = Path(
    os.environ.get("GEOATTN_CORPUS", Path(__file__).parents[2] / "shared/data/tinyshakespeare.txt")
)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not SHAKESPEARE.is_file():
        raise pytest.UsageError(
            f"the tinyshakespeare corpus is missing at {SHAKESPEARE}: put shared/ next to the checkout "
            "or set GEOATTN_CORPUS"
        )
