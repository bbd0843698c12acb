"""The native kernels' build as a user meets it (`geoattn.native`, docs/native.md): the
``geoattn native build`` command and its report, ``GEOATTN_NATIVE=require`` failing loudly with the
compiler's message, the GCC check, the cache folder under ``XDG_CACHE_HOME``, one build per machine
under the folder's lock, both build variants (``-march=native`` and the AVX2 ``x86-64-v3``) exact
against the reference, the kernels' own subnormal mode, and the bench header that names the CPU."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from geoattn import cli, native
from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention import rt_attention
from geoattn.bench import common

F64, F32 = torch.float64, torch.float32
X86_AVX2 = "avx2" in common._cpuinfo().get("flags", "").split()
MARCHES = ["native", "x86-64-v3"] if X86_AVX2 else ["native"]

pytestmark = pytest.mark.skipif(
    native.cpu_kernels() is None, reason="no C++ toolchain here: the native kernel cannot be built"
)


@pytest.fixture(scope="module")
def builds() -> dict[str, native.Build]:
    """Each variant built (or found) in the ordinary cache, before any test moves the cache."""
    return {march: native.build(march) for march in MARCHES}


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has loaded nothing, its cache under ``XDG_CACHE_HOME=tmp_path/xdg``."""
    monkeypatch.delenv("GEOATTN_CACHE", raising=False)
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TORCH_DONT_CHECK_COMPILER_ABI", "1")  # the fake compilers below are not GCC
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_builds", {})
    return tmp_path / "xdg" / "geoattn" / "native"


def _fake_compiler(folder: Path, version: str = "12.2.0", error: str = "error: simulated failure") -> str:
    """An executable named g++ that answers as GCC ``version`` and fails every compilation with
    ``error`` (the compiler's message a build must pass on)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "g++"
    path.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            case "$1" in
              --version) echo "g++ (fake) {version}"; exit 0;;
              -v) echo "gcc version {version} (fake)" >&2; exit 0;;
              -dumpfullversion|-dumpversion) echo "{version}"; exit 0;;
            esac
            echo "module.cpp:1:1: {error}" >&2
            exit 1
            """)
    )
    path.chmod(0o755)
    return str(path)


def _copy_build(source: native.Build, folder: Path) -> None:
    """Puts a finished build (library and record) into ``folder``, as the process that built it does."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (native._BUILD_INFO, native._read_info(source.folder)["library"]):
        shutil.copy(source.folder / name, folder / name)


# ------------------------------------------------------------------------------- the command ----
@pytest.mark.parametrize("march", MARCHES)
def test_the_build_command_reports_compiler_flags_cache_and_seconds(march, capsys):
    """``geoattn native build`` prints the compiler and its version, the flags with -march, the SIMD
    lanes of the target, the cache folder and the seconds; x86-64-v3 targets AVX2 (8 float32 lanes)
    and native this machine's widest vectors."""
    assert cli.main(["native", "build", "--march", march]) == 0
    out = capsys.readouterr().out
    fields = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert list(fields) == ["compiler", "flags", "march", "lanes", "cache", "seconds"]
    assert "(" in fields["compiler"] and Path(fields["compiler"].split(" (")[0]).is_file()
    assert f"-march={march}" in fields["flags"].split() and "-O3" in fields["flags"]
    assert Path(fields["cache"]).is_dir() and Path(fields["cache"]).name.startswith(march.replace("-", "_"))
    assert float(fields["seconds"].split()[0]) >= 0
    build = native.build(march)
    assert fields["lanes"] == f"{build.module.lanes} float32 ({build.module.isa})"
    if march == "x86-64-v3":
        assert (build.module.lanes, build.module.isa) == (8, "AVX2")
    elif "avx512f" in common._cpuinfo().get("flags", "").split():
        assert (build.module.lanes, build.module.isa) == (16, "AVX-512")


