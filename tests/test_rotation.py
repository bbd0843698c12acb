"""`rotate_pairs`: every path (the eager complex view, the strided-halves fallback, the compiled
form) against the pair formula written out, values and gradients."""

from __future__ import annotations

import pytest
import torch

from geoattn.algebra.rotation import rotate_pairs


def pair_formula(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    c, s = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((c * x0 - s * x1, s * x0 + c * x1), dim=-1).flatten(-2)


def inputs(layout: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if layout == "contiguous":
        x = torch.randn(3, 4, 10, 16, generator=g, dtype=dtype)
    elif layout == "heads view":  # q of a fused qkv projection: (B, T, 3, H, D) → (B, H, T, D)
        x = torch.randn(3, 10, 3, 4, 16, generator=g, dtype=dtype).select(2, 1).transpose(1, 2)
    else:  # an odd storage offset: no complex view, the fallback runs
        x = torch.randn(3 * 4 * 10 * 16 + 1, generator=g, dtype=dtype)[1:].view(3, 4, 10, 16)
    return x.requires_grad_()


@pytest.mark.parametrize("layout", ["contiguous", "heads view", "odd offset"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_eager_paths_equal_the_pair_formula(layout, dtype):
    x = inputs(layout, dtype)
    angle = torch.randn(1, 4, 10, 8, dtype=torch.float64) * 50  # large angles: cos in float64 first
    got, want = rotate_pairs(x, angle), pair_formula(x, angle)
    grad = torch.randn_like(want)
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 0, "rtol": 1e-6}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(
        torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0], **tol
    )


def test_compiled_form_equals_the_eager_one():
    x = inputs("heads view", torch.float32)
    angle = torch.randn(1, 4, 10, 8)
    compiled = torch.compile(rotate_pairs, fullgraph=True)
    torch.testing.assert_close(compiled(x, angle), rotate_pairs(x, angle), atol=1e-6, rtol=1e-6)
