"""Native CPU kernels (one C++ module), built once per machine and build variant.

* ``rt_lag_forward`` / ``rt_lag_backward`` (``rt_lag.h``): the flash-style attention core with a lag
  table (the default times, where ``log c`` depends on ``i − j`` only), the matmuls in the BLAS torch
  links and the elementwise work in SIMD lanes, parallel over heads and query blocks; the fused entry
  below runs it (``geoattn.attention.rt.native_cpu`` calls that entry only).
* ``rt_qkv_forward`` / ``rt_qkv_backward`` (``rt_qkv.h``): the same attention from the fused Q/K/V
  projection ``(B, N, 3, H, D)``: the normalisation (with the learned metric), the key magnitudes and
  the rotations into and out of the common frame happen in the same call instead of as separate
  passes around the kernel, each head instance's rows when its work item starts (in a per-thread
  scratch the attention then reads from cache) and their gradients as soon as its backward is done.
* ``frame_forward`` / ``frame_backward`` (``frame.h``): the rotor frame head's per-token transform
  (Gram–Schmidt frame, its rotation's action on Cl(3), applied to every channel) in one pass.
* ``grade_norm_forward`` / ``grade_norm_backward`` (``grade_norm.h``): the rotor layers' grade-wise
  layer norm (``GradeLayerNorm``) in one pass over the tokens each way, in either memory order.
* ``rotor_qkv_forward`` / ``rotor_qkv_backward`` (``rotor_qkv.h``): rotor attention's q, k and v cut
  into head groups, laid out as the heads read them, q and k moved by the rotor positional encoding
  (``geoattn.attention.rotor.qkv``).
* ``bilinear_product`` (``products.h``): a sparse bilinear product of multivectors from its Cayley
  table given at run time (``geoattn.algebra.kernels``: the large eager batches of the geometric
  product and its gradients, in either memory order).
* ``lanes``, ``isa``: the float32s per SIMD vector and the vector instructions of the build's target
  (16 / AVX-512, 8 / AVX2, 4 / NEON, SSE2 or plain C++); ``flushes_subnormals()``: whether the calling
  thread flushes subnormals (the kernels set that mode in their own parallel regions and restore it).

Building: `build` (what ``geoattn native build`` runs; ``make run`` runs it at set-up) compiles the
source with the toolchain ``torch.utils.cpp_extension`` uses (``$CXX``, default ``c++``, which must be
GCC ≥ 12, and ``ninja``) with ``-O3 -march=M -fopenmp`` into a cache folder (`cache_root`), one per
variant, torch version and source (and CPU, for ``native``). ``M`` is ``GEOATTN_NATIVE_MARCH`` (default
``native``: the CPU the build runs on; ``x86-64-v3`` builds for any x86 CPU with AVX2 and FMA). One
process per machine builds a variant, under a file lock in the cache folder; the others (DDP ranks)
wait and load its result. A process that finds the module built loads it without the compiler. The
documentation's page "Native CPU kernels" (docs/native.md) says the same for users.

`cpu_kernels` gives the module to the kernels, building it on first use if no one did; `available`
(what the dispatch tables ask) only finds a build, never compiles. What happens
when it cannot be built is ``GEOATTN_NATIVE`` (`mode`): unset or ``1``, one warning and None (the
kernels use their Python forms); ``require``, `NativeBuildError` with the compiler's error; ``0``, None
without trying.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from geoattn.core.cache import cache_dir
from geoattn.core.compile import constant_result
from geoattn.core.errors import ConfigError, NativeBuildError

try:
    import fcntl
except ImportError:  # not POSIX: torch's own build lock alone
    fcntl = None

NATIVE_ENV = "GEOATTN_NATIVE"
MARCH_ENV = "GEOATTN_NATIVE_MARCH"
DEFAULT_MARCH = "native"
MIN_GCC = 12
"""The oldest GCC that compiles the kernels: their SIMD lanes are GCC vectors shuffled with
``__builtin_shufflevector``, which GCC has from version 12 on."""

_FOLDER = Path(__file__).parent
_SOURCE = _FOLDER / "module.cpp"  # includes the headers beside it
_NAME = "geoattn_native_cpu"
_BUILD_INFO = "build.json"  # written once a build has succeeded: what `Build` reports
_LOCK = "build.lock"  # our lock (fcntl: the kernel releases it when its holder dies)
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on", "auto")


@dataclasses.dataclass(frozen=True)
class Build:
    """A native module built (or found built) and how it was made.

    Attributes:
        module: the loaded module (the kernels above).
        march: the ``-march`` value it was built with (``native``, ``x86-64-v3``, ...).
        target: what ``-march=native`` meant to the compiler (e.g. ``sapphirerapids``), else ``march``.
        compiler: the compiler's path and its version line.
        flags: the compiler flags of the build.
        folder: its cache folder.
        compiled: whether this call compiled it (False: it was found built).
        seconds: how long this call took (compiling, or waiting and loading).
        compile_seconds: how long its compilation took.
    """

    module: ModuleType
    march: str
    target: str
    compiler: str
    flags: tuple[str, ...]
    folder: Path
    compiled: bool
    seconds: float
    compile_seconds: float

    def lines(self) -> list[str]:
        """The report of ``geoattn native build``, one ``field: value`` per line."""
        how = "compiled" if self.compiled else f"already built; compiling took {self.compile_seconds:.1f} s"
        return [
            f"compiler: {self.compiler}",
            f"flags: {' '.join(self.flags)}",
            f"march: {self.march}" + (f" ({self.target})" if self.target != self.march else ""),
            f"lanes: {self.module.lanes} float32 ({self.module.isa})",
            f"cache: {self.folder}",
            f"seconds: {self.seconds:.1f} ({how})",
        ]


_state: dict[str, ModuleType | None] = {}  # "cpu": what `cpu_kernels` gives
_loaded: dict[Path, ModuleType] = {}  # the modules imported in this process, by folder
_builds: dict[str, Build] = {}  # the builds made or found in this process, by -march
_fingerprints: dict[str, str] = {}  # `_fingerprint` by -march, for `built_kernels`


def mode() -> str:
    """``"off"``, ``"auto"`` or ``"require"``, from ``GEOATTN_NATIVE`` (see the module doc)."""
    value = os.environ.get(NATIVE_ENV, "").strip().lower()
    if value in _OFF:
        return "off"
    if value in _ON:
        return "auto"
    if value == "require":
        return "require"
    raise ConfigError(
        f"{NATIVE_ENV}={value!r}: expected 0 (off), 1 (the default: warn, fall back) or require"
    )


def enabled() -> bool:
    """Whether native kernels may be used: not switched off by ``GEOATTN_NATIVE=0``."""
    return mode() != "off"


def march() -> str:
    """The ``-march`` value of the build the kernels use: ``GEOATTN_NATIVE_MARCH``, default ``native``."""
    return _checked_march(os.environ.get(MARCH_ENV, "").strip() or DEFAULT_MARCH, MARCH_ENV)


def _checked_march(value: str, source: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.+_-]*", value):
        raise ConfigError(f"{source}={value!r}: expected a -march value such as native or x86-64-v3")
    return value


NOT_BUILT = "native module not built: run `geoattn native build`"
"""Why a native path declines where the module is not built (or switched off)."""


@constant_result
def available() -> bool:
    """Whether the module is at hand without compiling: loaded in this process, or built in its cache
    folder (then loaded here). Never builds (a dispatch check asks this on every call; the build is
    `geoattn native build`'s, at set-up). A constant of the process, so a compiled graph's path choice
    treats it as a static fact."""
    return built_kernels() is not None


def built_kernels() -> ModuleType | None:
    """The module of the variant `march` if it is loaded or lies built in its cache folder, else None
    (also where ``GEOATTN_NATIVE=0``); never runs the compiler."""
    if "cpu" in _state:
        return _state["cpu"]
    if not enabled():
        return None
    target = march()
    if target not in _fingerprints:  # the sources' and the CPU's hash: read once
        _fingerprints[target] = _fingerprint(target)
    folder = cache_root() / f"{_slug(target)}-{_fingerprints[target]}"
    if folder in _loaded:
        _state["cpu"] = _loaded[folder]
    elif _read_info(folder) is not None:
        _state["cpu"] = _load_for_kernels()  # built: loading it needs no compiler
    return _state.get("cpu")


def cpu_kernels() -> ModuleType | None:
    """The compiled module (the functions above) of the variant `march`, or None: switched off, or
    not buildable here outside ``require`` mode (one warning, the first time).

    Raises:
        NativeBuildError: in ``require`` mode, where it cannot be built or loaded.
    """
    if "cpu" not in _state:
        _state["cpu"] = _load_for_kernels()
    return _state["cpu"]


def _load_for_kernels() -> ModuleType | None:
    required = mode()
    if required == "off":
        return None
    try:
        return build(quiet=False).module
    except NativeBuildError as err:
        if required == "require":
            raise
        warnings.warn(
            f"geoattn: native CPU kernels unavailable ({err.reason}); using the Python kernels "
            f"({NATIVE_ENV}=require makes this an error, {NATIVE_ENV}=0 silences it)",
            stacklevel=4,
        )
        return None


def cache_root() -> Path:
    """Where the builds lie: ``native`` in the package's one cache folder
    (:func:`geoattn.core.cache.cache_dir`: ``$GEOATTN_CACHE``, else ``$XDG_CACHE_HOME/geoattn``, else
    ``~/.cache/geoattn``)."""
    return cache_dir() / "native"


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The C++ compiler torch's extension builder runs (``$CXX``, default ``c++``)."""

    path: str
    version_line: str
    gcc_version: tuple[int, ...] | None  # None: not GCC (its version is not checked)

    def describe(self) -> str:
        """``/usr/bin/c++ (g++ (Debian 12.2.0-14) 12.2.0)``."""
        return f"{self.path} ({self.version_line})"


def toolchain() -> Toolchain:
    """The compiler and ``ninja``, checked before any build: present, and GCC ≥ `MIN_GCC`.

    Raises:
        NativeBuildError: one line saying what is missing or too old.
    """
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name)
    if path is None:
        raise NativeBuildError(
            f"no C++ compiler: {name!r} (CXX) is not on PATH; the native kernels need GCC >= {MIN_GCC}"
        )
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=True)
        out = version.stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeBuildError(f"the C++ compiler {path} does not run ({err})") from err
    version_line = out.strip().splitlines()[0] if out.strip() else path
    # GCC says "gcc version X" to -v whatever it is called (c++, g++-12, a wrapper); clang does not
    probe = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=60)
    found = re.search(r"^gcc version (\d+(?:\.\d+)*)", probe.stderr + probe.stdout, re.MULTILINE)
    gcc = tuple(int(x) for x in found.group(1).split(".")) if found else None
    if gcc is not None and gcc[0] < MIN_GCC:
        raise NativeBuildError(
            f"{path} is GCC {'.'.join(map(str, gcc))}; the native kernels need GCC >= {MIN_GCC} "
            "(__builtin_shufflevector): set CXX to a newer g++, or GEOATTN_NATIVE=0"
        )
    if shutil.which("ninja") is None:
        raise NativeBuildError(
            "ninja is not on PATH (torch builds its C++ extensions with it): pip install ninja"
        )
    return Toolchain(path, version_line, gcc)


