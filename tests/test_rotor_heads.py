"""A new rotor head type is one registry entry plus its kernel: an "identity" head, o_i = Σ_j α_ij v_j,
registered here and run by the functional kernel, the layer and a model config, with no library edit."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_o3_versor

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.rotor import HEADS, HeadType, register_head_type, rotor_attention, unregister_head_type
from geoattn.attention.rotor.reference import pairwise
from geoattn.layers.rotor_block import RotorAttention
from geoattn.models.rotor_lm import RotorLMConfig
from geoattn.training.config import parse_set
from geoattn.training.recipes import build_config
from geoattn.training.trainer import run_model, run_task

CL3 = CliffordAlgebra(3)


def identity_kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
    """``o_i = Σ_j α_ij v_j``: the rotor weights, values unmoved. q, k ``(B, H, N, C, dim)``,
    v ``(B, H, N, Cv, dim)`` → ``(B, H, N, Cv, dim)``."""
    B, H, N, C, dim = q.shape
    logits = algebra.scalar_product(algebra.reverse(q)[:, :, :, None], k[:, :, None]).sum(-1)
    logits = logits / math.sqrt(C * dim)  # (B, H, N, N)
    allowed = torch.ones(N, N, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    alpha = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bhjcd->bhicd", alpha, v)


@pytest.fixture
def identity_head():
    register_head_type(HeadType("identity", identity_kernel))
    yield "identity"
    unregister_head_type("identity")


def test_a_registered_head_type_runs_everywhere(identity_head):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, 5, c, 8, dtype=torch.float64) for c in (3, 3, 2))
    expected = identity_kernel(q, k, v, CL3, causal=True, inverse=False, key_mask=None, chunk_size=None)
    for backend in ("auto", "reference"):
        out = rotor_attention(q, k, v, algebra=CL3, head_type=identity_head, causal=True, backend=backend)
        torch.testing.assert_close(out, expected)
    # beside a built-in head in one layer: its head gives the identity head's sum, and the layer
    # stays equivariant (α is invariant, v moves with the frame)
    layer = RotorAttention(CL3, 4, [identity_head, "rotation"], head_channels=2).double()
    qh, kh, vh = (torch.randn(3, 2, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    heads = layer._heads([(t[:, :1] for t in (qh, kh, vh)), (t[:, 1:] for t in (qh, kh, vh))], None)
    none = dict(causal=False, inverse=False, key_mask=None, chunk_size=None)
    torch.testing.assert_close(heads[:, :1], identity_kernel(qh[:, :1], kh[:, :1], vh[:, :1], CL3, **none))
    x = torch.randn(3, 6, 4, 8, dtype=torch.float64)
    g = random_o3_versor(CL3, 2, torch.float64, seed=1)
    y, _ = layer(x)
    y_moved, _ = layer(CL3.sandwich(g, x))
    torch.testing.assert_close(y_moved, CL3.sandwich(g, y), atol=1e-10, rtol=1e-10)
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert RotorLMConfig(head_types=(identity_head, "rotation")).head_types == ("identity", "rotation")
    with pytest.raises(ValueError, match="inverse=True applies to .*not 'identity'"):
        rotor_attention(q, k, v, algebra=CL3, head_type=identity_head, inverse=True)


def _unmoved(q, k, v, algebra, inverse):
    """The scalar head's pair transform for the reference: key j's value as every query receives it,
    unmoved, per block of pairs ``(B, H, qb, kb, Cv, dim)``."""

    def block(s, e, t, u):
        return v[:, :, None, t:u].expand(-1, -1, e - s, -1, -1, -1)

    return block


@pytest.fixture
def scalar_head():
    """A head type defined wholly here: its fast kernel (the identity kernel above) and its reference
    (the library's pairwise oracle around its pair transform); no library file changes."""
    register_head_type(HeadType("scalar", identity_kernel, pairwise(_unmoved)))
    yield "scalar"
    unregister_head_type("scalar")


def test_a_head_registered_here_runs_forward_and_backward_against_its_reference(scalar_head):
    """Both rows of the rotor dispatch table run the registered head: the fast kernel against the
    reference (its α from the algebra engine's products), values and the gradients of q, k and v."""
    assert HEADS[scalar_head].kernels("sum") == (identity_kernel, HEADS[scalar_head].reference)
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, c, 8, dtype=torch.float64, requires_grad=True) for c in (2, 2, 3))
    mask = torch.tensor([[True, True, False, True, True, True], [True] * 6])
    outs, grads = {}, {}
    for backend in ("auto", "reference", "fast"):
        out = rotor_attention(q, k, v, algebra=CL3, head_type=scalar_head, causal=True, key_mask=mask,
                              backend=backend)  # fmt: skip
        outs[backend] = out
        grads[backend] = torch.autograd.grad(
            (out * torch.linspace(-1, 1, 8, dtype=out.dtype)).sum(), (q, k, v)
        )
    for backend in ("auto", "fast"):
        torch.testing.assert_close(outs[backend], outs["reference"], rtol=1e-12, atol=1e-12)
        for g, g_ref in zip(grads[backend], grads["reference"]):
            torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    assert grads["auto"][1].abs().sum() > 0  # the weights depend on k: its gradient is not vacuous


@pytest.mark.parametrize("task", ["pointcloud", "nbody"])
def test_head_types_from_a_comma_string_in_every_rotor_config(task):
    """``--set model.head_types=frame,projection`` reads as two heads in the point and n-body rotor
    models too (not as the characters of the string), and an unknown one is named."""
    sets = ["model.head_types=frame, projection", "model.head_channels=2"]
    config = build_config({"task": task, "model": "rotor", "n_layer": 1, "n_embd": 32}, parse_set(sets))
    model = run_model(run_task(config), config)
    assert model.config.head_types == ("frame", "projection")
    bad = build_config({"task": task, "model": "rotor"}, parse_set(["model.head_types=frame,spin"]))
    with pytest.raises(ValueError, match="'spin'"):
        run_model(run_task(bad), bad)
