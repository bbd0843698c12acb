"""The attention kernels' path tables (`geoattn.attention.dispatch`), RT, rotor and RFA alike: one row
shape, every rule a row's check, ``explain`` with every reason of every row, an explicit backend
honoured or refused by name, and checks that never build the native module."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from geoattn import native
from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention import rfa, rfa_attention, rotor_attention
from geoattn.attention.dispatch import Path as Row
from geoattn.attention.rotor import HEADS
from geoattn.attention.rotor import dispatch as rotor_dispatch
from geoattn.attention.rt import dispatch as rt_dispatch
from geoattn.attention.rt.params import Call as RTCall

TABLES = {"rt": rt_dispatch.PATHS, "rotor": rotor_dispatch.PATHS, "rfa": rfa.PATHS}
CL3 = CliffordAlgebra(3)


@pytest.mark.parametrize("kernel", TABLES)
def test_every_table_has_the_row_shape_and_names_existing_tests(kernel):
    root = Path(__file__).parent.parent
    for row in TABLES[kernel]:
        assert isinstance(row, Row) and isinstance(row.checks, tuple) and all(callable(c) for c in row.checks)
        file, name = row.test.split("::")
        assert (root / file).exists(), row
        assert callable(getattr(importlib.import_module(Path(file).stem), name, None)), row


def _rotor_call(backend="auto"):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    return rotor_dispatch.Call(q, k, v, CL3, HEADS["rotation"], "sum", False, False, None, None, backend)


def test_rotor_rows_explain_and_an_explicit_backend_runs_its_row(monkeypatch):
    reasons = dict(rotor_dispatch.explain(_rotor_call()))
    assert list(reasons) == ["reference", "fast"] and reasons["fast"] == ()
    assert "only on request" in reasons["reference"][0]
    assert rotor_dispatch.choose(_rotor_call()).name == "fast"
    assert rotor_dispatch.choose(_rotor_call("reference")).name == "reference"
    ran = []
    rows = tuple(
        row._replace(run=lambda call, row=row: ran.append(row.name) or row.run(call))
        for row in rotor_dispatch.PATHS
    )
    monkeypatch.setattr(rotor_dispatch, "PATHS", rows)
    call = _rotor_call()
    for backend in ("auto", "reference", "fast"):
        rotor_attention(call.q, call.k, call.v, algebra=CL3, backend=backend)
    assert ran == ["fast", "reference", "fast"]
    with pytest.raises(ValueError, match="unknown backend 'chunked'"):
        rotor_attention(call.q, call.k, call.v, algebra=CL3, backend="chunked")


def _rfa_inputs(n=7):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for _ in range(3))
    p = {
        name: torch.full((2,), 0.5, dtype=torch.float64)
        for name in ("mu", "sigma2", "eta2", "gamma2", "beta")
    }
    return q, k, v, p


def test_rfa_rows_honour_refuse_and_explain():
    q, k, v, p = _rfa_inputs()
    ref = rfa_attention(q, k, v, **p, backend="reference")
    torch.testing.assert_close(rfa_attention(q, k, v, **p, backend="chunked", chunk_size=3), ref)
    torch.testing.assert_close(rfa_attention(q, k, v, **p), ref)  # auto: the chunked row
    with pytest.raises(ValueError, match="backend='chunked' cannot run this call: return_weights"):
        rfa_attention(q, k, v, **p, backend="chunked", return_weights=True)
    # auto with the weights: no row serves it, and the message lists every row's reasons
    with pytest.raises(
        ValueError, match=r"(?s)no path serves.*reference: .*only on request.*chunked: return"
    ):
        rfa_attention(q, k, v, **p, return_weights=True)


def test_rfa_value_checks_run_under_the_debug_switch_only(monkeypatch):
    """``(p <= 0).any()`` reads the parameters (a device sync on a GPU): only with GEOATTN_DEBUG=1."""
    q, k, v, p = _rfa_inputs()
    bad = {**p, "eta2": -p["eta2"]}
    monkeypatch.delenv("GEOATTN_DEBUG", raising=False)
    read = []
    original = torch.Tensor.any
    monkeypatch.setattr(
        torch.Tensor, "any", lambda self, *a, **kw: read.append(1) or original(self, *a, **kw)
    )
    rfa_attention(q, k, v, **bad)  # no check: it runs
    assert not read
    monkeypatch.setenv("GEOATTN_DEBUG", "1")
    with pytest.raises(ValueError, match="eta2 must be > 0"):
        rfa_attention(q, k, v, **bad)


def test_native_checks_never_build(monkeypatch, tmp_path):
    """``can_use`` asks whether the module is built, never builds it: with an empty cache and the
    builder patched to fail, the native row declines with its reason and nothing was compiled."""
    calls = []

    def builder(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a dispatch check tried to build the native module")

    monkeypatch.setattr(native, "build", builder)
    monkeypatch.setattr(native, "_compile", builder)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_fingerprints", {})
    monkeypatch.delenv("GEOATTN_CACHE", raising=False)
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built here
    qkv = torch.randn(1, 8, 3, 2, 4)
    call = RTCall(
        qkv, None, 1.0, tuple(torch.ones(2) for _ in range(4)), None, None, True, True, "auto", False
    )
    assert dict(rt_dispatch.explain(call))["native"] == (native.NOT_BUILT,)
    assert rt_dispatch.choose(call).name == "chunked"
    with pytest.raises(ValueError, match="backend='native' cannot run this call: native module not built"):
        rt_dispatch.choose(call._replace(backend="native"))
    assert not calls and not native.available()
