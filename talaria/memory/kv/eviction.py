"""Eviction ranking: which cached blocks of a tier go first, and which lose when host is short.

A cached block (no reference, no pin) is ranked by the value of the sessions listing it:
orphans (no table lists them) first, oldest first; then the sessions neither running nor
pinned (the index's ``idle``), least valuable first (``set_priority``, then least recent;
with ``Eviction.LRU`` only recency counts; then the oldest session), each session
tail-first so what stays on device is still a prefix; last the blocks listed only by
running or pinned sessions' stale runs. Lower ranks go first.

``EvictionOrder`` reads the prefix index (:mod:`.prefix`) and changes nothing; the manager
(:mod:`.manager`) moves and drops the blocks it names.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from talaria.config import Eviction
from talaria.memory.kv.blocks import _Block
from talaria.memory.kv.prefix import PrefixIndex, _SessionState

_Rank = tuple[int, float, float]  # eviction order of a candidate block; lower goes first
_ORPHAN: _Rank = (0, 0.0, 0.0)
_HELD: _Rank = (2, 0.0, 0.0)  # listed only by running or pinned sessions
_Victim = tuple[_Rank, int, _Block]


class EvictionOrder:
    """Evictable blocks of one tier in eviction order, read from ``index`` under ``eviction``."""

    def __init__(self, index: PrefixIndex, eviction: Eviction) -> None:
        self._index = index
        self.eviction = eviction

    def victims(self, on_device: bool, limit: int) -> Iterator[_Victim]:
        """Up to ``limit`` distinct evictable blocks of one tier, least valuable first:
        orphans oldest first, then sessions by value, each tail-first."""
        seen: set[int] = set()
        for victim in self.candidates(on_device):
            if len(seen) >= limit:
                return
            if victim[1] not in seen:
                seen.add(victim[1])
                yield victim

    def candidates(self, on_device: bool) -> Iterator[_Victim]:
        """Evictable blocks of one tier in eviction order, with their rank (lower goes first);
        a block listed by several sessions may come more than once."""
        blocks = self._index.blocks
        for h in self._index.orphans:
            b = blocks[h]
            if b.on_device is on_device and not b.ref and not b.pin:
                yield _ORPHAN, h, b
        order = sorted(  # a device scan skips the sessions with no device block up front
            (s for s in self._index.idle.values() if s.n_device or not on_device),
            key=self._order,
        )
        for st in order:
            rank = self.rank(st)
            for h in self.tail_first(st, on_device):
                b_or_none = blocks.get(h)
                if (
                    b_or_none is not None
                    and b_or_none.on_device is on_device
                    and not b_or_none.ref
                    and not b_or_none.pin
                ):
                    yield rank, h, b_or_none
        for h, b in blocks.items():  # listed only by running or pinned sessions' stale runs
            if b.on_device is on_device and not b.ref and not b.pin:
                yield _HELD, h, b

    def tail_first(self, st: _SessionState, on_device: bool) -> Iterator[int]:
        """The session's table from the tail, skipping what cannot hold a block of the tier.

        A device scan usually needs only the leading device run: a session with no device
        block costs nothing, one whose device blocks are all in the run costs the run.
        """
        if not on_device:
            return reversed(st.table)
        if not st.n_device:
            return iter(())
        blocks = self._index.blocks
        run = 0
        for h in st.table:
            b = blocks.get(h)
            if b is None or not b.on_device:
                break
            run += 1
        return reversed(st.table[:run] if run == st.n_device else st.table)

    def value(self, st: _SessionState) -> tuple[float, float]:
        if self.eviction is Eviction.LRU:
            return (0.0, st.last_used)
        return (st.priority, st.last_used)

    def _order(self, st: _SessionState) -> tuple[float, float, int]:
        """Sessions by value, then in the order they were created."""
        return (*self.value(st), st.seq)

    def rank(self, st: _SessionState) -> _Rank:
        """Eviction rank of a session's blocks: by value, after orphans, before held ones."""
        if st.running or st.pinned:
            return _HELD
        return (1, *self.value(st))


def split_shortfall(
    victims: Sequence[_Victim], host: Sequence[_Victim], short: int
) -> tuple[int, int]:
    """Host is ``short`` blocks short of taking the device ``victims``: how many of the
    victims and how many of the ``host`` blocks (each least valuable first) to drop, as
    (victims dropped, host blocks dropped). The least valuable of both lists go; on equal
    value host blocks go first (they are the session's tail)."""
    n_drop = n_host = 0
    while n_drop + n_host < short:
        if n_host < len(host) and (n_drop == len(victims) or host[n_host][0] <= victims[n_drop][0]):
            n_host += 1
        else:
            n_drop += 1
    return n_drop, n_host