def flags(target: str) -> list[str]:
    """The compiler flags of the build for ``-march=target``."""
    return ["-O3", f"-march={target}", "-fopenmp"]


def build(target: str | None = None, *, quiet: bool = True, rebuild: bool = False) -> Build:
    """The native module for ``-march=target`` (default `march`): loaded from its cache folder if it
    was built there, else compiled now, by one process per machine (the others wait on the lock).

    Args:
        target: the ``-march`` value; None for `march`.
        quiet: False prints one line to stderr when this call compiles or waits for another process.
        rebuild: compile afresh even where a build is found (e.g. after a compiler upgrade).

    Raises:
        NativeBuildError: no usable compiler, or the compilation or the load failed (the message has
            the compiler's output).
    """
    target = _checked_march(target, "-march") if target else march()
    start = time.perf_counter()
    name = f"{_NAME}_{_slug(target)}"
    folder = cache_root() / f"{_slug(target)}-{_fingerprint(target)}"
    info = None if rebuild else _read_info(folder)
    if info is not None:  # built: loading it needs no compiler
        with _locked(folder, quiet):
            module = _import(name, folder)
        return _remember(module, info, folder, compiled=False, start=start)
    tools = toolchain()  # before any waiting: a missing or old compiler fails at once
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NativeBuildError(f"cannot create the cache folder {folder}: {err}") from err
    with _locked(folder, quiet):
        info = None if rebuild else _read_info(folder)  # another process may have built it meanwhile
        compiled = info is None
        if compiled:
            (folder / _BUILD_INFO).unlink(missing_ok=True)
            info = _compile(name, folder, target, tools, quiet)
        module = _import(name, folder)
    return _remember(module, info, folder, compiled=compiled, start=start)


