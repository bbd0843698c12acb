"""Shared test configuration: where the tinyshakespeare corpus lies.

The corpus is not part of the repository: it lies in ``shared/data`` next to the checkout (as in
CI). ``GEOATTN_CORPUS`` points elsewhere if needed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHAKESPEARE = Path(
    os.environ.get("GEOATTN_CORPUS", Path(__file__).parents[2] / "shared/data/tinyshakespeare.txt")
)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not SHAKESPEARE.is_file():
        raise pytest.UsageError(
            f"the tinyshakespeare corpus is missing at {SHAKESPEARE}: put shared/ next to the checkout "
            "or set GEOATTN_CORPUS"
        )


@pytest.fixture(autouse=True)
def _own_cache_settings(monkeypatch):
    """A user's ``GEOATTN_CACHE`` would take the place of the folders the cache tests set
    (``XDG_CACHE_HOME``, temporary ones): the tests run without it."""
    monkeypatch.delenv("GEOATTN_CACHE", raising=False)


@pytest.fixture(autouse=True)
def _restore_thread_count():
    """The bench commands set torch's thread count for their process (``--threads``); inside the test
    process that would carry over to every later test, whose float32 rounding (and, for a chaotic
    short training run, its outcome) depends on it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_lm_args(max_iters: int, eval_interval: int) -> list[str]:
    """`geoattn train` flags of a tiny character LM on the corpus: 1 layer, 32 wide, block 16, batch 8."""
    flags = "--task lm --model transformer --eval-iters 2 --batch-size 8 --block-size 16"
    flags += " --n-layer 1 --n-head 2 --n-embd 32 --no-plots"
    return [*flags.split(), "--data", str(SHAKESPEARE), "--max-iters", str(max_iters),
            "--eval-interval", str(eval_interval)]  # fmt: skip


def random_o3_versor(ga, n_vectors: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``(dim,)`` product of ``n_vectors`` random Euclidean vectors of ``ga`` (no e0): an O(3) element,
    a reflection when ``n_vectors`` is odd."""
    g = torch.Generator().manual_seed(seed)
    versor = None
    for _ in range(n_vectors):
        coords = torch.zeros(ga.n, dtype=dtype)
        coords[ga.r :] = torch.randn(ga.p, generator=g, dtype=dtype)
        vec = ga.vector(coords)
        versor = vec if versor is None else ga.geometric_product(versor, vec)
    return versor


def fit_one_batch(model, x, y, steps: int, lr: float = 1e-2) -> list[float]:
    """AdamW steps on one fixed batch ``(x, y)`` of a task model; the loss before each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
