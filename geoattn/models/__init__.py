"""Whole networks: language models and the RotorTransformer."""

# Lazy while the kernels are being written side by side; becomes plain imports once both exist.
_EXPORTS = {
    "RTTransformerLM": "geoattn.models.lm",
    "TransformerLM": "geoattn.models.lm",
    "RotorTransformer": "geoattn.models.rotor_transformer",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)


__all__ = list(_EXPORTS)
