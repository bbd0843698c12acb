"""Functional attention kernels: ``rt_attention`` (SPEC §1.2, §4.1), ``rotor_attention`` (SPEC §2, §4.1),
the generic flash-style ``blockwise_attention`` behind the general RT precision, and the RFA
baseline ``rfa_attention`` (SPEC §1.4)."""

from geoattn.attention.blockwise import blockwise_attention
from geoattn.attention.rfa import rfa_attention
from geoattn.attention.rotor import rotor_attention
from geoattn.attention.rt import rt_attention, rt_logits

__all__ = ["rt_attention", "rotor_attention", "blockwise_attention", "rt_logits", "rfa_attention"]