def test_make_run_builds_the_kernels_at_set_up():
    """``make run``: install, then ``geoattn native build`` (a failure stops set-up only under
    ``GEOATTN_NATIVE=require``), then the quickstart."""
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    recipe = lambda target: makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]  # noqa: E731
    assert recipe("run").startswith(" native\n") and "geoattn quickstart" in recipe("run")
    native_recipe = recipe("native")
    assert native_recipe.startswith(" install\n")
    assert '$(BIN)/geoattn native build || [ "$$GEOATTN_NATIVE" != require ]' in native_recipe


def test_the_build_command_when_switched_off(monkeypatch, capsys):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert cli.main(["native", "build"]) == 0
    assert "switched off" in capsys.readouterr().out


# ------------------------------------------------------------------------ failing loudly ----
@pytest.mark.parametrize("missing", ["CXX", "PATH"])
def test_require_mode_raises_where_there_is_no_compiler(missing, fresh, monkeypatch, tmp_path, capsys):
    """``CXX`` naming no compiler, or no ``c++`` on ``PATH``: ``require`` raises with a one-line reason,
    the default warns once and leaves the Python kernels, and the command exits 1 with the reason."""
    if missing == "CXX":
        monkeypatch.setenv("CXX", "/nonexistent/g++")
    else:
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
    name = "/nonexistent/g++" if missing == "CXX" else "c++"
    monkeypatch.setenv(native.NATIVE_ENV, "require")
    with pytest.raises(native.NativeBuildError, match=rf"no C\+\+ compiler: '{re.escape(name)}'.*GCC >= 12"):
        native.cpu_kernels()
    assert cli.main(["native", "build"]) == 1
    assert "no C++ compiler" in capsys.readouterr().err
    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setattr(native, "_state", {})
    with pytest.warns(UserWarning, match=r"native CPU kernels unavailable \(no C\+\+ compiler.*require"):
        assert native.cpu_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert native.cpu_kernels() is None


def test_require_mode_raises_with_the_compilers_error(fresh, monkeypatch, tmp_path):
    """A compiler that fails: ``require`` raises with its message (the full output in the error, its
    error line as the reason); the default mode's warning quotes that line."""
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path / "bin", error="error: simulated failure"))
    monkeypatch.setenv(native.NATIVE_ENV, "require")
    with pytest.raises(native.NativeBuildError) as caught:
        native.cpu_kernels()
    assert "module.cpp:1:1: error: simulated failure" in str(caught.value)
    assert caught.value.reason == "module.cpp:1:1: error: simulated failure"
    assert "-march=native" in str(caught.value)
    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setattr(native, "_state", {})
    with pytest.warns(UserWarning, match="unavailable \\(module.cpp:1:1: error: simulated failure\\)"):
        assert native.cpu_kernels() is None


def test_an_old_gcc_is_refused_up_front(fresh, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path / "bin", version="11.4.0"))
    with pytest.raises(native.NativeBuildError, match=r"is GCC 11\.4\.0; the native kernels need GCC >= 12"):
        native.build()
    assert not fresh.exists() or not any(fresh.iterdir())  # nothing started


def test_a_bad_setting_is_a_config_error(monkeypatch):
    from geoattn.core.errors import ConfigError

    monkeypatch.setenv(native.NATIVE_ENV, "loud")
    with pytest.raises(ConfigError, match="GEOATTN_NATIVE='loud'"):
        native.mode()
    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3 -O0")
    with pytest.raises(ConfigError, match="GEOATTN_NATIVE_MARCH"):
        native.march()


# ---------------------------------------------------------------------------- the cache ----
def test_a_lock_left_by_an_interrupted_build_is_cleared(fresh, monkeypatch):
    """An interrupted build leaves torch's own lock file, on which torch's builder would wait forever;
    with the folder's lock held no other process is building, so it goes before the compilation."""
    import torch.utils.cpp_extension as cpp

    folder = native.cache_root() / f"native-{native._fingerprint('native')}"
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    seen = []

    def load(*args, build_directory, **kwargs):
        seen.append((Path(build_directory) / "lock").exists())
        raise RuntimeError("stopped here")

    monkeypatch.setattr(cpp, "load", load)
    with pytest.raises(native.NativeBuildError, match="stopped here"):
        native.build("native")
    assert seen == [False]


