"""Functional attention kernels: ``rt_attention`` (SPEC §1.2) and ``rotor_attention`` (SPEC §2)."""

# Lazy while the kernels are being written side by side; becomes plain imports once both exist.
_EXPORTS = {
    "rt_attention": "geoattn.attention.rt",
    "rotor_attention": "geoattn.attention.rotor",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)


__all__ = list(_EXPORTS)
