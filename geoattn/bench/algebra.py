"""Batched geometric product (float32, Cl(3,0) and Cl(3,0,1)): geoattn vs kingdon, torch-ga, dense einsum.

One run, medians over ``--repeats`` interleaved rounds (each round times every implementation
once, so changes in machine load hit all alike), ratios to geoattn. Each peer gets its
fastest honest form: geoattn takes the batch-major ``(N, dim)`` tensors users hold (through the native
kernel where it is built; the row after it is what runs without it: large batches compiled, small
ones eager); kingdon gets
component-major ``(dim, N)`` torch tensors prepared outside the timing (its code-generated product
works blade by blade) and returns its list of blade rows; torch-ga's ``geom_prod`` and the dense
einsum over the Cayley table take ``(N, dim)``. Forward+backward is ``out.backward(g)`` with one
fixed random cotangent g for everyone. A missing peer (or one without a backward) says so in its
cells. The agreement line compares every peer's product and gradient with geoattn's on the same data.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from geoattn.algebra import CliffordAlgebra, kernels
from geoattn.bench.common import median_time, ms
from geoattn.core.errors import ConfigError
from geoattn.core.formatting import format_table

SIGNATURES = ((3, 0, 0), (3, 0, 1))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=200_000, help="number of products per call (default 200000)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per cell; the median is shown")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Peer:
    """One implementation: timed closures, or the reason each is missing."""

    name: str
    forward: Callable[[], object] | None = None
    forward_backward: Callable[[], object] | None = None
    result: Callable[[], tuple[Tensor, Tensor | None]] | None = None  # (N, dim) product, grad of a
    missing: str = ""
    no_backward: str = ""


def _geoattn(alg: CliffordAlgebra, a: Tensor, b: Tensor, g: Tensor) -> Peer:
    ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()

    def forward_backward() -> Tensor:
        ag.grad = bg.grad = None
        alg.geometric_product(ag, bg).backward(g)
        return ag.grad

    return Peer(
        "geoattn",
        lambda: alg.geometric_product(a, b),
        forward_backward,
        lambda: (alg.geometric_product(a, b), forward_backward()),
    )


def _geoattn_compiled(alg: CliffordAlgebra, a: Tensor, b: Tensor, g: Tensor) -> Peer:
    """geoattn's products without the native kernel, as where it is not built: the torch.compile'd
    per-blade form for large batches, the eager dense or gather form for small ones."""
    name = "geoattn, native kernel off"
    if kernels.native_products(a) is None:
        return Peer(name, missing="the row above (no native kernel)")
    base = _geoattn(alg, a, b, g)

    def compiled(fn: Callable[[], object]) -> Callable[[], object]:
        def call():
            with kernels.compiled_instead():
                return fn()

        return call

    return Peer(name, compiled(base.forward), compiled(base.forward_backward), compiled(base.result))


def _dense_einsum(alg: CliffordAlgebra, a: Tensor, b: Tensor, g: Tensor) -> Peer:
    cayley = alg.cayley.to(a)
    product = lambda x, y: torch.einsum("ni,ijk,nj->nk", x, cayley, y)  # noqa: E731
    ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()

    def forward_backward() -> Tensor:
        ag.grad = bg.grad = None
        product(ag, bg).backward(g)
        return ag.grad

    return Peer(
        "dense einsum (Cayley)",
        lambda: product(a, b),
        forward_backward,
        lambda: (product(a, b), forward_backward()),
    )


def _kingdon(alg: CliffordAlgebra, a: Tensor, b: Tensor, g: Tensor) -> Peer:
    try:
        kingdon = importlib.import_module("kingdon")
    except ImportError:
        return Peer("kingdon", missing="not installed")
    ka = kingdon.Algebra(alg.p, alg.q, alg.r)
    # kingdon orders blades by grade, then by basis index, as we do (r null vectors first): same rows.
    a_cm, b_cm, g_rows = a.T.contiguous(), b.T.contiguous(), list(g.T.contiguous())
    x, y = ka.multivector(values=a_cm), ka.multivector(values=b_cm)
    ag, bg = a_cm.clone().requires_grad_(), b_cm.clone().requires_grad_()
    xg, yg = ka.multivector(values=ag), ka.multivector(values=bg)

    def forward_backward() -> Tensor:
        ag.grad = bg.grad = None
        torch.autograd.backward(list((xg * yg).values()), g_rows)
        return ag.grad.T

    def result() -> tuple[Tensor, Tensor | None]:
        out = x * y
        if tuple(out.keys()) != tuple(x.keys()):
            raise RuntimeError(f"kingdon returned blades {out.keys()}, expected {x.keys()}")
        return torch.stack(list(out.values()), -1), peer.forward_backward and forward_backward()

    peer = Peer("kingdon (component-major)", lambda: x * y, forward_backward, result)
    return peer


def _torch_ga(alg: CliffordAlgebra, a: Tensor, b: Tensor, g: Tensor) -> Peer:
    try:
        torch_ga = importlib.import_module("torch_ga")
    except ImportError as err:
        return Peer("torch-ga", missing=f"not importable ({err})")
    ga = torch_ga.GeometricAlgebra(metric=list(alg.signature))
    ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()

    def forward_backward() -> Tensor:
        ag.grad = bg.grad = None
        ga.geom_prod(ag, bg).backward(g)
        return ag.grad

    return Peer(
        "torch-ga geom_prod",
        lambda: ga.geom_prod(a, b),
        forward_backward,
        lambda: (ga.geom_prod(a, b), forward_backward()),
    )


PEERS = (_geoattn, _geoattn_compiled, _kingdon, _torch_ga, _dense_einsum)


def measure(sig: tuple[int, int, int], n: int, repeats: int, seed: int) -> tuple[list[list[object]], str]:
    """Table rows and the agreement line for one signature."""
    alg = CliffordAlgebra(*sig)
    gen = torch.Generator().manual_seed(seed)
    a, b, g = (torch.randn(n, alg.dim, generator=gen) for _ in range(3))
    peers = [make(alg, a, b, g) for make in PEERS]
    for peer in peers:
        if peer.forward_backward:
            try:
                peer.forward_backward()
            except (RuntimeError, TypeError) as err:  # e.g. an op without a derivative
                peer.forward_backward, peer.no_backward = None, f"no backward ({type(err).__name__})"
    calls = {
        (peer.name, kind): getattr(peer, kind)
        for peer in peers
        for kind in ("forward", "forward_backward")
        if getattr(peer, kind)
    }
    for fn in calls.values():  # warm-up (and geoattn's one-time kernel compilation)
        median_time(fn, repeats=1, warmup=1)
    # interleaved rounds: a change in machine load hits every implementation alike
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            samples[key].append(median_time(fn, repeats=1, warmup=0))
    times = {(peer.name, kind): None for peer in peers for kind in ("forward", "forward_backward")}
    times.update({key: statistics.median(values) for key, values in samples.items()})
    reference = peers[0].result()
    agreement = []
    for peer in peers[1:]:
        if peer.result:
            out, grad = peer.result()
            text = f"{peer.name}: product {(out - reference[0]).abs().max().item():.2g}"
            if peer.forward_backward:
                text += f", grad {(grad - reference[1]).abs().max().item():.2g}"
            agreement.append(text)
    rows = []
    base = times["geoattn", "forward"], times["geoattn", "forward_backward"]
    for peer in peers:
        row: list[object] = [peer.name]
        for kind, t0 in zip(("forward", "forward_backward"), base):
            t = times[peer.name, kind]
            reason = peer.missing or (peer.no_backward if kind == "forward_backward" else "")
            row += [ms(t), f"{t / t0:.2f}"] if t is not None else [reason or "n/a", "-"]
        rows.append(row)
    return rows, "agreement with geoattn (max abs diff): " + "; ".join(agreement)


def run(args: argparse.Namespace) -> int:
    for name in ("n", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, float32, n = {args.n} products a call")
    print(f"medians of {args.repeats} calls; '× geoattn' = time / geoattn's time in this run\n")
    headers = ["implementation", "forward (ms)", "× geoattn", "forward+backward (ms)", "× geoattn"]
    for sig in SIGNATURES:
        rows, agreement = measure(sig, args.n, args.repeats, args.seed)
        print(f"### Cl{sig}: {args.n} geometric products\n")
        print(format_table(headers, rows))
        print(f"\n{agreement}\n")
    return 0
