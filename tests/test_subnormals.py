"""Subnormal floats: flushed by the geoattn program in every thread, kept by the library and on request."""

import os
import subprocess
import sys

import pytest
import torch

import geoattn.core.subnormals as subnormals
from geoattn.attention import rt_attention
from geoattn.attention.rt import dispatch
from geoattn.attention.rt.params import Call

# Multiplies a large tensor of subnormal numbers by one on every worker thread: the result is all
# zeros only if each thread flushes (a thread that keeps them returns the inputs). {setup} runs first.
_PROBE = """
import torch
{setup}
torch.set_num_threads(2)
y = torch.full((1 << 22,), 1e-39) * 1.0
print(int((y == 0).sum()), y.numel(), geoattn.core.subnormals.subnormals_flushed())
"""
# The geoattn program, its work replaced by the probe.
_CONSOLE = """
import geoattn.cli, geoattn.core.subnormals
geoattn.cli.main = lambda argv=None: 0
try:
    geoattn.cli.console()
except SystemExit:
    pass
"""
_LIBRARY = "import geoattn.attention, geoattn.core.subnormals"


def _probe(setup: str, keep: str | None) -> tuple[int, int, str]:
    env = {k: v for k, v in os.environ.items() if k != subnormals.KEEP_ENV}
    if keep is not None:
        env[subnormals.KEEP_ENV] = keep
    code = _PROBE.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    zeros, total, flushed = out.stdout.split()
    return int(zeros), int(total), flushed


def test_the_program_flushes_subnormals_in_every_thread():
    zeros, total, flushed = _probe(_CONSOLE, keep=None)
    assert (zeros, flushed) == (total, "True")


@pytest.mark.parametrize(("setup", "keep"), [(_CONSOLE, "1"), (_LIBRARY, None)])
def test_subnormals_are_kept_on_request_and_by_the_library(setup, keep):
    # the library alone leaves the process's floating-point mode as it found it
    zeros, _, flushed = _probe(setup, keep)
    assert (zeros, flushed) == (0, "False")


@pytest.mark.parametrize("structure", ["separable", "tied", "general"])
def test_the_path_and_the_values_do_not_depend_on_the_flush_mode(structure):
    # Sharp attention (large key magnitudes): many weights are far below float32's normal range. The
    # same path runs with the CPU flushing subnormals (as in the geoattn program) and without (a plain
    # program): the dispatch reads no process-global switch, and both agree with the reference.
    torch.manual_seed(0)
    b, h, n, d = 1, 2, 300, 8
    q, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    k = torch.randn(b, h, n, d) * 10  # κ up to ~800: logits spread far beyond float32's e^-87
    mu_r = torch.full((h,), 0.01)
    sigma_t2 = {"separable": torch.zeros(h), "tied": 2 * mu_r, "general": torch.full((h,), 0.05)}[structure]
    params = dict(mu_r=mu_r, sigma_t2=sigma_t2, eta_t2=torch.ones(h), beta=torch.ones(h), structure=structure)
    inputs = [x.double().requires_grad_() for x in (q, k, v)]
    as_double = {name: p.double() for name, p in params.items() if name != "structure"}
    expected = rt_attention(*inputs, backend="reference", **as_double)
    expected_grads = torch.autograd.grad(expected.sum(), inputs)
    chosen = []
    for flushed in (True, False):
        try:
            torch.set_flush_denormal(flushed)
            inputs32 = [x.detach().float().requires_grad_() for x in inputs]
            qkv = torch.stack([x.transpose(1, 2) for x in inputs32], dim=2)
            p32 = tuple(params[name] for name in ("mu_r", "sigma_t2", "eta_t2", "beta"))
            call = Call(qkv, None, 1.0, p32, None, None, True, True, "auto", False)
            chosen.append(dispatch.choose(call).name)
            out = rt_attention(*inputs32, **params)
            grads = torch.autograd.grad(out.sum(), inputs32)
        finally:
            torch.set_flush_denormal(False)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4, msg=f"flushed={flushed}")
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g.double(), e, rtol=1e-3, atol=1e-3, msg=f"flushed={flushed}")
    assert chosen[0] == chosen[1]


def test_numpy_reads_its_float_limits_without_a_warning_after_the_program_flushes():
    """NumPy measures its float limits on first use; under a flushed mode some versions warn that the
    smallest subnormal is zero (in every report and run log): the program measures them first. (The
    value is checked by its bits: under the flushed mode a conversion to a Python float reads zero.)"""
    code = _CONSOLE + (
        "import numpy as np, scipy.stats\n"
        "types = (np.float16, np.float32, np.float64)\n"
        "print([any(np.finfo(t).smallest_subnormal.tobytes()) for t in types])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != subnormals.KEEP_ENV}
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1:]
    assert out.stdout.strip() == "[True, True, True]"
