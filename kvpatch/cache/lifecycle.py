"""The phases of a :class:`~kvpatch.cache.CompressedLayer`'s life and the moves between them.

A layer is filled by one prefill, compressed once, then grows by its tail::

    EMPTY ──prefill──▶ PREFILLED ──compress──▶ COMPRESSED ◀──▶ APPENDING (a turn, its queries kept)
                          │    └──nothing to compress──▶ DENSE       ▲
                          └──defer──▶ WAITING ──every layer planned──┘
                                     ▲    │
                                     └────┴──▶ RECONSTRUCTING (a chunk of the context read again)

``RECONSTRUCTING`` returns to where it came from: ``WAITING`` (the prefill's scores) or
``COMPRESSED`` (an appended turn's). A saved context is loaded straight into ``COMPRESSED`` or
``DENSE``; ``reset`` returns to ``EMPTY`` from anywhere. Any other move is a bug in the caller
and raises :class:`LifecycleError`, naming the phase and the moves it allows.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    #: nothing stored yet
    EMPTY = "empty"
    #: the prefill is stored dense; kvpatch's attention compresses (or defers) it next
    PREFILLED = "prefilled"
    #: kept whole, a plain dense layer: no policy, or a prefill of one token
    DENSE = "dense"
    #: the prefill held dense until every layer's plan is made (shared budgets, a reconstruction)
    WAITING = "waiting"
    #: a chunk of the context read again is attended over what is held, then forgotten
    RECONSTRUCTING = "reconstructing"
    #: a store holds what the policy kept; new tokens join its tail
    COMPRESSED = "compressed"
    #: a segment is appended to the store (a chat turn), its queries recorded to compress it
    APPENDING = "appending"


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.EMPTY: frozenset({Phase.PREFILLED, Phase.COMPRESSED, Phase.DENSE}),
    Phase.PREFILLED: frozenset({Phase.COMPRESSED, Phase.WAITING, Phase.DENSE}),
    Phase.DENSE: frozenset(),
    Phase.WAITING: frozenset({Phase.RECONSTRUCTING, Phase.COMPRESSED, Phase.DENSE}),
    Phase.RECONSTRUCTING: frozenset(),  # left by Lifecycle.end_reconstruction only
    Phase.COMPRESSED: frozenset({Phase.APPENDING, Phase.RECONSTRUCTING}),
    Phase.APPENDING: frozenset({Phase.COMPRESSED}),
}


class LifecycleError(RuntimeError):
    """A layer was asked to move where its phase does not lead."""


class Lifecycle:
    """A layer's phase; ``RECONSTRUCTING`` remembers the phase it returns to.

    The phases are held by their names: plain data, which ``torch.export`` flattens and rebuilds
    with the cache (an enum member cannot be rebuilt from its attributes)."""

    def __init__(self) -> None:
        self._phase = Phase.EMPTY.value
        self._before_reconstruction: str | None = None

    @property
    def phase(self) -> Phase:
        return Phase(self._phase)

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._phase = phase.value

    def move(self, to: Phase) -> None:
        if to is not self.phase and to not in MOVES[self.phase]:
            allowed = ", ".join(sorted(p.value for p in MOVES[self.phase])) or "none"
            raise LifecycleError(
                f"a layer in phase {self.phase.value!r} cannot move to {to.value!r} "
                f"(from {self.phase.value!r}: {allowed})"
            )
        if to is Phase.RECONSTRUCTING and self.phase is not Phase.RECONSTRUCTING:
            self._before_reconstruction = self._phase
        self.phase = to

    def end_reconstruction(self) -> None:
        """Back to the phase the reconstruction started from."""
        if self.phase is not Phase.RECONSTRUCTING:
            raise LifecycleError(f"a layer in phase {self.phase.value!r} is not reconstructing")
        self._phase, self._before_reconstruction = self._before_reconstruction, None

    def reset(self) -> None:
        self._phase, self._before_reconstruction = Phase.EMPTY.value, None
