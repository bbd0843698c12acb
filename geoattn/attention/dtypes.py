"""Numerical precision policy shared by the attention kernels."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

Kernel = TypeVar("Kernel", bound=Callable[..., object])


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes in: float32 for half-precision inputs, else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def outside_autocast(kernel: Kernel) -> Kernel:
    """Run ``kernel(q, ...)`` with autocast disabled on ``q``'s device.

    The kernels cancel large terms (``β κ (⟨q̂, k̂⟩ − 1)``, ``|q − E R k|²``, ``1 ± ⟨a, b⟩``) and compute
    in :func:`work_dtype` for that reason; an enclosing ``torch.autocast`` would otherwise re-cast their
    matmuls and SDPA calls to bf16 and undo it. Outputs keep the input dtype. Outside autocast the
    kernel is called as it is: a disabled-autocast region in a compiled graph costs nothing at run time
    but makes torch.compile's autograd cache skip the whole graph (it re-traces on every start).
    """

    @functools.wraps(kernel)
    def wrapper(q: Tensor, *args, **kwargs):
        if not isinstance(q, Tensor) or not torch.is_autocast_enabled(q.device.type):
            return kernel(q, *args, **kwargs)  # (not a tensor: the kernel's own validation names it)
        with torch.autocast(q.device.type, enabled=False):
            return kernel(q, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
