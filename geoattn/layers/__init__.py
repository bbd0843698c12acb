"""Neural-network modules built on the kernels."""

# Lazy while the kernels are being written side by side; becomes plain imports once both exist.
_EXPORTS = {
    "RTAttention": "geoattn.layers.rt",
    "RTBlock": "geoattn.layers.rt",
    "RotorAttention": "geoattn.layers.rotor",
    "GradeLayerNorm": "geoattn.layers.multivector",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)


__all__ = list(_EXPORTS)
