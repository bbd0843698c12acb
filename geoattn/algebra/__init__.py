"""geoattn.algebra: the Clifford algebra engine and the shared pair rotation of RoPE / RT transport."""

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.algebra.rotation import rope_angles, rope_frequencies, rotate_pairs

__all__ = ["CliffordAlgebra", "rotate_pairs", "rope_angles", "rope_frequencies"]
