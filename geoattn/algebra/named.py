"""The algebras a model can be configured with, by name (``model.algebra``), and shared instances.

One table for every model and task: ``"cl3"`` Cl(3) (O(3); 8 blades), ``"cl4"`` Cl(4) (two rotation
planes per bivector; 16 blades), ``"pga"`` Cl(3,0,1) (GATr's projective algebra, E(3); 16 blades).
A model that runs in fewer of them says which (e.g. the RotorTransformer's 3D tasks: cl3, pga).
"""

from __future__ import annotations

import functools

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.core.errors import ConfigError

ALGEBRAS: dict[str, tuple[int, int, int]] = {"cl3": (3, 0, 0), "cl4": (4, 0, 0), "pga": (3, 0, 1)}


def algebra_signature(name: str, owner: str = "algebra", valid: tuple[str, ...] = tuple(ALGEBRAS)):
    """``(p, q, r)`` of the algebra ``name``; ConfigError naming ``owner`` unless ``name`` is in ``valid``."""
    if name not in valid or name not in ALGEBRAS:
        raise ConfigError(f"{owner} must be one of {valid}, got {name!r}")
    return ALGEBRAS[name]


def signature_name(signature: tuple[int, int, int]) -> str:
    """``"Cl(3)"`` for (3, 0, 0), ``"Cl(3,0,1)"`` for (3, 0, 1): the name in messages."""
    p, q, r = signature
    return f"Cl({p})" if (q, r) == (0, 0) else f"Cl({p},{q},{r})"


def named_algebra(name: str) -> CliffordAlgebra:
    """A new :class:`CliffordAlgebra` of the table's algebra ``name`` (for a model of its own)."""
    return CliffordAlgebra(*algebra_signature(name))


@functools.cache
def shared_algebra(p: int, q: int = 0, r: int = 0, *, compile: bool = True) -> CliffordAlgebra:
    """One :class:`CliffordAlgebra` per signature and ``compile`` flag for this process: what code
    that needs the algebra's products for constants (not a model's own algebra) uses, so that no
    kernel builds algebras of its own."""
    return CliffordAlgebra(p, q, r, compile=compile)