def test_the_cache_honours_xdg_cache_home(fresh, monkeypatch, tmp_path):
    """``XDG_CACHE_HOME`` (absolute) places the cache, ``GEOATTN_CACHE`` overrides it, a relative one
    is ignored as the XDG spec says; a build (failing here, with a fake compiler) works in that folder,
    one per variant."""
    assert native.cache_root() == fresh
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path / "bin"))
    for march in MARCHES:
        with pytest.raises(native.NativeBuildError):
            native.build(march)
    variants = sorted(p.name.split("-")[0] for p in fresh.iterdir())
    assert variants == sorted(m.replace("-", "_") for m in MARCHES)
    monkeypatch.setenv("GEOATTN_CACHE", str(tmp_path / "own"))
    assert native.cache_root() == tmp_path / "own" / "native"
    monkeypatch.delenv("GEOATTN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")
    assert native.cache_root() == Path.home() / ".cache" / "geoattn" / "native"


def test_a_found_build_loads_without_a_compiler(builds, fresh, monkeypatch):
    """What is built loads where no compiler is (a machine set up once, its toolchain gone)."""
    built = builds["native"]
    folder = native.cache_root() / built.folder.name
    _copy_build(built, folder)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv(native.NATIVE_ENV, "require")
    found = native.build()
    assert found.folder == folder and not found.compiled
    assert found.module.lanes == built.module.lanes


