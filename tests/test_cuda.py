"""The CUDA paths on a CUDA device, against the float64 reference on the CPU.

Skipped where torch sees no CUDA device (CI's machines and the CPU development machines): there the
same code is held to the reference by the CPU tests (`tests/test_rt_flex.py` traces FlexAttention's
forward and backward with ``aot_eager`` and compiles its forward with inductor;
`tests/test_rotor_attention.py` compiles the rotor block kernels). On a GPU these compile with inductor
to Triton kernels, which only a GPU runs: ``pytest tests/test_cuda.py`` there
(`benchmarks/device/cuda_checks.sh` does).
"""

from __future__ import annotations

import pytest
import torch
from test_rt_flex import _call, _leaves

import geoattn.core.compile
from geoattn.algebra.named import named_algebra
from geoattn.attention.rotor import rotor_attention
from geoattn.attention.rt import dispatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")

F64 = torch.float64
CUDA = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _rt_run(leaves, times, causal, backend, device, dtype):
    """Output and every leaf's gradient of one RT call (`test_rt_flex`'s leaves) on ``device`` in
    ``dtype``."""
    leaves = {k: v.detach().to(device, dtype).requires_grad_() for k, v in leaves.items()}
    times = None if times is None else times.to(device, dtype)
    call = _call(leaves, times, causal, backend)
    path = dispatch.choose(call)
    out = path.run(call)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(device, dtype)
    grads = torch.autograd.grad((out * weights).sum(), list(leaves.values()))
    return path.name, out.detach(), grads


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("times", ["default", "irregular"])
def test_flex_on_cuda_matches_reference(causal, times):
    """auto → FlexAttention compiled by inductor on the GPU (300 tokens: blocks of 128 and a partial one),
    float32, values and every gradient against the float64 reference on the CPU."""
    leaves, t = _leaves(b=2, h=2, n=300, d=16)
    t = None if times == "default" else t
    name, out, grads = _rt_run(leaves, t, causal, "auto", CUDA, torch.float32)
    assert name == "flex"
    _, ref, ref_grads = _rt_run(leaves, t, causal, "reference", "cpu", F64)
    assert _rel(out, ref) < 1e-4
    for key, g, g_ref in zip(leaves, grads, ref_grads):
        assert g.abs().sum() > 0, key
        assert _rel(g, g_ref) < 2e-3, key


def test_flex_path_runs_under_a_compiled_caller():
    """A model compiled around `rt_attention` (the trainer's ``--compile``): the same values as the
    uncompiled call. (Failed on the H200 while the flex call was lowered inside the
    caller's graph; flex's `attend` is a graph break since, held on the CPU by
    ``tests/test_rt_flex.py::test_a_compiled_caller_runs_flex_as_its_own_compiled_call``.)"""
    from geoattn.attention.rt import rt_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 64, 16, generator=g).to(CUDA) for _ in range(3))
    mu_r, sigma_t2, eta_t2, beta = (torch.full((2,), x, device=CUDA) for x in (0.1, 0.2, 1.0, 1.5))

    def f(q, k, v):
        return rt_attention(q, k, v, mu_r=mu_r, sigma_t2=sigma_t2, eta_t2=eta_t2, beta=beta, causal=True)

    torch.testing.assert_close(torch.compile(f)(q, k, v), f(q, k, v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_type,aggregation", [("rotation", "sum"), ("reflection", "sum"),
                                                   ("rotation", "compose"), ("frame", "sum")])  # fmt: skip
def test_rotor_attention_on_cuda_matches_cpu(head_type, aggregation, monkeypatch):
    """The rotor kernel's blocks compiled by inductor on the GPU (the size policy lowered so that these
    small blocks compile), float64: values and gradients equal the CPU reference's."""
    monkeypatch.setattr(geoattn.core.compile, "COMPILE_MIN_ELEMENTS", 1)
    ga = named_algebra("cl3")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 40, 2, ga.dim, generator=g, dtype=F64) for _ in range(3))
    results = {}
    for device, backend in ((CUDA, "auto"), ("cpu", "reference")):
        leaves = [x.to(device).requires_grad_() for x in (q, k, v)]
        out = rotor_attention(*leaves, algebra=ga, head_type=head_type, aggregation=aggregation,
                              backend=backend, causal=True, chunk_size=16)  # fmt: skip
        weight = torch.linspace(-1, 1, out.numel(), dtype=F64, device=out.device).view_as(out)
        results[backend] = (out.detach(), torch.autograd.grad((out * weight).sum(), leaves))
    out, grads = results["auto"]
    ref, ref_grads = results["reference"]
    assert out.device.type == "cuda"
    assert _rel(out, ref) < 1e-9
    for grad, ref_grad in zip(grads, ref_grads):
        assert _rel(grad, ref_grad) < 1e-8


def test_nbody_clifford_compiled_step_on_cuda():
    """The step `nbody-clifford-17k` trains: the Clifford model compiled on the GPU gives the eager
    model's loss and gradients (float32)."""
    from geoattn.tasks.nbody import CliffordGNNConfig, NBodyCliffordGNN

    torch.manual_seed(0)
    model = NBodyCliffordGNN(CliffordGNNConfig()).to(CUDA)
    for p in model.read_out.parameters():  # a non-zero read-out, so that every gradient is non-zero
        torch.nn.init.normal_(p, std=0.1)
    x, y = torch.randn(64, 5, 7, device=CUDA), torch.randn(64, 5, 3, device=CUDA)
    results = []
    for fn in (model, torch.compile(model)):
        _, loss = fn(x, y)
        results.append((loss.detach(), torch.autograd.grad(loss, list(model.parameters()))))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-6)
    for g, g_ref in zip(results[1][1], results[0][1]):
        assert _rel(g, g_ref) < 1e-3
