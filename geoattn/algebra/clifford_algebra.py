"""`CliffordAlgebra(p, q, r)`: batched, differentiable multivector operations, `clifford` conventions.

A multivector is a tensor ``(..., dim)`` with ``dim = 2ⁿ`` coefficients in the blade order of
:mod:`geoattn.algebra.tables` (``'', e1, e2, e3, e12, e13, e23, e123`` for Cl(3)). Every operation
broadcasts over the leading dimensions, works for any float dtype and device, and is autograd- and
``torch.compile``-safe (no in-place writes to inputs).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from geoattn.algebra import kernels
from geoattn.algebra.layout import channel_halves
from geoattn.algebra.tables import build_tables

MAX_DIMENSION = 6


class CliffordAlgebra:
    """The Clifford (geometric) algebra Cl(p, q, r) with n = p + q + r ≤ 6 basis vectors.

    Basis: r degenerate vectors first (square 0), then p squaring to +1, then q squaring to -1, as
    ``clifford.Cl(p, q, r)``; blades by grade, then lexicographically (``blade_names``).

    Attributes:
        p, q, r, n: the signature and n = p + q + r.
        dim: 2ⁿ, the number of blades (last dimension of every multivector).
        signature: ``(n,)`` tuple, the square of each basis vector.
        blade_names: clifford's ``layout.names`` (``''`` for the scalar, ``'e12'``, ...).
        grades: ``(dim,)`` tuple, the grade of each blade.
        grade_indices: ``grade_indices[k]`` = blade indices of grade k (contiguous: see ``grade_slice``).
        vector_indices, bivector_indices: ``grade_indices[1]``, ``grade_indices[2]``.
        cayley_sparse: the nonzero entries ``(i, j, k, sign)`` of ``e_i e_j = sign · e_k``.
        compile: run large batches of the bilinear products (n ≤ 4) through their kernels (default
            True; False: eager): on the CPU the native one (``geoattn.native``) from
            ``kernels.NATIVE_MIN_ROWS`` rows where it is built, else ``torch.compile``d per-blade
            kernels for rows · 4ⁿ passing `geoattn.core.compile.worth_compiling`, whose first large call per
            product compiles (seconds). See ``kernels.takes_kernel``.

    Tables for other modules (float64 CPU tensors, fresh copies; column convention ``M @ x``):
    ``blade_grades``, ``reverse_signs``, ``involution_signs``, ``invariant_metric``, ``cayley``,
    ``left_multiplication`` / ``right_multiplication`` (one matrix per basis blade) and, for any
    multivector, ``left_matrix(x)`` / ``right_matrix(x)``; ``blade_index(name)``, ``grade_slice(k)``.
    """

    def __init__(self, p: int, q: int = 0, r: int = 0, *, compile: bool = True):
        for name, value in (("p", p), ("q", q), ("r", r)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CliffordAlgebra needs integers p, q, r ≥ 0, got {name}={value!r}")
        n = p + q + r
        if not 1 <= n <= MAX_DIMENSION:
            raise ValueError(
                f"CliffordAlgebra supports 1 ≤ n = p + q + r ≤ {MAX_DIMENSION}, "
                f"got p={p}, q={q}, r={r} (n={n})"
            )
        self.p, self.q, self.r, self.n = p, q, r, n
        self.dim = 2**n
        t = build_tables(p, q, r)
        self.signature = t.signature
        self.blade_names = t.names
        self.grades = t.grades
        self.grade_indices = tuple(tuple(i for i, g in enumerate(t.grades) if g == k) for k in range(n + 1))
        self.vector_indices = self.grade_indices[1]
        self.bivector_indices = self.grade_indices[2] if n >= 2 else ()
        self.cayley_sparse = t.products["geometric"]
        self._tables = t
        self._blade_positions = {name: i for i, name in enumerate(t.names)}
        self._cache: dict[tuple, dict[str, Tensor]] = {}
        # twisted: e_i ⋆ e_j = (-1)^{grade i · grade j} e_i e_j, so V ⋆ x = V_even x + V_odd x̂
        g = t.grades
        twisted = tuple((i, j, k, -s if g[i] & g[j] & 1 else s) for i, j, k, s in self.cayley_sparse)
        self._entries = {**t.products, "twisted": twisted}
        self._products = kernels.products_for(self._entries, self.dim, f"cl{p}{q}{r}")
        self._masters = self._build_masters()
        self.compile = compile

    def __repr__(self) -> str:
        return f"CliffordAlgebra(p={self.p}, q={self.q}, r={self.r})"

    # ------------------------------------------------------------------ tables
    @property
    def cayley(self) -> Tensor:
        """Dense Cayley table ``(dim, dim, dim)`` (CPU, float32): ``e_i e_j = Σ_k cayley[i, j, k] e_k``.

        Entries are in {-1, 0, 1}; ``cayley_sparse`` lists the nonzero ones.
        """
        return self._masters["cayley"].float()  # a fresh copy: callers may modify it

    def blade_index(self, name: str) -> int:
        """Position of the blade ``name`` in the last dimension: ``blade_index("e12") == 4`` in Cl(3).

        Names are ``blade_names`` (basis indices ascending, as clifford writes them); the scalar is
        ``""`` or ``"1"``.
        """
        key = "" if name == "1" else name
        if key not in self._blade_positions:
            raise ValueError(
                f"blade_index: unknown blade {name!r} of {self!r}; blades are "
                f"{', '.join(repr(b) for b in self.blade_names)} (indices ascending)"
            )
        return self._blade_positions[key]

    def grade_slice(self, k: int) -> slice:
        """The blades of grade k, ``slice`` into the last dimension (blades are ordered by grade)."""
        if not isinstance(k, int) or not 0 <= k <= self.n:
            raise ValueError(f"grade_slice: k must be an integer in [0, {self.n}] for {self!r}, got k={k!r}")
        indices = self.grade_indices[k]
        return slice(indices[0], indices[-1] + 1)

    @property
    def blade_grades(self) -> Tensor:
        """``(dim,)`` long: the grade of each blade."""
        return torch.tensor(self.grades, dtype=torch.long)

    @property
    def reverse_signs(self) -> Tensor:
        """``(dim,)`` float64: ``reverse(x) == x * reverse_signs`` (grade k: ``(-1)^{k(k-1)/2}``)."""
        return self._masters["reverse"].clone()

    @property
    def involution_signs(self) -> Tensor:
        """``(dim,)`` float64: ``grade_involution(x) == x * involution_signs`` (grade k: ``(-1)^k``)."""
        return self._masters["involution"].clone()

    @property
    def invariant_metric(self) -> Tensor:
        """``(dim,)`` float64 ``⟨ẽ_A e_A⟩₀``: the weights of GATr's invariant inner product
        (``inner_product(x, y) == (x * y * invariant_metric).sum(-1)``; 0 on blades with a null vector).
        On the vector blades it is the signature."""
        return self._masters["inner"].clone()

    @property
    def left_multiplication(self) -> Tensor:
        """``(dim, dim, dim)`` float64: ``left_multiplication[A] @ x == e_A x`` (x a column ``(dim,)``)."""
        return self._masters["cayley"].permute(0, 2, 1).contiguous()

    @property
    def right_multiplication(self) -> Tensor:
        """``(dim, dim, dim)`` float64: ``right_multiplication[A] @ x == x e_A``."""
        return self._masters["cayley"].permute(1, 2, 0).contiguous()

    def left_matrix(self, x: Tensor) -> Tensor:
        """Matrix of ``y ↦ x y``: ``(..., dim)`` → ``(..., dim, dim)``, ``left_matrix(x) @ y == x y``."""
        self._check(x, "x", "left_matrix")
        return torch.einsum("...i,ijk->...kj", x, self._table(x.device, x.dtype)["cayley"])

    def right_matrix(self, x: Tensor) -> Tensor:
        """Matrix of ``y ↦ y x``: ``(..., dim)`` → ``(..., dim, dim)``, ``right_matrix(x) @ y == y x``."""
        self._check(x, "x", "right_matrix")
        return torch.einsum("...j,ijk->...ki", x, self._table(x.device, x.dtype)["cayley"])

    def _table(self, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
        """Sign/index tensors for one (device, dtype), made once on that device from the CPU masters.

        Inside a torch.compile trace a missing entry is converted without caching (a traced
        tensor must not leak into the cache); the graph then holds the conversion.
        """
        key = (device, dtype)
        if key in self._cache:
            return self._cache[key]
        table = {k: v.to(device, dtype if v.is_floating_point() else None) for k, v in self._masters.items()}
        if not torch.compiler.is_compiling():
            self._cache[key] = table
        return table

    def _build_masters(self) -> dict[str, Tensor]:
        """All tables as float64 (signs, products) / int64 (indices) CPU tensors; built once, eagerly."""
        t, dim = self._tables, self.dim
        out = {}
        dense = {}  # (dim, dim, dim): e_i e_j = Σ_k T[i, j, k] e_k for each product
        for name, entries in self._entries.items():
            i, j, k, s = torch.tensor(entries, dtype=torch.long).T
            dense[name] = torch.zeros(dim, dim, dim, dtype=torch.float64).index_put((i, j, k), s.double())
        if dim <= kernels.DENSE_MAX_DIM:  # kernels.dense_product: T as (dim, dim·dim)
            out.update({name: table.reshape(dim, dim * dim) for name, table in dense.items()})
        else:  # kernels.gather_product: signs (dim, dim) [i, k] and the partner j of (i, k)
            index = {m: i for i, m in enumerate(t.masks)}
            # partner[i, k]: the only blade j with e_i e_j ∝ e_k (j = i xor k as bitmasks)
            partner = [[index[t.masks[i] ^ t.masks[k]] for k in range(dim)] for i in range(dim)]
            out["partner"] = torch.tensor(partner, dtype=torch.long)
            out.update({name: table.sum(1) for name, table in dense.items()})
        out["cayley"], out["twisted_cayley"] = dense["geometric"], dense["twisted"]  # (dim, dim, dim)
        g = torch.tensor(t.grades)
        out["reverse"] = torch.where((g * (g - 1) // 2) % 2 == 1, -1.0, 1.0).double()
        out["involution"] = torch.where(g % 2 == 1, -1.0, 1.0).double()
        out["conjugate"] = out["reverse"] * out["involution"]
        # ⟨ẽ_i e_i⟩₀: the product of the squares of the blade's basis vectors
        metric = [math.prod(s for b, s in enumerate(t.signature) if m >> b & 1) for m in t.masks]
        out["inner"] = torch.tensor(metric, dtype=torch.float64)
        out["scalar"] = out["inner"] * out["reverse"]  # ⟨e_i e_i⟩₀
        out["grade_masks"] = (g[None, :] == torch.arange(self.n + 1)[:, None]).double()  # (n + 1, dim)
        out["one"] = out["grade_masks"][0]
        out["even_index"] = torch.tensor([i for i, k in enumerate(t.grades) if k % 2 == 0])  # (dim / 2,)
        even = out["even_index"]
        out["even_cayley"] = out["cayley"][:, even][:, :, even]  # (dim, dim / 2, dim / 2)
        return out

    # ------------------------------------------------------------------ checks
    def _check(self, x: Tensor, name: str, op: str) -> None:
        if not isinstance(x, Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{op}: {name} has shape {tuple(x.shape)}, "
                f"expected (..., {self.dim}) multivectors of {self!r}"
            )
        if not x.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got dtype {x.dtype}")

    def _check_pair(self, a: Tensor, b: Tensor, op: str) -> tuple[Tensor, Tensor]:
        self._check(a, "a", op)
        self._check(b, "b", op)
        try:
            torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
        except RuntimeError:
            raise ValueError(
                f"{op}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not broadcast over the leading dims"
            ) from None
        dtype = torch.promote_types(a.dtype, b.dtype)
        return a.to(dtype), b.to(dtype)

    def _check_grade(self, x: Tensor, grades: tuple[int, ...], name: str, op: str, what: str) -> None:
        """ValueError if x has other grades than ``grades`` (beyond sqrt(eps)·max|x|; eager only)."""
        if torch.compiler.is_compiling():  # data-dependent check: would break the graph
            return
        keep = torch.zeros(self.dim, dtype=torch.bool, device=x.device)
        keep[[i for g in grades for i in self.grade_indices[g]]] = True
        tol = torch.finfo(x.dtype).eps ** 0.5 * x.detach().abs().amax(-1).clamp_min(1.0)
        if (x.detach()[..., ~keep].abs().amax(-1) > tol).any():
            raise ValueError(
                f"{op}: {name} of shape {tuple(x.shape)} is not a pure {what}: it has nonzero blades of "
                f"grade other than {grades}"
            )

    # ------------------------------------------------------------------ products
    def _bilinear(self, a: Tensor, b: Tensor, table: str) -> Tensor:
        """The sparse bilinear product ``table``: ``(..., dim)`` × ``(..., dim)`` → ``(..., dim)``.

        Algebras with dim ≤ ``kernels.COMPILE_MAX_DIM``: inside a caller's ``torch.compile`` the
        generated per-blade expression is traced into its graph; large eager batches
        (``kernels.takes_kernel``) run the native kernel or that expression compiled. Small eager
        batches take ``kernels.dense_product`` (dim ≤ ``kernels.DENSE_MAX_DIM``) or
        ``kernels.gather_product``.
        """
        per_blade = self.dim <= kernels.COMPILE_MAX_DIM
        if torch.compiler.is_compiling():
            if per_blade:
                return self._products.plain(table)(a, b)
        elif per_blade and self.compile and not self._products.compile_failed and kernels.takes_kernel(a, b):
            return kernels.CompiledBilinear.apply(a, b, self._products, table)
        t = self._table(a.device, a.dtype)
        if self.dim <= kernels.DENSE_MAX_DIM:
            return kernels.dense_product(a, b, t[table])
        return kernels.gather_product(a, b, t["partner"], t[table])

    def geometric_product(self, a: Tensor, b: Tensor) -> Tensor:
        """``a b``. a: ``(..., dim)``, b: ``(..., dim)`` (leading dims broadcast) → ``(..., dim)``."""
        a, b = self._check_pair(a, b, "geometric_product")
        return self._bilinear(a, b, "geometric")

    def geometric_product_of_halves(self, h: Tensor) -> Tensor:
        """``left right`` of the two channel halves of ``h (..., 2H, dim)`` → ``(..., H, dim)`` (a layer
        that makes both factors with one map). Stored blade by blade and large enough, one native kernel
        call that writes both gradients where ``h`` keeps them (:class:`kernels.HalvesProduct`); else
        the halves as views and :meth:`geometric_product`."""
        if h.dim() < 2 or h.shape[-1] != self.dim or h.shape[-2] % 2:
            shape, dim = tuple(h.shape), self.dim
            raise ValueError(f"geometric_product_of_halves: h has shape {shape}, expected (..., 2H, {dim})")
        per_blade = self.dim <= kernels.COMPILE_MAX_DIM
        if (
            per_blade
            and self.compile
            and not self._products.compile_failed
            and not torch.compiler.is_compiling()
            and kernels.takes_halves(h)
        ):
            return kernels.HalvesProduct.apply(h, self._products, "geometric")
        return self.geometric_product(*channel_halves(h))

    def outer_product(self, a: Tensor, b: Tensor) -> Tensor:
        """``a ∧ b`` (wedge). ``(..., dim)`` × ``(..., dim)`` → ``(..., dim)``."""
        a, b = self._check_pair(a, b, "outer_product")
        return self._bilinear(a, b, "outer")

    def left_contraction(self, a: Tensor, b: Tensor) -> Tensor:
        """``a ⌋ b`` (clifford's ``a << b``): ``e_A ⌋ e_B = e_A e_B`` if A ⊆ B else 0. → ``(..., dim)``."""
        a, b = self._check_pair(a, b, "left_contraction")
        return self._bilinear(a, b, "left_contraction")

    def scalar_product(self, a: Tensor, b: Tensor) -> Tensor:
        """``⟨a b⟩₀``, the scalar part of the geometric product:
        ``(..., dim)`` × ``(..., dim)`` → ``(...)``."""
        a, b = self._check_pair(a, b, "scalar_product")
        return (a * b * self._table(a.device, a.dtype)["scalar"]).sum(-1)

    def inner_product(self, x: Tensor, y: Tensor) -> Tensor:
        """GATr's invariant inner product ``⟨x̃ y⟩₀ = Σ_i x_i y_i ⟨ẽ_i e_i⟩₀``. → ``(...)``.

        O(n)-invariant for non-degenerate signatures (blades containing a degenerate vector get weight 0).
        """
        x, y = self._check_pair(x, y, "inner_product")
        return (x * y * self._table(x.device, x.dtype)["inner"]).sum(-1)

    # ------------------------------------------------------------------ unary
    def _signs(self, x: Tensor, name: str, op: str) -> Tensor:
        self._check(x, "x", op)
        return x * self._table(x.device, x.dtype)[name]

    def reverse(self, x: Tensor) -> Tensor:
        """``x̃``: grade k gets the sign ``(-1)^{k(k-1)/2}``. ``(..., dim)`` → ``(..., dim)``."""
        return self._signs(x, "reverse", "reverse")

    def grade_involution(self, x: Tensor) -> Tensor:
        """``x̂``: grade k gets the sign ``(-1)^k``. ``(..., dim)`` → ``(..., dim)``."""
        return self._signs(x, "involution", "grade_involution")

    def conjugate(self, x: Tensor) -> Tensor:
        """Clifford conjugate ``x̄ = reverse(x̂)``. ``(..., dim)`` → ``(..., dim)``."""
        return self._signs(x, "conjugate", "conjugate")

    def grade(self, x: Tensor, k: int) -> Tensor:
        """Grade-k projection ``⟨x⟩_k``, same shape ``(..., dim)`` (other blades zeroed)."""
        self._check(x, "x", "grade")
        if not isinstance(k, int) or not 0 <= k <= self.n:
            raise ValueError(f"grade: k must be an integer in [0, {self.n}] for {self!r}, got k={k!r}")
        return x * self._table(x.device, x.dtype)["grade_masks"][k]

    def vector(self, v: Tensor) -> Tensor:
        """Embed vectors: ``(..., n)`` coordinates on ``e1..en`` → ``(..., dim)`` multivectors."""
        if not isinstance(v, Tensor) or v.ndim == 0 or v.shape[-1] != self.n:
            shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(
                f"vector: v has shape {shape}, expected (..., {self.n}) coordinates for {self!r}"
            )
        zeros = v.new_zeros(())
        return torch.cat(
            [zeros.expand(*v.shape[:-1], 1), v, zeros.expand(*v.shape[:-1], self.dim - 1 - self.n)], -1
        )

    def vector_part(self, x: Tensor) -> Tensor:
        """The grade-1 coefficients: ``(..., dim)`` → ``(..., n)``."""
        self._check(x, "x", "vector_part")
        return x[..., 1 : self.n + 1]

    def norm(self, x: Tensor) -> Tensor:
        """clifford's ``abs(x)``: ``sqrt(|⟨x̃ x⟩₀|)`` (the abs matters in mixed signatures). → ``(...)``.

        The gradient at x = 0 is defined as 0 (not NaN).
        """
        self._check(x, "x", "norm")
        return _safe_sqrt(self.inner_product(x, x).abs())

    def inverse(self, x: Tensor) -> Tensor:
        """Versor inverse ``x̃ / ⟨x x̃⟩₀``. ``(..., dim)`` → ``(..., dim)``.

        Exact for versors (products of invertible vectors), where ``x x̃`` is a scalar. Not a general
        multivector inverse. Where ``⟨x x̃⟩₀ = 0`` (null or zero x) the result is inf/nan: callers
        that may pass such x must guard; no check is made so the call stays sync-free.
        """
        self._check(x, "x", "inverse")
        return self.reverse(x) / self.inner_product(x, x).unsqueeze(-1)

    # ------------------------------------------------------------------ versors
    def sandwich(self, V: Tensor, x: Tensor) -> Tensor:
        """Versor action ``V x V⁻¹`` for even V and ``V x̂ V⁻¹`` for odd V. → ``(..., dim)``.

        Computed as ``(V_even x + V_odd x̂) V⁻¹``, which needs no branch on V's parity (a versor is
        either even or odd, so one of the two terms vanishes). V, x: ``(..., dim)``, broadcasting.
        """
        V, x = self._check_pair(V, x, "sandwich")
        return self._bilinear(self._bilinear(V, x, "twisted"), self.inverse(V), "geometric")

    def versor_matrix(self, V: Tensor) -> Tensor:
        """Matrix of the versor action, ``M @ x == sandwich(V, x)``: ``(..., dim)`` → ``(..., dim, dim)``."""
        self._check(V, "V", "versor_matrix")
        t = self._table(V.device, V.dtype)
        left = torch.einsum("...i,ijm->...mj", V, t["twisted_cayley"])  # x ↦ V ⋆ x = V_even x + V_odd x̂
        return self.right_matrix(self.inverse(V)) @ left  # then y ↦ y V⁻¹

    def exp(self, B: Tensor, *, simple: bool = False) -> Tensor:
        """Exponential of a bivector, exact for any bivector. ``(..., dim)`` → ``(..., dim)`` (even).

        n ≤ 3: every bivector is simple (B² = λ scalar): ``exp(B) = C(λ) + S(λ) B`` with
        C = cos√-λ / cosh√λ / 1 and S = sin√-λ/√-λ / sinh√λ/√λ / 1 (Taylor near λ = 0, so gradients
        are finite at B = 0). n ≥ 4 (non-simple bivectors exist): the exponential of the matrix of
        left multiplication by B on the even subalgebra, applied to 1: a 24-term Taylor series where
        that matrix has 1-norm < 1, else ``torch.linalg.matrix_exp`` (Taylor with scaling and
        squaring). Exact to rounding at any norm: tests agree to 1e-12 relative with products of
        closed-form exponentials of commuting simple components, up to rotation angles of 100.
        Half-precision input is computed in float32.

        ``simple=True``: the caller guarantees that B is a simple bivector (a 2-blade such as
        ``a ∧ b``, so B² is a scalar): the closed form is used in any dimension, and the grade check
        (which reads the tensor back to the host) is skipped, so kernels can call it sync-free.
        """
        self._check(B, "B", "exp")
        if not simple:
            self._check_grade(B, (2,), "B", "exp", "bivector")
        if B.dtype in (torch.float16, torch.bfloat16):  # cos/sinh/matrix_exp in float32, result cast back
            return self.exp(B.float(), simple=simple).to(B.dtype)
        if self.n <= 3 or simple:
            lam = self.scalar_product(B, B)
            c, s = cos_sinc(lam)
            return c.unsqueeze(-1) * self._table(B.device, B.dtype)["one"] + s.unsqueeze(-1) * B
        t = self._table(B.device, B.dtype)
        left = torch.einsum("...i,ijk->...kj", B, t["even_cayley"])  # (..., E, E): x ↦ B x, E = dim/2
        # exp(L_B) applied to the scalar 1. matrix_exp loses digits at small norms (its degree choice);
        # there the Taylor series (1-norm < 1, 24 terms: error < 1/25! ≈ 6e-26) is exact to rounding.
        term = series = t["one"][: self.dim // 2].expand_as(left[..., 0])  # the scalar is even blade 0
        for m in range(1, 25):
            term = (left @ term.unsqueeze(-1)).squeeze(-1) / m
            series = series + term
        small = left.abs().sum(-2).amax(-1, keepdim=True) < 1
        coeffs = torch.where(small, series, torch.linalg.matrix_exp(left)[..., 0])
        return coeffs.new_zeros(*coeffs.shape[:-1], self.dim).index_copy(-1, t["even_index"], coeffs)

    def rotor_between(self, a: Tensor, b: Tensor) -> Tensor:
        """The rotor R with ``R â R̃ = b̂`` (â, b̂ = a, b normalised): ``(σ + b̂ â) / |σ + b̂ â|``, σ = â².

        For unit Euclidean vectors this is ``(1 + b̂ â) / sqrt(2 (1 + ⟨â, b̂⟩))``, the smallest
        rotation in the plane a ∧ b; R is unit (``R R̃ = 1``) and maps the unit vector â to b̂ (so a
        to ``|a|/|b| · b``). a, b: ``(..., n)`` coordinates or ``(..., dim)`` pure vectors; leading
        dims broadcast → ``(..., dim)``. a² and b² must have the same sign (always so in Euclidean
        signatures). Zero or null vectors give the identity rotor.

        Antiparallel guard: where ``|σ + b̂ â|² < sqrt(eps)`` the plane a ∧ b is ill-defined, and R
        is the composition of the rotation by π in the plane of â and the basis vector least aligned
        with it (of the same square), which maps â to -â, then the (well-conditioned) rotor from -â
        to b̂. Finite, differentiable, and still exact: R â R̃ = b̂.
        """
        av, bv = self._as_vector(a, "a"), self._as_vector(b, "b")
        try:
            shape = torch.broadcast_shapes(av.shape[:-1], bv.shape[:-1])
        except RuntimeError:
            raise ValueError(
                f"rotor_between: shapes {tuple(a.shape)} and {tuple(b.shape)} do not broadcast"
            ) from None
        dtype = torch.promote_types(av.dtype, bv.dtype)
        av, bv = av.to(dtype).expand(*shape, self.n), bv.to(dtype).expand(*shape, self.n)
        sig = torch.tensor(self.signature, dtype=dtype, device=av.device)
        a_hat, b_hat = _unit_vector(av, sig), _unit_vector(bv, sig)
        sigma = torch.where((a_hat * a_hat * sig).sum(-1) < 0, -1.0, 1.0).to(dtype)
        direct, direct_norm2 = self._half_rotor(a_hat, b_hat, sigma)
        # antiparallel: first a half-turn taking â to -â, then the rotor from -â to b̂
        allowed = sig == sigma.unsqueeze(-1)
        score = torch.where(allowed, a_hat.abs(), torch.full_like(a_hat, math.inf))
        perp = torch.nn.functional.one_hot(score.argmin(-1), self.n).to(dtype)
        plane = self.outer_product(self.vector(a_hat), self.vector(perp))
        half_turn = plane / _safe_sqrt(self.inner_product(plane, plane).abs()).clamp_min(1e-30).unsqueeze(-1)
        second, _ = self._half_rotor(-a_hat, b_hat, sigma)
        fallback = self.geometric_product(second, half_turn)
        guard = torch.finfo(dtype).eps ** 0.5
        return torch.where((direct_norm2 > guard).unsqueeze(-1), direct, fallback)

    def _half_rotor(self, a_hat: Tensor, b_hat: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
        """``(σ + b̂ â) / |σ + b̂ â|`` and ``|σ + b̂ â|²`` (unit a_hat, b_hat ``(..., n)``)."""
        unnormalised = self.geometric_product(self.vector(b_hat), self.vector(a_hat))
        unnormalised = unnormalised + sigma.unsqueeze(-1) * self._table(a_hat.device, a_hat.dtype)["one"]
        norm2 = self.inner_product(unnormalised, unnormalised).abs()
        return unnormalised / _safe_sqrt(norm2).clamp_min(1e-30).unsqueeze(-1), norm2

    def _as_vector(self, x: Tensor, name: str) -> Tensor:
        """``(..., n)`` coordinates, or ``(..., dim)`` checked to be a pure vector → ``(..., n)``."""
        if not isinstance(x, Tensor) or x.ndim == 0 or x.shape[-1] not in (self.n, self.dim):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"rotor_between: {name} has shape {shape}, expected (..., {self.n}) vector coordinates or "
                f"(..., {self.dim}) pure-vector multivectors of {self!r}"
            )
        if not x.is_floating_point():
            raise ValueError(f"rotor_between: {name} must be a floating-point tensor, got dtype {x.dtype}")
        if x.shape[-1] == self.n:
            return x
        self._check_grade(x, (1,), name, "rotor_between", "vector")
        return x[..., 1 : self.n + 1]


def _safe_sqrt(x: Tensor) -> Tensor:
    """sqrt for x ≥ 0 with gradient 0 (not inf/NaN) at x = 0."""
    positive = x > 0
    return torch.where(
        positive, torch.sqrt(torch.where(positive, x, torch.ones_like(x))), torch.zeros_like(x)
    )


def _unit_vector(v: Tensor, sig: Tensor) -> Tensor:
    """v / sqrt(|v²|) for ``(..., n)`` coordinates; zero and null vectors map to 0."""
    norm = _safe_sqrt((v * v * sig).sum(-1).abs())
    return v / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1) * (norm > 0).unsqueeze(-1)


def cos_sinc(lam: Tensor) -> tuple[Tensor, Tensor]:
    """``C(λ) = Σ λᵐ/(2m)!`` and ``S(λ) = Σ λᵐ/(2m+1)!`` for any real λ (``exp(B) = C + S B`` if B² = λ).

    λ < 0: cos√-λ, sin√-λ/√-λ; λ > 0: cosh√λ, sinh√λ/√λ. Near 0 the Taylor polynomial (truncation
    error < λ⁴/8! < 1e-16 for |λ| < 1e-3) keeps values and gradients exact and finite.
    """
    small = lam.abs() < 1e-3
    safe = torch.where(small, torch.ones_like(lam), lam)
    x = torch.sqrt(safe.abs())
    c = torch.where(safe > 0, torch.cosh(x), torch.cos(x))
    s = torch.where(safe > 0, torch.sinh(x), torch.sin(x)) / x
    c_taylor = 1 + lam / 2 * (1 + lam / 12 * (1 + lam / 30))
    s_taylor = 1 + lam / 6 * (1 + lam / 20 * (1 + lam / 42))
    return torch.where(small, c_taylor, c), torch.where(small, s_taylor, s)
