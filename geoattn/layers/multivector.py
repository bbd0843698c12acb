"""Equivariant layers on multivector channels, generic over the algebra (Cl(3), PGA, ...); the maths:
docs/concepts/rotors.md.

Tensors: multivectors ``(..., C, dim)`` (C channels, ``dim = algebra.dim``), invariant scalars ``(..., S)``.
"Equivariant" means: for every versor g of the algebra's orthogonal group (O(n) in Cl(n); in PGA also
translations), acting by ``x ↦ g x̂ g⁻¹`` (grade involution for odd g) on every multivector channel,
the outputs transform the same way and the scalar outputs are unchanged.

The O(n)-equivariant linear maps of multivectors are the grade projections; in a degenerate algebra
(PGA) the left multiplication by the invariant null vector e0 is equivariant too (GATr). Multiplying
by the pseudoscalar is *not* reflection-equivariant (it flips sign under reflections), so
:class:`EquiLinear` does not use it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geoattn import native
from geoattn.algebra import kernels
from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.algebra.layout import channel_halves
from geoattn.native.gradients import torch_form_grads


def _check_mv(x: Tensor, algebra: CliffordAlgebra, channels: int, name: str, owner: str) -> None:
    if x.dim() < 2 or x.shape[-1] != algebra.dim or x.shape[-2] != channels:
        raise ValueError(
            f"{owner}: {name} has shape {tuple(x.shape)}, expected (..., {channels}, {algebra.dim}) "
            f"multivector channels of {algebra!r}"
        )


def _check_scalars(s: Tensor | None, channels: int, lead: torch.Size, name: str, owner: str) -> None:
    if channels == 0:
        if s is not None and s.shape[-1] != 0:
            raise ValueError(f"{owner}: got {name} of shape {tuple(s.shape)} but the layer takes no scalars")
        return
    if s is None or tuple(s.shape) != (*lead, channels):
        shape = None if s is None else tuple(s.shape)
        raise ValueError(f"{owner}: {name} has shape {shape}, expected {(*lead, channels)}")


class MultivectorEmbedding(nn.Module):
    """Typed geometric inputs → multivector channels: one channel-mixing ``Linear`` per grade.

    Equivariance fixes what may feed each grade: invariant scalar features only the scalar grade (a
    bias is allowed there), vectors (given as vectors, ``(..., V, n)`` coordinates) only the vector
    grade, bivectors (``(..., Bv, n(n-1)/2)`` in blade order) only the bivector grade; each is mixed
    over channels with the coordinates untouched, which commutes with any rotation or reflection.

    forward(scalars ``(..., S)`` | None, vectors ``(..., V, n)`` | None, bivectors ``(..., Bv, n(n-1)/2)``
    | None) → ``(..., C, dim)``.
    """

    def __init__(
        self,
        algebra: CliffordAlgebra,
        out_channels: int,
        scalars: int = 0,
        vectors: int = 0,
        bivectors: int = 0,
    ):
        super().__init__()
        if scalars + vectors + bivectors == 0:
            raise ValueError("MultivectorEmbedding needs at least one of scalars, vectors, bivectors > 0")
        self.algebra, self.out_channels = algebra, out_channels
        self.sizes = {"scalars": scalars, "vectors": vectors, "bivectors": bivectors}
        self.scalar = nn.Linear(scalars, out_channels) if scalars else None
        self.vector = nn.Linear(vectors, out_channels, bias=False) if vectors else None
        self.bivector = nn.Linear(bivectors, out_channels, bias=False) if bivectors else None

    def forward(
        self, scalars: Tensor | None = None, vectors: Tensor | None = None, bivectors: Tensor | None = None
    ) -> Tensor:
        ga = self.algebra
        widths = {"scalars": None, "vectors": ga.n, "bivectors": len(ga.bivector_indices)}
        lead = None
        for name, x in (("scalars", scalars), ("vectors", vectors), ("bivectors", bivectors)):
            size = self.sizes[name]
            if (x is None) != (size == 0):
                raise ValueError(f"MultivectorEmbedding: {name} {'missing' if x is None else 'not expected'}")
            if x is None:
                continue
            expect = (size,) if widths[name] is None else (size, widths[name])
            if tuple(x.shape[-len(expect) :]) != expect:
                raise ValueError(
                    f"MultivectorEmbedding: {name} has shape {tuple(x.shape)}, expected (..., {expect})"
                )
            here = x.shape[: x.dim() - len(expect)]
            if lead is not None and here != lead:
                raise ValueError(
                    f"MultivectorEmbedding: leading dims of {name} {tuple(here)} differ from {tuple(lead)}"
                )
            lead = here
        parts = []
        ref = next(x for x in (scalars, vectors, bivectors) if x is not None)
        zeros = lambda k: ref.new_zeros(*lead, self.out_channels, k)  # noqa: E731
        parts.append(self.scalar(scalars)[..., None] if scalars is not None else zeros(1))
        parts.append(
            self.vector(vectors.transpose(-1, -2)).transpose(-1, -2) if vectors is not None else zeros(ga.n)
        )
        nb = len(ga.bivector_indices)
        parts.append(
            self.bivector(bivectors.transpose(-1, -2)).transpose(-1, -2)
            if bivectors is not None
            else zeros(nb)
        )
        parts.append(zeros(ga.dim - 1 - ga.n - nb))
        return torch.cat(parts, -1)


class GradeLayerNorm(nn.Module):
    """Normalise each grade by its invariant norm, averaged over channels, times a learned gain per grade.

    ``x_k ← g_k · x_k / sqrt(mean_c |⟨x̃_ck x_ck⟩₀| + eps)`` for each grade k. The norm is GATr's inner
    product, invariant under the algebra's versors (in PGA blades with e0 do not count, so it is
    translation-invariant; they are scaled along with their grade). A grade made only of null blades
    (PGA's e0123) has no invariant norm and is left as is (times its gain).

    ``per_grade=False``: one norm over all grades (GATr's EquiLayerNorm), ``x ← g_k · x / sqrt(Σ_k ...)``.
    Per-grade normalisation hides every grade's size from the next layer (a lone vector channel
    becomes a unit vector), the joint one keeps the grades' relative sizes (e.g. a position against
    the scalar channels): :class:`RotorTransformer` uses the joint form for that reason.

    forward ``(..., C, dim)`` → ``(..., C, dim)``.
    """

    def __init__(self, algebra: CliffordAlgebra, eps: float = 1e-6, per_grade: bool = True):
        super().__init__()
        self.algebra, self.eps, self.per_grade = algebra, eps, per_grade
        grades, metric = algebra.blade_grades, algebra.invariant_metric
        onehot = F.one_hot(grades, algebra.n + 1).double()  # (dim, G)
        self.register_buffer("grade_onehot", onehot.float(), persistent=False)
        self.register_buffer("metric", metric.float(), persistent=False)
        normable = (onehot * metric.abs()[:, None]).sum(0) > 0  # (G,)
        self.register_buffer("normable", normable, persistent=False)
        # the native kernel's tables (CPU): each blade's grade and its metric in float64
        self._tables = (grades.long().cpu(), metric.double().cpu(), normable.cpu())
        self.gain = nn.Parameter(torch.ones(algebra.n + 1))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[-1] != self.algebra.dim:
            raise ValueError(
                f"GradeLayerNorm: x has shape {tuple(x.shape)}, expected (..., C, {self.algebra.dim})"
            )
        tokens = _tokens_view(x)
        if (
            tokens is not None
            and not torch.compiler.is_compiling()
            and kernels.native_products(x) is not None
        ):
            return _GradeNorm.apply(tokens, self.gain, self).view(x.shape)
        return self.reference(x, self.gain)

    def reference(self, x: Tensor, gain: Tensor) -> Tensor:
        """The same in torch operators (other devices and dtypes, compiled graphs, second derivatives)."""
        onehot = self.grade_onehot.to(x.dtype)
        gain = gain.to(x.dtype)
        sq = ((x * x * self.metric.to(x.dtype)).mean(-2) @ onehot).abs()  # (..., G): per-grade mean ⟨x̃x⟩₀
        if self.per_grade:
            scale = torch.where(self.normable, torch.rsqrt(sq + self.eps), torch.ones_like(sq)) * gain
        else:
            scale = torch.rsqrt(sq.sum(-1, keepdim=True) + self.eps) * gain
        return x * (scale @ onehot.t()).unsqueeze(-2)


def _tokens_view(x: Tensor) -> Tensor | None:
    """``x (..., C, dim)`` as ``(M, C, dim)`` without a copy (both memory orders), or None where its
    leading dims cannot be merged so."""
    try:
        return x.view(-1, *x.shape[-2:])
    except RuntimeError:
        return None


class _GradeNorm(torch.autograd.Function):
    """:class:`GradeLayerNorm` of ``x (M, C, dim)`` through the native kernel (``grade_norm.h``): one
    pass over the tokens each way, the output and ∂x laid out as x. Under a second derivative (the
    molecule model's forces) the backward takes the torch form's gradient, differentiably."""

    @staticmethod
    def forward(ctx, x: Tensor, gain: Tensor, layer: GradeLayerNorm) -> Tensor:
        ctx.save_for_backward(x, gain)
        ctx.layer = layer
        return native.cpu_kernels().grade_norm_forward(
            x, gain.to(x.dtype).contiguous(), *layer._tables, layer.per_grade, layer.eps
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, gain = ctx.saved_tensors
        layer = ctx.layer
        if torch.is_grad_enabled():  # create_graph: a derivative of this gradient will be taken
            forms = torch_form_grads(
                lambda: layer.reference(x, gain), (x, gain), ctx.needs_input_grad[:2], grad
            )
            return *forms, None
        g_x, g_gain = native.cpu_kernels().grade_norm_backward(
            x, gain.to(x.dtype).contiguous(), grad, *layer._tables, layer.per_grade, layer.eps
        )
        return g_x, g_gain.sum(0).to(gain.dtype), None


class EquiLinear(nn.Module):
    """Equivariant linear map of multivector (and scalar) channels, as GATr's.

    ``y_d = Σ_k Σ_c w[k, d, c] ⟨x_c⟩_k`` (grade-wise channel mixing), plus, in degenerate algebras
    (r ≥ 1, e.g. PGA), ``Σ_k Σ_c w0[k, d, c] e0 ⟨x_c⟩_k`` (e0 = the first basis vector, invariant under
    every versor). Scalars: ``in_scalars`` feed the scalar grade of the outputs and the inputs' scalar
    grade feeds ``out_scalars`` (both invariant); biases only on invariant slots (scalar grade, scalars).

    forward(x ``(..., Cin, dim)``, s ``(..., Sin)`` | None) → (``(..., Cout, dim)``, ``(..., Sout)`` | None).
    """

    def __init__(
        self,
        algebra: CliffordAlgebra,
        in_channels: int,
        out_channels: int,
        in_scalars: int = 0,
        out_scalars: int = 0,
        bias: bool = True,
    ):
        super().__init__()
        if in_channels < 1 or out_channels < 1:
            raise ValueError(f"EquiLinear needs ≥ 1 channels, got in={in_channels}, out={out_channels}")
        self.algebra = algebra
        self.in_channels, self.out_channels = in_channels, out_channels
        self.in_scalars, self.out_scalars = in_scalars, out_scalars
        G = algebra.n + 1
        self.weight = nn.Parameter(torch.randn(G, out_channels, in_channels) / math.sqrt(in_channels))
        self.register_buffer("grades", algebra.blade_grades, persistent=False)
        self.register_buffer("grade_onehot", F.one_hot(algebra.blade_grades, G).float(), persistent=False)
        if algebra.r > 0:
            # x ↦ e0 x as a matrix (row vectors: (e0 x)_B = Σ_A x_A L0[A, B]), mixed per source grade;
            # e0 = the first basis vector, a null one (clifford's order puts them first)
            e0_left = algebra.left_multiplication[algebra.vector_indices[0]].T.float()
            self.register_buffer("e0_left", e0_left, persistent=False)
            self.weight_e0 = nn.Parameter(
                torch.randn(G, out_channels, in_channels) / math.sqrt(4 * in_channels)
            )
            # e0 ⟨x⟩_k has grade k + 1: each output blade takes the weight of its source grade
            source = F.one_hot((algebra.blade_grades - 1).clamp_min(0), G).float()
            self.register_buffer("source_onehot", source, persistent=False)
        else:
            self.weight_e0 = None
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.s_to_mv = nn.Linear(in_scalars, out_channels, bias=False) if in_scalars else None
        self.mv_to_s = nn.Linear(in_channels, out_scalars, bias=bias) if out_scalars else None
        self.s_to_s = nn.Linear(in_scalars, out_scalars, bias=False) if in_scalars and out_scalars else None

    def forward(
        self, x: Tensor, s: Tensor | None = None, in_gain: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``in_gain (Cin, G)`` | None: a gain per input channel and grade, as if ``⟨x_c⟩_k`` were
        multiplied by ``in_gain[c, k]`` first (folded into the weights: no pass over ``x``)."""
        _check_mv(x, self.algebra, self.in_channels, "x", "EquiLinear")
        _check_scalars(s, self.in_scalars, x.shape[:-2], "s", "EquiLinear")
        G = self.weight.shape[0]
        if in_gain is not None and tuple(in_gain.shape) != (self.in_channels, G):
            expected = (self.in_channels, G)
            raise ValueError(f"EquiLinear: in_gain has shape {tuple(in_gain.shape)}, expected {expected}")
        gain = None if in_gain is None else in_gain.to(x.dtype).t()[:, None, :]  # (G, 1, in)
        weight = self.weight if gain is None else self.weight * gain
        w = _per_blade(weight, self.grade_onehot, x.dtype)  # (dim, out, in): each blade's grade's
        # one GEMM per blade, blades first: x stored blade by blade (`blade_major`) is read without a
        # copy, and the result is stored so, which the layers after it keep
        lead, dim = x.shape[:-2], x.shape[-1]
        xt = x.movedim(-1, 0).reshape(dim, -1, self.in_channels)  # (dim, M, in)
        y = torch.bmm(xt, w.transpose(1, 2))  # (dim, M, out)
        if self.weight_e0 is not None:
            # e0 ⟨x⟩_k, blades first: (e0 x)_B = Σ_A x_A L0[A, B]
            ex = (self.e0_left.to(x.dtype).t() @ xt.flatten(1)).view_as(xt)
            weight0 = self.weight_e0 if gain is None else self.weight_e0 * gain
            w0 = _per_blade(weight0, self.source_onehot, x.dtype)
            y = torch.baddbmm(y, ex, w0.transpose(1, 2))
        if self.bias is not None or self.s_to_mv is not None:
            # what the scalar blade gets besides its grade's weight: bias and scalar inputs, one GEMM
            bias = self.bias.to(x.dtype) if self.bias is not None else None
            if self.s_to_mv is not None:
                extra = F.linear(s.reshape(-1, self.in_scalars), self.s_to_mv.weight.to(x.dtype), bias)
            else:
                extra = bias.expand(y.shape[1], self.out_channels)
            y = _AddToFirstBlade.apply(y, extra)
        y = y.view(dim, *lead, self.out_channels).movedim(0, -1)
        s_out = None
        if self.out_scalars:
            # the scalar blade as the first slice of blades: its gradient is laid out like x's
            scalar_in = x.movedim(-1, 0)[0]
            scalar_in = scalar_in if gain is None else scalar_in * in_gain[:, 0].to(x.dtype)
            if self.s_to_s is None:
                s_out = self.mv_to_s(scalar_in)
            else:  # both sources of the scalar outputs in one GEMM
                inputs = torch.cat([scalar_in, s.to(x.dtype)], -1)
                weight = torch.cat([self.mv_to_s.weight, self.s_to_s.weight], 1).to(x.dtype)
                bias = self.mv_to_s.bias.to(x.dtype) if self.mv_to_s.bias is not None else None
                s_out = F.linear(inputs, weight, bias)
        return y, s_out


class _AddToFirstBlade(torch.autograd.Function):
    """``y[0] += extra`` in place on a blades-first ``y (dim, M, out)`` that is no view, ``extra (M, out)``:
    the gradient of ``y`` passes through as it is (autograd's own in-place bookkeeping copies it, and a
    concatenation would copy ``y`` in the forward as well)."""

    @staticmethod
    def forward(ctx, y: Tensor, extra: Tensor) -> Tensor:
        y[0] += extra
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad[0]


def _per_blade(weight: Tensor, onehot: Tensor, dtype: torch.dtype) -> Tensor:
    """``(G, out, in)`` grade matrices → ``(dim, out, in)`` blade matrices, ``onehot (dim, G)`` choosing
    each blade's grade: one GEMM each way (indexing by grade took a scatter-add in the backward)."""
    G = weight.shape[0]
    return (onehot.to(dtype) @ weight.to(dtype).view(G, -1)).view(-1, *weight.shape[1:])


class GradePathProduct(nn.Module):
    """Channel-wise geometric product with a learned weight per grade path (CGENN's steerable product).

    ``u_c = Σ_{i,j,k} w[c, i, j, k] ⟨⟨a_c⟩_i ⟨b_c⟩_j⟩_k`` over the grade triples (i, j, k) where the
    product has terms: every term is a grade projection of a geometric product, so each commutes with
    the versors and the whole is equivariant. The weights start at 1: the plain product ``a_c b_c``.

    How: one sparse bilinear product into a slot per (path, output blade) (``q``: the Cayley terms
    sorted into the paths, 64 of them in Cl(3), each slot a few), then ``u_k = Σ_q w[c, path(q)] q``
    (a multiply and one GEMM). Large batches run that product as the algebra's products run, a
    compiled per-blade kernel with compiled gradient kernels (`geoattn.algebra.kernels`); small ones
    the same product as a dense table.

    forward(a ``(..., C, dim)``, b ``(..., C, dim)``) → ``(..., C, dim)``.
    """

    def __init__(self, algebra: CliffordAlgebra, channels: int):
        super().__init__()
        self.algebra, self.channels = algebra, channels
        grades, dim = algebra.grades, algebra.dim
        terms = algebra.cayley_sparse
        paths = sorted({(grades[i], grades[j], grades[k]) for i, j, k, _ in terms})
        path_of = [paths.index((grades[i], grades[j], grades[k])) for i, j, k, _ in terms]
        slots = sorted({(p, k) for p, (_, _, k, _) in zip(path_of, terms)})  # (path, output blade)
        slot = {s: n for n, s in enumerate(slots)}
        entries = tuple((i, j, slot[p, k], sign) for p, (i, j, k, sign) in zip(path_of, terms))
        tag = f"{algebra.p}{algebra.q}{algebra.r}"
        widths = {"paths": (dim, dim, len(slots))}
        self._products = kernels.products_for({"paths": entries}, dim, f"paths_cl{tag}", widths)
        table = torch.zeros(dim, dim, len(slots))  # the same product as a dense table (small batches)
        for i, j, q, sign in entries:
            table[i, j, q] = sign
        self.register_buffer("table", table.view(dim, -1), persistent=False)
        self.register_buffer("slot_path", torch.tensor([p for p, _ in slots]), persistent=False)
        slot_blade = F.one_hot(torch.tensor([k for _, k in slots]), dim).float()  # (slots, dim)
        self.register_buffer("slot_blade", slot_blade, persistent=False)
        self.weight = nn.Parameter(torch.ones(channels, len(paths)))

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        _check_mv(a, self.algebra, self.channels, "a", "GradePathProduct")
        _check_mv(b, self.algebra, self.channels, "b", "GradePathProduct")
        dim, slots = self.algebra.dim, self.slot_path.numel()
        if torch.compiler.is_compiling():
            q = self._products.plain("paths")(a, b)
        elif self.algebra.compile and not self._products.compile_failed and kernels.takes_kernel(a, b):
            q = kernels.CompiledBilinear.apply(a, b, self._products, "paths")
        else:
            table = self.table.to(a.dtype)
            q = ((a @ table).unflatten(-1, (dim, slots)) * b.unsqueeze(-1)).sum(-2)
        weight = self.weight[:, self.slot_path].to(a.dtype)  # (C, slots): each slot's path weight
        return (q * weight) @ self.slot_blade.to(a.dtype)


class GradeGate(nn.Module):
    """Invariant gates per channel and grade (CGENN's MVSiLU): ``⟨x_c⟩_k · sigmoid(α_ck q_ck + β_ck)``
    with ``q_c0 = ⟨x_c⟩₀`` (a SiLU at α = 1, β = 0) and ``q_ck = ⟨x̃ x⟩₀`` of grade k (GATr's invariant
    inner product, 0 on null blades), so each grade is scaled by a function of invariants only.

    forward ``(..., C, dim)`` → ``(..., C, dim)``.
    """

    def __init__(self, algebra: CliffordAlgebra, channels: int):
        super().__init__()
        self.algebra, self.channels = algebra, channels
        G = algebra.n + 1
        onehot = F.one_hot(algebra.blade_grades, G).float()  # (dim, G)
        self.register_buffer("grade_onehot", onehot, persistent=False)
        metric = algebra.invariant_metric.float()
        self.register_buffer("metric", metric, persistent=False)
        self.alpha = nn.Parameter(torch.ones(channels, G))
        self.beta = nn.Parameter(torch.zeros(channels, G))

    def forward(self, x: Tensor) -> Tensor:
        _check_mv(x, self.algebra, self.channels, "x", "GradeGate")
        onehot = self.grade_onehot.to(x.dtype)
        q = (x * x * self.metric.to(x.dtype)) @ onehot  # (..., C, G): ⟨x̃ x⟩₀ per grade
        q = torch.cat((x[..., :1], q[..., 1:]), -1)  # the scalar grade by its signed value
        gate = torch.sigmoid(self.alpha.to(x.dtype) * q + self.beta.to(x.dtype))
        return x * (gate @ onehot.t())


class GeometricMLP(nn.Module):
    """Equivariant MLP (GATr-style): EquiLinear → channel-wise geometric product → gated GELU → EquiLinear.

    ``h, h' = EquiLinear(x)``; ``u = h h'`` (geometric product per channel, equivariant because the versor
    action is an algebra automorphism); ``u ← u · GELU(⟨u⟩₀)`` (the gate is an invariant scalar);
    scalars go through GELU; ``EquiLinear`` back to the input width.

    ``paths=True``: the product with a learned weight per grade path (:class:`GradePathProduct`, CGENN's);
    ``gate="grades"``: a sigmoid gate per grade (:class:`GradeGate`, CGENN's MVSiLU) instead of GELU(⟨u⟩₀).

    forward(x ``(..., C, dim)``, s ``(..., S)`` | None) → same shapes.
    """

    GATES = ("scalar", "grades")

    def __init__(
        self,
        algebra: CliffordAlgebra,
        channels: int,
        scalars: int = 0,
        hidden: int | None = None,
        hidden_scalars: int | None = None,
        *,
        paths: bool = False,
        gate: str = "scalar",
    ):
        super().__init__()
        if gate not in self.GATES:
            raise ValueError(f"GeometricMLP: gate must be one of {', '.join(self.GATES)}, got {gate!r}")
        self.algebra = algebra
        hidden = hidden or 2 * channels
        hidden_scalars = (hidden_scalars or 2 * scalars) if scalars else 0
        self.inner = EquiLinear(algebra, channels, 2 * hidden, scalars, hidden_scalars)
        self.outer = EquiLinear(algebra, hidden, channels, hidden_scalars, scalars)
        self.product = GradePathProduct(algebra, hidden) if paths else None
        self.gate = GradeGate(algebra, hidden) if gate == "grades" else None

    def forward(self, x: Tensor, s: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        h, hs = self.inner(x, s)  # (..., 2 · hidden, dim): both factors from one map
        if self.product is None:
            u = self.algebra.geometric_product_of_halves(h)
        else:
            u = self.product(*channel_halves(h))
        if self.gate is None:
            # the gate from the scalar blade, read as the first slice of blades: its gradient (zero but
            # there) is laid out blade by blade like u's, so a blade-major u keeps a blade-major gradient
            u = u * F.gelu(u.movedim(-1, 0)[0])[..., None]
        else:
            u = self.gate(u)
        return self.outer(u, F.gelu(hs) if hs is not None else None)
