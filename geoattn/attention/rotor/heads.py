"""The rotor head types: one registry of what each kind of head needs and which kernels run it, the
only place that knows a head's kind.

A head type is one :class:`HeadType`: its name, the algebras it runs in, the channels it needs, the
options it takes (``inverse``, ``aggregation="compose"``) and its kernels (the fast one and the
reference, each also for compose). :func:`rotor_attention`, :class:`RotorAttention` and the model
configs all check head types with :func:`check_head_types`, and ``rotor_attention``'s dispatch
(`geoattn.attention.rotor.dispatch`) runs whatever kernel the entry names, so a new head type is one
:func:`register_head_type` call beside its kernel. The built-in types register at the end of this
module: rotation and reflection (`geoattn.attention.rotor.sandwich`), projection
(`geoattn.attention.rotor.projection`), frame (`geoattn.attention.rotor.frame`).

A kernel is ``kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size) -> o`` with
``q, k (B, H, N, C, dim)``, ``v (B, H, N, Cv, dim)``, ``o (B, H, N, Cv, dim)``, the inputs already
checked and promoted to at least float32; ``key_mask`` is ``(B, N)`` bool or None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from geoattn.algebra.named import signature_name
from geoattn.attention.rotor import frame, projection, sandwich
from geoattn.attention.rotor.compose import compose
from geoattn.attention.rotor.reference import compose_reference, pairwise
from geoattn.core.errors import ConfigError

HeadKernel = Callable[..., Tensor]
AGGREGATIONS = ("sum", "compose")
# the head kinds a model's heads cycle through by default (``default_head_types``)
DEFAULT_HEAD_CYCLE = ("rotation", "rotation", "reflection", "projection")


@dataclass(frozen=True)
class HeadType:
    """One kind of rotor head.

    Fields:
        name: the ``head_type`` string.
        kernel: the fast exact kernel (``backend="auto"``), signature in the module docstring.
        reference: the naive pairwise oracle (``backend="reference"``); None: ``kernel`` is plain
            enough to be its own reference.
        signatures: the algebras ``(p, q, r)`` it runs in; None: every algebra whose directions can be
            unit, ``a² = 1`` (no basis vector squaring to −1).
        why: why it needs those algebras (for messages).
        min_channels: channels per head it needs in q and k.
        inverse: it accepts ``inverse=True`` (key → query).
        compose: ``(kernel, reference)`` of its ``aggregation="compose"`` (one mean rotor per query),
            or None: it only sums.
    """

    name: str
    kernel: HeadKernel
    reference: HeadKernel | None = None
    signatures: tuple[tuple[int, int, int], ...] | None = None
    why: str = ""
    min_channels: int = 1
    inverse: bool = False
    compose: tuple[HeadKernel, HeadKernel | None] | None = None

    def algebra_problem(self, signature: tuple[int, int, int]) -> str | None:
        """What is wrong with running in the algebra ``signature``, or None."""
        if self.signatures is None:
            if signature[1] > 0:
                return "needs unit directions a² = 1, so no basis vector squaring to -1"
            return None
        if tuple(signature) not in self.signatures:
            names = " or ".join(signature_name(s) for s in self.signatures)
            return f"needs {names}" + (f" ({self.why})" if self.why else "")
        return None

    def kernels(self, aggregation: str) -> tuple[HeadKernel, HeadKernel]:
        """``(fast, reference)`` of ``aggregation`` (``"sum"`` or ``"compose"``); a missing reference is
        the fast kernel itself. Call only after :func:`check_head_types` (compose needs ``compose``)."""
        fast, reference = self.compose if aggregation == "compose" else (self.kernel, self.reference)
        return fast, reference or fast


HEADS: dict[str, HeadType] = {}


def register_head_type(head: HeadType) -> HeadType:
    """Add ``head`` to the registry (a ValueError if its name is taken); returns it."""
    if head.name in HEADS:
        raise ValueError(f"head type {head.name!r} is already registered")
    HEADS[head.name] = head
    return head


def unregister_head_type(name: str) -> None:
    """Remove a registered head type (for tests that register their own)."""
    HEADS.pop(name, None)


def head_type_names() -> tuple[str, ...]:
    """The registered head types, in registration order."""
    return tuple(HEADS)


def default_head_types(n_head: int) -> tuple[str, ...]:
    """``n_head`` head types cycling through ``DEFAULT_HEAD_CYCLE``."""
    return tuple(DEFAULT_HEAD_CYCLE[i % len(DEFAULT_HEAD_CYCLE)] for i in range(n_head))


def check_head_types(
    owner: str,
    head_types: tuple[str, ...] | list[str] | str,
    signature: tuple[int, int, int],
    channels: int | None = None,
    *,
    algebra: str | None = None,
    aggregation: str = "sum",
    inverse: bool = False,
) -> tuple[str, ...]:
    """Check heads against the registry; returns ``head_types`` as a tuple.

    Args:
        owner: who asks, the start of every message (``"RotorLMConfig.head_types"``).
        head_types: one head type per head (or a comma string, as ``--set model.head_types=a,b`` gives).
        signature: ``(p, q, r)`` of the algebra; ``algebra``: how the caller names it in messages
            (default the signature's name).
        channels: channels per head in q and k, or None when not known yet.
        aggregation: ``"sum"`` or ``"compose"`` (needs a head type that composes, e.g. rotation).
        inverse: ``inverse=True`` is asked of every head (the functional kernel's rule; the layers
            pass it only to the heads that take it).

    Raises:
        ConfigError (a ValueError) naming the head type and the rule it breaks.
    """
    if isinstance(head_types, str):  # "rotation,projection" from the command line
        head_types = [t.strip() for t in head_types.split(",")]
    head_types = tuple(head_types)
    where = algebra or signature_name(signature)
    if not head_types:
        raise ConfigError(f"{owner}: no heads; give at least one of {head_type_names()}")
    for name in head_types:
        if name not in HEADS:
            raise ConfigError(f"{owner}: unknown head_type {name!r}, expected one of {head_type_names()}")
    for name in dict.fromkeys(head_types):
        head = HEADS[name]
        problem = head.algebra_problem(signature)
        if problem:
            raise ConfigError(f"{owner}: head_type {name!r} {problem}, got {where}")
        if channels is not None and channels < head.min_channels:
            raise ConfigError(
                f"{owner}: head_type {name!r} needs C ≥ {head.min_channels} channels per head in q and k "
                f"(head_channels ≥ {head.min_channels}), got C = {channels}"
            )
        if inverse and not head.inverse:
            takers = tuple(n for n, h in HEADS.items() if h.inverse)
            raise ConfigError(f"{owner}: inverse=True applies to {takers}, not {name!r}")
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"{owner}: unknown aggregation {aggregation!r}, expected one of {AGGREGATIONS}")
    if aggregation == "compose" and not any(HEADS[n].compose is not None for n in head_types):
        composing = " / ".join(repr(n) for n, h in HEADS.items() if h.compose is not None)
        raise ConfigError(
            f"{owner}: aggregation='compose' applies to {composing} heads (it composes their rotors): it "
            f"needs head_type {composing}, got {head_types}, with none"
        )
    return head_types


# --------------------------------------------------------------------------- the built-in head types
register_head_type(
    HeadType(
        "rotation",
        sandwich.factorised(sandwich.ROTATION),
        pairwise(sandwich.pair_values(sandwich.ROTATION)),
        inverse=True,
        compose=(compose, compose_reference),
    )
)
register_head_type(
    HeadType(
        "reflection",
        sandwich.factorised(sandwich.REFLECTION),
        pairwise(sandwich.pair_values(sandwich.REFLECTION)),
        inverse=True,
    )
)
register_head_type(HeadType("projection", projection.projection, pairwise(projection.pair_values)))
register_head_type(
    HeadType(
        "frame",
        frame.frame,
        pairwise(frame.pair_values),
        signatures=((3, 0, 0),),
        why="a frame is x, y, x × y",
        min_channels=2,
    )
)