def test_one_process_builds_the_others_wait_on_the_lock(builds, fresh, monkeypatch, tmp_path, capsys):
    """DDP ranks starting together: while another process holds the folder's lock (building), this
    one waits, then loads what that process built instead of compiling (its compiler, a fake one
    here, would fail). A holder that dies releases the lock with it."""
    built = builds["native"]
    folder = native.cache_root() / built.folder.name
    folder.mkdir(parents=True)
    lock = folder / native._LOCK
    # the "rank 0": holds the lock for a while, then leaves the finished build in the folder
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""\
                import fcntl, shutil, sys, time
                lock, source, folder, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
                handle = open(lock, "a+")
                fcntl.flock(handle, fcntl.LOCK_EX)
                print("held", flush=True)
                time.sleep(1.5)
                for name in names:
                    shutil.copy(f"{source}/{name}", f"{folder}/{name}")
                """),
            str(lock),
            str(built.folder),
            str(folder),
            native._read_info(built.folder)["library"],
            native._BUILD_INFO,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path / "bin"))
    start = time.perf_counter()
    waited = native.build(quiet=False)
    assert holder.wait(timeout=60) == 0
    assert time.perf_counter() - start > 0.5 and not waited.compiled and waited.folder == folder
    assert "waiting for another process building the native kernels" in capsys.readouterr().err
    # a holder killed mid-build: the lock goes with it
    dead = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; h=open(sys.argv[1],'a+'); "
         "fcntl.flock(h, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert dead.stdout.readline().strip() == "held"
    dead.kill()
    dead.wait(timeout=60)
    with native._locked(folder, quiet=True):
        pass


# ------------------------------------------------------------------- both builds, exact ----
def _inputs(dtype, n=37, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, d, generator=g, dtype=F64) for _ in range(3))
    k = k * (0.3 + 6.0 * torch.rand(2, 3, n, 1, generator=g, dtype=F64))
    omega = 0.3 * rope_frequencies(d, 3).to(F64)
    params = dict(
        mu_r=torch.tensor([0.0, 0.05, 0.2], dtype=F64),
        sigma_t2=torch.tensor([0.1, 0.02, 0.3], dtype=F64),
        eta_t2=torch.tensor([0.5, 1.0, 2.0], dtype=F64),
        beta=torch.tensor([1.0, 2.0, 0.5], dtype=F64),
    )
    return tuple(x.to(dtype) for x in (q, k, v, omega)), {name: p.to(dtype) for name, p in params.items()}


def _attend(dtype, backend, causal, d):
    (q, k, v, omega), params = _inputs(dtype, d=d)
    leaves = [x.requires_grad_() for x in (q, k, v, *params.values())]
    out = rt_attention(q, k, v, **params, omega=omega, causal=causal, backend=backend)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(dtype)
    return out, torch.autograd.grad((out * weights).sum(), leaves)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("dtype", "d"), [(F64, 16), (F32, 16), (F32, 8)], ids=["f64", "f32-d16", "f32-d8"])
@pytest.mark.parametrize("march", MARCHES)
def test_each_build_matches_the_reference(march, dtype, d, causal, monkeypatch):
    """Both build variants (the AVX2 one with 8-lane vectors, native with this CPU's), through the
    fused entry the native path calls, float64 to rounding and float32 with wide key magnitudes to
    float32's tolerance: values and every gradient (q, k, v, the four filter parameters) against the
    reference. D = 16 fills whole vectors on either width; D = 8 whole AVX2 vectors and single values
    on AVX-512."""
    monkeypatch.setattr(native, "_state", {"cpu": native.build(march).module})
    calls = []
    module = native._state["cpu"]

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(module, name)

    monkeypatch.setattr(native, "_state", {"cpu": Spy()})
    out, grads = _attend(dtype, "auto", causal, d)
    assert "rt_qkv_forward" in calls and "rt_qkv_backward" in calls
    ref, ref_grads = _attend(F64, "reference", causal, d)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=0, atol=2e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    names = ["q", "k", "v", "mu_r", "sigma_t2", "eta_t2", "beta"]
    for name, g, g_ref in zip(names, grads, ref_grads):
        scale = 1.0 if dtype == F64 else max(1.0, g_ref.abs().max().item())
        torch.testing.assert_close(
            g.double() / scale,
            g_ref / scale,
            **(dict(rtol=1e-9, atol=1e-10) if dtype == F64 else dict(rtol=0, atol=2e-3)),
            msg=f"gradient of {name}",
        )


@pytest.mark.parametrize("d", [8, 32])
@pytest.mark.parametrize("march", MARCHES)
def test_each_build_in_float32_matches_its_float64_over_many_blocks(march, d, builds):
    """The lag entry called directly with small blocks (query blocks of 16, key blocks of 24: causal
    rows end inside a vector of either width, and past the last whole one): float32, which runs the
    vector lanes, agrees with float64, which does not, values and gradients; the builds agree."""
    g = torch.Generator().manual_seed(6)
    b, h, n = 1, 2, 70
    q, k, v, grad_out = (torch.randn(b, h, n, d, generator=g, dtype=F64) for _ in range(4))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    lm2 = 3 * torch.randn(b, h, n, generator=g, dtype=F64)
    table = torch.rand(h, 2 * n - 1, generator=g, dtype=F64)
    beta = torch.rand(h, generator=g, dtype=F64) + 0.5
    results = {}
    for name, build in builds.items():
        kernel = build.module
        for dtype in (F32, F64):
            inputs = [x.to(dtype) for x in (q, k, v, lm2, table, beta)]
            out, lse = kernel.rt_lag_forward(*inputs, True, 16, 24)
            grads = kernel.rt_lag_backward(*inputs, out, lse, grad_out.to(dtype), True, 16, 24)
            results[name, dtype] = [out, lse, *grads]
    for f32, f64 in zip(results[march, F32], results[march, F64]):
        scale = max(1.0, f64.abs().max().item())
        torch.testing.assert_close(f32.double() / scale, f64 / scale, rtol=0, atol=2e-5)
    for a, e in zip(results[march, F64], results[MARCHES[0], F64]):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("signature", [(3, 0, 0), (3, 0, 1), (2, 0, 1)], ids=["Cl3", "PGA", "Cl201"])
@pytest.mark.parametrize("march", MARCHES)
def test_each_build_runs_the_products_of_the_per_blade_form(march, signature):
    """``bilinear_product`` (``products.h``) of each build against the generated per-blade Python for
    the same table, float64 to rounding and float32 to its own. Tables: the geometric product and its
    gradients (Cl(3) and PGA: the build's constant tables; Cl(2,0,1): the general form, the table read
    at run time) and the outer product (the general form); a grade-path table of more outputs than
    blades (the general form too) is in test_rotor_layers. Layouts: rows (M, dim); blade by blade
    (dim, 1, M) at a blade stride past M; in runs of 15 rows 30 apart (blocks end inside runs:
    copied) and of 32 rows 48 apart (whole chunks: read in place), as channel slices of the layers'
    stream; 150–160 rows, so the last block is a part; and ``bilinear_product_into`` writing into runs
    of a wider tensor (a layer's gradient where its concatenation would put it)."""
    from geoattn.algebra import CliffordAlgebra

    kernel = native.build(march).module
    products = CliffordAlgebra(*signature)._products
    g = torch.Generator().manual_seed(3)
    dim = 2 ** sum(signature)
    for table in ("geometric", "geometric.grad_a", "geometric.grad_b", "outer"):
        entries = torch.tensor(products._entries(table), dtype=torch.int64).view(-1, 4)
        for dtype in (F64, F32):
            tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
            a, b = (torch.randn(150, dim, generator=g, dtype=F64) for _ in range(2))
            expected = products.plain(table)(a, b)
            out = kernel.bilinear_product(a.to(dtype), b.to(dtype), entries, dim, False)
            torch.testing.assert_close(out.double(), expected, **tol, msg=f"{table}, rows, {dtype}")
            wide_a, wide_b = (torch.cat([x.T, x.T], 1).to(dtype) for x in (a, b))  # (dim, 300)
            out = kernel.bilinear_product(wide_a[:, None, :150], wide_b[:, None, :150], entries, dim, True)
            assert out.shape == (dim, 150)
            torch.testing.assert_close(out.T.double(), expected, **tol, msg=f"{table}, blades first, {dtype}")
            for groups, run, apart in ((10, 15, 30), (5, 32, 48)):
                wide = (torch.randn(dim, groups, apart, generator=g, dtype=F64) for _ in range(2))
                runs_a, runs_b = (x.to(dtype)[:, :, :run] for x in wide)
                out = kernel.bilinear_product(runs_a, runs_b, entries, dim, True)
                rows_a, rows_b = (x.permute(1, 2, 0).reshape(-1, dim).double() for x in (runs_a, runs_b))
                expected = products.plain(table)(rows_a, rows_b)
                torch.testing.assert_close(out.T.double(), expected, **tol, msg=f"{table}, runs of {run}")
                # written into runs of a wider tensor (`bilinear_product_into`), the rest untouched
                into = torch.full((dim, groups, apart + 7), 7.0, dtype=dtype)
                kernel.bilinear_product_into(runs_a, runs_b, entries, into[:, :, 3 : 3 + run])
                written = into[:, :, 3 : 3 + run].permute(1, 2, 0).reshape(-1, dim).double()
                torch.testing.assert_close(written, expected, **tol, msg=f"{table}, into runs of {run}")
                assert (into[:, :, :3] == 7).all() and (into[:, :, 3 + run :] == 7).all()


def test_the_constant_tables_are_the_algebras():
    """``products_tables.h`` is what `native_tables_source` writes from the algebra's tables now (after
    a change to the tables or the signatures, rewrite it with that function)."""
    from geoattn.algebra import kernels

    header = Path(native.__file__).parent / kernels.NATIVE_TABLES_HEADER
    assert header.read_text() == kernels.native_tables_source()


def test_the_products_kernel_refuses_a_table_outside_its_operands():
    """An entry naming blade 8 of 8-blade operands is an error, not a read past the rows; so is an
    output of other rows, or narrower than the table writes."""
    kernel = native.cpu_kernels()
    a = torch.randn(10, 8)
    with pytest.raises(RuntimeError, match="entry 1 names a blade outside the operands' widths"):
        kernel.bilinear_product(a, a, torch.tensor([[0, 0, 0, 1], [8, 0, 0, 1]]), 8, False)
    with pytest.raises(RuntimeError, match="a and b differ in rows"):
        kernel.bilinear_product(a, a[:5], torch.tensor([[0, 0, 0, 1]]), 8, False)
    runs = a.T.reshape(8, 2, 5)  # 10 rows in two runs
    with pytest.raises(RuntimeError, match="out holds other rows than a and b"):
        kernel.bilinear_product_into(runs, runs, torch.tensor([[0, 0, 0, 1]]), torch.empty(8, 2, 4))
    with pytest.raises(RuntimeError, match="entry 0 names a blade outside"):
        kernel.bilinear_product_into(runs, runs, torch.tensor([[0, 0, 4, 1]]), torch.empty(4, 2, 5))


@pytest.mark.parametrize("march", MARCHES)
def test_the_march_setting_selects_the_build(march, monkeypatch):
    """``GEOATTN_NATIVE_MARCH`` is the variant `cpu_kernels` loads (each its own module and folder)."""
    monkeypatch.setenv(native.MARCH_ENV, march)
    monkeypatch.setattr(native, "_state", {})
    assert native.cpu_kernels() is native.build(march).module
    assert f"-march={march}" in native.describe()


# -------------------------------------------------------------------- the subnormal mode ----
@pytest.mark.parametrize("march", MARCHES)
def test_the_kernels_set_their_own_subnormal_mode(march):
    """Whether or not the calling thread flushes subnormals (`flush_subnormals`), the kernels give the
    same bits, and the caller's mode is as it was after each call."""
    kernel = native.build(march).module
    g = torch.Generator().manual_seed(4)
    b, h, n, d = 1, 2, 50, 16
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    lm2 = 6 * torch.randn(b, h, n, generator=g)  # wide magnitudes: factors far below 1
    table = torch.randn(h, 2 * n - 1, generator=g).abs()
    beta = torch.rand(h, generator=g) + 0.5
    grad_out = torch.randn(b, h, n, d, generator=g)
    results = {}
    try:
        for flushed in (False, True, False):
            set_here = torch.set_flush_denormal(flushed)  # False where torch cannot set the mode
            out, lse = kernel.rt_lag_forward(q, k, v, lm2, table, beta, True, 16, 24)
            grads = kernel.rt_lag_backward(q, k, v, lm2, table, beta, out, lse, grad_out, True, 16, 24)
            assert kernel.flushes_subnormals() == (flushed and set_here)
            results.setdefault(flushed, []).append([out, lse, *grads])
    finally:
        torch.set_flush_denormal(False)
    assert not kernel.flushes_subnormals()
    for a, e in zip(results[True][0], results[False][0]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert torch.tensor(1e-39) * 1.0 != 0  # the caller's thread keeps IEEE subnormals


# ----------------------------------------------------------------------- the bench header ----
def test_every_bench_header_names_the_cpu_its_isa_the_blas_and_the_build(capsys):
    """The header `geoattn bench ...` prints first (`machine_header`): the CPU model, its vector ISA,
    torch's BLAS and the native build's -march."""
    header = common.machine_header()
    cpu_line, native_line = header.splitlines()
    assert cpu_line.startswith(f"cpu: {common.cpu_model()} (")
    assert any(isa in cpu_line for isa in ("AVX-512", "AVX2", "AVX", "NEON", "SVE", "SSE"))
    assert "blas: " in cpu_line and ("MKL" in cpu_line) == torch.backends.mkl.is_available()
    assert native_line.startswith("native kernels: -march=") and "float32 lanes" in native_line
    if "avx512f" in common._cpuinfo().get("flags", "").split():
        assert "(AVX-512;" in cpu_line
    # the bench commands print it first (here a bad flag stops the command right after)
    assert cli.main(["bench", "algebra", "--n", "0"]) == 2
    assert capsys.readouterr().out.startswith(header + "\n")


def test_the_header_says_when_the_kernels_are_off(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert common.machine_header().splitlines()[1] == "native kernels: off (GEOATTN_NATIVE=0)"


@pytest.mark.parametrize("march", MARCHES)
def test_each_build_lays_out_the_rotor_heads_q_k_v(march):
    """``rotor_qkv_forward`` / ``_backward`` (``rotor_qkv.h``) of each build against the torch form
    (``rotor_qkv._torch_groups``, gradients by autograd): 8 and 16 blades, no action, one shared by the
    batch and one per batch row, head groups in head order and out of it; float64 to rounding, float32
    to its own; the projection's gradient written blade by blade, as the projection lays out its output."""
    from geoattn.algebra.layout import blade_major
    from geoattn.attention.rotor.qkv import _torch_groups

    kernel = native.build(march).module
    g = torch.Generator().manual_seed(5)
    B, N, H, C = 3, 7, 4, 2
    for dim in (8, 16):
        for actions in (0, 1, B):
            for groups in ([[0, 1], [2], [3]], [[0, 3], [1, 2]], [[0, 1, 2, 3]]):
                qkv = blade_major(torch.randn(B, N, 3, H, C, dim, generator=g, dtype=F64)).requires_grad_()
                action = torch.randn(actions, H, N, dim, dim, generator=g, dtype=F64) if actions else None
                if action is not None:
                    action.requires_grad_()
                outs = [t for part in _torch_groups(qkv, action, groups) for t in part]
                weights = [torch.randn(t.shape, generator=g, dtype=F64) for t in outs]
                inputs = [qkv] + ([action] if action is not None else [])
                expected = torch.autograd.grad(sum((t * w).sum() for t, w in zip(outs, weights)), inputs)
                heads, sizes = [h for grp in groups for h in grp], [len(grp) for grp in groups]
                shape = [B, N, H, C, dim]
                for dtype in (F64, F32):
                    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
                    x = qkv.detach().to(dtype).movedim(-1, 0).reshape(dim, -1)
                    act = action.detach().to(dtype) if action is not None else torch.empty(0, dtype=dtype)
                    got = kernel.rotor_qkv_forward(x, act, shape, heads, sizes)
                    for a, e in zip(got, outs):
                        assert a.is_contiguous() and a.shape == e.shape
                        torch.testing.assert_close(a.double(), e.detach(), **tol)
                    g_x, g_act = kernel.rotor_qkv_backward(
                        x, act, [w.to(dtype) for w in weights], shape, heads, sizes
                    )
                    g_x = g_x.view(dim, B, N, 3, H, C).movedim(0, -1)  # blade by blade, as qkv
                    torch.testing.assert_close(g_x.double(), expected[0], **tol)
                    if action is not None:
                        torch.testing.assert_close(g_act.double(), expected[1], **tol)
                    else:
                        assert g_act.numel() == 0


@pytest.mark.parametrize("march", MARCHES)
def test_each_build_runs_the_grade_norm_of_the_torch_form(march):
    """``grade_norm_forward`` / ``_backward`` (``grade_norm.h``) of each build against GradeLayerNorm's
    torch form (gradients by autograd): Cl(3) and PGA (null blades, a grade of them alone), per grade
    and joint, either memory order and a gradient in the other one; float64 to rounding, float32 to its
    own."""
    from geoattn.algebra import CliffordAlgebra
    from geoattn.algebra.layout import blade_major
    from geoattn.layers.multivector import GradeLayerNorm

    kernel = native.build(march).module
    g = torch.Generator().manual_seed(6)
    for signature in ((3, 0, 0), (3, 0, 1)):
        ga = CliffordAlgebra(*signature)
        for per_grade in (True, False):
            norm = GradeLayerNorm(ga, per_grade=per_grade).double()
            gain = torch.randn(ga.n + 1, generator=g, dtype=F64).requires_grad_()
            x = torch.randn(40, 6, ga.dim, generator=g, dtype=F64)
            grad = torch.randn(40, 6, ga.dim, generator=g, dtype=F64)
            for x_in, grad_in in ((x, blade_major(grad)), (blade_major(x), grad)):
                xr = x_in.clone().requires_grad_()
                y = norm.reference(xr, gain)
                expected = torch.autograd.grad(y, (xr, gain), grad_in)
                for dtype in (F64, F32):
                    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-4, atol=1e-5)
                    xd, gd, gaind = x_in.to(dtype), grad_in.to(dtype), gain.detach().to(dtype)
                    args = (*norm._tables, per_grade, norm.eps)
                    out = kernel.grade_norm_forward(xd, gaind, *args)
                    assert out.stride() == xd.stride()
                    torch.testing.assert_close(out.double(), y.detach(), **tol)
                    g_x, g_gain = kernel.grade_norm_backward(xd, gaind, gd, *args)
                    torch.testing.assert_close(g_x.double(), expected[0], **tol)
                    torch.testing.assert_close(g_gain.sum(0).double(), expected[1], **tol)
