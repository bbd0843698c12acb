"""Kernels of the bilinear products (geometric, outer, left contraction, twisted) of `CliffordAlgebra`.

Three forms of the same sparse product ``c_k = Σ sign · a_i · b_j`` over the nonzero Cayley entries:

* ``dense_product`` (dim ≤ ``DENSE_MAX_DIM``, i.e. Cl(3)): one GEMM of ``a`` with the product's
  dense ``(dim, dim·dim)`` table, then a multiply and sum with ``b`` over a ``(..., dim, dim)``
  intermediate; its gradients, to any order, are GEMMs and elementwise ops. Against the gather
  below, whose backward is a scatter, it is level or better in Cl(3) (`geoattn bench algebra --n 3360`,
  BENCHMARKS.md), and its double backward (a force loss) stays GEMMs, where the gather's is scatters.
* ``gather_product`` (larger algebras): the dim² nonzero terms through an indexed gather; the GEMM
  does dim³, and already at dim = 16 (PGA) loses to the gather (BENCHMARKS.md).
* a per-blade expression generated from the sparse table (64 multiply-adds for Cl(3)) on the
  user's batch-major ``(M, dim)`` tensors. Large eager batches run it under ``torch.compile``: one
  fused loop over the rows that reads each row's blades and writes the product's row (`geoattn
  bench algebra` against kingdon). Written component-major (``(dim, M)``) instead, the compiled
  kernel wrote the blades as rows and transposed them in a second pass over the output, the slower
  form. Inside a caller's ``torch.compile`` it is traced as-is into the caller's graph.
* the native kernel (``geoattn.native``, ``products.h``): the same sparse table read at run time, in
  blocks of rows, either memory order. Where it is built it takes the large eager batches on the CPU
  in place of the compiled expression: as fast (`geoattn bench algebra`), without torch.compile's
  tracing on first use (seconds per kernel: most of a short point-cloud run's first step).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch
from torch import Tensor

from geoattn import native
from geoattn.algebra.layout import channel_halves, is_blade_major
from geoattn.core.compile import worth_compiling

Entries = Sequence[tuple[int, int, int, int]]  # (i, j, k, sign): e_i ∘ e_j = sign · e_k

# Above this many blades (n ≥ 5: 1024+ terms per product, three kernels with the backward) the
# compilation itself takes minutes; such algebras stay on the gather form unless the caller
# compiles their own model (which traces the per-blade expression).
COMPILE_MAX_DIM = 16
# Algebras up to this many blades take the dense-table product in eager mode (module docstring)
DENSE_MAX_DIM = 8
# Dtypes of the native kernel (`CompiledProducts.run_native`)
NATIVE_DTYPES = (torch.float32, torch.float64)
# torch.compile backend of the large-batch kernels (tests use "eager": dynamo's tracing and caching
# without code generation)
COMPILE_BACKEND = "inductor"


def gather_product(a: Tensor, b: Tensor, partner: Tensor, signs: Tensor) -> Tensor:
    """``c_k = Σ_i signs[i, k] · a_i · b_{partner[i, k]}``; a, b ``(..., dim)`` broadcasting → ``(..., dim)``.

    Each output blade k gets one term per left blade i (the partner j = i xor k is unique), so this
    is the nonzero Cayley entries (dim² multiply-adds), not the dense dim³ contraction.
    """
    return (a.unsqueeze(-1) * b[..., partner] * signs).sum(-2)


def dense_product(a: Tensor, b: Tensor, table: Tensor) -> Tensor:
    """``c_k = Σ_ij T[i, j, k] a_i b_j``; a, b ``(..., dim)`` broadcasting → ``(..., dim)``.

    table: the product's dense table ``T`` reshaped ``(dim, dim·dim)``. ``a @ T`` is
    ``(..., dim (j), dim (k))``; contracting it with ``b`` over j gives the product. The GEMM does
    dim³ multiply-adds where the product has dim² nonzero terms, but at dim = 8 one GEMM costs no
    more than the indexing a sparse form needs. Its backward keeps ``a @ T`` ``(..., dim·dim)`` when b
    needs a gradient.
    """
    dim = a.shape[-1]
    return ((a @ table).unflatten(-1, (dim, dim)) * b.unsqueeze(-1)).sum(-2)


def per_blade_source(
    entries: Entries, dim: int, name: str, blades_first: bool = False, out_dim: int | None = None
) -> str:
    """Python source of ``name(a, b)``: ``(..., dim)`` × ``(..., dim)`` (broadcasting) → ``(..., dim)``.

    The body reads each blade as a column of the batch-major ``(M, dim)`` rows and stacks the
    product's blades back into rows (compiled: one loop over the rows, no transposes).
    ``blades_first``: ``(dim, ...)`` × ``(dim, ...)`` → ``(dim, ...)`` instead (same shapes, no
    broadcasting), each blade one slice: the form for multivectors stored blade by blade
    (`geoattn.algebra.layout.blade_major`), which the batch-major form would read strided.
    ``out_dim``: the output's width where it is not ``dim`` (then the inputs' widths may differ
    too: only their leading dims broadcast).
    """
    out_dim = dim if out_dim is None else out_dim
    lines = [f"def {name}(a, b):"]
    if blades_first:
        column = "a[{i}]", "b[{j}]"
    else:
        lines += ["    lead = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])"]
        lines += ["    a = a.expand(*lead, a.shape[-1]).reshape(-1, a.shape[-1])  # (M, width)"]
        lines += ["    b = b.expand(*lead, b.shape[-1]).reshape(-1, b.shape[-1])"]
        column = "a[:, {i}]", "b[:, {j}]"
    used_a = sorted({i for i, _, _, _ in entries})
    used_b = sorted({j for _, j, _, _ in entries})
    lines += [f"    a{i} = {column[0].format(i=i)}" for i in used_a]
    lines += [f"    b{j} = {column[1].format(j=j)}" for j in used_b]
    outputs = []
    for k in range(out_dim):
        terms = [f"{'+' if s > 0 else '-'} a{i} * b{j}" for i, j, kk, s in entries if kk == k]
        zero = "a[0] * b[0]" if blades_first else "a[:, 0] * b[:, 0]"
        outputs.append(" ".join(terms).removeprefix("+ ") or f"torch.zeros_like({zero})")
    stacked = f"torch.stack([{', '.join(outputs)}], {0 if blades_first else -1})"
    lines.append(f"    return {stacked}" if blades_first else f"    return {stacked}.view(*lead, {out_dim})")
    return "\n".join(lines)


def make_per_blade_product(
    entries: Entries, dim: int, name: str, blades_first: bool = False, out_dim: int | None = None
) -> Callable[[Tensor, Tensor], Tensor]:
    """The generated per-blade product: ``(..., dim)`` × ``(..., dim)`` (broadcasting) → ``(..., dim)``
    (``blades_first``: ``(dim, ...)`` × ``(dim, ...)`` → ``(dim, ...)``, :func:`per_blade_source`).

    Each call compiles new source, so every product has its own code object: torch.compile keeps
    its compiled graphs per code object, and one function shared by many tables would be recompiled
    for each (and fail at dynamo's recompile limit, 8).
    """
    namespace = {"torch": torch}
    source = per_blade_source(entries, dim, name, blades_first, out_dim)
    exec(compile(source, f"<geoattn.algebra {name}>", "exec"), namespace)
    return namespace[name]


def gradient_tables(entries: Entries) -> tuple[Entries, Entries]:
    """Tables of the two gradients of ``c = a ∘ b``, which are bilinear products themselves:
    ``grad_a = g ∘_A b`` (``grad_a_i = Σ s g_k b_j``), ``grad_b = a ∘_B g`` (``grad_b_j = Σ s a_i g_k``)."""
    return tuple((k, j, i, s) for i, j, k, s in entries), tuple((i, k, j, s) for i, j, k, s in entries)


# Signatures whose geometric product and gradient tables the native build carries as constants
# (``geoattn/native/products_tables.h``, written by `native_tables_source`): the rotor models' Cl(3)
# and GATr's PGA. Their kernels run the terms with the signs folded in; other tables take the general
# form, which reads the table at run time.
NATIVE_SIGNATURES = ((3, 0, 0), (3, 0, 1))
NATIVE_TABLES_HEADER = "products_tables.h"


def product_family(entries: Entries) -> list[Entries]:
    """``entries`` and every table its gradients reach (`gradient_tables`, to any order: the six
    orders of the roles (a, b, output)), first found first."""
    family, queue = [], [tuple(entries)]
    while queue:
        table = queue.pop(0)
        if table not in family:
            family.append(table)
            queue.extend(gradient_tables(table))
    return family


def native_tables_source() -> str:
    """The C++ header of the native kernel's constant tables: for each of `NATIVE_SIGNATURES`, the
    dense signs ``[i][k]`` (0 where absent) of its geometric product's `product_family`."""
    from geoattn.algebra.tables import build_tables

    by_width: dict[int, list[tuple[str, list[int]]]] = {}
    for p, q, r in NATIVE_SIGNATURES:
        tables = build_tables(p, q, r)
        dim = len(tables.names)
        for n, table in enumerate(product_family(tables.products["geometric"])):
            signs = [0] * dim * dim
            for i, _, k, sign in table:
                signs[i * dim + k] = sign
            by_width.setdefault(dim, []).append((f"Cl({p},{q},{r}) geometric, role order {n}", signs))
    lines = [
        "// Generated by geoattn.algebra.kernels.native_tables_source(); do not edit (a test compares).",
        "// The dense signs [i][k] of the geometric products' tables and their gradients' (products.h).",
        "",
        "#pragma once",
        "",
        "namespace products {",
        "",
        "template <int W>",
        "struct FixedTables;",
    ]
    for dim, tables in sorted(by_width.items()):
        lines += ["", "template <>", f"struct FixedTables<{dim}> {{"]
        lines.append(f"  static constexpr int count = {len(tables)};")
        lines.append(f"  static constexpr signed char sign[{len(tables)}][{dim * dim}] = {{")
        for name, signs in tables:
            lines.append(f"      // {name}")
            row = ", ".join(str(x) for x in signs)
            lines.append(f"      {{{row}}},")
        lines += ["  };", "};"]
    lines += ["", "}  // namespace products", ""]
    return "\n".join(lines)


class CompiledProducts:
    """Per-blade products of one signature: plain, under ``torch.compile`` (built on first use), and
    through the native kernel where it is built.

    Besides the named ``tables``, ``name + ".grad_a"`` / ``".grad_b"`` (recursively) are the
    gradient tables of ``name``, so the compiled path's backward is two more compiled per-blade
    kernels (see `CompiledBilinear`). Algebras of one signature share one instance
    (:func:`products_for`), so building many models compiles each product once. ``widths``: a table's
    ``(a, b, output)`` widths where they are not ``dim`` (e.g. a product into more slots than blades).
    """

    def __init__(
        self,
        tables: dict[str, Entries],
        dim: int,
        tag: str,
        widths: dict[str, tuple[int, int, int]] | None = None,
    ):
        self._tables = dict(tables)
        self._widths = dict(widths or {})
        self._dim, self._tag = dim, tag
        self._plain: dict[str, Callable] = {}
        self._compiled: dict[str, Callable | None] = {}
        self._native_entries: dict[str, Tensor] = {}  # the tables as (E, 4) int64 rows (i, j, k, sign)
        self.compile_failed = False
        if dim <= COMPILE_MAX_DIM:  # eagerly: torch.compile cannot trace the code generation
            for name in tables:
                self.plain(name)

    def plain(self, table: str, blades_first: bool = False) -> Callable[[Tensor, Tensor], Tensor]:
        key = _key(table, blades_first)
        if key not in self._plain:
            name = f"{table.replace('.', '_')}_{self._tag}" + ("_blades_first" if blades_first else "")
            entries, out_dim = self._entries(table), self.widths(table)[2]
            self._plain[key] = make_per_blade_product(entries, self._dim, name, blades_first, out_dim)
        return self._plain[key]

    def widths(self, table: str) -> tuple[int, int, int]:
        """``(a, b, output)`` widths of ``table`` (a gradient table's follow from its product's)."""
        if table in self._widths or "." not in table:
            return self._widths.get(table, (self._dim,) * 3)
        base, _, which = table.rpartition(".")
        a, b, out = self.widths(base)
        return (out, b, a) if which == "grad_a" else (a, out, b)

    def _entries(self, table: str) -> Entries:
        if table not in self._tables:  # "<product>.grad_a" or "<product>.grad_b"
            base, _, which = table.rpartition(".")
            grad_a, grad_b = gradient_tables(self._entries(base))
            self._tables[table] = grad_a if which == "grad_a" else grad_b
        return self._tables[table]

    def compiled(self, table: str, blades_first: bool = False) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The compiled product, or None where compilation is unavailable (then callers stay eager)."""
        if self.compile_failed:
            return None
        key = _key(table, blades_first)
        if key not in self._compiled:
            self._compiled[key] = torch.compile(
                self.plain(table, blades_first), backend=COMPILE_BACKEND, dynamic=True, fullgraph=True
            )
        return self._compiled[key]

    def run(self, table: str, a: Tensor, b: Tensor, blades_first: bool = False) -> Tensor:
        """``a ∘ b`` through the native kernel where it is built (float32 and float64 on the CPU), else
        the compiled one where it is available, else the plain per-blade one."""
        module = native_products(a)
        if module is not None:
            return self.run_native(module, table, a, b, blades_first)
        kernel = self.compiled(table, blades_first)
        if kernel is not None:
            try:
                return kernel(a, b)
            except torch._dynamo.exc.BackendCompilerFailed as err:  # e.g. no C++ compiler here
                self.disable(err)
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                self.give_up(table, err, blades_first)
        return self.plain(table, blades_first)(a, b)

    def native_entries(self, table: str) -> Tensor:
        """``table`` as the native kernel reads it: ``(E, 4)`` int64 rows ``(i, j, k, sign)``."""
        if table not in self._native_entries:
            self._native_entries[table] = torch.tensor(self._entries(table), dtype=torch.int64).view(-1, 4)
        return self._native_entries[table]

    def run_native(
        self, module: ModuleType, table: str, a: Tensor, b: Tensor, blades_first: bool = False
    ) -> Tensor:
        """``a ∘ b`` through ``module.bilinear_product`` (``geoattn.native``, ``products.h``): the same
        operands as :meth:`run` (contiguous ``(M, dim)`` rows, or ``(dim, ...)`` blade by blade)."""
        entries, out_dim = self.native_entries(table), self.widths(table)[2]
        if not blades_first:
            return module.bilinear_product(a, b, entries, out_dim, False)
        out = module.bilinear_product(_blade_runs(a), _blade_runs(b), entries, out_dim, True)
        return out.view(out_dim, *a.shape[1:])

    def disable(self, err: Exception) -> None:
        """No compiler here (e.g. no C++ toolchain): every product of this signature stays eager."""
        warnings.warn(f"torch.compile unavailable ({err!r}): geoattn.algebra stays eager", stacklevel=4)
        self.compile_failed = True

    def give_up(self, table: str, err: Exception, blades_first: bool = False) -> None:
        """One product hit a torch.compile limit (e.g. the recompile limit, after many dtypes and
        devices): that product stays eager from now on, the others keep their kernels."""
        warnings.warn(f"{table} of {self._tag} stays eager: {type(err).__name__}", stacklevel=4)
        self._compiled[_key(table, blades_first)] = None


def _blade_runs(x: Tensor) -> Tensor:
    """``x (dim, ...)`` stored blade by blade as the native kernel reads it: ``(dim, G, inner)`` with
    each run of ``inner`` rows contiguous, a view where one exists (the whole rows as one run, or a
    channel slice of the blade-major stream as runs of its channels), else a contiguous copy."""
    dim, rows = x.shape[0], x[0].numel()
    for shape in ((dim, 1, rows), (dim, rows // max(x.shape[-1], 1), x.shape[-1])):
        try:
            runs = x.view(shape)
        except RuntimeError:  # those dims do not merge without a copy
            continue
        if runs.stride(2) == 1:
            return runs
    return x.contiguous().view(dim, 1, rows)


_NATIVE_OFF: list[bool] = []  # `compiled_instead` nests
# Rows from which a product takes the native kernel: from 256 rows on it measured faster than the
# eager dense and gather forms, forward and backward, in Cl(3) and PGA (BENCHMARKS.md); below, level
NATIVE_MIN_ROWS = 256


def takes_kernel(a: Tensor, b: Tensor) -> bool:
    """Whether the product of ``a`` and ``b`` ``(..., width)`` (leading dims broadcasting) goes through
    `CompiledBilinear`: the native kernel from `NATIVE_MIN_ROWS` rows where it runs them, else the
    compiled one where `worth_compiling` says so (its (rows, width, width) count)."""
    rows = math.prod(torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]))
    if native_products(a) is not None:
        return rows >= NATIVE_MIN_ROWS
    return worth_compiling(rows * a.shape[-1] * b.shape[-1])


def native_products(x: Tensor) -> ModuleType | None:
    """The native module (``geoattn.native``) that runs the products of operands like ``x``: float32
    and float64 on the CPU, where the module is built (and not switched off); else None."""
    if _NATIVE_OFF or x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES:
        return None
    return native.cpu_kernels()


@contextlib.contextmanager
def compiled_instead() -> Iterator[None]:
    """Within it the large batches take the compiled per-blade form even where the native kernel is
    built (what `geoattn bench algebra` times beside it)."""
    _NATIVE_OFF.append(True)
    try:
        yield
    finally:
        _NATIVE_OFF.pop()


def _key(table: str, blades_first: bool) -> str:
    return f"{table} (blades first)" if blades_first else table


_SHARED: dict[str, CompiledProducts] = {}


def products_for(
    tables: dict[str, Entries], dim: int, tag: str, widths: dict[str, tuple[int, int, int]] | None = None
) -> CompiledProducts:
    """The one :class:`CompiledProducts` of the signature ``tag`` (its ``tables`` are the signature's)."""
    if tag not in _SHARED:
        _SHARED[tag] = CompiledProducts(tables, dim, tag, widths)
    return _SHARED[tag]


class HalvesProduct(torch.autograd.Function):
    """``left ∘ right`` of the two channel halves of one blade-major ``h (..., 2H, dim)`` (a layer that
    makes both operands with one map, as the geometric MLP) through the native kernel: ``(..., H, dim)``
    stored blade by blade. Its backward writes both halves' gradients into one tensor laid out as ``h``
    (``bilinear_product_into``), where a split's backward would concatenate them; under a higher
    derivative it takes the differentiable form (:class:`CompiledBilinear` and a concatenation).
    Callers check :func:`takes_halves` first."""

    @staticmethod
    def forward(ctx, h: Tensor, products: CompiledProducts, table: str) -> Tensor:
        ctx.save_for_backward(h)
        ctx.products, ctx.table = products, table
        left, right = _halves(h.detach())
        module = native_products(h)
        return products.run_native(module, table, left, right, blades_first=True).movedim(0, -1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (h,) = ctx.saved_tensors
        products, table = ctx.products, ctx.table
        if torch.is_grad_enabled():  # create_graph: a derivative of this gradient will be taken
            left, right = channel_halves(h)
            grad_left = CompiledBilinear.apply(grad, right, products, table + ".grad_a")
            grad_right = CompiledBilinear.apply(left, grad, products, table + ".grad_b")
            return torch.cat((grad_left, grad_right), -2), None, None
        module = native_products(h)
        dim, width = h.shape[-1], h.shape[-2]
        out = h.new_empty(dim, h.numel() // (dim * width), width)  # (dim, rows, 2H): h's own order
        out_left, out_right = out.chunk(2, -1)  # runs of H rows each, in place
        g = _blade_runs(grad.movedim(-1, 0))
        left, right = (_blade_runs(x) for x in _halves(h.detach()))
        module.bilinear_product_into(g, right, products.native_entries(table + ".grad_a"), out_left)
        module.bilinear_product_into(left, g, products.native_entries(table + ".grad_b"), out_right)
        return out.view(dim, *h.shape[:-1]).movedim(0, -1), None, None


def _halves(h: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`channel_halves` of ``h``, blades first: ``(dim, ..., H)`` views each."""
    left, right = channel_halves(h)
    return left.movedim(-1, 0), right.movedim(-1, 0)


def takes_halves(h: Tensor) -> bool:
    """Whether :class:`HalvesProduct` runs ``h (..., 2H, dim)``: stored blade by blade, enough rows for
    the native kernel (:func:`takes_kernel`), and the native module built for its dtype and device."""
    if h.shape[-2] % 2 or not is_blade_major(h) or native_products(h) is None:
        return False
    return takes_kernel(*channel_halves(h))


class CompiledBilinear(torch.autograd.Function):
    """``a ∘ b`` through the native or compiled kernel (:meth:`CompiledProducts.run`); its backward
    calls the gradient kernels the same way.

    (Letting torch.compile differentiate the fused kernel instead is several times slower forward +
    backward.) The backward goes through this Function again, so higher derivatives work too.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, products: CompiledProducts, table: str) -> Tensor:
        ctx.save_for_backward(a, b)
        ctx.products, ctx.table = products, table
        # always contiguous (M, dim), detached and no view (detach last: dynamo guards on a view's
        # base): one compiled graph per dtype and device whatever the rank, strides or requires_grad
        # of the operands (a broadcast operand is copied). Operands of one shape both stored blade by
        # blade go in as contiguous (dim, M) instead, and the result comes back stored so: no copies
        lead = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
        if a.shape == b.shape and is_blade_major(a) and is_blade_major(b):
            rows_a, rows_b = (x.movedim(-1, 0).detach() for x in (a, b))  # (dim, ...), strided is fine
            return products.run(table, rows_a, rows_b, blades_first=True).movedim(0, -1)
        flat_a, flat_b = (
            x.expand(*lead, x.shape[-1]).reshape(-1, x.shape[-1]).contiguous().detach() for x in (a, b)
        )
        return products.run(table, flat_a, flat_b).view(*lead, products.widths(table)[2])

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = CompiledBilinear.apply(grad, b, ctx.products, ctx.table + ".grad_a").sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            grad_b = CompiledBilinear.apply(a, grad, ctx.products, ctx.table + ".grad_b").sum_to_size(b.shape)
        return grad_a, grad_b, None, None