def describe() -> str:
    """One line on the build the kernels use, without building: ``-march=native (sapphirerapids),
    16 float32 lanes (AVX-512)``, ``off (GEOATTN_NATIVE=0)``, ``unavailable ...`` or ``not built``."""
    if not enabled():
        return f"off ({NATIVE_ENV}=0)"
    if "cpu" in _state and _state["cpu"] is None:
        return "unavailable (the Python kernels run)"
    target = march()
    found = _builds.get(target)
    if found is not None:
        what = found.target, found.module.lanes, found.module.isa
    else:
        info = _read_info(cache_root() / f"{_slug(target)}-{_fingerprint(target)}")
        if info is None:
            return f"-march={target}, not built yet (geoattn native build)"
        what = info.get("target", target), info.get("lanes", "?"), info.get("isa", "?")
    resolved, lanes, isa = what
    text = f"-march={target}" + (f" ({resolved})" if resolved != target else "")
    return f"{text}, {lanes} float32 lanes ({isa})"


def _first_error(output: str) -> str:
    """The line of a failed build's output that says what failed: the compiler's first error, else
    the output's last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    for pattern in (r":\s*(fatal )?error:", r"\berror\b"):
        found = [line for line in lines if re.search(pattern, line, re.IGNORECASE)]
        found = [line for line in found if not line.startswith("Error building extension")]
        if found:
            return found[0][:300]
    return lines[-1][:300] if lines else "no message"


def _slug(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", target)


def _remember(module: ModuleType, info: dict, folder: Path, *, compiled: bool, start: float) -> Build:
    result = Build(
        module=module,
        march=info["march"],
        target=info.get("target", info["march"]),
        compiler=info["compiler"],
        flags=tuple(info["flags"]),
        folder=folder,
        compiled=compiled,
        seconds=time.perf_counter() - start,
        compile_seconds=info["seconds"],
    )
    _builds[result.march] = result
    return result


def _fingerprint(target: str) -> str:
    """The cache key of a build: torch's version, the CPU (for ``native`` only: any other target does
    not depend on it), the flags and the sources' text (a changed header, which torch's own check does
    not see, builds afresh). The compiler is not part of it, so that a process that finds the build
    needs none (``--rebuild`` after a compiler upgrade)."""
    sources = "".join(p.read_text() for p in sorted(_FOLDER.glob("*")) if p.suffix in (".h", ".cpp"))
    cpu = _cpu_flags() if target == "native" else ""
    text = f"{torch.__version__}|{platform.machine()}|{cpu}|{' '.join(flags(target))}|{sources}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _read_info(folder: Path) -> dict | None:
    """The record of a finished build in ``folder`` (its library present), else None."""
    try:
        info = json.loads((folder / _BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None
    library = info.get("library")
    return info if library and (folder / library).is_file() else None


@contextlib.contextmanager
def _locked(folder: Path, quiet: bool) -> Iterator[None]:
    """Holds the folder's build lock: the first process builds, the others wait here (DDP ranks
    starting together), then find the build done. The kernel releases the lock if its holder dies,
    so an interrupted build leaves nothing to wait for."""
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(folder / _LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                print(f"geoattn: waiting for another process building the native kernels in {folder}",
                      file=sys.stderr, flush=True)  # fmt: skip
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(name: str, folder: Path, target: str, tools: Toolchain, quiet: bool) -> dict:
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import load

    # torch remembers by name what it compiled in this process and, asked again with the same
    # arguments, only imports: a retry after a failed build (or --rebuild) must compile
    getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(name, None)
    # torch's own lock, left by an interrupted build, would make its builder wait forever; with ours
    # held no other process is building here
    (folder / "lock").unlink(missing_ok=True)
    if not quiet:
        print(f"geoattn: compiling the native CPU kernels (-march={target}, once per machine) in {folder}",
              file=sys.stderr, flush=True)  # fmt: skip
    start = time.perf_counter()
    cxx_flags = flags(target)
    try:
        module = load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=cxx_flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001 - the compiler's or the loader's error, whatever its type
        text = str(err).strip()
        raise NativeBuildError(
            f"building the native kernels with {tools.describe()} {' '.join(cxx_flags)} failed:\n{text}",
            reason=_first_error(text) if text else type(err).__name__,
        ) from err
    info = {
        "march": target,
        "target": _resolved_march(tools.path, target),
        "compiler": tools.describe(),
        "flags": cxx_flags,
        "seconds": round(time.perf_counter() - start, 1),
        "library": Path(module.__file__).name,
        "lanes": int(module.lanes),
        "isa": str(module.isa),
        "torch": torch.__version__,
    }
    tmp = folder / (_BUILD_INFO + ".tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    tmp.replace(folder / _BUILD_INFO)
    _loaded[folder] = module
    return info


def _import(name: str, folder: Path) -> ModuleType:
    if folder in _loaded:
        return _loaded[folder]
    info = _read_info(folder)
    path = folder / (info["library"] if info else f"{name}.so")
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - a missing symbol, a foreign torch: the loader's message
        raise NativeBuildError(f"loading the native kernels from {path} failed: {err}") from err
    _loaded[folder] = module
    return module


def _resolved_march(compiler: str, target: str) -> str:
    """What ``-march=native`` means to the compiler on this CPU (GCC's ``-Q --help=target``)."""
    if target != "native":
        return target
    try:
        out = subprocess.run(
            [compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return target
    found = re.search(r"^\s*-march=\s+(\S+)", out, re.MULTILINE)
    return found.group(1) if found else target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
