"""Functional attention kernels: ``rt_attention`` (docs/concepts/rt-filter.md; `geoattn.attention.rt`, its
paths behind one dispatch table), ``rotor_attention`` (docs/concepts/rotors.md) and the RFA baseline
``rfa_attention`` (docs/concepts/rt-filter.md#baselines)."""

from geoattn.attention.rfa import rfa_attention
from geoattn.attention.rotor import rotor_attention
from geoattn.attention.rt import rt_attention, rt_logits

__all__ = ["rt_attention", "rotor_attention", "rt_logits", "rfa_attention"]
