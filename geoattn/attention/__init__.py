"""Functional attention kernels: ``rt_attention`` (SPEC §1.2, §4.1), ``rotor_attention`` (SPEC §2, §4.1),
the generic flash-style ``blockwise_attention`` behind the general RT precision, and the RFA
baseline ``rfa_attention`` (SPEC §1.4)."""

from geoattn.attention.blockwise import blockwise_attention
from geoattn.attention.rfa_kernel import rfa_attention
from geoattn.attention.rotor_kernel import rotor_attention
from geoattn.attention.rt_kernel import rt_attention, rt_logits

__all__ = ["rt_attention", "rotor_attention", "blockwise_attention", "rt_logits", "rfa_attention"]
