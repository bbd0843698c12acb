"""The FlexAttention path (`geoattn.attention.rt.flex`, the CUDA row of the dispatch table), compiled
and run on the CPU against the float64 reference.

torch compiles FlexAttention for the CPU, but declines its backward there (``_validate_device``
raises for inputs that require gradients, and inductor has no CPU lowering of the backward). So:

* values and every gradient (q, k, v; the per-head parameters μ_r, σ_t², η_t², β and ``log m²`` and
  the times, all captured by the ``score_mod``; a learned ω and the metric, around it) with the
  ``aot_eager`` backend: Dynamo and AOTAutograd trace the same graph as on a GPU, FlexAttention's
  backward included, and FlexAttention's reference kernels run it (the device check patched out);
* the forward with inductor, as on a GPU but with inductor's CPU code generation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rt import dispatch, flex, rt_attention_qkv
from geoattn.attention.rt.params import Call

F64 = torch.float64


@pytest.fixture
def aot_eager(monkeypatch):
    """FlexAttention compiled with aot_eager, its backward allowed on the CPU."""
    monkeypatch.setattr(flex, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(flex, "_CACHE", {})
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _leaves(b=2, h=2, n=12, d=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, n, 3, h, d, generator=g, dtype=F64)
    qkv[:, :, 1] *= 0.3 + 3 * torch.rand(b, n, 1, 1, generator=g, dtype=F64)  # key magnitudes vary
    leaves = {
        "qkv": qkv,
        "metric": 0.5 + torch.rand(h, d, generator=g, dtype=F64),
        "omega": 0.3 * rope_frequencies(d, h).to(F64),
        "mu_r": torch.tensor([0.05, 0.4]),
        "sigma_t2": torch.tensor([0.1, 0.3]),
        "eta_t2": torch.tensor([0.5, 2.0]),
        "beta": torch.tensor([1.0, 2.5]),
    }
    times = torch.cumsum(0.1 + 1.5 * torch.rand(b, n, generator=g, dtype=F64), -1)
    return {k: v.to(dtype).requires_grad_() for k, v in leaves.items()}, times.to(dtype)


def _call(leaves, times, causal, backend, key_scale=1.3):
    params = tuple(leaves[name] for name in ("mu_r", "sigma_t2", "eta_t2", "beta"))
    qkv, metric, omega = leaves["qkv"], leaves["metric"], leaves["omega"]
    return Call(qkv, metric, key_scale, params, omega, times, causal, True, backend, False)


def _run(path_run, call, leaves):
    out = path_run(call)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out, torch.autograd.grad((out * weights).sum(), list(leaves.values()))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("times", ["default", "irregular"])
def test_compiled_flex_matches_reference(causal, times, aot_eager):
    from geoattn.attention.rt import reference

    leaves, t = _leaves()
    t = None if times == "default" else t
    out, grads = _run(flex.run, _call(leaves, t, causal, "flex"), leaves)
    ref, ref_grads = _run(reference.run, _call(leaves, t, causal, "reference"), leaves)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, g, g_ref in zip(leaves, grads, ref_grads):
        assert g.abs().sum() > 0, name  # every leaf reaches the output
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")


def test_inductor_compiled_flex_forward_matches_reference(monkeypatch):
    """The forward as inductor compiles it (float32: FlexAttention's CPU kernels take no float64)."""
    from geoattn.attention.rt import reference

    monkeypatch.setattr(flex, "_CACHE", {})
    torch._dynamo.reset()
    leaves, t = _leaves(dtype=torch.float32)
    with torch.no_grad():
        out = flex.run(_call(leaves, t, True, "flex"))[0]
        as64 = {k: v.double() for k, v in leaves.items()}
        ref = reference.run(_call(as64, t.double(), True, "reference"))[0]
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)
    torch._dynamo.reset()


def test_a_flex_training_step_reads_no_values(aot_eager, monkeypatch):
    """`rt_attention_qkv` with the FlexAttention row accepting the CPU: forward and backward after the
    first call (which compiles and builds the causal block mask once), with every Python-level way
    of reading a tensor's value (``item``, ``bool``, ``int``, ``float``, ``tolist``, ``numpy``,
    ``torch.equal``) made to raise: on a GPU each of those would synchronise the device. (A dispatch
    mode, as the CPU paths' test uses, would stop Dynamo from compiling FlexAttention.) The compiled
    graph itself cannot hold such a read (Dynamo would have broken the graph there, back into this
    Python). With ``GEOATTN_DEBUG=1`` the value checks do read, and the patch catches them."""
    rows = tuple(p._replace(checks=()) if p.name == "flex" else p for p in dispatch.PATHS)
    monkeypatch.setattr(dispatch, "PATHS", rows)
    leaves, t = _leaves()
    qkv, metric, omega = leaves.pop("qkv"), leaves.pop("metric"), leaves.pop("omega")

    def step():
        out = rt_attention_qkv(qkv, metric=metric, key_scale=1.3, **leaves, omega=omega, backend="flex")
        out.square().sum().backward()

    step()  # compiles; builds the block mask

    def no_sync(*args, **kwargs):
        raise AssertionError("a device sync in the training step")

    for name in ("item", "__bool__", "__int__", "__float__", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    monkeypatch.setattr(torch, "equal", no_sync)
    step()
    monkeypatch.setenv("GEOATTN_DEBUG", "1")
    with pytest.raises(AssertionError, match="a device sync"):
        step()


def test_a_compiled_caller_runs_flex_as_its_own_compiled_call(monkeypatch):
    """A model compiled around `rt_attention` (the trainer's ``--compile``) reaches the flex path as a
    graph break: FlexAttention then compiles on its own, as the CUDA tests verify it, instead of being
    lowered inside the caller's graph (there inductor's flex lowering fails: on the CPU with
    NoValidChoicesError, on an H200 with torch 2.11 too, in `tests/test_cuda.py`). Forward with inductor,
    the flex row made to serve the CPU."""
    from geoattn.attention.rt import rt_attention

    rows = tuple(p._replace(checks=()) if p.name == "flex" else p for p in dispatch.PATHS)
    monkeypatch.setattr(dispatch, "PATHS", rows[:1] + rows[2:])  # reference, flex, chunked
    monkeypatch.setattr(flex, "_CACHE", {})
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 64, 16, generator=g) for _ in range(3))
    mu_r, sigma_t2, eta_t2, beta = (torch.full((2,), x) for x in (0.1, 0.2, 1.0, 1.5))

    def f(q, k, v, backend="auto"):
        params = dict(mu_r=mu_r, sigma_t2=sigma_t2, eta_t2=eta_t2, beta=beta)
        return rt_attention(q, k, v, **params, causal=True, backend=backend)

    with torch.no_grad():
        compiled, eager, chunked = torch.compile(f)(q, k, v), f(q, k, v), f(q, k, v, "chunked")
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, chunked, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
