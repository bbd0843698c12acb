"""Functional attention kernels: ``rt_attention`` (SPEC §1.2, §4.1; `geoattn.attention.rt`, its paths
behind one dispatch table), ``rotor_attention`` (SPEC §2, §4.1) and the RFA baseline
``rfa_attention`` (SPEC §1.4)."""

from geoattn.attention.rfa_kernel import rfa_attention
from geoattn.attention.rotor_kernel import rotor_attention
from geoattn.attention.rt import rt_attention, rt_logits

__all__ = ["rt_attention", "rotor_attention", "rt_logits", "rfa_attention"]
